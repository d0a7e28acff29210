"""TODO: docstring (split from coordinator.engine.job_state)."""

from __future__ import annotations

import numpy as np

from coordinator.rounds.sample_ranges import touched_shards
from epochmesh.v1 import common_pb2


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
