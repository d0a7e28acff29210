"""The agent's round computations without networking: local SGD's inner loop against a plain
eager PyTorch loop, the sync-mode gradient, slicing, compression with error feedback, and
taking parameters out of a peer's state transfer."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.optim import build_optimizer
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.compression import ErrorFeedback, decode
from epochmesh.wire.tensors import decode_bundle, from_safetensors
from node_agent.core.slowdown import SlowdownController
from node_agent.link.cache import BlobCache
from node_agent.link.connection import CoordinatorConnection
from node_agent.ring.mailbox import StateSnapshot
from node_agent.ring.service import PeerServer
from node_agent.training.compute import (
    KIND_GRADIENT,
    KIND_PSEUDO_GRADIENT,
    accumulated_loss_and_grads,
    encode_update,
    gradient_step,
    inner_optimizer,
    inner_step_slices,
    job_error_feedback,
    local_sgd_steps,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import ComputedUpdate, LoadedJob
from node_agent.training.params import ensure_params, params_from_state, state_source_address
from tests.fixtures import make_classification, write_mlp_job

pytestmark = pytest.mark.timeout(120)

N = 200
LOCAL_SGD = {
    "sync": "local_sgd",
    "inner_steps": 4,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "lr": 0.1,
    "momentum": 0.9,
}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    toml = write_mlp_job(tmp_path_factory.mktemp("mlp"), N, overrides={"train": LOCAL_SGD})
    return build_job(load_spec(toml), cache=ExportCache.default())


@pytest.fixture
def program(packed: PackedJob) -> TrainableProgram:
    return TrainableProgram.from_bytes(packed.program, packed.initial_state)


@pytest.fixture(scope="module")
def dataset(packed: PackedJob) -> ShardedDataset:
    return ShardedDataset(packed.shards, inputs=["x"], targets=["y"])


def eager_model(packed: PackedJob) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model.load_state_dict(from_safetensors(packed.initial_state))
    return model


def eager_inner_loop(
    model: nn.Module, opt: torch.optim.Optimizer, slices: Sequence[Sequence[int]]
) -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch: H steps, Δ = start − end, sample-weighted mean loss; model back at start."""
    data = make_classification(N)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    total = 0.0
    for idx in slices:
        i = torch.tensor(list(idx))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data["x"][i]), data["y"][i])
        loss.backward()
        opt.step()
        total += float(loss.detach()) * len(idx)
    delta = {k: start[k] - p.detach() for k, p in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])
    return delta, total / sum(len(s) for s in slices)


def test_inner_step_slices() -> None:
    idx = list(range(100, 130))
    assert inner_step_slices(idx, 10, 3) == [idx[0:10], idx[10:20], idx[20:30]]
    # Near an epoch's end: fewer samples, the last step smaller.
    assert inner_step_slices(idx[:25], 10, 3) == [idx[0:10], idx[10:20], idx[20:25]]
    assert inner_step_slices(idx[:4], 10, 3) == [idx[0:4]]
    assert inner_step_slices(idx[:10], 10, 1) == [idx[:10]]
    with pytest.raises(ValueError, match="more than inner_steps"):
        inner_step_slices(idx, 10, 2)
    with pytest.raises(ValueError, match="no samples"):
        inner_step_slices([], 10, 2)
    with pytest.raises(ValueError, match="local_batch"):
        inner_step_slices(idx, 0, 2)
    with pytest.raises(ValueError, match="inner_steps"):
        inner_step_slices(idx, 10, 0)


def test_local_sgd_matches_eager_loop_and_keeps_optimizer_state(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    opt = build_optimizer(packed.spec, program.parameters())
    model = eager_model(packed)
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = program.get_parameters()
    # Two rounds on different samples, the second with a short last step; the inner
    # optimizer's momentum carries over from round to round (DiLoCo), parameters do not.
    for slices in (
        inner_step_slices(range(0, 64), 16, 4),
        inner_step_slices(range(64, 114), 16, 4),
    ):
        update = local_sgd_steps(program, opt, slices, dataset.get_batch, SlowdownController())
        ref_delta, ref_loss = eager_inner_loop(model, ref_opt, slices)
        assert update.kind == KIND_PSEUDO_GRADIENT
        assert update.num_samples == sum(len(s) for s in slices)
        assert update.steps == len(slices)
        assert list(update.tensors) == program.param_names
        for k, d in update.tensors.items():
            assert d.dtype == torch.float32 and d.device.type == "cpu"
            torch.testing.assert_close(d, ref_delta[k], rtol=0, atol=1e-6)
        assert math.isclose(update.mean_loss, ref_loss, rel_tol=1e-5)
        # The program is back at the round's parameters.
        now = program.get_parameters()
        assert all(torch.equal(now[k], start[k]) for k in start)
    assert all("momentum_buffer" in opt.state[p] for p in program.parameters())


def test_local_sgd_reduces_the_loss_of_its_samples(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    opt = build_optimizer(packed.spec, program.parameters())
    idx = list(range(0, 40))
    inputs, targets = dataset.get_batch(idx)
    before = program.loss(inputs, targets)
    update = local_sgd_steps(program, opt, [idx] * 8, dataset.get_batch, SlowdownController())
    program.set_parameters({k: p - update.tensors[k] for k, p in program.get_parameters().items()})
    assert program.loss(inputs, targets) < before


def test_compute_seconds_are_the_wall_time_of_the_padded_steps(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    slow = SlowdownController(3.0)
    opt = build_optimizer(packed.spec, program.parameters())
    t0 = time.monotonic()
    update = local_sgd_steps(
        program, opt, inner_step_slices(range(30), 8, 4), dataset.get_batch, slow
    )
    wall = time.monotonic() - t0
    # Every step is padded to 3x its compute (an over-long sleep is paid back on the next one,
    # at most one step's padding).
    assert slow.steps == 4
    assert 2.5 * slow.compute_seconds <= update.compute_s <= wall


def test_a_time_box_stops_the_steps_and_covers_the_prefix(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    slices = inner_step_slices(range(60), 8, 8)  # 8 steps, the last of 4 samples
    ticks = [0]

    def tick() -> None:  # one "second" per step on the loop's clock
        ticks[0] += 1

    def clock() -> float:
        return float(ticks[0])

    opt = build_optimizer(packed.spec, program.parameters())
    boxed = local_sgd_steps(
        program, opt, slices, dataset.get_batch, SlowdownController(), tick, 3.4, clock
    )
    # After 3 steps (3 s) a fourth would end at 4 s: 0.6 s past the box, more than the 0.4 s
    # short of it that stopping leaves.
    assert (boxed.steps, boxed.num_samples, boxed.compute_s) == (3, 24, 3.0)
    ref_opt = build_optimizer(packed.spec, program.parameters())
    prefix = local_sgd_steps(program, ref_opt, slices[:3], dataset.get_batch, SlowdownController())
    for k, d in boxed.tensors.items():
        torch.testing.assert_close(d, prefix.tensors[k], rtol=0, atol=0)
    ticks[0] = 0
    whole = local_sgd_steps(
        program, opt, slices, dataset.get_batch, SlowdownController(), tick, 100.0, clock
    )
    assert (whole.steps, whole.num_samples) == (8, 60)
    ticks[0] = 0
    one = local_sgd_steps(
        program, opt, slices, dataset.get_batch, SlowdownController(), tick, 0.1, clock
    )
    assert (one.steps, one.num_samples) == (1, 8)  # at least one step


def test_a_step_that_raises_leaves_the_round_parameters(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    opt = build_optimizer(packed.spec, program.parameters())
    start = program.get_parameters()
    calls = [0]

    def cancel_on_third() -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        local_sgd_steps(
            program,
            opt,
            inner_step_slices(range(40), 10, 4),
            dataset.get_batch,
            SlowdownController(),
            cancel_on_third,
        )
    now = program.get_parameters()
    assert all(torch.equal(now[k], start[k]) for k in start)
    assert all(p.grad is None for p in program.parameters())


def test_gradient_step_is_the_mean_loss_gradient(
    program: TrainableProgram, dataset: ShardedDataset
) -> None:
    batch = dataset.get_batch(list(range(10, 42)))
    update = gradient_step(program, batch, SlowdownController())
    loss, grads = program.loss_and_grads(*batch)
    assert update.kind == KIND_GRADIENT and update.num_samples == 32 and update.steps == 1
    assert update.mean_loss == pytest.approx(loss)
    for k, g in grads.items():
        assert torch.equal(update.tensors[k], g)


class PassRecorder:
    """The program, noting the batch size of every forward/backward pass."""

    def __init__(self, program: TrainableProgram) -> None:
        self.program = program
        self.passes: list[int] = []

    def loss_and_grads(
        self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> tuple[float, dict[str, torch.Tensor]]:
        self.passes.append(int(inputs[0].shape[0]))
        return self.program.loss_and_grads(inputs, targets)


def test_micro_batches_accumulate_to_the_whole_batch_gradient(
    program: TrainableProgram, dataset: ShardedDataset
) -> None:
    batch = dataset.get_batch(list(range(5, 42)))  # 37 samples
    loss, grads = program.loss_and_grads(*batch)
    recorder = PassRecorder(program)
    acc_loss, acc = accumulated_loss_and_grads(recorder, *batch, micro_batch=8)  # type: ignore[arg-type]
    assert recorder.passes == [8, 8, 8, 8, 5]
    assert acc_loss == pytest.approx(loss, rel=1e-6)
    assert acc.keys() == grads.keys()
    for k, g in grads.items():
        assert acc[k].dtype == torch.float32
        torch.testing.assert_close(acc[k], g, rtol=1e-5, atol=1e-6)
    update = gradient_step(program, batch, SlowdownController(), micro_batch=8)
    assert update.num_samples == 37 and update.mean_loss == pytest.approx(loss, rel=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(update.tensors[k], g, rtol=1e-5, atol=1e-6)
    # A micro-batch no smaller than the batch (or 0): one pass, the very same result.
    for micro in (0, 37, 100):
        recorder.passes.clear()
        same_loss, same = accumulated_loss_and_grads(recorder, *batch, micro_batch=micro)  # type: ignore[arg-type]
        assert recorder.passes == [37] and same_loss == loss
        assert all(torch.equal(same[k], g) for k, g in grads.items())


def test_local_sgd_inner_steps_with_micro_batches(
    packed: PackedJob, dataset: ShardedDataset
) -> None:
    slices = inner_step_slices(range(60), 15, 4)
    deltas = []
    for micro in (0, 4):
        prog = TrainableProgram.from_bytes(packed.program, packed.initial_state)
        opt = build_optimizer(packed.spec, prog.parameters())
        update = local_sgd_steps(
            prog, opt, slices, dataset.get_batch, SlowdownController(), micro_batch=micro
        )
        assert update.num_samples == 60 and update.steps == 4
        deltas.append(update.tensors)
    for k, d in deltas[0].items():
        torch.testing.assert_close(deltas[1][k], d, rtol=1e-4, atol=1e-6)


def spec_with(compression: str, ratio: float = 0.0) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(compression=compression, topk_ratio=ratio)


def test_inner_optimizer_is_built_once_per_job(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    job = LoadedJob(program=program, dataset=dataset)
    opt = inner_optimizer(job, packed.spec)
    assert inner_optimizer(job, packed.spec) is opt
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["lr"] == pytest.approx(0.1)


def test_a_restored_job_state_gets_a_fresh_inner_optimizer(
    packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    """Task.restored_version: the inner optimizer is kept while it stays the same, and built
    anew once the job's state was restored (its momentum came from undone rounds)."""
    job = LoadedJob(program=program, dataset=dataset)
    task = agent_pb2.Task(restored_version=0)
    assert not job.follow_restore(task)  # the first task: nothing stepped before
    opt = inner_optimizer(job, packed.spec)
    assert not job.follow_restore(task)
    assert inner_optimizer(job, packed.spec) is opt
    task.restored_version = 17  # a rollback (or a coordinator restart) restored version 17
    assert job.follow_restore(task)
    fresh = inner_optimizer(job, packed.spec)
    assert fresh is not opt
    assert not job.follow_restore(task)
    assert inner_optimizer(job, packed.spec) is fresh


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "topk"])
def test_encode_update_uses_the_spec_codec_and_job_error_feedback(
    program: TrainableProgram, dataset: ShardedDataset, codec: str
) -> None:
    job = LoadedJob(program=program, dataset=dataset)
    spec = spec_with(codec, 0.1 if codec == "topk" else 0.0)
    ef = job_error_feedback(job, spec)
    assert (ef is not None) == (codec in ("int8", "topk"))
    assert job_error_feedback(job, spec) is ef  # kept per job
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(p.shape, generator=g) for k, p in program.get_parameters().items()}
    update = ComputedUpdate(KIND_PSEUDO_GRADIENT, tensors, 1.0, 0.1, 10)
    header, payload = encode_update(update, spec, ef)
    assert {t.codec for t in header.tensors} == {codec}
    out = decode_bundle(header, payload)
    for k, t in tensors.items():
        if codec == "none":
            assert torch.equal(out[k], t)
        elif codec == "topk":
            kept = out[k] != 0
            assert torch.equal(out[k][kept], t[kept])
            assert ef is not None
            residual = ef.residual(k)
            assert residual is not None and torch.equal(out[k] + residual, t)
        else:
            assert float((out[k] - t).abs().max()) < 0.05 * float(t.abs().max())


def test_error_feedback_follows_a_changed_codec(
    program: TrainableProgram, dataset: ShardedDataset
) -> None:
    job = LoadedJob(program=program, dataset=dataset)
    first = job_error_feedback(job, spec_with("topk", 0.1))
    assert first is not None
    again = job_error_feedback(job, spec_with("topk", 0.2))
    assert again is not None and again is not first and again.ratio == 0.2
    assert job_error_feedback(job, spec_with("int8")) is not again
    assert job_error_feedback(job, spec_with("fp16")) is None


def test_error_feedback_rollback_snapshot_is_not_aliased() -> None:
    # run_train_task snapshots ef.state_tensors() before encoding and restores it when the
    # update is not applied: compress() must replace residuals, never modify them in place.
    ef = ErrorFeedback("topk", 0.1)
    ef.compress("w", torch.arange(20.0))
    saved = ef.state_tensors()
    before = saved["w"].clone()
    ef.compress("w", torch.ones(20))
    assert torch.equal(saved["w"], before)
    ef.load_state_tensors(saved)
    residual = ef.residual("w")
    assert residual is not None and torch.equal(residual, before)
    data = ErrorFeedback("topk", 0.1).compress("w", torch.arange(20.0))
    assert decode(data, "topk", (20,)).count_nonzero() == 2


def test_params_from_state(program: TrainableProgram) -> None:
    params = program.get_parameters()
    expected = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
    state = {f"param/{k}": v for k, v in params.items()}
    state["optim/momentum_buffer/0.weight"] = torch.zeros(1)
    got = params_from_state(state, expected)
    assert list(got) == list(params) and all(torch.equal(got[k], params[k]) for k in params)
    missing = dict(state)
    missing.pop("param/2.bias")
    with pytest.raises(ValueError, match="lacks parameter '2.bias'"):
        params_from_state(missing, expected)
    wrong = dict(state)
    wrong["param/2.bias"] = torch.zeros(5)
    with pytest.raises(ValueError, match="'2.bias'"):
        params_from_state(wrong, expected)


def test_state_source_address(tmp_path: Path) -> None:
    task = agent_pb2.Task(state_source_node_id="b")
    task.ring.node_ids.extend(["a", "b"])
    task.ring.peer_addresses.extend(["127.0.0.1:1", "127.0.0.1:2"])
    assert state_source_address(task) == "127.0.0.1:2"
    task.state_source_address = "10.0.0.1:5"
    assert state_source_address(task) == "10.0.0.1:5"
    with pytest.raises(ValueError, match="without an address"):
        state_source_address(agent_pb2.Task(state_source_node_id="zz"))


@pytest.mark.timeout(30)
async def test_ensure_params_takes_the_rounds_state_from_a_peer(
    program: TrainableProgram, dataset: ShardedDataset, tmp_path: Path
) -> None:
    # A --no-peer node of a ring job: the round's parameters come from a member's
    # PeerService (TransferState over real gRPC on loopback), not from the coordinator.
    held = program.get_parameters()
    served = {k: v + 1.0 for k, v in held.items()}
    asked: list[tuple[str, int]] = []
    serve_version = [7]

    async def provider(job_id: str, version: int) -> StateSnapshot | None:
        asked.append((job_id, version))
        tensors = {f"param/{k}": v for k, v in served.items()}
        tensors["optim/momentum_buffer/0.bias"] = torch.zeros(32)
        return StateSnapshot(version=serve_version[0], tensors=tensors)

    server = PeerServer("127.0.0.1:0", state_provider=provider, tune_malloc=False)
    await server.start()
    connection = CoordinatorConnection(
        "127.0.0.1:1", tmp_path / "agent", lambda: agent_pb2.RegisterRequest(), insecure=True
    )
    try:
        task = agent_pb2.Task(
            task_id="t-1",
            job_id="j-1",
            params_version=7,
            deadline_seconds=10,
            state_source_node_id="n-member",
            state_source_address=server.address,
        )
        ctx = TaskContext(
            task=task,
            connection=connection,
            cache=BlobCache(tmp_path / "cache"),
            device="cpu",
            device_info=common_pb2.Device(),
            slowdown=SlowdownController(),
        )
        job = LoadedJob(
            program=program,
            dataset=dataset,
            version=6,
            expected={k: (v.dtype, tuple(v.shape)) for k, v in held.items()},
        )
        await ensure_params(ctx, job, task)
        assert job.version == 7 and asked == [("j-1", 7)]
        now = program.get_parameters()
        assert all(torch.equal(now[k], served[k]) for k in served)
        await ensure_params(ctx, job, task)  # already held: no transfer
        assert len(asked) == 1
        # A peer that answers with another version than the round's is not trusted.
        job.version = 6
        serve_version[0] = 8
        with pytest.raises(ValueError, match="sent version 8"):
            await ensure_params(ctx, job, task)
        assert job.version == 6
    finally:
        await server.stop()
        await connection.close()
