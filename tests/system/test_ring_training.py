"""Ring all-reduce training with real processes: a coordinator, agents with PeerServices
(``--peer-listen``, mutual TLS with their node certificates) and slowdowns 1, 2 and 4, jobs
submitted with the `epochmesh` CLI.

- Equivalence: a ring job trains to the parameters of the single-process replay of its recorded
  rounds (plain PyTorch, the submitter's model.py) within 1e-5, every epoch covered once.
- A ``--no-peer`` agent takes part in a ring job through the coordinator (its update reaches
  the ring through the round's gateway member); the replay still matches.
- Time-boxed local SGD rings: members weigh their pseudo-gradients by the samples they trained in
  their boxes; a member slowed after its benchmark trains fewer steps instead of holding the
  ring; every sample once, the weights add up, the audits accuse nobody.
- A peer killed with kill -9 in the middle of an all-reduce: the round is retried without it
  (event round.retried), the job finishes, and every sample of every epoch is trained exactly
  once according to the records.

The tests share one cluster and run in file order: the last one kills an agent.
(The coordinator's side of checksum mismatches, topk + ring and rings without members is
tested in tests/integration/test_ring_coordinator.py with agents played by the test.)
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from epochmesh.v1 import (
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.fixtures import write_job
from tests.procs import STDERR_LOG, start_coordinator, sync_channel_for, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_training import import_model, submit

log = logging.getLogger(__name__)

SLOWDOWNS = (1, 2, 4)
LR = 0.05
MOMENTUM = 0.9
SEED = 7
FEATURES = 32

# Small and quick: the ring's logic is under test here, not the allocation (test_training.py
# checks shares); the job benchmark of a heavy model on a slowed agent would dominate.
MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
"""


# About a million parameters (4.4 MB of gradients): the all-reduce then takes most of a round,
# so that a kill right after a member begins it lands in the middle of it.
WIDE_MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8)
    )
"""


def make_dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 8, generator=g)
    return {"x": x, "y": (x @ w).argmax(dim=1)}


@pytest.fixture(scope="module")
def ring_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    root = tmp_path_factory.mktemp("ring")
    with start_coordinator(root / "coord", "--heartbeat-interval", "0.5") as coord:
        agents = {
            f"x{s}": AgentProc(
                coord.address,
                root / f"agent-x{s}",
                "--slowdown",
                str(s),
                "--name",
                f"x{s}",
                "--peer-listen",
                "127.0.0.1:0",
            )
            for s in SLOWDOWNS
        }
        try:
            wait_benchmarked(coord.address, len(agents))
            yield coord.address, agents
        finally:
            for a in agents.values():
                a.kill9()


def wait_benchmarked(address: str, count: int) -> None:
    wait_until(
        lambda: len([n for n in list_nodes(address) if n.benchmark.samples_per_second]) >= count,
        timeout=60,
        message="agents did not register and benchmark",
    )


def ring_job(
    tmp_path: Path, n: int, train: dict | None = None, model: str = MODEL, **cluster: object
) -> tuple[Path, dict[str, torch.Tensor]]:
    data = make_dataset(n)
    job_toml = write_job(
        tmp_path / "job",
        model,
        data,
        {
            "name": "ring",
            "model": {"file": "model.py", "loss": "cross_entropy"},
            "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
            "train": {
                "epochs": 2,
                "global_batch": 64,
                "optimizer": "sgd",
                "lr": LR,
                "momentum": MOMENTUM,
                "seed": SEED,
                **(train or {}),
            },
            "cluster": {"aggregation": "ring", "checkpoint_every": 3, **cluster},
        },
    )
    return job_toml, data


def finish(address: str, job_id: str, timeout: float) -> tuple[list, list, dict]:
    """Wait for SUCCEEDED; return the rounds, the job's events and the trained state."""
    with sync_channel_for(address) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)

        def done() -> common_pb2.Job | None:
            job = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
            assert job.state not in (common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED), (
                job.message
            )
            return job if job.state == common_pb2.JOB_STATE_SUCCEEDED else None

        wait_until(done, timeout=timeout, interval=0.25, message=f"job {job_id} did not finish")
        rounds = list(jobs.GetRounds(job_pb2.GetRoundsRequest(job_id=job_id), timeout=10).rounds)
        events = list(
            sched.WatchEvents(scheduler_pb2.WatchEventsRequest(job_id=job_id), timeout=10)
        )
        data = b"".join(
            m.chunk.data
            for m in jobs.DownloadResult(job_pb2.DownloadResultRequest(job_id=job_id), timeout=30)
        )
    return rounds, events, st_load(data)


def applied(rnd: common_pb2.RoundRecord) -> list[common_pb2.RoundPart]:
    return sorted((p for p in rnd.parts if p.status == "applied"), key=lambda p: p.node_id)


def part_indices(part: common_pb2.RoundPart) -> list[int]:
    return [i for r in part.ranges for i in range(r.start, r.stop)]


def check_exactly_once(rounds: list[common_pb2.RoundRecord], n: int, epochs: int = 2) -> None:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in applied(rnd):
            by_epoch[rnd.epoch].extend(part_indices(part))
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(n)), f"epoch {epoch} is not covered exactly once"


def replay_diff(
    job_dir: Path, data: dict, rounds: list[common_pb2.RoundRecord], trained: dict
) -> float:
    """Max abs difference between the trained state and a plain PyTorch replay of the rounds:
    per round, the b_i-weighted mean of the parts' mean-loss gradients, one SGD step."""
    module = import_model(job_dir / "model.py")
    torch.manual_seed(SEED)
    model = module.make_model()
    assert set(trained) == set(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.functional.cross_entropy
    for rnd in rounds:
        parts = applied(rnd)
        if not parts:
            continue
        total_b = sum(p.local_batch for p in parts)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for part in parts:
            idx = torch.tensor(part_indices(part))
            model.zero_grad()
            loss_fn(model(data["x"][idx]), data["y"][idx]).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g.add_(p.grad, alpha=part.local_batch / total_b)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
    return max((trained[k] - v).abs().max().item() for k, v in model.state_dict().items())


@pytest.mark.timeout(120)
def test_ring_training_matches_single_process_replay(
    ring_cluster: tuple[str, dict], tmp_path: Path
) -> None:
    address, agents = ring_cluster
    n = 576
    job_toml, data = ring_job(tmp_path, n, min_nodes=3, max_nodes=3)
    t0 = time.monotonic()
    job_id = submit(address, job_toml)
    rounds, events, trained = finish(address, job_id, timeout=90)
    check_exactly_once(rounds, n)
    ids = {a.node_id() for a in agents.values()}
    assert all({p.node_id for p in applied(r)} <= ids for r in rounds)
    assert any(len(applied(r)) == 3 for r in rounds)
    assert all(r.attempts >= 1 for r in rounds)
    diff = replay_diff(tmp_path / "job", data, rounds, trained)
    assert diff <= 1e-5, f"max abs difference {diff}"
    assert not [e for e in events if e.kind == "job.diverged"]
    # Every member probed the other two (PeerService pings) for the coordinator's ring order.
    for a in agents.values():
        measured = set(re.findall(r"peer link to (n-[0-9a-f]+): rtt", a.log_text()))
        assert measured == ids - {a.node_id()}, (a.node_id(), measured)
    log.info(
        f"ring equivalence: {len(rounds)} rounds in {time.monotonic() - t0:.1f}s, diff {diff:.2e}"
    )


@pytest.mark.timeout(120)
def test_a_no_peer_agent_takes_part_in_a_ring_job(
    ring_cluster: tuple[str, dict], tmp_path: Path
) -> None:
    address, agents = ring_cluster
    if "ext" not in agents:
        agents["ext"] = AgentProc(
            address, tmp_path.parent / "agent-ext", "--slowdown", "2", "--name", "ext", "--no-peer"
        )
    wait_benchmarked(address, len(agents))
    ext_id = agents["ext"].wait_node_id()
    info = next(n for n in list_nodes(address) if n.node_id == ext_id)
    assert info.peer_address == ""
    n = 384
    job_toml, data = ring_job(tmp_path, n, min_nodes=4, max_nodes=4)
    t0 = time.monotonic()
    job_id = submit(address, job_toml)
    rounds, _, trained = finish(address, job_id, timeout=90)
    check_exactly_once(rounds, n)
    ext_parts = [p for r in rounds for p in applied(r) if p.node_id == ext_id]
    assert len(ext_parts) >= len(rounds) // 2, "the --no-peer agent hardly took part"
    diff = replay_diff(tmp_path / "job", data, rounds, trained)
    assert diff <= 1e-5, f"max abs difference {diff}"
    log.info(
        f"ring + external: {len(rounds)} rounds in {time.monotonic() - t0:.1f}s, diff {diff:.2e}"
    )


@pytest.mark.timeout(120)
def test_local_sgd_with_int8_in_a_ring(ring_cluster: tuple[str, dict], tmp_path: Path) -> None:
    """Pseudo-gradients of H inner steps, int8 on the ring's wire, the outer Nesterov step on
    every member: the replicas stay bit-identical (no job.diverged), every epoch is covered
    once, H*b_i samples per part, and the loss falls."""
    address, _ = ring_cluster
    n, h = 768, 4
    job_toml, _ = ring_job(
        tmp_path,
        n,
        train={
            "epochs": 3,
            "global_batch": 32,
            "lr": 0.1,
            "momentum": 0.0,  # inner SGD momentum 0.9 under Nesterov 0.9 oscillates here
            "sync": "local_sgd",
            "inner_steps": h,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "compression": "int8",
        },
        min_nodes=3,
        max_nodes=3,
    )
    job_id = submit(address, job_toml)
    rounds, events, _ = finish(address, job_id, timeout=90)
    check_exactly_once(rounds, n, epochs=3)
    assert not [e for e in events if e.kind == "job.diverged"]
    parts = [p for r in rounds for p in applied(r)]
    assert all(p.inner_steps == -(-len(part_indices(p)) // p.local_batch) for p in parts)
    assert sum(len(part_indices(p)) == h * p.local_batch for p in parts) >= len(parts) // 2
    first, last = rounds[0].loss, rounds[-1].loss
    assert last < 0.8 * first, (
        f"loss {first:.3f} -> {last:.3f}: {[round(r.loss, 3) for r in rounds]}"
    )


# A member's line after a time-boxed (weighted) ring round: round, samples, steps, its weight and
# the round's summed weight.
WEIGHTED_ROUND = re.compile(
    r"round (\d+) attempt (\d+): pseudo_gradient of (\d+) samples in (\d+) step\(s\).*"
    r"weight ([0-9.]+) of ([0-9.]+)\)"
)
BOXED_H = 192


@pytest.mark.timeout(180)
def test_time_boxed_local_sgd_rings_weigh_members_by_the_samples_they_trained(
    ring_cluster: tuple[str, dict], tmp_path: Path
) -> None:
    """Every member declares weighted contributions, so local SGD ring rounds are time-boxed:
    each member steps for its box and weighs its pseudo-gradient by the samples it trained
    (int8 on the wire, the weight in its own block). A member slowed down after its benchmark
    trains fewer steps in its box instead of holding the ring; what it did not train goes back
    to pending. Every sample is trained once, the replicas agree, the members' weights add up
    to the summed weight each divided by, the audits of the weighted all-reduce accuse nobody,
    and the loss falls."""
    address, all_agents = ring_cluster
    # Ring members only: a --no-peer node (an earlier test's) would leave the ring unboxed.
    agents = {name: a for name, a in all_agents.items() if name != "ext"}
    ext = all_agents.get("ext")
    n = 24 * BOXED_H * 5
    job_toml, _ = ring_job(
        tmp_path,
        n,
        train={
            "epochs": 1,
            "global_batch": 24,
            "lr": 0.05,
            "momentum": 0.0,
            "sync": "local_sgd",
            "inner_steps": BOXED_H,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "compression": "int8",
        },
        min_nodes=3,
        max_nodes=3,
    )
    slowed = agents["x1"]
    slowed_id = slowed.node_id()
    starts = {name: len(a.log_text()) for name, a in agents.items()}
    with sync_channel_for(address) as ch:
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        if ext is not None:
            sched.Cordon(scheduler_pb2.NodeRequest(node_id=ext.node_id()), timeout=10)
    job_id = submit(address, job_toml)
    try:
        with sync_channel_for(address) as ch:
            jobs = job_pb2_grpc.JobServiceStub(ch)

            def first_round_applied() -> bool:
                got = jobs.GetRounds(job_pb2.GetRoundsRequest(job_id=job_id), timeout=10)
                return any(applied(r) for r in got.rounds)

            wait_until(first_round_applied, timeout=90, message="no round was applied")
        # Far slower than its benchmark and first round said (DATA_DIR/slowdown).
        (slowed.data_dir / "slowdown").write_text("20")
        rounds, events, _ = finish(address, job_id, timeout=120)
    finally:
        (slowed.data_dir / "slowdown").write_text("1")
        if ext is not None:
            with sync_channel_for(address) as ch:
                scheduler_pb2_grpc.SchedulerServiceStub(ch).Uncordon(
                    scheduler_pb2.NodeRequest(node_id=ext.node_id()), timeout=10
                )
    check_exactly_once(rounds, n, epochs=1)
    kinds = {e.kind for e in events}
    assert not kinds & {"job.diverged", "round.disputed", "round.aborted"}, kinds

    # What the members logged of their weighted rounds, the last attempt of each: (round, node)
    # -> attempt, samples, steps, weight, summed weight.
    logged: dict[tuple[int, str], tuple[int, int, int, float, float]] = {}
    for name, agent in agents.items():
        for m in WEIGHTED_ROUND.finditer(agent.log_text()[starts[name] :]):
            rnd, attempt, samples, steps = (int(m.group(k)) for k in range(1, 5))
            key = (rnd, agent.node_id())
            if key not in logged or logged[key][0] <= attempt:
                logged[key] = (attempt, samples, steps, float(m.group(5)), float(m.group(6)))
    by_round = {r.round: r for r in rounds}
    # The attempt each round applied (a retried round's members logged earlier ones too).
    weighted = {
        (rnd, node): v[1:]
        for (rnd, node), v in logged.items()
        if rnd in by_round and v[0] == by_round[rnd].attempts - 1
    }
    boxed = sorted({rnd for rnd, _ in weighted})
    assert len(boxed) >= 2, sorted(logged.items())
    for rnd in boxed:
        record = by_round[rnd]
        parts = {p.node_id: p for p in applied(record)}
        members = {node: v for (r, node), v in weighted.items() if r == rnd}
        assert set(members) == set(parts), (rnd, members, record)
        total = sum(w for _, _, w, _ in members.values())
        for node, (samples, steps, _, summed) in members.items():
            # The record holds the prefix the member trained, and the weight it put in.
            assert len(part_indices(parts[node])) == samples, (rnd, node)
            assert parts[node].inner_steps == steps == -(-samples // parts[node].local_batch)
            assert abs(summed - total) <= 1e-5 * total + 2e-6, (rnd, summed, total)
    # Slowed after its benchmark, x1 trained far fewer steps than its box was planned for (the
    # coordinator's "about N steps" of the round), at least once before the estimates caught
    # up, instead of holding the ring: its untrained samples were trained later.
    coord_log = (slowed.data_dir.parent / "coord" / STDERR_LOG).read_text(errors="replace")
    planned = {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(
            rf"job {job_id} round (\d+): time boxes .* for about (\d+) steps", coord_log
        )
    }
    short = [
        (rnd, steps, planned[rnd])
        for (rnd, node), (_, steps, _, _) in weighted.items()
        if node == slowed_id and rnd in planned and steps < 0.5 * planned[rnd]
    ]
    assert short, (planned, sorted(weighted.items()))
    # The weighted rounds were audited (new nodes are checked every round) and nobody was
    # accused or struck for them.
    nodes = {x.node_id: x for x in list_nodes(address)}
    for agent in agents.values():
        info = nodes[agent.node_id()]
        assert info.strikes == 0, (agent.node_id(), info.strikes)
        assert info.reputation.failed_total == 0, info.reputation
    assert rounds[-1].loss < rounds[0].loss, [round(r.loss, 4) for r in rounds]
    log.info(
        "time-boxed rounds (round, node: samples, steps, weight, summed): %s",
        {k: v for k, v in sorted(weighted.items())},
    )


# The agent's line right before ring_allreduce (DEBUG): round, attempt, rank, ring size.
ALLREDUCE_STARTS = re.compile(
    r"round (\d+) attempt \d+: all-reduce of \d+ floats as rank \d+ of (\d+)"
)


@pytest.mark.timeout(120)
def test_a_peer_killed_mid_allreduce_is_left_out_and_the_round_retried(
    ring_cluster: tuple[str, dict], tmp_path: Path
) -> None:
    address, agents = ring_cluster
    n = 576
    job_toml, _ = ring_job(tmp_path, n, model=WIDE_MODEL, min_nodes=2, max_nodes=4)
    victim = agents["x1"]  # the fastest: it waits in the all-reduce for the slower members
    victim_id = victim.node_id()
    log_start = len(victim.log_text())
    job_id = submit(address, job_toml)

    def in_allreduce() -> int:
        """The round whose all-reduce the victim has just begun, in a ring of two or more (the
        others benchmark the job meanwhile; round 3 or later)."""
        found = list(ALLREDUCE_STARTS.finditer(victim.log_text()[log_start:]))
        if found and int(found[-1].group(1)) >= 3 and int(found[-1].group(2)) >= 2:
            return int(found[-1].group(1))
        return 0

    killed_round = int(wait_until(in_allreduce, timeout=60, interval=0.005, message="no full ring"))
    victim.kill9()
    t0 = time.monotonic()
    rounds, events, _ = finish(address, job_id, timeout=90)
    check_exactly_once(rounds, n)
    retried = [e for e in events if e.kind == "round.retried"]
    assert retried, [e.kind for e in events]
    blamed = [e for e in retried if victim_id in e.attrs["failed"].split(",")]
    assert blamed, [e.message for e in retried]
    # The victim's rounds whose check it had not answered yet (its sketches and start state go
    # beside its next task, the one it was killed in) are undone with the rounds after them:
    # the retried round may be among the rolled-back ones.
    with sync_channel_for(address) as ch:
        recorded = job_pb2_grpc.JobServiceStub(ch).GetRounds(
            job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=True), timeout=10
        )
    rnd = next(r for r in recorded.rounds if r.round == int(blamed[0].attrs["round"]))
    assert rnd.round == killed_round, "the retried round is the one whose all-reduce was cut"
    assert rnd.attempts >= 2
    assert {p.node_id: p.status for p in rnd.parts}[victim_id] == "failed"
    assert all(
        victim_id not in {p.node_id for p in applied(r)} for r in rounds if r.round > rnd.round
    )
    log.info(f"kill -9 mid all-reduce: job finished {time.monotonic() - t0:.1f}s after the kill")
