"""A ring job's state on this agent: the version it holds, its snapshots, what it serves peers.

The state per job is kept in the worker's `RingJobs` (node_agent.training.ring_jobs, reached
as ``ctx.ring_jobs``; bounded like MAX_LOADED_JOBS): the round optimizer over the loaded
program's parameters, at most two snapshots (CPU copies, never modified once made, so
`RingJobs.provide_state` can serve them while a round runs), and the cached update.
`state_for` gives a round its job's state.

`ensure_state` makes a round hold the job's state of version v = task.params_version (step 1
of the ring round, node_agent.training.ring_round): TransferState of exactly v from
task.state_source_node_id when the task names one; else already live; else one of the
snapshots kept here; else PullParameters(version=v, include_optimizer_state) from the
coordinator. A round number below the last one run here means the coordinator went back to a
checkpoint: the state kept here is dropped first.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from enum import Enum

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
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import BundleAssembler, params_checksum
from node_agent.ring.client import fetch_state, peer_channel
from node_agent.ring.mailbox import StateSnapshot
from node_agent.ring.runtime import PeerRuntime
from node_agent.training.context import TaskContext
from node_agent.training.jobs import LoadedJob
from node_agent.training.params import state_source_address
from node_agent.training.ring_jobs import RingJobState, UpdateKey

# Lower bound of the join timeout and of coordinator calls made during a ring round.
MIN_CALL_TIMEOUT_S = 5.0

Shapes = Mapping[str, tuple[int, ...]]


# -- pure parts ---------------------------------------------------------------------------------


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


# -- per-job state ------------------------------------------------------------------------------


async def state_for(ctx: TaskContext, task: agent_pb2.Task, loaded: LoadedJob) -> RingJobState:
    """The job's ring state over ``loaded``, kept in ``ctx.ring_jobs`` (a new round optimizer
    when the job has none over this program)."""
    state = ctx.ring_jobs.current(task.job_id, loaded)
    if state is not None:
        return state
    # In the compute thread: the process's first optimizer imports torch._dynamo (seconds on a
    # loaded host), which on the event loop stalled every member's heartbeats past its lease.
    optimizer = await ctx.run_compute(build_round_optimizer, task.spec, loaded.program.parameters())
    return ctx.ring_jobs.hold(task.job_id, loaded, optimizer)


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


def apply_round(state: RingJobState, summed: torch.Tensor, new_version: int) -> StateSnapshot:
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


# -- holding the round's version ----------------------------------------------------------------


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
    address = state_source_address(task)
    version = int(task.params_version)
    identity = _identity_of(ctx)
    channel = peer_channel(address, task.state_source_node_id, identity)
    try:
        snap = await fetch_state(
            channel,
            task.job_id,
            node_id=ctx.node_id,
            min_version=version,
            timeout=call_timeout(ctx, task),
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
    got, tensors = await pull_bundle(
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


async def pull_bundle(
    ctx: TaskContext,
    task: agent_pb2.Task,
    make_request: Callable[[], agent_pb2.PullParametersRequest],
    expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    assembler: BundleAssembler | None = None
    version = -1
    stream: AsyncIterator[agent_pb2.PullParametersResponse] = ctx.stub.PullParameters(
        make_request(), timeout=call_timeout(ctx, task)
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


def call_timeout(ctx: TaskContext, task: agent_pb2.Task) -> float:
    due = ctx.deadline
    left = (due - time.monotonic()) if due is not None else task.deadline_seconds
    return max(MIN_CALL_TIMEOUT_S, left + MIN_CALL_TIMEOUT_S)


def _identity_of(ctx: TaskContext) -> Identity | None:
    runtime = getattr(ctx, "peer", None)
    if isinstance(runtime, PeerRuntime):
        return runtime.identity
    from node_agent.core.identity import transport_identity

    return transport_identity(ctx.connection.data_dir, ctx.connection.insecure)
