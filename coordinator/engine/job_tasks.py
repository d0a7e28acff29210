"""The tasks a job's runner hands its nodes: TRAIN, CHECK and BENCHMARK, and the shards they fetch.

Functions of the job's record and what the runner knows at hand-out time (coordinator/engine/
job_runner.py passes it in); they build the task only, the runner queues it.
"""

from __future__ import annotations

import numpy as np

from coordinator.rounds.round_state import Part, RoundState
from coordinator.rounds.sample_ranges import (
    TASK_RANGES_FIELD,
    encode_ranges_field,
    touched_shards,
)
from epochmesh.v1 import agent_pb2, common_pb2


class JobShards:
    """The job's dataset shards, by the samples they hold."""

    def __init__(self, job: common_pb2.Job) -> None:
        self.job = job
        self._starts: np.ndarray | None = None  # the job's shards' starts (a task's shards)

    def of(self, runs: np.ndarray) -> list[common_pb2.Shard]:
        """The job's shards that hold the samples of ``runs`` (what a task must fetch)."""
        if self._starts is None:
            self._starts = np.array([s.start for s in self.job.shards], dtype=np.int64)
        return [self.job.shards[int(i)] for i in touched_shards(self._starts, runs)]


def benchmark_task(job: common_pb2.Job, spec: common_pb2.JobSpec, task_id: str) -> agent_pb2.Task:
    """A BENCHMARK task of the job's program on a node (a few batch sizes up to the global
    batch)."""
    b = spec.global_batch
    sizes = sorted({max(1, b // 8), max(1, b // 4), max(1, b // 2), b})
    return agent_pb2.Task(
        task_id=task_id,
        kind=agent_pb2.TASK_KIND_BENCHMARK,
        job_id=job.job_id,
        spec=spec,
        program=job.program,
        initial_state=job.initial_state,
        shards=list(job.shards),  # prefetches the dataset before the first round
        benchmark_batch_sizes=sizes,
    )


def train_task(
    job: common_pb2.Job,
    spec: common_pb2.JobSpec,
    shards: JobShards,
    rs: RoundState,
    part: Part,
    *,
    inner_steps: int,
    verify_chunks: int,
    restored_version: int,
    payload: tuple[common_pb2.TensorBundle, bytes] | None,
    inline_max_bytes: int,
) -> agent_pb2.Task:
    """The TRAIN task of ``part`` of ``rs``; ``payload``: the encoded parameters of the
    round's version when the runner holds them, inlined when at most ``inline_max_bytes``."""
    task = agent_pb2.Task(
        task_id=part.task_id,
        kind=agent_pb2.TASK_KIND_TRAIN,
        job_id=job.job_id,
        spec=spec,
        program=job.program,
        initial_state=job.initial_state,
        shards=shards.of(part.ranges),
        epoch=rs.epoch,
        round=rs.round,
        local_batch=part.local_batch,
        params_version=rs.version,
        deadline_seconds=rs.deadline_s,
        inner_steps=max(inner_steps, part.inner_steps),
        compute_budget_seconds=part.budget_s,
    )
    task.verify_chunks = verify_chunks
    task.restored_version = restored_version
    task.MergeFromString(encode_ranges_field(TASK_RANGES_FIELD, part.ranges))
    if payload is not None and len(payload[1]) <= inline_max_bytes:
        # Small models: the parameters travel with the task (no PullParameters round trip
        # between the hand-out and the compute).
        task.params_bundle.CopyFrom(payload[0])
        task.params_data = payload[1]
    return task


def check_task(
    job: common_pb2.Job,
    spec: common_pb2.JobSpec,
    shards: JobShards,
    task_id: str,
    round_id: int,
    version: int,
    runs: np.ndarray,
    check: agent_pb2.CheckSpec,
    payload: tuple[common_pb2.TensorBundle, bytes] | None,
    *,
    epoch: int,
    deadline_s: float,
    inline_max_bytes: int,
    local_batch: int = 0,
) -> agent_pb2.Task:
    """A CHECK task: recompute the samples ``runs`` (a chunk of another node's part of
    ``round_id``) from parameters ``version`` and sketch the gradient (coordinator/engine/
    verifier.py). Local SGD (``local_batch`` > 0): run the chunk's steps from the start
    state ``payload``, which travels inline whatever its size."""
    task = agent_pb2.Task(
        task_id=task_id,
        kind=agent_pb2.TASK_KIND_CHECK,
        job_id=job.job_id,
        spec=spec,
        program=job.program,
        initial_state=job.initial_state,
        shards=shards.of(runs),
        epoch=epoch,
        round=round_id,
        local_batch=local_batch or (int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0),
        params_version=version,
        deadline_seconds=deadline_s,
        check=check,
    )
    task.MergeFromString(encode_ranges_field(TASK_RANGES_FIELD, runs))
    if payload is not None and (local_batch or len(payload[1]) <= inline_max_bytes):
        task.params_bundle.CopyFrom(payload[0])
        task.params_data = payload[1]
    return task
