"""The agent's side of verification (issue 20) without networking: a part cut into chunks whose
weighted sum is the part's gradient and whose commitments fit it, the test-only cheats
(node_agent.testing.cheat) and their consistency: for an honest update and for every cheated one, the
sample-weighted sum of the chunks' sketches is the sketch of the update sent (a smart cheater
passes the sketch check; only recomputation catches it). The real exported program
(epochmesh.program.archive.TrainableProgram) of the tests' MLP computes every gradient."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.sketch import combine, relative_distance, sketch
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import chunk_bounds, commitment_problem
from node_agent.core.slowdown import SlowdownController
from node_agent.link.cache import BlobCache
from node_agent.link.connection import CoordinatorConnection
from node_agent.testing.cheat import (
    CHEAT_ENV,
    SCALE,
    UPDATE_KINDS,
    Cheat,
    cheat_chunks,
    cheat_from_environment,
    cheat_update,
    fill_skipped,
    lazy_count,
    noise_like,
    parse_cheat,
    randomized,
    round_generator,
)
from node_agent.training.compute import (
    chunked_gradient_step,
    combine_chunks,
    gradient_step,
    update_in_thread,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import ChunkGradients, ComputedUpdate, LoadedJob
from tests.fixtures import write_mlp_job

pytestmark = pytest.mark.timeout(120)

N = 240
K = 12


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    return build_job(
        load_spec(write_mlp_job(tmp_path_factory.mktemp("mlp"), N)), cache=ExportCache.default()
    )


@pytest.fixture
def program(packed: PackedJob) -> TrainableProgram:
    return TrainableProgram.from_bytes(packed.program, packed.initial_state)


@pytest.fixture(scope="module")
def dataset(packed: PackedJob) -> ShardedDataset:
    return ShardedDataset(packed.shards, inputs=["x"], targets=["y"])


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1).double() for k in sorted(tensors)])


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over the whole gradient."""
    fb = flat(b)
    return float((flat(a) - fb).norm() / fb.norm())


def sketch_gap(update: ComputedUpdate, seed: int = 12345, buckets: int = 256) -> float:
    """Relative distance between the update's sketch and its chunks' weighted sketch sum."""
    chunks = update.chunks
    assert chunks is not None
    n = sum(chunks.samples)
    combined = combine(
        [
            (m / n, sketch(g, seed, buckets))
            for m, g in zip(chunks.samples, chunks.grads, strict=True)
        ]
    )
    return relative_distance(combined, sketch(update.tensors, seed, buckets))


class PassRecorder:
    """The program, noting the batch size of every forward/backward pass."""

    def __init__(self, program: TrainableProgram) -> None:
        self.program = program
        self.passes: list[int] = []
        self.param_names = program.param_names

    def loss_and_grads(
        self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> tuple[float, dict[str, torch.Tensor]]:
        self.passes.append(int(inputs[0].shape[0]))
        return self.program.loss_and_grads(inputs, targets)


# -- chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("samples", "micro"), [(37, 0), (37, 2), (100, 0), (24, 5), (5, 0)])
def test_the_chunked_update_is_the_parts_gradient(
    program: TrainableProgram, dataset: ShardedDataset, samples: int, micro: int
) -> None:
    batch = dataset.get_batch(list(range(7, 7 + samples)))
    whole = gradient_step(program, batch, SlowdownController())
    update = chunked_gradient_step(program, batch, SlowdownController(), micro, K)
    chunks = update.chunks
    assert chunks is not None
    bounds = chunk_bounds(samples, K)
    assert len(bounds) == max(1, min(samples // 2, K))
    assert chunks.samples == [b - a for a, b in bounds] and update.num_samples == samples
    assert update.kind == whole.kind and list(update.tensors) == list(whole.tensors)
    assert all(t.dtype == torch.float32 for t in update.tensors.values())
    assert rel(update.tensors, whole.tensors) <= 1e-6
    assert update.mean_loss == pytest.approx(whole.mean_loss, rel=1e-6)
    commitments = chunks.commitments()
    assert [c.samples for c in commitments] == chunks.samples
    assert (
        commitment_problem([(c.samples, c.loss) for c in commitments], samples, update.mean_loss, K)
        == ""
    )
    # Each chunk is its own samples' gradient (micro-batches within it as the job's).
    for (a, b), loss, grads in zip(bounds, chunks.losses, chunks.grads, strict=True):
        ref_loss, ref = program.loss_and_grads(
            [t[a:b] for t in batch[0]], [t[a:b] for t in batch[1]]
        )
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert rel(grads, ref) <= 1e-6
    assert sketch_gap(update) <= 1e-6  # float32 sums against float64 ones


def test_micro_batches_apply_within_each_chunk(
    program: TrainableProgram, dataset: ShardedDataset
) -> None:
    recorder = PassRecorder(program)
    batch = dataset.get_batch(list(range(50)))  # chunks of 5 and 4 samples (50 = 2 x 5 + 10 x 4)
    chunked_gradient_step(recorder, batch, SlowdownController(), 3, K)  # type: ignore[arg-type]
    assert recorder.passes == [3, 2] * 2 + [3, 1] * 10


def test_combine_chunks_is_the_weighted_sum_in_order() -> None:
    g = torch.Generator().manual_seed(3)
    grads = [{"w": torch.randn(5, generator=g), "b": torch.randn(2, generator=g)} for _ in range(3)]
    chunks = ChunkGradients(samples=[4, 3, 3], losses=[1.0, 2.0, 4.0], grads=grads)
    loss, total = combine_chunks(chunks)
    assert loss == pytest.approx((4 * 1.0 + 3 * 2.0 + 3 * 4.0) / 10)
    expected = grads[0]["w"] * 0.4
    expected.add_(grads[1]["w"], alpha=0.3).add_(grads[2]["w"], alpha=0.3)
    assert torch.equal(total["w"], expected)
    assert grads[0]["w"].data_ptr() != total["w"].data_ptr()  # the chunks are left as they were
    assert (
        commitment_problem(list(zip(chunks.samples, chunks.losses, strict=True)), 10, loss, 3) == ""
    )


# -- the cheat switch ---------------------------------------------------------------------------


def test_parse_cheat() -> None:
    assert parse_cheat("scaled") == Cheat("scaled", 0)
    assert parse_cheat(" Lazy:3 ") == Cheat("lazy", 3)
    assert parse_cheat("stale:0").active_at(0)
    assert not parse_cheat("flipped:2").active_at(1) and parse_cheat("flipped:2").active_at(2)
    for bad in ("", "honest", "scaled:", "scaled:x", "scaled:-1", "random:1.5"):
        with pytest.raises(ValueError, match=CHEAT_ENV):
            parse_cheat(bad)
    assert cheat_from_environment({}) is None
    assert cheat_from_environment({CHEAT_ENV: "  "}) is None
    assert cheat_from_environment({CHEAT_ENV: "random:4"}) == Cheat("random", 4)
    with pytest.raises(ValueError, match="one of scaled, flipped, random, lazy, stale"):
        cheat_from_environment({CHEAT_ENV: "bogus"})


def grads_of(seed: int, k: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"a": torch.randn(4, 3, generator=g), "b": torch.randn(7, generator=g)} for _ in range(k)
    ]


def test_scaled_flipped_and_random_chunks() -> None:
    grads, losses = grads_of(1), [0.5, 0.7, 0.9]
    out_losses, scaled = cheat_chunks(Cheat("scaled"), 0, losses, grads)
    assert out_losses == losses
    for g, s in zip(grads, scaled, strict=True):
        assert float(flat(s).norm()) == pytest.approx(SCALE * float(flat(g).norm()), rel=1e-6)
        assert all(torch.equal(s[k], g[k] * SCALE) for k in g)
    _, flipped = cheat_chunks(Cheat("flipped"), 0, losses, grads)
    assert all(torch.equal(f[k], -g[k]) for g, f in zip(grads, flipped, strict=True) for k in g)
    _, noise = cheat_chunks(Cheat("random"), 5, losses, grads)
    for g, r in zip(grads, noise, strict=True):
        for k in g:
            assert r[k].shape == g[k].shape and r[k].dtype == g[k].dtype
            assert float(r[k].norm()) == pytest.approx(float(g[k].norm()), rel=1e-6)
        assert float(flat(r).norm()) == pytest.approx(float(flat(g).norm()), rel=1e-6)
        cos = float(flat(r) @ flat(g)) / float(flat(r).norm() * flat(g).norm())
        assert abs(cos) < 0.9  # not the gradient
    # Seeded from the round: the same round repeats, another differs.
    assert all(
        torch.equal(a[k], b[k]) for a, b in zip(noise, randomized(grads, 5), strict=True) for k in a
    )
    other = randomized(grads, 6)
    assert not torch.equal(other[0]["a"], noise[0]["a"])
    assert noise_like(grads[0], round_generator(5))["a"].equal(noise[0]["a"])


def test_lazy_fill_and_count() -> None:
    assert [lazy_count(k) for k in (1, 2, 4, 5, 8, 12, 13)] == [1, 1, 1, 2, 2, 3, 4]
    grads, losses = grads_of(2, 3), [1.0, 2.0, 6.0]
    out_losses, out = fill_skipped(losses, grads, 12)
    assert len(out) == 12 and out_losses[:3] == losses and out_losses[3:] == [3.0] * 9
    mean = {k: (grads[0][k] + grads[1][k] + grads[2][k]) / 3 for k in grads[0]}
    for g in out[3:]:
        assert all(torch.allclose(g[k], mean[k]) for k in mean)
    assert all(torch.equal(out[i][k], grads[i][k]) for i in range(3) for k in grads[i])
    with pytest.raises(ValueError):
        fill_skipped([], [], 12)


def test_stale_repeats_the_previous_chunks_and_update() -> None:
    now, before = grads_of(3), grads_of(4)
    losses, prev_losses = [1.0, 1.0, 1.0], [2.0, 3.0, 4.0]
    out_losses, out = cheat_chunks(Cheat("stale"), 1, losses, now, (prev_losses, before))
    assert out_losses == prev_losses
    assert all(torch.equal(o[k], b[k]) for o, b in zip(out, before, strict=True) for k in o)
    # Nothing kept (the first cheated round), or another number of chunks: honest.
    for previous in (None, (prev_losses[:2], before[:2])):
        again_losses, again = cheat_chunks(Cheat("stale"), 1, losses, now, previous)
        assert again_losses == losses
        assert all(torch.equal(o[k], g[k]) for o, g in zip(again, now, strict=True) for k in o)
    loss, tensors = cheat_update(Cheat("stale"), 1, 0.1, now[0], (0.2, before[0]))
    assert loss == 0.2 and all(torch.equal(tensors[k], before[0][k]) for k in tensors)
    loss, tensors = cheat_update(Cheat("scaled"), 1, 0.1, now[0])
    assert loss == 0.1 and all(torch.equal(tensors[k], now[0][k] * SCALE) for k in tensors)


# -- cheats in the trainer: update, chunks and sketches consistent ------------------------------


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[TaskContext]:
    # A plaintext channel that is never used: nothing here calls out.
    connection = CoordinatorConnection(
        "127.0.0.1:1", tmp_path / "agent", lambda: agent_pb2.RegisterRequest(), insecure=True
    )
    try:
        yield TaskContext(
            task=agent_pb2.Task(),
            connection=connection,
            cache=BlobCache(tmp_path / "cache"),
            device="cpu",
            device_info=common_pb2.Device(),
            slowdown=SlowdownController(),
        )
    finally:
        await connection.close()


def train_task(
    round_: int, start: int, samples: int, verify_chunks: int, spec: common_pb2.JobSpec
) -> agent_pb2.Task:
    task = agent_pb2.Task(
        task_id=f"t-{round_}",
        kind=agent_pb2.TASK_KIND_TRAIN,
        job_id="j",
        round=round_,
        local_batch=samples,
        verify_chunks=verify_chunks,
        spec=spec,
    )
    task.ranges.add(start=start, stop=start + samples)
    return task


def honest_and_cheated(
    ctx: TaskContext,
    program: TrainableProgram | PassRecorder,
    dataset: ShardedDataset,
    spec: common_pb2.JobSpec,
    cheat: Cheat,
    verify_chunks: int,
    samples: int = 60,
) -> tuple[ComputedUpdate, ComputedUpdate, LoadedJob]:
    """Round 0 (the cheat starts at round 1: honest) and round 1 (cheated) on the same job,
    with the same parameters and samples; and the honest update of round 1."""
    job = LoadedJob(program=program, dataset=dataset)  # type: ignore[arg-type]
    first = update_in_thread(
        replace(ctx, tamper=cheat), job, train_task(0, 0, samples, verify_chunks, spec), verify=True
    )
    cheated = update_in_thread(
        replace(ctx, tamper=cheat),
        job,
        train_task(1, 60, samples, verify_chunks, spec),
        verify=True,
    )
    return first, cheated, job


async def test_every_cheat_keeps_its_update_the_sum_of_its_chunks(
    ctx: TaskContext, packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    spec = packed.spec
    honest = update_in_thread(
        ctx, LoadedJob(program, dataset), train_task(1, 60, 60, K, spec), verify=True
    )
    assert honest.chunks is not None and sketch_gap(honest) <= 1e-6
    honest_norm = float(flat(honest.tensors).norm())
    for kind in UPDATE_KINDS:
        first, cheated, _ = honest_and_cheated(ctx, program, dataset, spec, Cheat(kind, 1), K)
        chunks = cheated.chunks
        assert chunks is not None and len(chunks.grads) == K, kind
        assert sketch_gap(cheated) <= 1e-6, kind
        assert sketch_gap(first) <= 1e-6, kind
        assert (
            commitment_problem(
                [(c.samples, c.loss) for c in chunks.commitments()], 60, cheated.mean_loss, K
            )
            == ""
        ), kind
        assert cheated.num_samples == 60
        gap = rel(cheated.tensors, honest.tensors)
        norm = float(flat(cheated.tensors).norm())
        if kind == "scaled":
            assert norm == pytest.approx(SCALE * honest_norm, rel=1e-5)
            assert rel({k: v / SCALE for k, v in cheated.tensors.items()}, honest.tensors) < 1e-6
        elif kind == "flipped":
            assert rel({k: -v for k, v in cheated.tensors.items()}, honest.tensors) < 1e-6
        elif kind == "random":
            assert all(
                float(flat(g).norm()) == pytest.approx(float(flat(h).norm()), rel=1e-5)
                for g, h in zip(chunks.grads, honest.chunks.grads, strict=True)
            )
            assert gap > 0.3
        elif kind == "lazy":
            assert gap > 1e-3
            assert chunks.losses[3:] == [sum(chunks.losses[:3]) / 3] * (K - 3)
        elif kind == "stale":
            # Round 0's chunks and update again (same chunk sizes: the very same update).
            assert first.chunks is not None
            assert chunks.losses == first.chunks.losses
            assert all(torch.equal(cheated.tensors[k], first.tensors[k]) for k in first.tensors)
            assert gap > 1e-3


async def test_a_lazy_cheater_computes_only_a_quarter_of_its_chunks(
    ctx: TaskContext, packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    recorder = PassRecorder(program)
    job = LoadedJob(program=recorder, dataset=dataset)  # type: ignore[arg-type]
    update = update_in_thread(
        replace(ctx, tamper=Cheat("lazy")), job, train_task(0, 0, 60, K, packed.spec), verify=True
    )
    assert recorder.passes == [5, 5, 5]  # ceil(12 / 4) chunks of 5 samples
    assert update.num_samples == 60 and update.chunks is not None and len(update.chunks.grads) == K
    # Without chunks: a quarter of the samples computed, all of them claimed.
    recorder.passes.clear()
    update = update_in_thread(
        replace(ctx, tamper=Cheat("lazy")), job, train_task(0, 0, 60, 0, packed.spec), verify=True
    )
    assert recorder.passes == [15] and update.num_samples == 60 and update.chunks is None
    # Before its first cheated round, and for an honest agent: every chunk.
    recorder.passes.clear()
    update_in_thread(
        replace(ctx, tamper=Cheat("lazy", 1)),
        job,
        train_task(0, 0, 60, K, packed.spec),
        verify=True,
    )
    assert recorder.passes == [5] * K


async def test_cheats_without_chunks_change_the_whole_update(
    ctx: TaskContext, packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    spec = packed.spec
    job = LoadedJob(program=program, dataset=dataset)
    honest = update_in_thread(ctx, job, train_task(1, 60, 60, 0, spec), verify=True)
    assert honest.chunks is None
    for kind in UPDATE_KINDS:
        first, cheated, _ = honest_and_cheated(ctx, program, dataset, spec, Cheat(kind, 1), 0)
        assert cheated.chunks is None and cheated.num_samples == 60, kind
        if kind == "scaled":
            assert all(
                torch.equal(cheated.tensors[k], honest.tensors[k] * SCALE) for k in honest.tensors
            )
        elif kind == "flipped":
            assert all(torch.equal(cheated.tensors[k], -honest.tensors[k]) for k in honest.tensors)
        elif kind == "random":
            assert float(flat(cheated.tensors).norm()) == pytest.approx(
                float(flat(honest.tensors).norm()), rel=1e-5
            )
            assert rel(cheated.tensors, honest.tensors) > 0.3
        elif kind == "lazy":
            assert rel(cheated.tensors, honest.tensors) > 1e-3
        elif kind == "stale":
            assert all(torch.equal(cheated.tensors[k], first.tensors[k]) for k in first.tensors)
            assert cheated.mean_loss == first.mean_loss


async def test_stale_is_honest_in_its_first_round_and_an_honest_agent_keeps_nothing(
    ctx: TaskContext, packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    spec = packed.spec
    job = LoadedJob(program=program, dataset=dataset)
    first = update_in_thread(
        replace(ctx, tamper=Cheat("stale")), job, train_task(0, 0, 60, K, spec), verify=True
    )
    honest = update_in_thread(
        ctx, LoadedJob(program, dataset), train_task(0, 0, 60, K, spec), verify=True
    )
    assert all(torch.equal(first.tensors[k], honest.tensors[k]) for k in honest.tensors)
    assert job.previous is first
    plain = LoadedJob(program=program, dataset=dataset)
    update_in_thread(
        replace(ctx, tamper=Cheat("scaled")), plain, train_task(0, 0, 60, K, spec), verify=True
    )
    assert plain.previous is None


async def test_without_verification_the_update_is_todays(
    ctx: TaskContext, packed: PackedJob, program: TrainableProgram, dataset: ShardedDataset
) -> None:
    # verify_chunks == 0, or a caller that does not verify (ring rounds): one gradient step,
    # bit for bit.
    batch = dataset.get_batch(list(range(60)))
    ref = gradient_step(program, batch, SlowdownController())
    for task, verify in (
        (train_task(0, 0, 60, 0, packed.spec), True),
        (train_task(0, 0, 60, K, packed.spec), False),
    ):
        update = update_in_thread(ctx, LoadedJob(program, dataset), task, verify=verify)
        assert update.chunks is None and update.mean_loss == ref.mean_loss
        assert all(torch.equal(update.tensors[k], ref.tensors[k]) for k in ref.tensors)
    assert math.isfinite(ref.mean_loss)
