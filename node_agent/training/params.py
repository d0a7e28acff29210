"""A round's parameters on the agent: from the task, a peer's TransferState, or PullParameters.

`ensure_params(ctx, job, task)` makes the job hold the parameters of task.params_version:
already held; else from the peer named by task.state_source_node_id through TransferState
(checked against the job's expected names, dtypes and shapes); else from the task itself when
the coordinator sent them inline (small models); else PullParameters from the coordinator.
"""

from __future__ import annotations

import torch

from epochmesh.v1 import agent_pb2
from epochmesh.wire.tensors import BundleAssembler, decode_bundle
from node_agent.training.context import TaskContext
from node_agent.training.jobs import (
    LoadedJob,
)


async def _pull_parameters(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> None:
    request = agent_pb2.PullParametersRequest(
        node_id=ctx.node_id, lease_id=ctx.lease_id, job_id=task.job_id, version=task.params_version
    )
    timeout = max(5.0, task.deadline_seconds)
    assembler: BundleAssembler | None = None
    version = -1
    async for msg in ctx.stub.PullParameters(request, timeout=timeout):
        part = msg.WhichOneof("part")
        if part == "header":
            assembler = BundleAssembler(msg.header.bundle, expected=job.expected)
            version = msg.header.version
        elif part == "chunk":
            if assembler is None:
                raise ValueError("PullParameters sent a chunk before its header")
            assembler.add(msg.chunk)
        ctx.check_cancelled()
    if assembler is None:
        raise ValueError("PullParameters ended without parameters")
    params = assembler.finish()
    await ctx.run_compute(job.program.set_parameters, params)
    job.version = version


def state_source_address(task: agent_pb2.Task) -> str:
    """Where the task's state source listens: state_source_address, else its ring address."""
    if task.state_source_address:
        return task.state_source_address
    ring = task.ring
    for node_id, address in zip(ring.node_ids, ring.peer_addresses, strict=False):
        if node_id == task.state_source_node_id and address:
            return str(address)
    raise ValueError(f"task names state source {task.state_source_node_id!r} without an address")


def params_from_state(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """The parameters ("param/<name>") out of a state bundle, checked against `expected`."""
    params: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        t = tensors.get(f"param/{name}")
        if t is None:
            raise ValueError(f"state transfer lacks parameter {name!r}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"state transfer's parameter {name!r} is {t.dtype} {list(t.shape)}, expected "
                f"{dtype} {list(shape)}"
            )
        params[name] = t
    return params


async def _fetch_state_from_peer(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> None:
    # Imported here: the peer module pulls in the ring service, which PS-only agents never need.
    from node_agent.core.identity import transport_identity
    from node_agent.ring.client import fetch_state, peer_channel

    address = state_source_address(task)
    identity = transport_identity(ctx.connection.data_dir, ctx.connection.insecure)
    channel = peer_channel(address, task.state_source_node_id, identity)
    try:
        snapshot = await fetch_state(
            channel,
            task.job_id,
            node_id=ctx.node_id,
            min_version=task.params_version,
            timeout=max(5.0, task.deadline_seconds),
        )
    finally:
        await channel.close()
    if snapshot.version != task.params_version:
        raise ValueError(
            f"peer {task.state_source_node_id} sent version {snapshot.version} of job "
            f"{task.job_id}, the round needs {task.params_version}"
        )
    params = params_from_state(dict(snapshot.tensors), job.expected)
    await ctx.run_compute(job.program.set_parameters, params)
    job.version = snapshot.version


async def ensure_params(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> None:
    """Make the job hold the parameters of task.params_version."""
    if job.version == task.params_version:
        return
    if task.state_source_node_id:
        await _fetch_state_from_peer(ctx, job, task)
    elif task.HasField("params_bundle"):
        await ctx.run_compute(set_inline_parameters, job, task)
    else:
        await _pull_parameters(ctx, job, task)


def set_inline_parameters(job: LoadedJob, task: agent_pb2.Task) -> None:
    """The task carries its parameters (a small model): check and load them."""
    params = decode_bundle(task.params_bundle, task.params_data, job.expected)
    job.program.set_parameters(params)
    job.version = task.params_version
