"""TASK_KIND_CHECK: recompute one chunk of another node's part (verification, issue 20;
docs/verification-protocol.md step 5).

The task names the job (spec, program, initial state, shards) as a TRAIN task does, the samples
of the chunk (`ranges`, in the checked node's order), the version the checked node computed
from (`params_version`: inline in `params_bundle`/`params_data` for a small model, else
PullParameters), and the sketch to answer with (`check.seed`, `check.buckets`).

The agent loads the job as a TRAIN round does (`load_for_task`: the program is kept
for the job's own rounds), makes it hold that version (`ensure_params`: the job's
`version` then names it, so that a later TRAIN task of the job loads its own), computes the
chunk's mean loss and gradient with the job's micro_batch
(`accumulated_loss_and_grads`, as the checked node computed each chunk) through the
slowdown controller (a slowed agent is slow here too) and answers ReportCheck with the loss,
the gradient's CountSketch (epochmesh.sketch, float64) and the device seconds it took. The
answer is sent beside the agent's next task (`TaskContext.beside`): a round may wait for that
task, while only the check's own deadline waits for the answer. The
program's random draws are seeded as on the checked node (`checked_scope`: the task's job and
round, the checked node's id `checked_node_id`, the chunk's samples), so that its dropout masks
and noise are the ones the checked node drew.

A local SGD check (`is_local_sgd`) carries the checked node's state at the chunk's start
inline ("param/<name>", "optim/<key>/<name>": its parameters and inner optimizer state): the
agent runs the chunk's inner steps (local_batch samples each) from it with a fresh inner
optimizer loaded with that state (`recompute_local_chunk`) and sketches the parameters
before the steps minus after. The job's program then holds that state, not a version of the
job: its `version` is forgotten (the next TRAIN task fetches its own). On a ring member the
ring's live state is marked gone from the program (its next round loads its kept snapshot).

Failures follow TRAIN's conventions (node_agent.runtime.dispatch.dispatch_task): anything raised
before the answer is reported by the dispatcher, which for a CHECK task answers
ReportCheck(failed=True, error=...) (`TaskContext.report_failure`); an answer that cannot be
sent is logged (the coordinator's watchdog draws another checker when the deadline passes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from epochmesh.dataset import ranges_to_indices
from epochmesh.sketch import sketch
from epochmesh.v1 import agent_pb2
from epochmesh.verification import MAX_BUCKETS
from epochmesh.wire.tensors import decode_bundle
from node_agent.link.connection import Expired
from node_agent.sandbox.host import NONFINITE, ConfinedProgram, ProgramFault
from node_agent.sandbox.seeding import SeedScope
from node_agent.training.compute import (
    accumulated_loss_and_grads,
    inner_step_slices,
    is_local_sgd,
    recompute_local_chunk,
    require_finite,
    step_timeout,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import LoadedJob
from node_agent.training.loading import load_for_task
from node_agent.training.params import ensure_params


@dataclass
class CheckResult:
    loss: float
    sketch: list[float]
    compute_s: float  # device seconds (slowdown factor included)
    samples: int


def check_problem(task: agent_pb2.Task) -> str:
    """Why a CHECK task cannot be run ("" if it can)."""
    if task.check.buckets < 1 or task.check.buckets > MAX_BUCKETS:
        return f"the check asks for {task.check.buckets} sketch buckets (1 to {MAX_BUCKETS})"
    if not task.job_id:
        return "the check names no job"
    if is_local_sgd(task.spec):
        if not task.HasField("params_bundle"):
            return "a local SGD check carries no start state"
        if task.local_batch < 1:
            return "a local SGD check names no local_batch"
    if not task.ranges:
        return "the check names no samples"
    if not task.checked_node_id:
        return "the check names no checked node (its id seeds the program's random draws)"
    return ""


def checked_scope(task: agent_pb2.Task) -> SeedScope:
    """Whose random draws a check repeats: the checked node's in the task's job and round."""
    return SeedScope(task.job_id, int(task.round), task.checked_node_id)


def local_check_in_thread(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> CheckResult:
    """A local SGD chunk's loss and parameter difference sketch from the start state the task
    carries; runs on the compute thread."""
    if isinstance(job.program, ConfinedProgram):
        job.program.timeout_s = step_timeout(task)
    indices = ranges_to_indices(task.ranges)
    state = decode_bundle(task.params_bundle, task.params_data)
    slices = inner_step_slices(indices, task.local_batch, len(indices))
    job.version = -1  # the program holds the checked node's state from now on
    ctx.check_cancelled()
    update = recompute_local_chunk(
        job.program,
        task.spec,
        state,
        slices,
        job.dataset.get_batch,
        ctx.slowdown,
        checked_scope(task),
    )
    require_finite(update)
    ctx.check_cancelled()
    values = sketch(update.tensors, task.check.seed, task.check.buckets).tolist()
    return CheckResult(
        loss=update.mean_loss, sketch=values, compute_s=update.compute_s, samples=len(indices)
    )


def check_in_thread(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> CheckResult:
    """The chunk's loss and gradient sketch from the parameters the job holds (the task's
    version); runs on the compute thread."""
    if isinstance(job.program, ConfinedProgram):
        job.program.timeout_s = step_timeout(task)
    indices = ranges_to_indices(task.ranges)
    if not indices:
        raise ValueError("the check names no samples")
    due = ctx.deadline
    if due is not None and time.monotonic() > due:
        raise Expired(f"the check's {task.deadline_seconds:.2f}s deadline passed before compute")
    ctx.check_cancelled()
    inputs, targets = job.dataset.get_batch(indices)
    program, micro = job.program, task.spec.micro_batch
    seed = checked_scope(task).seed(indices)
    loss, grads = ctx.slowdown.timed_step(
        lambda: accumulated_loss_and_grads(program, inputs, targets, micro, seed)
    )
    compute_s = ctx.slowdown.last_device_seconds
    gradient = {k: g.detach().to("cpu", torch.float32) for k, g in grads.items()}
    if not math.isfinite(loss):
        raise ProgramFault(f"the job's program computed a non-finite loss ({loss})", NONFINITE)
    for name, g in gradient.items():
        if not bool(torch.isfinite(g).all()):
            raise ProgramFault(f"the job's gradient for {name!r} is not finite", NONFINITE)
    ctx.check_cancelled()
    values = sketch(gradient, task.check.seed, task.check.buckets).tolist()
    return CheckResult(loss=loss, sketch=values, compute_s=compute_s, samples=len(indices))


async def run_check_task(ctx: TaskContext, task: agent_pb2.Task) -> None:
    started = time.monotonic()
    problem = check_problem(task)
    if problem:
        raise ValueError(problem)
    job = await load_for_task(ctx, task)
    loaded = time.monotonic()
    ctx.check_cancelled()
    local = is_local_sgd(task.spec)
    ring = ctx.ring_jobs.get(task.job_id)
    if ring is not None:
        # A ring member checking another's part: the program's parameters are set to the
        # checked version, so the ring's live state is no longer in it (its next round loads
        # its own from the snapshots it keeps).
        ring.live_version = None
    if not local:
        await ensure_params(ctx, job, task)
        if job.version != task.params_version:
            raise ValueError(
                f"the parameters fetched are version {job.version}, the check needs "
                f"{task.params_version}"
            )
    fetched = time.monotonic()
    ctx.check_cancelled()
    # The inputs are in: the next task (another check's inputs, the next round) comes while
    # this one computes.
    if ctx.poll_next is not None:
        ctx.poll_next()
    compute = local_check_in_thread if local else check_in_thread
    result = await ctx.run_compute(compute, ctx, job, task)
    computed = time.monotonic()

    async def report() -> None:
        await ctx.call(
            "ReportCheck",
            lambda: agent_pb2.ReportCheckRequest(
                node_id=ctx.node_id,
                lease_id=ctx.lease_id,
                task_id=task.task_id,
                loss=result.loss,
                sketch=result.sketch,
                compute_seconds=result.compute_s,
            ),
        )
        ctx.log.info(
            "check of round %d (version %d): %d samples, loss %.6g, compute %.3fs, total "
            "%.3fs (load %.3f, params %.3f, compute+sketch %.3f, report %.3f)",
            task.round,
            task.params_version,
            result.samples,
            result.loss,
            result.compute_s,
            time.monotonic() - started,
            loaded - started,
            fetched - loaded,
            computed - fetched,
            time.monotonic() - computed,
        )

    # The answer is computed: the report goes beside the agent's next task (a round waits on
    # that one, nobody on this report but the check's own deadline).
    await ctx.beside(report(), f"the report of check task {task.task_id}")
