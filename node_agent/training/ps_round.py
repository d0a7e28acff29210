"""The parameter-server TRAIN task: a round's update computed, encoded and pushed; sketches, snapshots.

`run_train_task(ctx, task)` (parameter-server mode, and nodes without a PeerService in a ring
job): load the job (node_agent.training.jobs), get the round's parameters
(node_agent.training.params: already held; else from the peer named by
task.state_source_node_id through TransferState; else from the task itself when the
coordinator sent them inline (small models); else PullParameters from the coordinator),
compute the update (node_agent.training.compute), encode it with the spec's compression (int8
and topk through a per-job ErrorFeedback, whose residual is rolled back when the update is not
applied) and stream it with PushUpdate in chunks of at most 1 MiB, kind "gradient" or
"pseudo_gradient".

Verification (docs/verification-protocol.md; parameter-server rounds): when the task asks for
`verify_chunks`, the update is computed in chunks (node_agent.training.compute) and the header
carries one ChunkCommitment (samples, loss) per chunk. The chunk gradients are kept until
PushUpdate answers; if it asks for sketches (`response.sketch.buckets` > 0), the CountSketch of
every chunk's gradient under its seed goes back with CommitSketches. A failure there is
logged: the round's update is in. When the answer to the sketches names a chunk, its start
state is uploaded (PushUpdate kind "snapshot") for a checker to run its steps from
(`recompute_local_chunk`); the ring trainer uploads its members' snapshots the same way
(`push_snapshot`). Sketches and start state go beside the agent's next task
(`TaskContext.beside`), not before it: the next round waits on that task, nothing on them but
the check (their chunks are the part's own copies). A ring job's external node, whose start
state is the program's live parameters, sends them before its next task.

The round's `Tamper` (``ctx.tamper``, node_agent.training.tamper) may change what is computed
and sent (node_agent.training.compute), consistently in its chunks and its update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import torch

from epochmesh.optim import (
    PARAM_PREFIX,
)
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import (
    MAX_BUCKETS,
    with_round_start,
)
from epochmesh.wire.compression import ErrorFeedback
from epochmesh.wire.tensors import encode_bundle, iter_chunks
from node_agent.link.connection import Expired, Stopped, describe
from node_agent.training.compute import (
    encode_update,
    job_error_feedback,
    update_in_thread,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import (
    ChunkGradients,
    ComputedUpdate,
    LoadedJob,
)
from node_agent.training.loading import load_for_task
from node_agent.training.params import ensure_params, set_inline_parameters

log = logging.getLogger(__name__)

KIND_SNAPSHOT = "snapshot"

# Per attempt of a CommitSketches call (retried within the task's report window).
SKETCH_CALL_TIMEOUT_S = 10.0


# -- parameter-server rounds --------------------------------------------------------------------


@dataclass
class RoundWork:
    """What a round's compute thread produced, with the time each phase took."""

    update: ComputedUpdate
    bundle: common_pb2.TensorBundle
    payload: bytes
    # The error feedback's residuals before this update (restored if it is not applied).
    saved_residuals: dict[str, torch.Tensor] | None
    params_s: float
    steps_s: float
    encode_s: float


def round_in_thread(
    ctx: TaskContext,
    job: LoadedJob,
    task: agent_pb2.Task,
    ef: ErrorFeedback | None,
) -> RoundWork:
    """One parameter-server round on the compute thread, in one go (no hand-offs between the
    phases: on a busy host each costs a wake-up of another thread): load inline parameters
    (when the task carries the version the job lacks), compute the update (in the task's
    verification chunks, if any), encode it."""
    t0 = time.monotonic()
    if job.version != task.params_version:
        set_inline_parameters(job, task)
    t1 = time.monotonic()
    ctx.check_cancelled()
    due = ctx.deadline
    if due is not None and t1 > due:
        # The round closed without this part (the agent was busy or cut off): computing it now
        # would only delay the next task. The coordinator has returned its samples to pending.
        raise Expired(f"the round's {task.deadline_seconds:.2f}s deadline passed before compute")
    update = update_in_thread(ctx, job, task, verify=True)
    t2 = time.monotonic()
    ctx.check_cancelled()
    # Residuals are replaced (never modified in place) by compress(): a shallow copy is a
    # snapshot to go back to when the update is not applied (its samples are trained again).
    saved = ef.state_tensors() if ef is not None else None
    bundle, payload = encode_update(update, task.spec, ef)
    return RoundWork(update, bundle, payload, saved, t1 - t0, t2 - t1, time.monotonic() - t2)


async def push_requests(
    header: agent_pb2.UpdateHeader, payload: bytes
) -> AsyncIterator[agent_pb2.PushUpdateRequest]:
    """A PushUpdate stream: the header, then the payload in chunks."""
    yield agent_pb2.PushUpdateRequest(header=header)
    for chunk in iter_chunks(payload):
        yield agent_pb2.PushUpdateRequest(chunk=chunk)


async def run_train_task(ctx: TaskContext, task: agent_pb2.Task) -> None:
    started = time.monotonic()
    job = await load_for_task(ctx, task)
    loaded = time.monotonic()
    if job.version != task.params_version and not (
        task.HasField("params_bundle") and not task.state_source_node_id
    ):
        await ensure_params(ctx, job, task)  # from a peer or the coordinator
    fetched = time.monotonic() - loaded
    cpu0, slept0 = ctx.slowdown.compute_seconds, ctx.slowdown.padding_seconds
    unpaid0 = ctx.slowdown.unpaid_seconds
    ctx.check_cancelled()
    ef = job_error_feedback(job, task.spec)
    work = await ctx.run_compute(round_in_thread, ctx, job, task, ef)
    update, bundle, payload, saved = work.update, work.bundle, work.payload, work.saved_residuals
    chunks = update.chunks  # kept until PushUpdate answers (dropped when this returns)
    header = agent_pb2.UpdateHeader(
        node_id=ctx.node_id,
        lease_id=ctx.lease_id,
        task_id=task.task_id,
        job_id=task.job_id,
        round=task.round,
        num_samples=update.num_samples,
        mean_loss=update.mean_loss,
        compute_seconds=update.compute_s,
        bundle=bundle,
        kind=update.kind,
        params_version=task.params_version,
        chunks=chunks.commitments() if chunks is not None else (),
    )

    async def requests() -> AsyncIterator[agent_pb2.PushUpdateRequest]:
        async for msg in push_requests(header, payload):
            yield msg
        # The update is out: the agent's next NextTask poll can start (see Agent._poll_early).
        if ctx.poll_next is not None:
            ctx.poll_next()

    timeout = max(5.0, task.deadline_seconds)
    accepted = False
    encoded = time.monotonic()
    try:
        ctx.check_cancelled()
        response = await ctx.stub.PushUpdate(requests(), timeout=timeout)
        accepted = response.accepted
    finally:
        if not accepted and ef is not None and saved is not None:
            ef.load_state_tensors(saved)
    if accepted:
        done = time.monotonic()
        ctx.log.info(
            "round %d: %s of %d samples in %d step(s), loss %.4f, %d bytes (%s), "
            "compute %.3fs, total %.3fs (load %.3f, params %.3f, steps %.3f [cpu %.3f, "
            "slowdown sleep %.3f, late wake-ups not paid back %.3f], encode %.3f, push %.3f)",
            task.round,
            update.kind,
            update.num_samples,
            update.steps,
            update.mean_loss,
            len(payload),
            task.spec.compression or "none",
            update.compute_s,
            done - started,
            loaded - started,
            fetched + work.params_s,
            work.steps_s,
            ctx.slowdown.compute_seconds - cpu0,
            ctx.slowdown.padding_seconds - slept0,
            ctx.slowdown.unpaid_seconds - unpaid0,
            work.encode_s,
            done - encoded,
        )
        wanted = response.sketch
        if wanted.buckets > 0:
            owed = answer_check(ctx, task, job, chunks, wanted)
            if task.spec.aggregation == "ring" and chunks is not None and not chunks.starts:
                # A ring job's external node in a synchronous round: the start state it may be
                # asked for is the program's parameters now, which the next task changes.
                await owed
            else:
                await ctx.beside(owed, f"the sketches of round {task.round}")
    else:
        ctx.log.warning("round %d: update not applied: %s", task.round, response.reason)


async def answer_check(
    ctx: TaskContext,
    task: agent_pb2.Task,
    job: LoadedJob,
    chunks: ChunkGradients | None,
    wanted: agent_pb2.CheckSpec,
) -> None:
    """The PushUpdate response drew the part for a check: send its chunks' sketches, then, if
    the answer names a chunk, the state that chunk started from."""
    drawn = await commit_sketches(ctx, task, chunks, wanted)
    if drawn is None or not drawn.snapshot_wanted or chunks is None:
        return
    index = drawn.snapshot_chunk
    if not chunks.starts and 0 <= index < len(chunks.grads):
        # A ring job's external node: the parameters its part started from (the coordinator
        # holds the ring's versions only at checkpoints).
        params = await ctx.run_compute(start_parameters, job)
        await push_snapshot(ctx, task, params, index)
    elif 0 <= index < len(chunks.starts):
        state = chunks.starts[index]
        if task.spec.aggregation == "ring":  # with the round's start parameters
            state = with_round_start(state, chunks.starts[0])
        await push_snapshot(ctx, task, state, index)
    else:
        ctx.log.warning(
            "round %d: the coordinator asked for the start state of chunk %d; the part has %d",
            task.round,
            index,
            len(chunks.starts),
        )


async def commit_sketches(
    ctx: TaskContext,
    task: agent_pb2.Task,
    chunks: ChunkGradients | None,
    wanted: agent_pb2.CheckSpec,
) -> agent_pb2.CommitSketchesResponse | None:
    """The PushUpdate response asked for the sketches of the round's chunks: compute them
    (beside the compute thread: `TaskContext.run_beside`) and send them with CommitSketches;
    the coordinator's answer (None when they were not sent). The update is in whatever happens
    here: a failure is logged, never raised (except the agent's own stop)."""
    if chunks is None:
        ctx.log.warning(
            "round %d: the coordinator asked for chunk sketches, but the update has no chunks "
            "(the task asked for none)",
            task.round,
        )
        return None
    if wanted.buckets > MAX_BUCKETS:
        ctx.log.warning(
            "round %d: the coordinator asked for sketches of %d buckets (at most %d): not sent",
            task.round,
            wanted.buckets,
            MAX_BUCKETS,
        )
        return None
    try:
        t0 = time.monotonic()
        values = await ctx.run_beside(chunks.sketches, wanted.seed, wanted.buckets)
        t1 = time.monotonic()
        reply = await ctx.call(
            "CommitSketches",
            lambda: agent_pb2.CommitSketchesRequest(
                node_id=ctx.node_id,
                lease_id=ctx.lease_id,
                job_id=task.job_id,
                task_id=task.task_id,
                seed=wanted.seed,
                sketches=values,
            ),
            timeout=SKETCH_CALL_TIMEOUT_S,
        )
    except Stopped:
        raise
    except Exception as exc:
        ctx.log.warning(
            "round %d: could not send the sketches of its %d chunks: %s",
            task.round,
            len(chunks.grads),
            describe(exc),
        )
        return None
    ctx.log.info(
        "round %d: sketches of %d chunks x %d buckets sent (sketch %.3fs, call %.3fs)",
        task.round,
        len(chunks.grads),
        wanted.buckets,
        t1 - t0,
        time.monotonic() - t1,
    )
    return reply if isinstance(reply, agent_pb2.CommitSketchesResponse) else None


def start_parameters(job: LoadedJob) -> dict[str, torch.Tensor]:
    """The parameters the job's program holds ("param/<name>", CPU copies; compute thread):
    after a synchronous part's gradient, the ones it started from."""
    return {
        PARAM_PREFIX + n: p.detach().to("cpu", copy=True)
        for n, p in zip(job.program.param_names, job.program.parameters(), strict=True)
    }


async def push_snapshot(
    ctx: TaskContext, task: agent_pb2.Task, state: Mapping[str, torch.Tensor], index: int
) -> None:
    """Verification: the coordinator drew chunk ``index`` to recompute; upload ``state``, the
    state it started from (PushUpdate kind "snapshot", uncompressed): for local SGD the chunk's
    start state, whose digest went with the update; for a ring member the parameters its round
    started from. Failures are logged, never raised (except the agent's own stop)."""
    t0 = time.monotonic()
    bundle, payload = await ctx.run_beside(encode_bundle, state)
    header = agent_pb2.UpdateHeader(
        node_id=ctx.node_id,
        lease_id=ctx.lease_id,
        task_id=task.task_id,
        job_id=task.job_id,
        round=task.round,
        kind=KIND_SNAPSHOT,
        params_version=task.params_version,
        bundle=bundle,
        snapshot_chunk=index,
    )

    try:
        reply = await ctx.stub.PushUpdate(
            push_requests(header, payload), timeout=SKETCH_CALL_TIMEOUT_S
        )
    except Stopped:
        raise
    except Exception as exc:
        ctx.log.warning(
            "round %d: could not upload the start state of chunk %d: %s",
            task.round,
            index,
            describe(exc),
        )
        return
    ctx.log.info(
        "round %d: start state of chunk %d uploaded (%d bytes, %.3fs): %s",
        task.round,
        index,
        len(payload),
        time.monotonic() - t0,
        "taken" if reply.accepted else f"refused: {reply.reason}",
    )
