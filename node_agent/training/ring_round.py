"""Ring TRAIN rounds on the agent (aggregation = "ring"), and the state this agent serves peers.

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
2. The update (`trainer.compute_update`: the gradient, or local SGD's pseudo-gradient), cached
   by (round, version, ranges, batch, inner steps) so that a retried attempt reuses it: no
   sample is trained twice and local SGD's inner optimizer is not stepped again.
3. Flattened in parameter order into a float32 buffer scaled by b_i / B (task.local_batch /
   task.ring_total_samples); the round's gateway member (task.ring_gateway) adds the sum of
   the coordinator-side contributions (PullParameters(external_round=round), already scaled).
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
   is drawn. (Tests only: EPOCHMESH_TEST_CHEAT, node_agent.testing.cheat.)

Reported times: compute_seconds is the device time of the update the step used (a retry
reuses the cached update and reports its time again); communicate_seconds is the task's wall
time minus the wall time spent computing in this task.

State per job lives in this module (bounded like trainer.MAX_LOADED_JOBS): the round
optimizer over the loaded program's parameters, at most two snapshots (CPU copies, never
modified once made, so `provide_state` can serve them while a round runs), and the cached
update. `provide_state` is the PeerServer's StateProvider: the exact version asked if held,
else the newest (the joiner checks the version).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

import grpc
import torch

from epochmesh.identity import Identity
from epochmesh.optim import (
    OPTIM_PREFIX,
    PARAM_PREFIX,
    build_round_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
    state_tensors,
)
from epochmesh.ring.evidence import FlatSketch, member_evidence
from epochmesh.ring.schedule import RING_CODECS, RingSchedule, chunk_elems_for
from epochmesh.sketch import sketch
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import MAX_BUCKETS, with_round_start
from epochmesh.wire.tensors import BundleAssembler, encode_bundle, iter_chunks, params_checksum
from node_agent.link.connection import Expired, Stopped, describe
from node_agent.ring.allreduce import RingPeerFailed, RingTransport, ring_allreduce
from node_agent.ring.links import PeerLinks
from node_agent.ring.service import PeerServer, StateSnapshot, fetch_state, peer_channel
from node_agent.runtime.dispatch import TaskCancelled, TaskContext
from node_agent.testing.cheat import CONTRIBUTION, SCALE, cheat_from_environment
from node_agent.training import ps_round as trainer

log = logging.getLogger(__name__)

T = TypeVar("T")

KIND_CHECKPOINT = "checkpoint"
# Ring state kept per agent process: as many jobs as the trainer keeps loaded.
MAX_RING_JOBS = trainer.MAX_LOADED_JOBS
# Used when a task carries no per-step deadline (the coordinator should always send one).
DEFAULT_STEP_DEADLINE_S = 30.0
# Lower bound of the join timeout and of coordinator calls made during a ring round.
MIN_CALL_TIMEOUT_S = 5.0
# An announced attempt stays open this long past its task's deadline when it never starts here.
ANNOUNCE_GRACE_S = 60.0

Shapes = Mapping[str, tuple[int, ...]]


# ---------------------------------------------------------------------------------------------
# Pure parts


def flatten(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The tensors named `names`, in that order, as one flat contiguous float32 CPU buffer (a
    new tensor). KeyError names a missing tensor."""
    parts = []
    for name in names:
        t = tensors.get(name)
        if t is None:
            raise KeyError(f"update lacks tensor {name!r}")
        parts.append(t.detach().reshape(-1).to("cpu", torch.float32))
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def unflatten(buffer: torch.Tensor, shapes: Shapes) -> dict[str, torch.Tensor]:
    """Views of the flat `buffer` shaped like `shapes` (in its order): the inverse of
    `flatten`. ValueError when the sizes do not add up."""
    total = sum(_numel(s) for s in shapes.values())
    if buffer.dim() != 1 or buffer.numel() != total:
        raise ValueError(
            f"buffer holds {buffer.numel()} elements, the parameters {total} "
            f"({len(shapes)} tensors)"
        )
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        out[name] = buffer[offset : offset + n].view(shape)
        offset += n
    return out


def _all_finite(buffer: torch.Tensor) -> bool:
    return bool(torch.isfinite(buffer).all())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def split_state(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(parameters in `expected` order, optimizer state or None) of a state bundle.

    A bundle in state naming ("param/<n>", "optim/<k>") gives the optimizer state (possibly
    empty); a bundle of plain parameter names gives None (no optimizer state at all).
    ValueError for missing, unexpected or mis-shaped tensors.
    """
    stateful = any(k.startswith(PARAM_PREFIX) for k in tensors)
    params: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        key = f"{PARAM_PREFIX}{name}" if stateful else name
        t = tensors.get(key)
        if t is None:
            raise ValueError(f"the state lacks parameter {name!r}")
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"parameter {name!r} is {t.dtype} {list(t.shape)} in the state, the program "
                f"has {dtype} {list(shape)}"
            )
        params[name] = t
    if not stateful:
        extra = [k for k in tensors if k not in expected]
        if extra:
            raise ValueError(f"the parameters hold unexpected tensors {extra[:5]}")
        return params, None
    optim: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.startswith(PARAM_PREFIX):
            if key[len(PARAM_PREFIX) :] not in expected:
                raise ValueError(f"the state holds an unknown parameter {key!r}")
        elif key.startswith(OPTIM_PREFIX):
            optim[key[len(OPTIM_PREFIX) :]] = t
        else:
            raise ValueError(f"state tensor {key!r} is neither param/ nor optim/")
    return params, optim


def params_of(snapshot: StateSnapshot) -> dict[str, torch.Tensor]:
    """The parameters of a state snapshot by plain name, in order."""
    n = len(PARAM_PREFIX)
    return {k[n:]: t for k, t in snapshot.tensors.items() if k.startswith(PARAM_PREFIX)}


def optim_of(snapshot: StateSnapshot) -> dict[str, torch.Tensor]:
    """The optimizer state tensors of a state snapshot by key, in order."""
    n = len(OPTIM_PREFIX)
    return {k[n:]: t for k, t in snapshot.tensors.items() if k.startswith(OPTIM_PREFIX)}


class BadState(Exception):
    """A peer served a state that is not the one the ring agreed on for its version."""

    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id


def check_served_state(snapshot: StateSnapshot, task: agent_pb2.Task) -> None:
    """BadState unless ``snapshot`` (fetched from task.state_source_node_id) hashes to the
    checksums the ring agreed on for its version (task.state_params_checksum and
    task.state_optim_checksum; an empty one is not checked)."""
    source = task.state_source_node_id
    for what, expected, tensors in (
        ("parameters", task.state_params_checksum, params_of(snapshot)),
        ("optimizer state", task.state_optim_checksum, optim_of(snapshot)),
    ):
        if not expected:
            continue
        got = params_checksum(tensors)
        if got != expected:
            raise BadState(
                source,
                f"peer {source} served version {snapshot.version} of job {task.job_id} whose "
                f"{what} are not the ones its ring agreed on (checksum {got[:16]}, agreed "
                f"{expected[:16]})",
            )


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


def round_optimizer_keeps_state(spec: common_pb2.JobSpec) -> bool:
    """Whether the round optimizer has per-parameter state (so that a fresh one differs)."""
    if spec.sync == "local_sgd":
        return spec.outer_momentum > 0
    if spec.optimizer == "adamw":
        return True
    return spec.momentum > 0


class Source(Enum):
    """Where a ring task gets the state of its version from (`choose_source`)."""

    LIVE = "live"  # the program already holds it
    SNAPSHOT = "snapshot"  # a snapshot kept here (current, or the pre-step one of a retry)
    PEER = "peer"  # TransferState from task.state_source_node_id
    COORDINATOR = "coordinator"  # PullParameters


def choose_source(
    version: int, live_version: int | None, held: Sequence[int], state_source_node_id: str
) -> Source:
    """Where to get `version` from.

    A named state source means the coordinator knows this node does not hold that version (a
    joiner, or a node that missed rounds): its state is fetched even when a snapshot of the
    same number is kept here, since that one may come from before a coordinator restart (the
    same version number, other contents). Without one: the live state, else a kept snapshot
    (a retried round goes back to its pre-step state), else the coordinator.
    """
    if state_source_node_id:
        return Source.PEER
    if live_version is not None and live_version == version:
        return Source.LIVE
    if version in held:
        return Source.SNAPSHOT
    return Source.COORDINATOR


def rolled_back(last_round: int | None, round_: int) -> bool:
    """Whether a task's round lies before the last round this node ran for the job: the
    coordinator went back to a checkpoint, so the state kept here may be from rounds that no
    longer count."""
    return last_round is not None and round_ < last_round


UpdateKey = tuple[int, int, tuple[tuple[int, int], ...], int, int]


def update_key(task: agent_pb2.Task) -> UpdateKey:
    """What identifies a round's update on this node: a retried attempt of the same round with
    the same version, ranges and batch reuses it."""
    return (
        task.round,
        task.params_version,
        tuple((r.start, r.stop) for r in task.ranges),
        task.local_batch,
        task.inner_steps,
    )


def prune_snapshots(
    snapshots: Mapping[int, StateSnapshot], keep: Sequence[int]
) -> dict[int, StateSnapshot]:
    """Only the snapshots of the versions in `keep` (the current and the pre-step one)."""
    return {v: s for v, s in snapshots.items() if v in keep}


# ---------------------------------------------------------------------------------------------
# Per-job state


@dataclass
class CachedUpdate:
    key: UpdateKey
    flat: torch.Tensor  # unscaled, float32 CPU, parameter order
    kind: str
    mean_loss: float
    compute_s: float
    num_samples: int
    steps: int
    # Verification (sync rounds with Task.verify_chunks): the chunks the update is the
    # weighted sum of, kept until the report's answer says whether the part is checked.
    chunks: trainer.ChunkGradients | None = None


@dataclass
class RingJobState:
    job_id: str
    loaded: trainer.LoadedJob
    optimizer: torch.optim.Optimizer
    # version -> state (at most the current one and the pre-step one of the last round)
    snapshots: dict[int, StateSnapshot] = field(default_factory=dict)
    # The version the live program + optimizer hold (None: unknown, e.g. a step was cut off).
    live_version: int | None = None
    cached: CachedUpdate | None = None
    last_round: int | None = None  # the last round a task of this job ran here

    def forget_state(self) -> None:
        """Drop the kept versions and the cached update (the coordinator rolled back)."""
        self.snapshots = {}
        self.live_version = None
        self.cached = None

    @property
    def names(self) -> list[str]:
        return list(self.loaded.program.param_names)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: shape for n, (_, shape) in self.loaded.expected.items()}


_ring_jobs: OrderedDict[str, RingJobState] = OrderedDict()


def job_state(job_id: str) -> RingJobState | None:
    return _ring_jobs.get(job_id)


async def _state_for(
    ctx: TaskContext, task: agent_pb2.Task, loaded: trainer.LoadedJob
) -> RingJobState:
    state = _ring_jobs.get(task.job_id)
    if state is not None and state.loaded is loaded:
        _ring_jobs.move_to_end(task.job_id)
        return state
    # In the compute thread: the process's first optimizer imports torch._dynamo (seconds on a
    # loaded host), which on the event loop stalled every member's heartbeats past its lease.
    optimizer = await ctx.run_compute(build_round_optimizer, task.spec, loaded.program.parameters())
    state = _ring_jobs.get(task.job_id)
    if state is None:
        state = RingJobState(job_id=task.job_id, loaded=loaded, optimizer=optimizer)
    else:
        # The trainer loaded the program again: the kept snapshots (CPU copies) still hold.
        state.loaded, state.optimizer, state.live_version = loaded, optimizer, None
    _ring_jobs[task.job_id] = state
    _ring_jobs.move_to_end(task.job_id)
    while len(_ring_jobs) > MAX_RING_JOBS:
        _ring_jobs.popitem(last=False)
    return state


def _snapshot_live(state: RingJobState, version: int) -> StateSnapshot:
    """A CPU copy of the live parameters and optimizer state (compute thread)."""
    names = state.names
    params = {
        n: p.detach().to("cpu", copy=True)
        for n, p in zip(names, state.loaded.program.parameters(), strict=True)
    }
    optim = {
        k: t.detach().to("cpu", copy=True)
        for k, t in optimizer_state_tensors(state.optimizer, names).items()
    }
    return StateSnapshot(version=version, tensors=state_tensors(params, optim))


def _load_live(
    state: RingJobState,
    params: Mapping[str, torch.Tensor],
    optim: Mapping[str, torch.Tensor] | None,
) -> None:
    """Put parameters and optimizer state into the live program (compute thread); `optim`
    None or empty: a fresh optimizer."""
    state.loaded.program.set_parameters(params)
    if optim:
        load_optimizer_state_tensors(state.optimizer, state.names, optim)
    else:
        state.optimizer.state.clear()


def _apply_round(state: RingJobState, summed: torch.Tensor, new_version: int) -> StateSnapshot:
    """The reduced buffer as .grad, one round-optimizer step, a snapshot of the new state."""
    grads = unflatten(summed, state.shapes)
    params = state.loaded.program.parameters()
    try:
        for name, p in zip(state.names, params, strict=True):
            p.grad = grads[name].to(device=p.device, dtype=p.dtype)
        state.optimizer.step()
    finally:
        for p in params:
            p.grad = None
    return _snapshot_live(state, new_version)


async def provide_state(job_id: str, version: int) -> StateSnapshot | None:
    """The PeerServer's StateProvider: the state of exactly `version` when this agent holds it
    (current or the kept pre-step snapshot), else its newest (the joiner checks the version),
    None when it holds no state of the job."""
    state = _ring_jobs.get(job_id)
    if state is None or not state.snapshots:
        return None
    snap = state.snapshots.get(version)
    return snap if snap is not None else state.snapshots[max(state.snapshots)]


def forget_jobs() -> None:
    """Drop all ring state (tests; an agent keeps it for its life)."""
    _ring_jobs.clear()


# ---------------------------------------------------------------------------------------------
# The agent's PeerService side


class PeerRuntime:
    """This agent's PeerServer, its identity for dialing peers, and the ring transport."""

    def __init__(self, server: PeerServer | None, identity: Identity | None) -> None:
        self.server = server
        self.identity = identity
        self._transport: RingTransport | None = None
        self.links = PeerLinks()  # measured links to ring peers, reported to the coordinator

    def transport(self, node_id: str) -> RingTransport:
        """The ring transport for this node id (made again if the coordinator assigned
        another id since)."""
        if self.server is None:
            raise ValueError(
                "this agent runs no PeerService (--no-peer) and cannot take part in a ring"
            )
        t = self._transport
        if t is None or t.node_id != node_id:
            if t is not None:
                _spawn_close(t)
            t = self._transport = RingTransport.for_server(
                node_id, self.server, identity=self.identity
            )
        return t

    async def close(self) -> None:
        await self.links.close()
        if self._transport is not None:
            await self._transport.close()
            self._transport = None


_closing: set[asyncio.Task[None]] = set()


def _spawn_close(transport: RingTransport) -> None:
    task = asyncio.get_running_loop().create_task(transport.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


# ---------------------------------------------------------------------------------------------
# The ring TRAIN task


async def run_ring_task(ctx: TaskContext, task: agent_pb2.Task, runtime: PeerRuntime) -> None:
    """One attempt of a ring round on this member (see the module docstring)."""
    started = time.monotonic()
    cheat = cheat_from_environment()  # tests only; ValueError for a bad value
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

    loaded = await trainer.load_for_task(ctx, task)
    state = await _state_for(ctx, task, loaded)
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
        update = await trainer.compute_update(
            ctx, loaded, task, verify=task.verify_chunks > 0, cheat=cheat
        )
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
    if cheat is not None and cheat.kind == CONTRIBUTION and cheat.active_at(task.round):
        buffer.mul_(SCALE)  # tests only: the ring gets another contribution than the one shown
        trainer.note_cheat(CONTRIBUTION, int(task.round))
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

    state.live_version = None
    snapshot = await ctx.run_compute(_apply_round, state, buffer, version + 1)
    state.snapshots = prune_snapshots(
        {**state.snapshots, version + 1: snapshot}, [version, version + 1]
    )
    state.live_version = version + 1
    loaded.version = version + 1
    checksum = await ctx.run_compute(params_checksum, params_of(snapshot))
    optim_sum = await ctx.run_compute(params_checksum, optim_of(snapshot))

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
        "ring %.3fs (%d members, %s), state from %s, version %d -> %d",
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
        source.value,
        version,
        version + 1,
    )
    if task.push_state:
        await push_state(ctx, task, snapshot, checksum, cached)
    if reply is not None and (reply.sketch.buckets > 0 or reply.ring_audit.buckets > 0):
        await send_check_evidence(ctx, task, state, cached, copies, version, reply)


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
    fs = FlatSketch.build(shapes, audit.seed, audit.buckets)
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
    state: RingJobState,
    cached: CachedUpdate,
    copies: AuditCopies | None,
    version: int,
    reply: agent_pb2.ReportProgressResponse,
) -> None:
    """Verification: the answer to the report says this member's part is checked (``sketch``)
    and/or the round is audited (``ring_audit``). Send, under the seed, the sketches of its
    chunks and of the update it put into the all-reduce, and its evidence of the all-reduce
    (CommitSketches); when the answer to them draws a chunk, upload the parameters of
    ``version`` (the round's start; still kept as the pre-step snapshot) for its checker.
    Failures are logged, never raised (the round is done)."""
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
        update = unflatten(cached.flat, state.shapes)
        request.sketches.extend(
            await ctx.run_compute(cached.chunks.sketches, check.seed, check.buckets)
        )
        own = await ctx.run_compute(sketch, update, check.seed, check.buckets)
        request.update_sketch.extend(own.tolist())
    if audit.buckets > 0 and copies is not None and copies.result is not None:
        evidence = await ctx.run_compute(ring_evidence, task, state.shapes, copies, audit)
        request.ring.CopyFrom(evidence)
    t1 = time.monotonic()
    try:
        drawn = await ctx.call(
            "CommitSketches", lambda: request, timeout=trainer.SKETCH_CALL_TIMEOUT_S
        )
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
        await trainer.push_snapshot(ctx, task, with_round_start(starts[index], starts[0]), index)
        return
    start = state.snapshots.get(version)
    if start is None:
        ctx.log.warning(
            "round %d: the parameters of version %d are asked for a check; no longer kept",
            task.round,
            version,
        )
        return
    params = {PARAM_PREFIX + n: t for n, t in params_of(start).items()}
    await trainer.push_snapshot(ctx, task, params, index)


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


# -- holding the round's version ---------------------------------------------------------------


async def ensure_state(ctx: TaskContext, state: RingJobState, task: agent_pb2.Task) -> Source:
    """Make the live program and round optimizer hold version task.params_version."""
    version = int(task.params_version)
    if rolled_back(state.last_round, task.round):
        ctx.log.info(
            "job %s: round %d comes after round %d here: the coordinator went back to a "
            "checkpoint; dropping the state kept here",
            task.job_id,
            task.round,
            state.last_round,
        )
        state.forget_state()
    state.last_round = int(task.round)
    source_node = task.state_source_node_id if task.state_source_node_id != ctx.node_id else ""
    source = choose_source(version, state.live_version, list(state.snapshots), source_node)
    if source is Source.LIVE:
        return source
    if source is Source.SNAPSHOT:
        snap = state.snapshots[version]
        params, optim = split_state(snap.tensors, state.loaded.expected)
        # Going back to v (a retried round): the state made after v is no longer valid.
        state.snapshots = prune_snapshots(state.snapshots, [version - 1, version])
    elif source is Source.PEER:
        snap = await _fetch_from_peer(ctx, state, task)
        params, optim = split_state(snap.tensors, state.loaded.expected)
        state.snapshots = {version: snap}
    else:
        snap, params, optim = await _pull_state(ctx, state, task)
        state.snapshots = {version: snap}
    state.live_version = None
    await ctx.run_compute(_load_live, state, params, optim)
    state.live_version = version
    state.loaded.version = version
    ctx.log.debug("job %s: holding version %d (from the %s)", task.job_id, version, source.value)
    return source


async def _fetch_from_peer(
    ctx: TaskContext, state: RingJobState, task: agent_pb2.Task
) -> StateSnapshot:
    address = trainer.state_source_address(task)
    version = int(task.params_version)
    identity = _identity_of(ctx)
    channel = peer_channel(address, task.state_source_node_id, identity)
    try:
        snap = await fetch_state(
            channel,
            task.job_id,
            node_id=ctx.node_id,
            min_version=version,
            timeout=_call_timeout(ctx, task),
        )
    finally:
        await channel.close()
    if snap.version != version:
        raise ValueError(
            f"peer {task.state_source_node_id} sent version {snap.version} of job "
            f"{task.job_id}; the round needs version {version}"
        )
    await ctx.run_compute(check_served_state, snap, task)
    return snap


async def _pull_state(
    ctx: TaskContext, state: RingJobState, task: agent_pb2.Task
) -> tuple[StateSnapshot, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    version = int(task.params_version)
    got, tensors = await _pull_bundle(
        ctx,
        task,
        lambda: agent_pb2.PullParametersRequest(
            node_id=ctx.node_id,
            lease_id=ctx.lease_id,
            job_id=task.job_id,
            version=version,
            include_optimizer_state=True,
        ),
    )
    if got != version:
        raise ValueError(
            f"the coordinator sent version {got} of job {task.job_id}; the round needs {version}"
        )
    params, optim = split_state(tensors, state.loaded.expected)
    if optim is None and version > 0 and round_optimizer_keeps_state(task.spec):
        raise ValueError(
            f"the coordinator sent the parameters of version {version} without the optimizer "
            "state; a fresh optimizer would make this replica diverge from the others"
        )
    snap = StateSnapshot(
        version=version,
        tensors=state_tensors(
            {n: t.detach().to("cpu", copy=True) for n, t in params.items()},
            {k: t.detach().to("cpu", copy=True) for k, t in (optim or {}).items()},
        ),
    )
    return snap, params, optim


async def pull_external_sum(
    ctx: TaskContext, state: RingJobState, task: agent_pb2.Task
) -> torch.Tensor:
    """The gateway's addend: the coordinator-side contributions of the round (already
    scaled), flattened in parameter order."""
    _, tensors = await _pull_bundle(
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


async def _pull_bundle(
    ctx: TaskContext,
    task: agent_pb2.Task,
    make_request: Callable[[], agent_pb2.PullParametersRequest],
    expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    assembler: BundleAssembler | None = None
    version = -1
    stream: AsyncIterator[agent_pb2.PullParametersResponse] = ctx.stub.PullParameters(
        make_request(), timeout=_call_timeout(ctx, task)
    )
    async for msg in stream:
        part = msg.WhichOneof("part")
        if part == "header":
            if assembler is not None:
                raise ValueError("PullParameters sent two headers")
            assembler = BundleAssembler(msg.header.bundle, expected=expected)
            version = msg.header.version
        elif part == "chunk":
            if assembler is None:
                raise ValueError("PullParameters sent a chunk before its header")
            assembler.add(msg.chunk)
        ctx.check_cancelled()
    if assembler is None:
        raise ValueError("PullParameters ended without a bundle")
    return version, assembler.finish()


def _call_timeout(ctx: TaskContext, task: agent_pb2.Task) -> float:
    due = ctx.deadline
    left = (due - time.monotonic()) if due is not None else task.deadline_seconds
    return max(MIN_CALL_TIMEOUT_S, left + MIN_CALL_TIMEOUT_S)


def _identity_of(ctx: TaskContext) -> Identity | None:
    runtime = getattr(ctx, "peer", None)
    if isinstance(runtime, PeerRuntime):
        return runtime.identity
    from node_agent.core.identity import transport_identity

    return transport_identity(ctx.connection.data_dir)


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
        response = await ctx.stub.PushUpdate(requests(), timeout=_call_timeout(ctx, task))
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


__all__ = [
    "PeerRuntime",
    "Source",
    "choose_source",
    "contribution_scale",
    "flatten",
    "provide_state",
    "ring_codec",
    "run_ring_task",
    "split_state",
    "state_tensors",
    "unflatten",
    "update_key",
]
