"""One node's queue of tasks at the coordinator: in what order a node is handed its tasks."""

from __future__ import annotations

from dataclasses import dataclass

from epochmesh.v1 import agent_pb2

# A queued task lets at most this many later tasks of a more urgent kind go ahead of it.
# Without a bound a check would wait for as long as the node's rounds follow one another
# (a ring job's node finds its next round task queued each time it asks), and miss its
# deadline every time; with one, a check waits for one round task at most and its deadline
# (four rounds or more) holds.
MAX_PASSED = 1


def queue_rank(task: agent_pb2.Task) -> int:
    """How urgent a task is (lower first): round tasks, checks, the rest (benchmarks)."""
    if task.kind == agent_pb2.TASK_KIND_TRAIN:
        return 0
    return 1 if task.kind == agent_pb2.TASK_KIND_CHECK else 2


@dataclass
class _Queued:
    task: agent_pb2.Task
    job_id: str
    rank: int
    passed: int = 0  # how many later tasks went ahead of this one


class TaskQueue:
    """A node's tasks in the order they are handed out: by kind (`queue_rank`: every node of
    a round waits for its slowest one, a check only for its own deadline), in order of
    arrival within a kind, and no task passed by more than `MAX_PASSED` later ones."""

    def __init__(self) -> None:
        self._queued: list[_Queued] = []

    def push(self, task: agent_pb2.Task, job_id: str) -> None:
        rank = queue_rank(task)
        at = len(self._queued)
        while at > 0:
            before = self._queued[at - 1]
            if before.rank <= rank or before.passed >= MAX_PASSED:
                break
            at -= 1
        for overtaken in self._queued[at:]:
            overtaken.passed += 1
        self._queued.insert(at, _Queued(task, job_id, rank))

    def pop(self) -> tuple[agent_pb2.Task, str]:
        """The next task and its job (IndexError when empty)."""
        first = self._queued.pop(0)
        return first.task, first.job_id

    def __len__(self) -> int:
        return len(self._queued)

    def tasks(self) -> list[tuple[agent_pb2.Task, str]]:
        """The queued tasks and their jobs, next first."""
        return [(q.task, q.job_id) for q in self._queued]
