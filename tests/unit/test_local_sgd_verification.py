"""Local SGD verification without networking (issue 20): a part's inner steps cut into chunks
whose parameter differences add up to its pseudo-gradient, the state each chunk started from
committed by digest, the coordinator's check of an uploaded start state
(coordinator/verification/snapshot_check.py), and a checker's recomputation of one chunk from it
(node_agent.training.compute.recompute_local_chunk): an honest chunk is reproduced, a cheater's made-up chunk is
not, whichever start states it commits. The real exported program of the tests' MLP computes
every step."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from coordinator.verification.snapshot_check import snapshot_problem
from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.optim import build_optimizer
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.sketch import combine, relative_distance, sketch
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import (
    local_sgd_chunk_samples,
    local_sgd_commitment_problem,
    local_sgd_grid,
    local_sgd_groups,
    loss_matches,
    recompute_tolerance,
    state_digest,
    step_chunk_bounds,
)
from epochmesh.wire.tensors import encode_bundle
from node_agent.core.slowdown import SlowdownController
from node_agent.link.cache import BlobCache
from node_agent.link.connection import CoordinatorConnection
from node_agent.testing.cheat import UPDATE_KINDS, Cheat
from node_agent.training.compute import (
    grouped_local_chunks,
    inner_step_slices,
    local_sgd_steps,
    recompute_local_chunk,
    split_training_state,
    update_in_thread,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import ComputedUpdate, LoadedJob
from tests.fixtures import write_mlp_job

pytestmark = pytest.mark.timeout(120)

N = 240
SEED, BUCKETS = 987654321, 256
TOL = recompute_tolerance("cpu", "cpu", local_sgd=True)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    return build_job(
        load_spec(write_mlp_job(tmp_path_factory.mktemp("mlp"), N)), cache=ExportCache.default()
    )


@pytest.fixture(scope="module")
def dataset(packed: PackedJob) -> ShardedDataset:
    return ShardedDataset(packed.shards, inputs=["x"], targets=["y"])


def fresh(packed: PackedJob) -> TrainableProgram:
    return TrainableProgram.from_bytes(packed.program, packed.initial_state)


def local_spec(packed: PackedJob, optimizer: str = "sgd") -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec()
    spec.CopyFrom(packed.spec)
    spec.sync, spec.inner_steps, spec.inner_optimizer = "local_sgd", 12, optimizer
    spec.lr, spec.momentum = 0.05, 0.9
    spec.beta1, spec.beta2, spec.eps = 0.9, 0.999, 1e-8
    return spec


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


def local_task(
    round_: int, start: int, samples: int, local_batch: int, k: int, spec: common_pb2.JobSpec
) -> agent_pb2.Task:
    task = agent_pb2.Task(
        task_id=f"t-{round_}",
        kind=agent_pb2.TASK_KIND_TRAIN,
        job_id="j",
        round=round_,
        local_batch=local_batch,
        inner_steps=spec.inner_steps,
        verify_chunks=k,
        spec=spec,
    )
    task.ranges.add(start=start, stop=start + samples)
    return task


def sketches_of(update: ComputedUpdate) -> torch.Tensor:
    assert update.chunks is not None
    return torch.stack([sketch(g, SEED, BUCKETS) for g in update.chunks.grads])


def recompute(
    packed: PackedJob,
    dataset: ShardedDataset,
    spec: common_pb2.JobSpec,
    update: ComputedUpdate,
    indices: list[int],
    local_batch: int,
    k: int,
) -> tuple[float, float]:
    """A checker's recomputation of chunk k on a program of its own: (sketch distance, loss)."""
    assert update.chunks is not None
    offset = sum(update.chunks.samples[:k])
    mine = indices[offset : offset + update.chunks.samples[k]]
    slices = inner_step_slices(mine, local_batch, len(mine))
    got = recompute_local_chunk(
        fresh(packed),
        spec,
        update.chunks.starts[k],
        slices,
        dataset.get_batch,
        SlowdownController(),
    )
    committed = sketch(update.chunks.grads[k], SEED, BUCKETS)
    return relative_distance(committed, sketch(got.tensors, SEED, BUCKETS)), got.mean_loss


def test_step_chunks_and_their_samples() -> None:
    assert step_chunk_bounds(12, 6) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    assert step_chunk_bounds(5, 12) == [(i, i + 1) for i in range(5)]
    assert step_chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert step_chunk_bounds(0, 3) == []
    # 58 samples, 5 a step: 12 steps (the last of 3); a grid of 12 pieces of one step, grouped
    # into 6 chunks of two steps.
    assert local_sgd_grid(12, 6) == [(i, i + 1) for i in range(12)]
    assert local_sgd_chunk_samples(58, 5, 6, 58) == [10, 10, 10, 10, 10, 8]
    # A time box stopped it after 7 steps (35 samples): the 7 pieces it reached still make 6
    # chunks (cut from the planned chunks of two steps, 4: a check would cost 1/4 of it).
    assert local_sgd_groups(7, 6) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert local_sgd_chunk_samples(58, 5, 6, 35) == [10, 5, 5, 5, 5, 5]
    assert local_sgd_chunk_samples(58, 5, 6, 40) == [10, 10, 5, 5, 5, 5]
    # Fewer pieces than chunks: one chunk each. 30 steps (24 pieces) stopped after 22 steps
    # (16 pieces): still 12 chunks.
    assert local_sgd_chunk_samples(20, 5, 6, 10) == [5, 5]
    assert len(local_sgd_chunk_samples(30 * 4, 4, 12, 22 * 4)) == 12


def test_state_digest_is_of_names_types_shapes_and_bytes() -> None:
    a = {"param/w": torch.ones(2, 3), "optim/momentum_buffer/w": torch.zeros(2, 3)}
    d = state_digest(a)
    assert len(d) == 32 and state_digest(dict(reversed(list(a.items())))) == d
    changed = dict(a, **{"param/w": a["param/w"].clone()})
    changed["param/w"][1, 2] = 1.0000001
    assert state_digest(changed) != d
    assert state_digest(dict(a, **{"param/w": torch.ones(3, 2)})) != d
    assert state_digest(dict(a, **{"param/w": torch.ones(2, 3, dtype=torch.float64)})) != d
    assert (
        state_digest(
            {"param/v": torch.ones(2, 3), "optim/momentum_buffer/w": a["optim/momentum_buffer/w"]}
        )
        != d
    )


def test_commitments_of_a_local_sgd_update() -> None:
    good = [(10, 1.0, b"x" * 32), (10, 2.0, b"y" * 32), (8, 3.0, b"z" * 32)]
    loss = (10 * 1.0 + 10 * 2.0 + 8 * 3.0) / 28
    assert local_sgd_commitment_problem(good, 28, loss, 28, 5, 3) == ""
    short = [(10, 1.0, b"x" * 31), *good[1:]]
    assert "31 bytes" in local_sgd_commitment_problem(short, 28, loss, 28, 5, 3)
    assert "expected 3" in local_sgd_commitment_problem(good[:2], 28, loss, 28, 5, 3)
    assert "it has 10" in local_sgd_commitment_problem(
        [(9, 1.0, b"x" * 32), *good[1:]], 28, loss, 28, 5, 3
    )
    assert "no chunk commitments" in local_sgd_commitment_problem([], 28, loss, 28, 5, 3)
    assert "mean_loss" in local_sgd_commitment_problem(good, 28, loss + 0.1, 28, 5, 3)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
async def test_an_honest_part_passes_every_step_of_its_check(
    ctx: TaskContext, packed: PackedJob, dataset: ShardedDataset, optimizer: str
) -> None:
    """Two rounds (the inner optimizer's state carries over): in each, the chunks add up to the
    pseudo-gradient, their start states pass the coordinator's check, and every chunk is
    reproduced by a checker from its start state, with the state loaded (not without it)."""
    spec = local_spec(packed, optimizer)
    program = fresh(packed)
    job = LoadedJob(program=program, dataset=dataset)
    for round_, start in ((0, 0), (1, 60)):
        payload = encode_bundle(program.get_parameters())
        task = local_task(round_, start, 58, 5, 6, spec)
        update = update_in_thread(ctx, job, task, verify=True)
        chunks = update.chunks
        assert chunks is not None and chunks.samples == [10, 10, 10, 10, 10, 8]
        assert update.steps == 12 and update.num_samples == 58
        commitments = [(c.samples, c.loss, c.start_digest) for c in chunks.commitments()]
        assert local_sgd_commitment_problem(commitments, 58, update.mean_loss, 58, 5, 6) == ""
        sketches = sketches_of(update)
        whole = sketch(update.tensors, SEED, BUCKETS)
        assert relative_distance(whole, combine([(1.0, s) for s in sketches])) < 1e-6
        assert chunks.digests == [state_digest(s) for s in chunks.starts]
        params0, optim0 = split_training_state(chunks.starts[0])
        assert all(torch.equal(params0[n], t) for n, t in program.get_parameters().items())
        assert bool(optim0) == (round_ > 0)  # state from the round before
        for k in range(len(chunks.samples)):
            problem, _ = snapshot_problem(
                chunks.starts[k], chunks.digests[k], payload, sketches[:k], SEED, BUCKETS
            )
            assert problem == "", (k, problem)
        indices = list(range(start, start + 58))
        distances = []
        for k in range(len(chunks.samples)):
            distance, loss = recompute(packed, dataset, spec, update, indices, 5, k)
            distances.append(distance)
            assert loss_matches(chunks.losses[k], loss, TOL), (k, chunks.losses[k], loss)
        assert max(distances) <= TOL, distances
    # The optimizer state matters: chunk 3 of the last round from its parameters alone.
    params3, _ = split_training_state(chunks.starts[3])
    bare = {f"param/{n}": t for n, t in params3.items()}
    mine = indices[30:40]
    got = recompute_local_chunk(
        fresh(packed),
        spec,
        bare,
        inner_step_slices(mine, 5, 10),
        dataset.get_batch,
        SlowdownController(),
    )
    distance = relative_distance(sketches[3], sketch(got.tensors, SEED, BUCKETS))
    assert distance > 100 * TOL, distance


async def test_a_time_boxed_part_commits_the_chunks_it_reached(
    ctx: TaskContext, packed: PackedJob, dataset: ShardedDataset
) -> None:
    spec = local_spec(packed)
    job = LoadedJob(program=fresh(packed), dataset=dataset)
    task = local_task(0, 0, 58, 5, 6, spec)
    task.compute_budget_seconds = 1e-9  # one step, then the box is over
    update = update_in_thread(ctx, job, task, verify=True)
    assert update.steps == 1 and update.num_samples == 5
    assert update.chunks is not None and update.chunks.samples == [5]
    commitments = [(c.samples, c.loss, c.start_digest) for c in update.chunks.commitments()]
    assert local_sgd_commitment_problem(commitments, 5, update.mean_loss, 58, 5, 6) == ""


async def test_a_task_that_waited_for_a_check_has_its_time_box_cut_by_the_wait(
    ctx: TaskContext, packed: PackedJob, dataset: ShardedDataset
) -> None:
    """The box ends when it would have had the task started on arrival: a task that came
    while the agent finished a check trains for the box less that wait (at least one step),
    so that the round does not wait for this node; one that started at once trains its whole
    box."""
    spec = local_spec(packed)
    task = local_task(0, 0, 58, 5, 6, spec)
    task.compute_budget_seconds = 600.0  # far more than the 12 steps take
    at_once = update_in_thread(
        ctx, LoadedJob(program=fresh(packed), dataset=dataset), task, verify=True
    )
    assert at_once.steps == 12 and at_once.num_samples == 58
    ctx.received_at = ctx.started_at - 900.0  # the box was over before the task started
    late = update_in_thread(
        ctx, LoadedJob(program=fresh(packed), dataset=dataset), task, verify=True
    )
    assert late.steps == 1 and late.num_samples == 5
    assert late.chunks is not None and late.chunks.samples == [5]


def test_the_time_box_less_the_wait_before_the_task_started() -> None:
    task = agent_pb2.Task()
    ctx = TaskContext(
        task=task,
        connection=None,  # type: ignore[arg-type]  # time_box reads the clocks only
        cache=None,  # type: ignore[arg-type]
        device="cpu",
        device_info=common_pb2.Device(),
        slowdown=SlowdownController(),
        received_at=100.0,
        started_at=102.5,
    )
    assert ctx.time_box(0.0) == 0.0  # no box stays none
    assert ctx.time_box(10.0) == pytest.approx(7.5)
    assert 0 < ctx.time_box(2.0) <= 1e-6  # waited past it: one step
    ctx.started_at = 99.0  # clocks read in another order: no wait, not a longer box
    assert ctx.time_box(10.0) == 10.0


def test_a_part_cut_short_still_has_its_chunks(packed: PackedJob, dataset: ShardedDataset) -> None:
    """A part a time box stopped after 7 of its 12 planned steps: the 7 pieces of its grid it
    reached are grouped into 6 chunks (cut from 6 planned chunks of two steps it would have had
    4, and a check would recompute a quarter of it): they add up to its pseudo-gradient, their
    start states pass the coordinator's check, and the commitments fit."""
    spec = local_spec(packed)
    program = fresh(packed)
    payload = encode_bundle(program.get_parameters())
    slices = inner_step_slices(list(range(58)), 5, 12)
    opt = build_optimizer(spec, program.parameters())
    pieces = local_sgd_steps(
        program,
        opt,
        slices[:7],  # where the box stopped it
        dataset.get_batch,
        SlowdownController(),
        chunk_steps=local_sgd_grid(len(slices), 6),
    )
    assert pieces.chunks is not None and len(pieces.chunks.grads) == 7
    chunks = grouped_local_chunks(pieces.chunks, 6)
    assert chunks.samples == [10, 5, 5, 5, 5, 5] == local_sgd_chunk_samples(58, 5, 6, 35)
    assert chunks.starts[1] is pieces.chunks.starts[2]
    update = ComputedUpdate(
        kind=pieces.kind,
        tensors=pieces.tensors,
        mean_loss=pieces.mean_loss,
        compute_s=0.0,
        num_samples=35,
        steps=7,
        chunks=chunks,
    )
    commitments = [(c.samples, c.loss, c.start_digest) for c in chunks.commitments()]
    assert local_sgd_commitment_problem(commitments, 35, pieces.mean_loss, 58, 5, 6) == ""
    sketches = sketches_of(update)
    whole = sketch(pieces.tensors, SEED, BUCKETS)
    assert relative_distance(whole, combine([(1.0, s) for s in sketches])) < 1e-6
    for k in range(len(chunks.samples)):
        problem, _ = snapshot_problem(
            chunks.starts[k], chunks.digests[k], payload, sketches[:k], SEED, BUCKETS
        )
        assert problem == "", (k, problem)


async def test_a_cheaters_made_up_chunks_are_not_reproduced(
    ctx: TaskContext, packed: PackedJob, dataset: ShardedDataset
) -> None:
    """Every cheat (from round 1): the update is the sum of its chunks and its start states fit
    its sketches (a smart cheater passes both checks at no compute), yet a checker's
    recomputation of a made-up chunk from its committed start state differs by far more than
    the tolerance: every chunk for scaled, flipped, random and stale, the made-up ones (after
    the first quarter) for lazy."""
    spec = local_spec(packed)
    for kind in UPDATE_KINDS:
        program = fresh(packed)
        job = LoadedJob(program=program, dataset=dataset)
        cheat = Cheat(kind, 1)
        update_in_thread(
            replace(ctx, tamper=cheat), job, local_task(0, 0, 58, 5, 6, spec), verify=True
        )
        payload = encode_bundle(program.get_parameters())
        task = local_task(1, 0, 58, 5, 6, spec)  # the same samples: stale resends round 0's
        cheated = update_in_thread(replace(ctx, tamper=cheat), job, task, verify=True)
        chunks = cheated.chunks
        assert chunks is not None and chunks.samples == [10, 10, 10, 10, 10, 8], kind
        assert cheated.num_samples == 58 and cheated.steps == 12, kind
        sketches = sketches_of(cheated)
        whole = sketch(cheated.tensors, SEED, BUCKETS)
        assert relative_distance(whole, combine([(1.0, s) for s in sketches])) < 1e-5, kind
        for k in range(6):
            problem, _ = snapshot_problem(
                chunks.starts[k], chunks.digests[k], payload, sketches[:k], SEED, BUCKETS
            )
            assert problem == "", (kind, k, problem)
        made_up = range(2, 6) if kind == "lazy" else range(6)
        for k in made_up:
            distance, _ = recompute(packed, dataset, spec, cheated, list(range(58)), 5, k)
            assert distance > 100 * TOL, (kind, k, distance)
        if kind == "lazy":  # its first quarter (2 of 6 chunks) was stepped honestly
            assert recompute(packed, dataset, spec, cheated, list(range(58)), 5, 0)[0] <= TOL


def test_a_start_state_that_is_not_the_committed_one_is_refused() -> None:
    torch.manual_seed(0)
    p0 = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    d0 = {"w": torch.randn(4, 3) * 1e-2, "b": torch.randn(3) * 1e-2}
    p1 = {n: p0[n] - d0[n] for n in p0}
    optim = {
        "optim/momentum_buffer/w": torch.randn(4, 3),
        "optim/momentum_buffer/b": torch.randn(3),
    }
    s0 = {**{f"param/{n}": t for n, t in p0.items()}, **optim}
    s1 = {**{f"param/{n}": t for n, t in p1.items()}, **optim}
    payload = encode_bundle(p0)
    earlier = sketch(d0, SEED, BUCKETS).unsqueeze(0)
    none = torch.zeros(0, BUCKETS, dtype=torch.float64)
    assert snapshot_problem(s0, state_digest(s0), payload, none, SEED, BUCKETS)[0] == ""
    assert snapshot_problem(s1, state_digest(s1), payload, earlier, SEED, BUCKETS)[0] == ""
    # Not the committed state.
    problem, evidence = snapshot_problem(s1, state_digest(s0), payload, earlier, SEED, BUCKETS)
    assert "digest differs" in problem and evidence["committed_digest"] == state_digest(s0).hex()
    # Committed, but not where its chunks lead: as chunk 0 (not the round's parameters), as
    # chunk 1 with other parameters.
    assert (
        "round's parameters"
        in snapshot_problem(s1, state_digest(s1), payload, none, SEED, BUCKETS)[0]
    )
    s1_bad = dict(s1, **{"param/w": p1["w"] * 1.01})
    problem, evidence = snapshot_problem(
        s1_bad, state_digest(s1_bad), payload, earlier, SEED, BUCKETS
    )
    assert "committed chunks before it" in problem and float(evidence["distance"]) > 1e-3
    # Malformed: a missing parameter, a stray tensor, non-finite optimizer state.
    missing = {k: v for k, v in s0.items() if k != "param/b"}
    assert (
        "missing ['b']"
        in snapshot_problem(missing, state_digest(missing), payload, none, SEED, BUCKETS)[0]
    )
    stray = dict(s0, **{"extra/x": torch.ones(1)})
    assert (
        "neither a parameter"
        in snapshot_problem(stray, state_digest(stray), payload, none, SEED, BUCKETS)[0]
    )
    nan = dict(s0, **{"optim/momentum_buffer/b": torch.full((3,), math.nan)})
    assert "non-finite" in snapshot_problem(nan, state_digest(nan), payload, none, SEED, BUCKETS)[0]
