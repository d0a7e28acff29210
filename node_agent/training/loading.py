"""Loading a task's job: its program and the shards the task touches, kept between rounds.

- `load_for_task(ctx, task)`: the job's exported program and the shards the task touches,
  loaded once per job (blobs come through the verified cache) and kept between rounds in
  ``ctx.jobs`` (node_agent.training.jobs.LoadedJobs).
"""

from __future__ import annotations

from epochmesh.dataset import ShardedDataset
from epochmesh.v1 import agent_pb2
from node_agent.training.context import TaskContext
from node_agent.training.jobs import LoadedJob


async def _load_job(ctx: TaskContext, task: agent_pb2.Task) -> LoadedJob:
    job = ctx.jobs.get(task.job_id)
    if job is not None:
        return job
    program_path = await ctx.fetch_blob(task.program)
    state_path = await ctx.fetch_blob(task.initial_state)

    def load() -> LoadedJob:
        prog = ctx.programs.load(
            program_path.read_bytes(), state_path.read_bytes(), job_id=task.job_id
        )
        dataset = ShardedDataset(inputs=list(task.spec.inputs), targets=list(task.spec.targets))
        params = prog.get_parameters()
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
        return LoadedJob(program=prog, dataset=dataset, expected=expected)

    job = await ctx.run_compute(load)
    ctx.jobs.keep(ctx.programs, task.job_id, job)
    return job


async def _load_shards(ctx: TaskContext, job: LoadedJob, task: agent_pb2.Task) -> None:
    for shard in task.shards:
        if job.dataset.has_shard(shard.start, shard.count):
            continue
        path = await ctx.fetch_blob(shard.blob)
        await ctx.run_compute(job.dataset.add_shard, shard.start, shard.count, path)


async def load_for_task(ctx: TaskContext, task: agent_pb2.Task) -> LoadedJob:
    """The job's program (loaded once per job) with the shards this task touches loaded."""
    job = await _load_job(ctx, task)
    await _load_shards(ctx, job, task)
    return job
