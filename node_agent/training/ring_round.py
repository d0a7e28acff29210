"""Ring TRAIN rounds on the agent (aggregation = "ring"): the round, its evidence, its checkpoints.

A ring round (a TRAIN task with `task.ring`), per the session protocol B.4:

1. Hold the job's state (parameters and round-optimizer state) of version v =
   task.params_version: TransferState of exactly v from task.state_source_node_id when the
   task names one (mutual TLS, the peer's certificate must name that node; the coordinator
   names a source only to nodes it knows do not hold v); else already live; else one of the
   snapshots kept here (the current version and the pre-step state of the last round, so that
   a retried round can go back to v); else PullParameters(version=v, include_optimizer_state)
   from the coordinator ("param/<n>" and "optim/<key>" tensors; plain parameter names are
   taken too, with a fresh optimizer, but only at version 0 or for an optimizer without
   state). A round number below the last one run here means the coordinator went back to a
   checkpoint: the state kept here is dropped first.
2. The update (`compute_update`: the gradient, or local SGD's pseudo-gradient), cached
   by (round, version, ranges, batch, inner steps) so that a retried attempt reuses it: no
   sample is trained twice and local SGD's inner optimizer is not stepped again.
3. Flattened in parameter order into a float32 buffer scaled by b_i / B (task.local_batch /
   task.ring_total_samples); the round's gateway member (task.ring_gateway) adds the sum of
   the coordinator-side contributions (PullParameters(external_round=round), already scaled).
   A time-boxed round of local SGD (task.ring_weighted; the update covers the steps that fit
   in task.compute_budget_seconds): scaled by the samples trained / task.ring_total_samples
   instead, with that weight appended (epochmesh.ring.weights), and the all-reduced update is
   divided by the summed weight before step 5: the sample-weighted mean of what was trained.
4. `ring_allreduce` with the spec's wire codec (fp16/bf16/int8; anything else travels "none"),
   the per-step deadline task.ring.deadline_seconds, and the rest of the task's deadline as the
   join timeout (neighbours may still be computing).
5. The summed buffer becomes .grad and `build_round_optimizer` steps: version v+1, kept as the
   current snapshot (the v snapshot is kept as the pre-step one). ReportProgress with
   params_checksum (sha256 over the parameters in program order), ring_attempt and
   params_version = v+1; with task.push_state, PushUpdate(kind "checkpoint") of the v+1 state.
   RingPeerFailed: ReportProgress(failed, failed_peer_node_id, ring_attempt); the state stays
   at v (nothing was stepped).
6. Verification (Task.verify_chunks > 0, coordinator/engine/verifier.py): the update is computed in
   chunks whose commitments go with the report; the all-reduce keeps what it received in the
   reduce-scatter. When the report's answer says the part is checked and/or the round audited,
   `send_check_evidence` sends the chunk and update sketches and the member's evidence of the
   all-reduce (epochmesh.ring.evidence), and uploads the round's start parameters when a chunk
   is drawn, beside the member's next task (`TaskContext.beside`): the next ring round waits
   on no member's sketches. (The round's `Tamper`, ``ctx.tamper``, may change the update and the
   contribution put into the ring: node_agent.training.tamper.)

Reported times: compute_seconds is the device time of the update the step used (a retry
reuses the cached update and reports its time again); communicate_seconds is the task's wall
time minus the wall time spent computing in this task.

The state a ring job keeps on this agent between rounds (the round optimizer, snapshots, the
cached update) and what this agent serves its peers (`RingJobs.provide_state`) live in
node_agent.training.ring_jobs; how a round comes to hold its version (step 1) in
node_agent.training.ring_state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from epochmesh.optim import (
    PARAM_PREFIX,
)
from epochmesh.ring.evidence import FlatSketch, member_evidence
from epochmesh.ring.schedule import RING_CODECS, RingSchedule, chunk_elems_for
from epochmesh.ring.weights import (
    weight_of,
    weighted_contribution,
    weighted_mean,
    weighted_shapes,
)
from epochmesh.sketch import sketch
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import MAX_BUCKETS, with_round_start
from epochmesh.wire.tensors import encode_bundle, iter_chunks, params_checksum
from node_agent.link.connection import Expired, Stopped, describe
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.mailbox import StateSnapshot
from node_agent.ring.runtime import PeerRuntime
from node_agent.training.compute import compute_update
from node_agent.training.context import TaskCancelled, TaskContext
from node_agent.training.loading import load_for_task
from node_agent.training.ps_round import SKETCH_CALL_TIMEOUT_S, push_snapshot
from node_agent.training.ring_jobs import CachedUpdate, RingJobState
from node_agent.training.ring_state import (
    MIN_CALL_TIMEOUT_S,
    BadState,
    Shapes,
    apply_round,
    call_timeout,
    ensure_state,
    flatten,
    optim_of,
    params_of,
    prune_snapshots,
    pull_bundle,
    state_for,
    unflatten,
    update_key,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

KIND_CHECKPOINT = "checkpoint"
# Used when a task carries no per-step deadline (the coordinator should always send one).
DEFAULT_STEP_DEADLINE_S = 30.0
# An announced attempt stays open this long past its task's deadline when it never starts here.
ANNOUNCE_GRACE_S = 60.0


# ---------------------------------------------------------------------------------------------
# Pure parts


def _all_finite(buffer: torch.Tensor) -> bool:
    return bool(torch.isfinite(buffer).all())


def ring_codec(spec: common_pb2.JobSpec) -> str:
    """The ring's wire codec: the spec's compression when a ring can carry it, else "none"."""
    codec = spec.compression or "none"
    return codec if codec in RING_CODECS else "none"


def contribution_scale(local_batch: int, ring_total_samples: int) -> float:
    """b_i / B: the weight of this node's mean-loss update in the round's sum."""
    if local_batch < 1:
        raise ValueError(f"local_batch must be >= 1 (got {local_batch})")
    if ring_total_samples < local_batch:
        raise ValueError(
            f"ring_total_samples {ring_total_samples} is smaller than this node's local_batch "
            f"{local_batch}"
        )
    return local_batch / ring_total_samples


# ---------------------------------------------------------------------------------------------
# The ring TRAIN task


async def run_ring_task(ctx: TaskContext, task: agent_pb2.Task, runtime: PeerRuntime) -> None:
    """One attempt of a ring round on this member (see the module docstring)."""
    started = time.monotonic()
    ring = task.ring
    attempt = int(ring.attempt)
    scale = contribution_scale(task.local_batch, task.ring_total_samples)
    transport = runtime.transport(ctx.node_id)
    if not 0 <= ring.rank < len(ring.node_ids) or ring.node_ids[ring.rank] != ctx.node_id:
        raise ValueError(
            f"the task's ring {list(ring.node_ids)} does not put this node ({ctx.node_id}) at "
            f"its rank {ring.rank}"
        )
    peers = [
        (n, a) for n, a in zip(ring.node_ids, ring.peer_addresses, strict=False) if n != ctx.node_id
    ]
    # This node takes streams, bulk tokens and abort reports for this attempt from its members
    # from now on (not for attempts it has no task of), and refuses revoked certificates.
    transport.mailbox.announce(
        (task.job_id, int(task.round), attempt),
        list(ring.node_ids),
        int(ring.rank),
        max(task.deadline_seconds, 0.0) + ANNOUNCE_GRACE_S,
    )
    if runtime.server is not None:
        runtime.server.service.add_revoked(task.revoked_node_ids)
    runtime.links.refresh(peers, transport.probe)  # background; reported with the outcome
    peer_ids = [n for n, _ in peers]

    loaded = await load_for_task(ctx, task)
    state = await state_for(ctx, task, loaded)
    version = int(task.params_version)
    try:
        source = await ensure_state(ctx, state, task)
    except BadState as exc:
        # The source, not this node, is at fault: named, as a member that failed the ring.
        ctx.failure_reported = True
        ctx.log.warning("%s", exc)
        await ctx.report_progress(
            failed=True,
            error=str(exc)[:2000],
            failed_peer_node_id=exc.node_id,
            ring_attempt=attempt,
            peer_links=runtime.links.report(peer_ids),
        )
        return
    ctx.check_cancelled()

    key = update_key(task)
    compute_wall = 0.0
    cached = state.cached if state.cached is not None and state.cached.key == key else None
    if cached is None:
        due = ctx.deadline
        if due is not None and time.monotonic() > due:
            raise Expired(
                f"the round's {task.deadline_seconds:.2f}s deadline passed before compute"
            )
        t0 = time.monotonic()
        state.live_version = None  # local SGD moves the parameters while it computes
        update = await compute_update(ctx, loaded, task, verify=task.verify_chunks > 0)
        state.live_version = version  # compute_update leaves the parameters at the start
        flat = await ctx.run_compute(flatten, update.tensors, state.names)
        compute_wall = time.monotonic() - t0
        cached = CachedUpdate(
            key=key,
            flat=flat,
            kind=update.kind,
            mean_loss=update.mean_loss,
            compute_s=update.compute_s,
            num_samples=update.num_samples,
            steps=update.steps,
            chunks=update.chunks,
        )
        state.cached = cached
    ctx.check_cancelled()

    weighted = task.ring_weighted
    if weighted:
        # A time-boxed round: the weight is the samples trained, the tail carries it.
        if task.ring_gateway:
            raise ValueError("a weighted ring round has no external nodes to sum in")
        weight = weight_of(cached.num_samples, int(task.ring_total_samples))
        buffer = await ctx.run_compute(
            weighted_contribution, cached.flat, weight, len(ring.node_ids)
        )
    else:
        buffer = await ctx.run_compute(torch.mul, cached.flat, scale)
    if task.ring_gateway:
        external = await pull_external_sum(ctx, state, task)
        buffer.add_(external)

    if not await ctx.run_compute(_all_finite, buffer):
        # Refused here as the parameter server refuses it: the neighbours would blame this
        # node for it anyway (every hop checks what it receives), so it says so itself.
        ctx.failure_reported = True
        await ctx.report_progress(
            failed=True,
            error="this node's update holds NaN or Inf values",
            failed_peer_node_id=ctx.node_id,
            ring_attempt=attempt,
            peer_links=runtime.links.report(peer_ids),
            compute_seconds=cached.compute_s,
        )
        return
    # Verification: what the ring audit's evidence is computed from (epochmesh.ring.evidence).
    copies = await ctx.run_compute(AuditCopies.of, buffer) if task.verify_chunks > 0 else None
    factor = ctx.tamper.contribution_factor(int(task.round))
    if factor != 1.0:
        buffer.mul_(factor)  # the ring gets another contribution than the one shown
    deadline_s = ring.deadline_seconds if ring.deadline_seconds > 0 else DEFAULT_STEP_DEADLINE_S
    due = ctx.deadline
    join_s = max(deadline_s, MIN_CALL_TIMEOUT_S, (due - time.monotonic()) if due else 0.0)
    ctx.log.debug(
        "round %d attempt %d: all-reduce of %d floats as rank %d of %d (%s), step deadline "
        "%.2fs, join timeout %.2fs",
        task.round,
        attempt,
        buffer.numel(),
        ring.rank,
        len(ring.node_ids),
        ring_codec(task.spec),
        deadline_s,
        join_s,
    )
    ring_t0 = time.monotonic()
    try:
        await _unless_cancelled(
            ctx,
            ring_allreduce(
                buffer,
                ring,
                transport,
                deadline_s,
                ring_codec(task.spec),
                job_id=task.job_id,
                round=task.round,
                join_timeout_s=join_s,
                received=copies.received if copies is not None else None,
            ),
        )
    except RingPeerFailed as exc:
        ring_s = time.monotonic() - ring_t0
        ctx.log.warning(
            "round %d attempt %d: ring failed after %.2fs: %s", task.round, attempt, ring_s, exc
        )
        ctx.failure_reported = True
        await ctx.report_progress(
            failed=True,
            error=str(exc)[:2000],
            failed_peer_node_id=exc.node_id,
            ring_fault=exc.fault,
            ring_attempt=attempt,
            peer_links=runtime.links.report(peer_ids),
            compute_seconds=cached.compute_s,
            communicate_seconds=max(0.0, time.monotonic() - started - compute_wall),
        )
        return
    ring_s = time.monotonic() - ring_t0
    if copies is not None:
        copies.result = await ctx.run_compute(torch.clone, buffer)
    weights = ""
    if weighted:
        # The summed weight is positive for honest members; anything else is not stepped on.
        weights = f", weight {weight:.6f} of {float(buffer[-1]):.6f}"
        buffer = await ctx.run_compute(weighted_mean, buffer, cached.flat.numel())

    state.live_version = None
    snapshot = await ctx.run_compute(apply_round, state, buffer, version + 1)
    state.snapshots = prune_snapshots(
        {**state.snapshots, version + 1: snapshot}, [version, version + 1]
    )
    state.live_version = version + 1
    loaded.version = version + 1
    checksum = await ctx.run_compute(params_checksum, params_of(snapshot))
    optim_sum = await ctx.run_compute(params_checksum, optim_of(snapshot))

    # The round is applied here: the next task's poll waits at the coordinator while the
    # report (and any state push) goes out.
    if ctx.poll_next is not None:
        ctx.poll_next()
    reply = await ctx.report_progress(
        chunks=cached.chunks.commitments() if cached.chunks is not None else (),
        samples_done=cached.num_samples,
        mean_loss=cached.mean_loss,
        compute_seconds=cached.compute_s,
        communicate_seconds=max(0.0, time.monotonic() - started - compute_wall),
        params_checksum=checksum,
        optim_checksum=optim_sum,
        ring_attempt=attempt,
        params_version=version + 1,
        peer_links=runtime.links.report(peer_ids),
    )
    ctx.log.info(
        "round %d attempt %d: %s of %d samples in %d step(s), loss %.4f, compute %.3fs, "
        "ring %.3fs (%d members, %s%s), state from %s, version %d -> %d",
        task.round,
        attempt,
        cached.kind,
        cached.num_samples,
        cached.steps,
        cached.mean_loss,
        cached.compute_s,
        ring_s,
        len(ring.node_ids),
        ring_codec(task.spec),
        weights,
        source.value,
        version,
        version + 1,
    )
    if task.push_state:
        await push_state(ctx, task, snapshot, checksum, cached)
    if reply is not None and (reply.sketch.buckets > 0 or reply.ring_audit.buckets > 0):
        # Beside the next task, not before it: the next round's ring waits on nobody's
        # sketches. What they are computed from is this round's own (the cached update, the
        # audit copies, the start snapshot taken now: the next round prunes it from the state).
        start = state.snapshots.get(version)
        await ctx.beside(
            send_check_evidence(ctx, task, state.shapes, cached, copies, start, version, reply),
            f"the sketches of round {task.round}",
        )


@dataclass
class AuditCopies:
    """What a member's ring audit evidence is computed from: its contribution (the scaled
    buffer it put in), what it received in the reduce-scatter, the all-reduced result."""

    contribution: torch.Tensor
    received: torch.Tensor
    result: torch.Tensor | None = None

    @classmethod
    def of(cls, buffer: torch.Tensor) -> AuditCopies:
        """Before the all-reduce: a copy of the contribution, zeros to receive into."""
        return cls(buffer.clone(), torch.zeros_like(buffer))


def ring_evidence(
    task: agent_pb2.Task, shapes: Shapes, copies: AuditCopies, audit: agent_pb2.CheckSpec
) -> agent_pb2.RingEvidence:
    """This member's evidence of the round's all-reduce under the audit's seed (compute
    thread; epochmesh.ring.evidence)."""
    assert copies.result is not None
    codec = ring_codec(task.spec)
    n = len(task.ring.node_ids)
    schedule = RingSchedule.build(n, copies.contribution.numel(), chunk_elems_for(codec))
    # A weighted round's buffer ends in the weight's tail, sketched as one more tensor.
    flat_shapes = weighted_shapes(shapes, n) if task.ring_weighted else shapes
    fs = FlatSketch.build(flat_shapes, audit.seed, audit.buckets)
    ev = member_evidence(
        schedule,
        int(task.ring.rank),
        codec,
        copies.contribution,
        copies.received,
        copies.result,
        fs,
    )
    sent, received, own, result = ev.flat()
    return agent_pb2.RingEvidence(
        seed=audit.seed,
        buckets=audit.buckets,
        sent=sent,
        received=received,
        own=own,
        result=result,
    )


async def send_check_evidence(
    ctx: TaskContext,
    task: agent_pb2.Task,
    shapes: Shapes,
    cached: CachedUpdate,
    copies: AuditCopies | None,
    start: StateSnapshot | None,
    version: int,
    reply: agent_pb2.ReportProgressResponse,
) -> None:
    """Verification: the answer to the report says this member's part is checked (``sketch``)
    and/or the round is audited (``ring_audit``). Send, under the seed, the sketches of its
    chunks and of the update it put into the all-reduce, and its evidence of the all-reduce
    (CommitSketches); when the answer to them draws a chunk, upload ``start`` (the state of
    ``version``, the round's start) for its checker. Runs beside the member's next task
    (`TaskContext.beside`): it reads nothing the next round changes. Failures are logged,
    never raised (the round is done)."""
    check, audit = reply.sketch, reply.ring_audit
    if max(check.buckets, audit.buckets) > MAX_BUCKETS:
        ctx.log.warning("round %d: sketches of more than %d buckets asked", task.round, MAX_BUCKETS)
        return
    request = agent_pb2.CommitSketchesRequest(
        node_id=ctx.node_id,
        lease_id=ctx.lease_id,
        job_id=task.job_id,
        task_id=task.task_id,
        seed=check.seed if check.buckets > 0 else audit.seed,
    )
    t0 = time.monotonic()
    if check.buckets > 0 and cached.chunks is not None:
        update = unflatten(cached.flat, shapes)
        request.sketches.extend(
            await ctx.run_beside(cached.chunks.sketches, check.seed, check.buckets)
        )
        own = await ctx.run_beside(sketch, update, check.seed, check.buckets)
        request.update_sketch.extend(own.tolist())
    if audit.buckets > 0 and copies is not None and copies.result is not None:
        evidence = await ctx.run_beside(ring_evidence, task, shapes, copies, audit)
        request.ring.CopyFrom(evidence)
    t1 = time.monotonic()
    try:
        drawn = await ctx.call("CommitSketches", lambda: request, timeout=SKETCH_CALL_TIMEOUT_S)
    except Stopped:
        raise
    except Exception as exc:
        ctx.log.warning(
            "round %d: could not send its check's sketches: %s", task.round, describe(exc)
        )
        return
    ctx.log.info(
        "round %d: sketches sent (%s%s; sketch %.3fs, call %.3fs)",
        task.round,
        f"{len(request.sketches) // max(check.buckets, 1)} chunks"
        if check.buckets
        else "no chunks",
        ", ring evidence" if request.HasField("ring") else "",
        t1 - t0,
        time.monotonic() - t1,
    )
    if not isinstance(drawn, agent_pb2.CommitSketchesResponse) or not drawn.snapshot_wanted:
        return
    index = drawn.snapshot_chunk
    if cached.chunks is not None and cached.chunks.starts:  # local SGD
        if not 0 <= index < len(cached.chunks.starts):
            ctx.log.warning("round %d: the start state of chunk %d is asked", task.round, index)
            return
        starts = cached.chunks.starts
        await push_snapshot(ctx, task, with_round_start(starts[index], starts[0]), index)
        return
    if start is None:
        ctx.log.warning(
            "round %d: the parameters of version %d are asked for a check; no longer kept",
            task.round,
            version,
        )
        return
    params = {PARAM_PREFIX + n: t for n, t in params_of(start).items()}
    await push_snapshot(ctx, task, params, index)


async def _unless_cancelled(ctx: TaskContext, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (TaskCancelled) once the task is abandoned."""
    job = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({job}, timeout=0.1)
            if done:
                return job.result()
            if ctx.cancelled.is_set():
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError, RingPeerFailed):
                    await job
                raise TaskCancelled(ctx.cancel_reason or "task cancelled")
    finally:
        if not job.done():
            job.cancel()


# -- the gateway's addend -----------------------------------------------------------------------


async def pull_external_sum(
    ctx: TaskContext, state: RingJobState, task: agent_pb2.Task
) -> torch.Tensor:
    """The gateway's addend: the coordinator-side contributions of the round (already
    scaled), flattened in parameter order."""
    _, tensors = await pull_bundle(
        ctx,
        task,
        lambda: agent_pb2.PullParametersRequest(
            node_id=ctx.node_id,
            lease_id=ctx.lease_id,
            job_id=task.job_id,
            external_round=task.round,
        ),
        expected=state.loaded.expected,
    )
    return await ctx.run_compute(flatten, tensors, state.names)


# -- checkpoints -------------------------------------------------------------------------------


async def push_state(
    ctx: TaskContext,
    task: agent_pb2.Task,
    snapshot: StateSnapshot,
    checksum: str,
    cached: CachedUpdate,
) -> None:
    """PushUpdate(kind "checkpoint") of the state this round produced."""
    bundle, payload = await ctx.run_compute(encode_bundle, dict(snapshot.tensors))
    header = agent_pb2.UpdateHeader(
        node_id=ctx.node_id,
        lease_id=ctx.lease_id,
        task_id=task.task_id,
        job_id=task.job_id,
        round=task.round,
        num_samples=cached.num_samples,
        mean_loss=cached.mean_loss,
        compute_seconds=cached.compute_s,
        bundle=bundle,
        kind=KIND_CHECKPOINT,
        params_version=snapshot.version,
        params_checksum=checksum,
    )

    async def requests() -> AsyncIterator[agent_pb2.PushUpdateRequest]:
        yield agent_pb2.PushUpdateRequest(header=header)
        for chunk in iter_chunks(payload):
            yield agent_pb2.PushUpdateRequest(chunk=chunk)

    t0 = time.monotonic()
    try:
        response = await ctx.stub.PushUpdate(requests(), timeout=call_timeout(ctx, task))
    except grpc.aio.AioRpcError as exc:
        ctx.log.warning(
            "round %d: checkpoint of version %d refused: %s: %s",
            task.round,
            snapshot.version,
            exc.code().name,
            exc.details(),
        )
        return
    if response.accepted:
        ctx.log.info(
            "round %d: checkpoint of version %d pushed (%d bytes, %.2fs)",
            task.round,
            snapshot.version,
            len(payload),
            time.monotonic() - t0,
        )
    else:
        ctx.log.warning(
            "round %d: checkpoint of version %d not taken: %s",
            task.round,
            snapshot.version,
            response.reason,
        )
