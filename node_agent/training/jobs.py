"""The agent's loaded jobs: each job's program, shards and per-job training state, kept between rounds.

- `LoadedJobs`: the jobs the worker keeps loaded between rounds (at most MAX_LOADED_JOBS; the
  oldest job's program is stopped beyond that), filled by `load_for_task(ctx, task)`
  (node_agent.training.loading: the job's exported program and the shards the task touches,
  loaded once per job, blobs through the verified cache).
- `LoadedJobs.adopt(programs, job_id, program, dataset)`: a job benchmark hands over the
  program and shards it loaded, so that the job's first round does not load them again.

A `LoadedJob` also holds what its rounds carry over (the version of its parameters, the local
SGD inner optimizer, the error feedback of lossy compression), and the records of a round's
update it may keep (`ComputedUpdate`, with the verified chunks' `ChunkGradients`), which
node_agent.training.compute produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epochmesh.dataset import ShardedDataset
from epochmesh.program.archive import TrainableProgram
from epochmesh.sketch import sketch_many
from epochmesh.v1 import agent_pb2
from epochmesh.wire.compression import ErrorFeedback
from node_agent.sandbox.host import (
    ConfinedProgram,
    ProgramHosts,
)

# Loaded programs kept per agent process (a donor rarely serves more than a couple of jobs).
MAX_LOADED_JOBS = 2


# What a job's compute runs on: in the agent always a ConfinedProgram (a child process); the
# pure functions below take either.
Program = ConfinedProgram | TrainableProgram


@dataclass
class LoadedJob:
    program: Program
    dataset: ShardedDataset
    version: int = -1
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    # local_sgd: the inner optimizer over program.parameters(), kept across rounds (DiLoCo).
    inner_optimizer: torch.optim.Optimizer | None = None
    # Residuals of lossy compression of this job's updates (ERROR_FEEDBACK_CODECS).
    error_feedback: ErrorFeedback | None = None
    # Kept by the round's Tamper (node_agent.training.tamper) for later rounds: the last round's
    # update as computed.
    previous: ComputedUpdate | None = None
    # ... and the latest update of each chunk count it computed.
    earlier: dict[int, ComputedUpdate] = field(default_factory=dict)
    # Task.restored_version the inner optimizer stepped under (None: not seen yet): the job's
    # state was restored since when a task brings another.
    restored_version: int | None = None

    def follow_restore(self, task: agent_pb2.Task) -> bool:
        """Local SGD: drop the inner optimizer when the job's state was restored (a rollback,
        a coordinator restart) since it stepped: its state holds the steps of rounds that were
        undone (after a bad update, momentum from the parameters it wrecked). Whether it was."""
        seen, self.restored_version = self.restored_version, int(task.restored_version)
        if seen is None or seen == self.restored_version or self.inner_optimizer is None:
            return False
        self.inner_optimizer = None
        return True


@dataclass
class ChunkGradients:
    """A verified part's chunks (epochmesh.verification), in order: each one's samples, mean
    loss and gradient (float32 CPU tensors in the program's parameter order)."""

    samples: list[int]
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    # Local SGD: the state each chunk's steps started from ("param/<name>", "optim/<key>/
    # <name>"; kept until the check is decided) and its digest (verification.state_digest).
    starts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)

    def commitments(self) -> list[agent_pb2.ChunkCommitment]:
        digests = self.digests or [b""] * len(self.samples)
        return [
            agent_pb2.ChunkCommitment(samples=n, loss=loss, start_digest=d)
            for n, loss, d in zip(self.samples, self.losses, digests, strict=True)
        ]

    def sketches(self, seed: int, buckets: int) -> list[float]:
        """The CountSketch of every chunk's gradient under ``seed`` (float64), chunk-major."""
        out: list[float] = []
        for s in sketch_many(self.grads, seed, buckets):
            out.extend(s.tolist())
        return out


@dataclass
class ComputedUpdate:
    """A round's update: float32 CPU tensors in the program's parameter order."""

    kind: str  # KIND_GRADIENT | KIND_PSEUDO_GRADIENT
    tensors: dict[str, torch.Tensor]
    mean_loss: float  # sample-weighted over all steps
    compute_s: float  # device seconds of all steps (slowdown factor included)
    num_samples: int
    steps: int = 1
    # Verification: the chunks the update is the weighted sum of (None: not chunked).
    chunks: ChunkGradients | None = None


class LoadedJobs:
    """The jobs this agent keeps loaded between rounds (at most MAX_LOADED_JOBS; the oldest
    job's program is stopped beyond that). The worker owns one for its life and hands it to
    every task (TaskContext.jobs); node_agent.training.loading loads into it."""

    def __init__(self) -> None:
        self._jobs: dict[str, LoadedJob] = {}

    def get(self, job_id: str) -> LoadedJob | None:
        return self._jobs.get(job_id)

    def keep(self, programs: ProgramHosts, job_id: str, job: LoadedJob) -> None:
        """Keep a loaded job, stopping the program of the oldest one beyond MAX_LOADED_JOBS."""
        while len(self._jobs) >= MAX_LOADED_JOBS:
            old = self._jobs.pop(next(iter(self._jobs)))
            if isinstance(old.program, ConfinedProgram):
                programs.release(old.program)
        self._jobs[job_id] = job

    def adopt(
        self, programs: ProgramHosts, job_id: str, program: Program, dataset: ShardedDataset
    ) -> bool:
        """Keep a program and dataset that a job benchmark already loaded for the job's rounds,
        so that its first round does not load the exported program again (seconds of a first
        round). The program's parameters must still be the job's initial ones (a benchmark
        computes gradients only); the first round pulls its parameters anyway. Returns False
        when the job is loaded already (nothing changes)."""
        if job_id in self._jobs:
            return False
        params = program.get_parameters()
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
        self.keep(programs, job_id, LoadedJob(program=program, dataset=dataset, expected=expected))
        return True
