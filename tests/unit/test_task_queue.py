"""A node's task queue at the coordinator and the agent's reports sent beside its next task:
what keeps verification off a round's critical path."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from coordinator.scheduling.task_queue import MAX_PASSED, TaskQueue, queue_rank
from epochmesh.v1 import agent_pb2
from node_agent.core.config import AgentConfig
from node_agent.link.connection import Stopped
from node_agent.runtime import worker
from node_agent.runtime.worker import Agent

K = agent_pb2


def task(kind: int, name: str) -> agent_pb2.Task:
    return agent_pb2.Task(kind=kind, task_id=name)


def order(queue: TaskQueue) -> list[str]:
    return [t.task_id for t, _ in queue.tasks()]


def test_a_round_task_goes_before_a_check_and_a_check_before_a_benchmark() -> None:
    queue = TaskQueue()
    queue.push(task(K.TASK_KIND_CHECK, "check"), "j")
    queue.push(task(K.TASK_KIND_BENCHMARK, "bench"), "j")
    queue.push(task(K.TASK_KIND_TRAIN, "train"), "j")  # the next round's task, after a check
    assert order(queue) == ["train", "check", "bench"]
    assert [queue_rank(t) for t, _ in queue.tasks()] == [0, 1, 2]
    assert [queue.pop()[0].task_id for _ in range(3)] == ["train", "check", "bench"]
    assert len(queue) == 0


def test_tasks_of_one_kind_keep_their_order_of_arrival() -> None:
    queue = TaskQueue()
    for i in range(5):
        queue.push(task(K.TASK_KIND_CHECK, f"c{i}"), f"job-{i}")
    queue.push(task(K.TASK_KIND_TRAIN, "t"), "job-t")
    assert [(t.task_id, j) for t, j in queue.tasks()] == [("t", "job-t")] + [
        (f"c{i}", f"job-{i}") for i in range(5)
    ]


def test_no_task_is_passed_by_more_than_max_passed_later_ones() -> None:
    """A node whose rounds follow one another finds its next round task queued each time it
    asks: a check must still come out, after at most MAX_PASSED round tasks."""
    assert MAX_PASSED == 1
    queue = TaskQueue()
    queue.push(task(K.TASK_KIND_CHECK, "check"), "j")
    queue.push(task(K.TASK_KIND_BENCHMARK, "bench"), "j")
    handed: list[str] = []
    for r in range(4):  # each round's task arrives before the node asks again
        queue.push(task(K.TASK_KIND_TRAIN, f"round-{r}"), "j")
        handed.append(queue.pop()[0].task_id)
    handed.extend(t.task_id for t, _ in queue.tasks())
    # round-0 passed both; neither may be passed again, so both come out before round-1.
    assert handed == ["round-0", "check", "bench", "round-1", "round-2", "round-3"]


def test_a_task_that_may_not_be_passed_keeps_those_behind_it_in_place() -> None:
    queue = TaskQueue()
    queue.push(task(K.TASK_KIND_CHECK, "check-1"), "j")
    queue.push(task(K.TASK_KIND_TRAIN, "train-1"), "j")  # passes check-1 (its one)
    queue.push(task(K.TASK_KIND_BENCHMARK, "bench"), "j")
    queue.push(task(K.TASK_KIND_CHECK, "check-2"), "j")  # passes the benchmark
    # A round task may pass neither the benchmark (passed once) nor check-2 behind it.
    queue.push(task(K.TASK_KIND_TRAIN, "train-2"), "j")
    assert order(queue) == ["train-1", "check-1", "check-2", "bench", "train-2"]


def agent(tmp_path: Path) -> Agent:
    return Agent(AgentConfig(coordinator="127.0.0.1:1", data_dir=tmp_path))


async def test_reports_beside_the_next_task_run_on_their_own_bounded_in_number(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path)
    release = asyncio.Event()
    started: list[int] = []

    async def report(i: int) -> None:
        started.append(i)
        await release.wait()

    # Up to MAX_BESIDE are handed over without waiting: the task that owed them is over.
    for i in range(worker.MAX_BESIDE):
        await asyncio.wait_for(a._beside(report(i), f"report {i}"), timeout=5)
    await asyncio.sleep(0)
    assert sorted(started) == list(range(worker.MAX_BESIDE))
    # One more waits for a slot.
    extra = asyncio.ensure_future(a._beside(report(99), "report 99"))
    for _ in range(5):  # it cannot get a slot before one of the four ends, however long
        await asyncio.sleep(0)
    assert not extra.done() and 99 not in started
    release.set()
    await asyncio.wait_for(extra, timeout=5)
    await asyncio.wait_for(a._finish_besides(), timeout=5)
    assert 99 in started and not a._besides


async def test_a_report_that_fails_is_logged_and_a_late_one_given_up_when_leaving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker, "BESIDE_WAIT_S", 0.2)
    a = agent(tmp_path)
    never = asyncio.Event()
    cancelled = asyncio.Event()

    async def broken() -> None:
        raise ConnectionError("the coordinator went away")

    async def stopped() -> None:
        raise Stopped()

    async def stuck() -> None:
        try:
            await never.wait()
        finally:
            cancelled.set()

    with caplog.at_level(logging.INFO, logger=worker.__name__):
        await a._beside(broken(), "the report of check task c-1")
        await a._beside(stopped(), "the sketches of round 7")
        await a._beside(stuck(), "the report of check task c-2")
        await asyncio.wait_for(a._finish_besides(), timeout=5)
    assert cancelled.is_set() and not a._besides
    text = caplog.text
    assert "the report of check task c-1 could not be sent" in text
    assert "the coordinator went away" in text
    assert "the sketches of round 7 was not sent: the agent stops" in text
    assert "the report of check task c-2: not sent within" in text
