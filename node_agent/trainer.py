"""TRAIN rounds on the agent (parameter-server mode).

One round: make sure the job's exported program and the shards the round touches are loaded
(blobs come through the verified cache), pull the parameters of the round's version unless
this agent already holds them, compute the gradient of the mean loss over the task's samples
(in the order given, through the slowdown controller), and stream it back with PushUpdate in
chunks of at most 1 MiB. The program and the dataset stay loaded between rounds of a job.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from epochmesh.dataset import ShardedDataset, ranges_to_indices
from epochmesh.program import TrainableProgram
from epochmesh.tensors import BundleAssembler, encode_bundle, iter_chunks
from epochmesh.v1 import agent_pb2
from node_agent.connection import Expired
from node_agent.tasks import TaskContext

# Loaded programs kept per agent process (a donor rarely serves more than a couple of jobs).
MAX_LOADED_JOBS = 2


@dataclass
class LoadedJob:
    program: TrainableProgram
    dataset: ShardedDataset
    version: int = -1
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)


_jobs: dict[str, LoadedJob] = {}


async def _load_job(ctx: TaskContext, task: agent_pb2.Task) -> LoadedJob:
    job = _jobs.get(task.job_id)
    if job is not None:
        return job
    program_path = await ctx.fetch_blob(task.program)
    state_path = await ctx.fetch_blob(task.initial_state)

    def load() -> LoadedJob:
        prog = TrainableProgram.from_bytes(
            program_path.read_bytes(), state_path.read_bytes(), torch.device(ctx.device)
        )
        dataset = ShardedDataset(inputs=list(task.spec.inputs), targets=list(task.spec.targets))
        params = prog.get_parameters()
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
        return LoadedJob(program=prog, dataset=dataset, expected=expected)

    job = await ctx.run_compute(load)
    while len(_jobs) >= MAX_LOADED_JOBS:
        _jobs.pop(next(iter(_jobs)))
    _jobs[task.job_id] = job
    return job


async def _load_shards(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> None:
    for shard in task.shards:
        if job.dataset.has_shard(shard.start, shard.count):
            continue
        path = await ctx.fetch_blob(shard.blob)
        await ctx.run_compute(job.dataset.add_shard, shard.start, shard.count, path)


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


async def run_train_task(ctx: TaskContext, task: agent_pb2.Task) -> None:
    started = time.monotonic()
    job = await _load_job(ctx, task)
    await _load_shards(ctx, job, task)
    if job.version != task.params_version:
        await _pull_parameters(ctx, job, task)
    ctx.check_cancelled()
    due = ctx.deadline
    if due is not None and time.monotonic() > due:
        # The round closed without this part (the agent was busy or cut off): computing it now
        # would only delay the next task. The coordinator has returned its samples to pending.
        raise Expired(f"the round's {task.deadline_seconds:.2f}s deadline passed before compute")
    indices = ranges_to_indices(task.ranges)
    if len(indices) != task.local_batch:
        raise ValueError(f"task names {len(indices)} samples but local_batch {task.local_batch}")

    def compute() -> tuple[float, dict[str, torch.Tensor], float]:
        inputs, targets = job.dataset.get_batch(indices)
        loss, grads = ctx.slowdown.timed_step(lambda: job.program.loss_and_grads(inputs, targets))
        # The step's time on this (possibly emulated) device: F x its compute time.
        return loss, {k: g.cpu() for k, g in grads.items()}, ctx.slowdown.last_device_seconds

    loss, grads, compute_s = await ctx.run_compute(compute)
    ctx.check_cancelled()
    bundle, payload = await ctx.run_compute(encode_bundle, grads)
    header = agent_pb2.UpdateHeader(
        node_id=ctx.node_id,
        lease_id=ctx.lease_id,
        task_id=task.task_id,
        job_id=task.job_id,
        round=task.round,
        num_samples=len(indices),
        mean_loss=loss,
        compute_seconds=compute_s,
        bundle=bundle,
        kind="gradient",
        params_version=task.params_version,
    )

    async def requests() -> AsyncIterator[agent_pb2.PushUpdateRequest]:
        yield agent_pb2.PushUpdateRequest(header=header)
        for chunk in iter_chunks(payload):
            yield agent_pb2.PushUpdateRequest(chunk=chunk)

    timeout = max(5.0, task.deadline_seconds)
    response = await ctx.stub.PushUpdate(requests(), timeout=timeout)
    if response.accepted:
        ctx.log.info(
            "round %d: %d samples, loss %.4f, compute %.3fs, total %.3fs",
            task.round,
            len(indices),
            loss,
            compute_s,
            time.monotonic() - started,
        )
    else:
        ctx.log.warning("round %d: update not applied: %s", task.round, response.reason)
