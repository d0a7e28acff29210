"""Pure parts of the agent's ring rounds: flatten/unflatten, state naming and snapshots, the
choice of where a round's version comes from, update caching keys, scaling, the wire codec,
and the --peer-listen / --peer-advertise flags."""

from __future__ import annotations

import asyncio

import pytest
import torch

from epochmesh.optim import build_round_optimizer, optimizer_state_tensors, state_tensors
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import params_checksum
from node_agent.core.config import (
    DEFAULT_PEER_LISTEN,
    advertised_peer_address,
    parse_args,
    split_host_port,
)
from node_agent.ring.mailbox import StateSnapshot
from node_agent.training import ring_round as rt
from node_agent.training import ring_state as rs
from node_agent.training.ring_jobs import RingJobs

pytestmark = pytest.mark.timeout(30)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(4, 3, generator=g),
        "fc1.bias": torch.randn(4, generator=g),
        "scale": torch.randn((), generator=g),
        "fc2.weight": torch.randn(2, 4, generator=g),
    }


# -- flatten / unflatten -------------------------------------------------------------------------


def test_flatten_in_given_order_and_unflatten_back() -> None:
    ts = _tensors()
    names = ["fc2.weight", "fc1.weight", "scale", "fc1.bias"]
    flat = rs.flatten(ts, names)
    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.is_contiguous()
    assert flat.numel() == 8 + 12 + 1 + 4
    assert torch.equal(flat[:8], ts["fc2.weight"].reshape(-1))
    assert torch.equal(flat[20:21], ts["scale"].reshape(-1))
    back = rs.unflatten(flat, {n: tuple(ts[n].shape) for n in names})
    assert list(back) == names
    for n in names:
        assert torch.equal(back[n], ts[n])
    # Views of the buffer: writing through them changes it (the .grad of the step is free).
    back["scale"].fill_(7.0)
    assert flat[20].item() == 7.0


def test_flatten_is_a_copy_and_converts_to_float32() -> None:
    ts = {"a": torch.ones(3, dtype=torch.float64), "b": torch.zeros(2)}
    flat = rs.flatten(ts, ["a", "b"])
    assert flat.dtype == torch.float32
    flat.zero_()
    assert torch.equal(ts["a"], torch.ones(3, dtype=torch.float64))


def test_flatten_and_unflatten_refuse_mismatches() -> None:
    with pytest.raises(KeyError, match="lacks tensor 'c'"):
        rs.flatten({"a": torch.zeros(1)}, ["a", "c"])
    assert rs.flatten({}, []).numel() == 0
    with pytest.raises(ValueError, match="buffer holds 5 elements, the parameters 6"):
        rs.unflatten(torch.zeros(5), {"a": (2, 3)})
    with pytest.raises(ValueError):
        rs.unflatten(torch.zeros(2, 3), {"a": (2, 3)})


# -- state naming --------------------------------------------------------------------------------


def _spec(**fields: object) -> common_pb2.JobSpec:
    base: dict[str, object] = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
    base.update(fields)
    return common_pb2.JobSpec(**base)  # type: ignore[arg-type]


def _stepped_optimizer(spec: common_pb2.JobSpec) -> tuple[list[str], torch.optim.Optimizer]:
    ts = _tensors()
    names = list(ts)
    params = [torch.nn.Parameter(t.clone()) for t in ts.values()]
    opt = build_round_optimizer(spec, params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return names, opt


def test_state_tensors_naming_round_trips_through_split_state() -> None:
    names, opt = _stepped_optimizer(_spec(optimizer="adamw"))
    params = {n: p.detach() for n, p in zip(names, opt.param_groups[0]["params"], strict=True)}
    optim = optimizer_state_tensors(opt, names)
    state = state_tensors(params, optim)
    assert list(state)[: len(names)] == [f"param/{n}" for n in names]
    assert "optim/exp_avg/fc1.weight" in state and "optim/step/scale" in state
    expected = {n: (p.dtype, tuple(p.shape)) for n, p in params.items()}
    got_params, got_optim = rs.split_state(state, expected)
    assert list(got_params) == names
    assert got_optim is not None and set(got_optim) == set(optim)
    assert rs.params_of(StateSnapshot(3, state)).keys() == params.keys()


def test_split_state_of_plain_parameters_has_no_optimizer_state() -> None:
    ts = _tensors()
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in ts.items()}
    params, optim = rs.split_state(dict(reversed(ts.items())), expected)
    assert list(params) == list(ts) and optim is None
    # A state bundle without optimizer entries: an optimizer that has no state yet.
    params, optim = rs.split_state(state_tensors(ts, {}), expected)
    assert optim == {}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("param/scale"), "lacks parameter 'scale'"),
        (lambda s: s.__setitem__("param/scale", torch.zeros(2)), "parameter 'scale' is"),
        (lambda s: s.__setitem__("param/other", torch.zeros(1)), "unknown parameter"),
        (lambda s: s.__setitem__("extra", torch.zeros(1)), "neither param/ nor optim/"),
        (
            lambda s: s.__setitem__("param/fc1.bias", torch.zeros(4, dtype=torch.float64)),
            "float64",
        ),
    ],
)
def test_split_state_refuses_bad_states(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    ts = _tensors()
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in ts.items()}
    state = state_tensors(ts, {})
    mutate(state)
    with pytest.raises(ValueError, match=message):
        rs.split_state(state, expected)


def test_split_state_refuses_extra_plain_tensors() -> None:
    ts = _tensors()
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in ts.items()}
    with pytest.raises(ValueError, match="unexpected tensors"):
        rs.split_state({**ts, "x": torch.zeros(1)}, expected)


# -- version choice, snapshots, cache keys -------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "live", "held", "source", "want"),
    [
        (5, 5, [4, 5], "", rs.Source.LIVE),
        (4, 5, [4, 5], "", rs.Source.SNAPSHOT),  # a retried round goes back to v
        (5, None, [4, 5], "", rs.Source.SNAPSHOT),  # a step was cut off: reload v
        (6, 5, [4, 5], "", rs.Source.COORDINATOR),
        (0, None, [], "", rs.Source.COORDINATOR),  # first round
        (3, None, [], "node-c", rs.Source.PEER),  # joiner
        (6, 5, [4, 5], "node-b", rs.Source.PEER),  # missed a round
        # The coordinator says this node does not hold v: a kept v may predate a restart.
        (5, 5, [4, 5], "node-b", rs.Source.PEER),
        (4, 5, [4, 5], "node-b", rs.Source.PEER),
    ],
)
def test_choose_source(
    version: int, live: int | None, held: list[int], source: str, want: rs.Source
) -> None:
    assert rs.choose_source(version, live, held, source) is want


def test_rolled_back() -> None:
    assert not rs.rolled_back(None, 0)
    assert not rs.rolled_back(4, 4)  # a retried attempt of the same round
    assert not rs.rolled_back(4, 5)
    assert rs.rolled_back(9, 5)  # the coordinator restarted from a checkpoint


def test_prune_snapshots_keeps_only_the_named_versions() -> None:
    snaps = {v: StateSnapshot(v, {}) for v in (3, 4, 5)}
    assert list(rs.prune_snapshots(snaps, [4, 5])) == [4, 5]
    assert list(rs.prune_snapshots(snaps, [3, 4])) == [3, 4]
    assert rs.prune_snapshots(snaps, [9]) == {}


def _task(**fields: object) -> agent_pb2.Task:
    base: dict[str, object] = {
        "round": 7,
        "params_version": 6,
        "local_batch": 4,
        "inner_steps": 1,
        "ranges": [
            common_pb2.SampleRange(start=0, stop=2),
            common_pb2.SampleRange(start=8, stop=10),
        ],
    }
    base.update(fields)
    return agent_pb2.Task(**base)  # type: ignore[arg-type]


def test_update_key_is_the_same_for_a_retried_attempt_only() -> None:
    key = rs.update_key(_task())
    retry = _task(ring=common_pb2.RingAssignment(attempt=1, rank=0), task_id="other")
    assert rs.update_key(retry) == key
    assert rs.update_key(_task(round=8)) != key
    assert rs.update_key(_task(params_version=7)) != key
    assert rs.update_key(_task(local_batch=3)) != key
    assert (
        rs.update_key(_task(ranges=[common_pb2.SampleRange(start=0, stop=4)])) != key
    )  # same samples count, other samples


def test_provide_state_serves_the_exact_version_else_the_newest() -> None:
    ring_jobs = RingJobs()
    assert asyncio.run(ring_jobs.provide_state("job", 3)) is None
    state = ring_jobs.hold("job", None, None)  # type: ignore[arg-type]
    state.snapshots = {
        4: StateSnapshot(4, {"param/a": torch.zeros(1)}),
        5: StateSnapshot(5, {}),
    }
    assert asyncio.run(ring_jobs.provide_state("job", 4)).version == 4  # type: ignore[union-attr]
    assert asyncio.run(ring_jobs.provide_state("job", 5)).version == 5  # type: ignore[union-attr]
    assert asyncio.run(ring_jobs.provide_state("job", 0)).version == 5  # type: ignore[union-attr]
    assert asyncio.run(ring_jobs.provide_state("job", 9)).version == 5  # type: ignore[union-attr]
    assert asyncio.run(ring_jobs.provide_state("other", 4)) is None


# -- scaling, codec, optimizer state -------------------------------------------------------------


def test_contribution_scale() -> None:
    assert rt.contribution_scale(3, 12) == 0.25
    assert rt.contribution_scale(12, 12) == 1.0
    with pytest.raises(ValueError, match="ring_total_samples 2 is smaller"):
        rt.contribution_scale(3, 2)
    with pytest.raises(ValueError, match="local_batch must be >= 1"):
        rt.contribution_scale(0, 10)


@pytest.mark.parametrize(
    ("compression", "codec"),
    [
        ("", "none"),
        ("none", "none"),
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("int8", "int8"),
        ("topk", "none"),
    ],
)
def test_ring_codec(compression: str, codec: str) -> None:
    assert rt.ring_codec(common_pb2.JobSpec(compression=compression)) == codec


def test_round_optimizer_keeps_state() -> None:
    assert rs.round_optimizer_keeps_state(_spec(momentum=0.9))
    assert not rs.round_optimizer_keeps_state(_spec(momentum=0.0))
    assert rs.round_optimizer_keeps_state(_spec(optimizer="adamw", momentum=0.0))
    assert rs.round_optimizer_keeps_state(_spec(sync="local_sgd", outer_momentum=0.9))
    assert not rs.round_optimizer_keeps_state(_spec(sync="local_sgd", outer_momentum=0.0))


def test_step_on_unflattened_sum_matches_the_parameter_server_arithmetic() -> None:
    """The member's step (summed buffer as .grad) equals the PS's weighted aggregate step."""
    spec = _spec()
    ts = _tensors()
    names = list(ts)
    g = torch.Generator().manual_seed(1)
    grads = [{n: torch.randn(t.shape, generator=g) for n, t in ts.items()} for _ in range(3)]
    batches = [5, 2, 1]
    total = sum(batches)
    summed = sum(rs.flatten(gr, names) * (b / total) for gr, b in zip(grads, batches, strict=True))
    assert isinstance(summed, torch.Tensor)
    ring_params = [torch.nn.Parameter(t.clone()) for t in ts.values()]
    opt = build_round_optimizer(spec, ring_params)
    unflat = rs.unflatten(summed, {n: tuple(t.shape) for n, t in ts.items()})
    for n, p in zip(names, ring_params, strict=True):
        p.grad = unflat[n].clone()
    opt.step()
    ps_params = [torch.nn.Parameter(t.clone()) for t in ts.values()]
    ps_opt = build_round_optimizer(spec, ps_params)
    for n, p in zip(names, ps_params, strict=True):
        acc = torch.zeros_like(p)
        for gr, b in zip(grads, batches, strict=True):
            acc.add_(gr[n], alpha=b / total)
        p.grad = acc
    ps_opt.step()
    for a, b in zip(ring_params, ps_params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # Replicas that step on the same bits agree bit for bit (what the checksum compares).
    again = [torch.nn.Parameter(t.clone()) for t in ts.values()]
    opt2 = build_round_optimizer(spec, again)
    for n, p in zip(names, again, strict=True):
        p.grad = unflat[n].clone()
    opt2.step()
    assert params_checksum(dict(zip(names, ring_params, strict=True))) == params_checksum(
        dict(zip(names, again, strict=True))
    )


# -- flags ---------------------------------------------------------------------------------------


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:7000") == ("::1", 7000)
    assert split_host_port("example.org", port_optional=True) == ("example.org", 0)
    for bad in ("nohost", ":80", "host:port", "host:70000", "::1:80", "[::1"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_advertised_peer_address() -> None:
    assert advertised_peer_address("127.0.0.1:0", "", 4242) == "127.0.0.1:4242"
    assert advertised_peer_address("0.0.0.0:7000", "", 7000) == "127.0.0.1:7000"
    assert advertised_peer_address("0.0.0.0:0", "donor.example.org", 5123) == (
        "donor.example.org:5123"
    )
    assert advertised_peer_address("0.0.0.0:7000", "203.0.113.9:17000", 7000) == (
        "203.0.113.9:17000"
    )
    assert advertised_peer_address("[::]:0", "", 9) == "127.0.0.1:9"
    assert advertised_peer_address("[::1]:0", "", 9) == "[::1]:9"


def test_peer_flags() -> None:
    base = ["--coordinator", "c:1", "--data-dir", "/tmp/x"]
    cfg = parse_args(base)
    assert cfg.peer_listen == DEFAULT_PEER_LISTEN and not cfg.no_peer and cfg.peer_advertise == ""
    cfg = parse_args([*base, "--peer-listen", "0.0.0.0:7000", "--peer-advertise", "h.example:0"])
    assert cfg.peer_listen == "0.0.0.0:7000" and cfg.peer_advertise == "h.example"
    assert parse_args([*base, "--no-peer"]).no_peer
    for bad in (
        ["--peer-listen", "nope"],
        ["--peer-advertise", "0.0.0.0:7000"],
        ["--no-peer", "--peer-listen", "127.0.0.1:0"],
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])


def test_a_served_state_must_be_the_one_the_ring_agreed_on() -> None:
    """A joiner checks the state a peer serves against the checksums the coordinator put in its
    task (what the ring agreed on for the version): another state names the peer (BadState);
    no checksum known (empty) checks nothing."""
    params = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    optim = {"0.momentum_buffer": torch.full((2, 3), 0.5)}
    snap = StateSnapshot(4, state_tensors(params, optim))
    task = agent_pb2.Task(
        job_id="j-1",
        params_version=4,
        state_source_node_id="n-source",
        state_params_checksum=params_checksum(params),
        state_optim_checksum=params_checksum(optim),
    )
    rs.check_served_state(snap, task)
    rs.check_served_state(snap, agent_pb2.Task(state_source_node_id="n-source"))  # unknown
    bent = {"0.momentum_buffer": torch.full((2, 3), 0.25)}  # momentum that steers the joiner
    with pytest.raises(rs.BadState, match="optimizer state are not the ones") as err:
        rs.check_served_state(StateSnapshot(4, state_tensors(params, bent)), task)
    assert err.value.node_id == "n-source"
    other = {**params, "b": torch.zeros(3)}
    with pytest.raises(rs.BadState, match="parameters are not the ones"):
        rs.check_served_state(StateSnapshot(4, state_tensors(other, optim)), task)
