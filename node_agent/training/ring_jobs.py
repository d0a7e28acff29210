"""The ring jobs' state this agent keeps between rounds, and what it serves its peers.

`RingJobs` holds, per ring job (bounded like MAX_LOADED_JOBS), a `RingJobState`: the round
optimizer over the loaded program's parameters, at most two snapshots (CPU copies, never
modified once made, so `provide_state` can serve them while a round runs), and the cached
update. The worker owns one for its life: it hands `provide_state` to its PeerServer (the
StateProvider: the exact version asked if held, else the newest; the joiner checks the
version) and the object itself to every task (TaskContext.ring_jobs), where
node_agent.training.ring_state and check_task read it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from node_agent.ring.mailbox import StateSnapshot
from node_agent.training.jobs import MAX_LOADED_JOBS, ChunkGradients, LoadedJob

# Ring state kept per agent process: as many jobs as the trainer keeps loaded.
MAX_RING_JOBS = MAX_LOADED_JOBS


UpdateKey = tuple[int, int, tuple[tuple[int, int], ...], int, int]


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
    chunks: ChunkGradients | None = None


@dataclass
class RingJobState:
    job_id: str
    loaded: LoadedJob
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


class RingJobs:
    """The ring state of the jobs this agent ran rounds of, least recently used first."""

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, RingJobState] = OrderedDict()

    def get(self, job_id: str) -> RingJobState | None:
        return self._jobs.get(job_id)

    def current(self, job_id: str, loaded: LoadedJob) -> RingJobState | None:
        """The job's state when it is over ``loaded`` (marked used), else None."""
        state = self._jobs.get(job_id)
        if state is not None and state.loaded is loaded:
            self._jobs.move_to_end(job_id)
            return state
        return None

    def hold(
        self, job_id: str, loaded: LoadedJob, optimizer: torch.optim.Optimizer
    ) -> RingJobState:
        """The job's state over ``loaded`` with ``optimizer`` (a new one, or the kept one with
        the live state unknown), kept as the most recently used; the least recently used job
        beyond MAX_RING_JOBS is dropped."""
        state = self._jobs.get(job_id)
        if state is None:
            state = RingJobState(job_id=job_id, loaded=loaded, optimizer=optimizer)
        else:
            # The trainer loaded the program again: the kept snapshots (CPU copies) still hold.
            state.loaded, state.optimizer, state.live_version = loaded, optimizer, None
        self._jobs[job_id] = state
        self._jobs.move_to_end(job_id)
        while len(self._jobs) > MAX_RING_JOBS:
            self._jobs.popitem(last=False)
        return state

    async def provide_state(self, job_id: str, version: int) -> StateSnapshot | None:
        """The PeerServer's StateProvider: the state of exactly `version` when this agent holds
        it (current or the kept pre-step snapshot), else its newest (the joiner checks the
        version), None when it holds no state of the job."""
        state = self._jobs.get(job_id)
        if state is None or not state.snapshots:
            return None
        snap = state.snapshots.get(version)
        return snap if snap is not None else state.snapshots[max(state.snapshots)]
