"""What a job runner may ask of the coordinator that hosts it (the engine).

Runners depend on this protocol, never on the engine itself, so that imports run one way:
engine -> runners -> runner_host. Node ownership is the host's: its cluster scheduler decides
which job holds a node, and a runner only learns which nodes it was given and hands back those
it stops using.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from coordinator.engine.api import CoordinatorContext
from epochmesh.v1 import agent_pb2


class RunnerHost(Protocol):
    ctx: CoordinatorContext

    async def nodes_for(self, job_id: str, refused: Collection[str] = ()) -> list[str]:
        """The nodes the scheduler gives the job now, held by it from this call on (nodes in
        ``refused``, which the job will not use, are neither held nor returned)."""
        ...

    def planned_nodes(self, job_id: str) -> list[str]:
        """The nodes the scheduler's current plan gives the job (held by it or not), without
        taking any."""
        ...

    async def release(self, node_id: str, job_id: str) -> None:
        """The job stops using the node (it is free for the scheduler's next pass)."""
        ...

    def enqueue(self, node_id: str, task: agent_pb2.Task, job_id: str) -> None:
        """Queue a task for the node's next NextTask (round tasks before checks before the
        rest)."""
        ...

    def round_finished(self, job_id: str, open_tasks: Collection[str]) -> None:
        """The job's round closed: forget its task ids but ``open_tasks``."""
        ...

    def reference_rate(self, node_id: str) -> float:
        """The node's reference benchmark (samples/s), 0 if unknown."""
        ...

    def is_silent(self, node_id: str) -> bool:
        """Whether the node has not heartbeaten for longer than ``silence_limit_s``."""
        ...

    def silence_limit_s(self) -> float: ...

    def wait_reason(self, job_id: str) -> str:
        """Why the scheduler gives the job no node now ("" when it gives it some)."""
        ...
