"""The task context: what a task handler (node_agent.training) gets from the dispatcher.

It sits below the dispatcher (node_agent.runtime.dispatch), which imports the handlers; a
handler imports this module, never the dispatcher.

`TaskContext` is everything a handler may use. It is the contract with the handlers
(node_agent.training.ps_round, ring_round, check_task):

    ctx.task               the Task message being run
    ctx.connection         CoordinatorConnection: .stub (AgentServiceStub, for streaming calls
                           such as PullParameters / PushUpdate), .node_id, .lease_id
    ctx.node_id / ctx.lease_id   the session now (the lease may be renewed while a task runs:
                           read them when building each request, do not cache them)
    ctx.stub               shortcut for ctx.connection.stub
    await ctx.call(method, make_request, timeout=...)
                           unary AgentService call with retries of transient errors and lease
                           renewal, bounded by the task's deadline; make_request() is called
                           for every attempt (build it from ctx.node_id / ctx.lease_id)
    await ctx.fetch_blob(ref) -> Path
                           a verified local copy of a blob (cache, resumable download, retries)
    ctx.cache              BlobCache (DATA_DIR/cache)
    ctx.device             torch device string to train on: "cpu" or "cuda:N"
    ctx.device_info        common_pb2.Device of that device
    ctx.slowdown           SlowdownController: wrap each training step in
                           ctx.slowdown.timed_step(fn) (or call ctx.slowdown.pad(seconds))
    ctx.memory_limit_bytes emulated device memory (--memory-limit) or None
    ctx.programs           ProgramHosts: loads a job's program into a confined child process
                           (node_agent.sandbox.host); the agent never runs one itself
    ctx.cancelled          threading.Event, set when the task must be abandoned (coordinator
                           cancel_task, drain grace exceeded); ctx.check_cancelled() raises
                           TaskCancelled -- check between steps, it is safe from any thread
    await ctx.run_compute(fn, *args)
                           run blocking torch work on the agent's compute thread, so that
                           heartbeats keep flowing meanwhile
    ctx.deadline           time.monotonic() by which the task is due (None: no deadline)
    await ctx.report_progress(**fields) / await ctx.report_failure(error)
                           ReportProgress with node/lease/task ids filled in
    ctx.log                logger whose messages name the task
    ctx.peer               node_agent.ring.runtime.PeerRuntime (PeerServer, identity, ring
                           transport), or None when the agent runs none (--no-peer)
    ctx.jobs               LoadedJobs: the jobs the worker keeps loaded between rounds
                           (node_agent.training.jobs; node_agent.training.loading fills it)
    ctx.ring_jobs          RingJobs: the ring jobs' state the worker keeps between rounds and
                           serves its peers (node_agent.training.ring_jobs)
    ctx.tamper             Tamper: how the round's work is done other than as asked
                           (node_agent.training.tamper; HONEST unless the test entry point
                           installed another)
    await ctx.beside(work, what)
                           send what a finished part owes that nothing waits on (a check's
                           report, a checked part's sketches and start state) beside the
                           agent's next task instead of before it: the worker runs ``work``
                           on its own and waits for it before the agent leaves; without a
                           worker (``beside_next`` None) it is awaited here

A TRAIN handler is `async def run_train_task(ctx: TaskContext, task: Task) -> None`. It
reports its own results (PushUpdate, ReportProgress); raising makes the dispatcher report the
task failed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc

from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.core.slowdown import SlowdownController
from node_agent.link.cache import BlobCache, CacheError
from node_agent.link.connection import (
    CoordinatorConnection,
    Expired,
    Stopped,
    describe,
    is_transient,
)
from node_agent.ring.runtime import PeerRuntime
from node_agent.sandbox.host import (
    ProgramHosts,
)
from node_agent.training.benchmark import (
    JOB_PLAN,
    BenchmarkPlan,
)
from node_agent.training.jobs import LoadedJobs
from node_agent.training.ring_jobs import RingJobs
from node_agent.training.tamper import HONEST, Tamper

log = logging.getLogger(__name__)

T = TypeVar("T")


# Give up on a blob whose downloads keep hashing wrong after this many tries.
MAX_INTEGRITY_FAILURES = 3


# Without a task deadline, results are retried for this long before they are dropped.
DEFAULT_REPORT_WINDOW_S = 120.0
# The smallest time box (`TaskContext.time_box`): any positive box runs one step.
MIN_TIME_BOX_S = 1e-6


class TaskCancelled(Exception):
    """The task was abandoned (coordinator cancel_task, or the drain grace ran out)."""


class _TaskLog(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"[task {self.extra['task_id'] if self.extra else '?'}] {msg}", kwargs


@dataclass
class TaskContext:
    """What a task handler gets; see the module docstring for the contract."""

    task: agent_pb2.Task
    connection: CoordinatorConnection
    cache: BlobCache
    device: str
    device_info: common_pb2.Device
    slowdown: SlowdownController
    executor: Executor | None = None
    memory_limit_bytes: int | None = None
    programs: ProgramHosts = field(default_factory=lambda: ProgramHosts("cpu", None, None))
    job_benchmark: BenchmarkPlan = JOB_PLAN  # a BENCHMARK task's plan (its sizes from the task)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.monotonic)
    # When the agent started the task (the context is made then): later than received_at for a
    # task brought by an early poll while another task (a check) was still running.
    started_at: float = field(default_factory=time.monotonic)
    cancel_reason: str = ""
    failure_reported: bool = False
    # Called once what is left of the task does not need the coordinator to wait for this
    # node's next poll: a parameter-server round's update is sent (before its answer), a ring
    # round's all-reduce is applied (before its report), a check's inputs are in (before its
    # compute). The agent starts its next NextTask poll then; the task it brings runs once
    # this one has finished.
    poll_next: Callable[[], None] | None = None
    peer: PeerRuntime | None = None
    # The worker's, for its life (a fresh one per context by default: tests).
    jobs: LoadedJobs = field(default_factory=LoadedJobs)
    ring_jobs: RingJobs = field(default_factory=RingJobs)
    tamper: Tamper = HONEST
    # The worker's runner of work beside the next task (see `beside`); None: run it inline.
    beside_next: Callable[[Coroutine[Any, Any, None], str], Awaitable[None]] | None = None
    # The thread that computes that work (sketches, start-state encodings: `run_beside`); None:
    # `executor`. Not the compute thread: there it would wait for the next round's compute.
    beside_executor: Executor | None = None
    log: logging.LoggerAdapter[logging.Logger] = field(init=False)

    def __post_init__(self) -> None:
        self.log = _TaskLog(log, {"task_id": self.task.task_id})

    # -- session --------------------------------------------------------------------------------

    @property
    def stub(self) -> Any:
        return self.connection.stub

    @property
    def node_id(self) -> str:
        return self.connection.node_id

    @property
    def lease_id(self) -> str:
        return self.connection.lease_id

    @property
    def deadline(self) -> float | None:
        if self.task.deadline_seconds > 0:
            return self.received_at + self.task.deadline_seconds
        return None

    def time_box(self, budget_s: float) -> float:
        """The task's time box (local SGD, `Task.compute_budget_seconds`; 0: none) less the time
        the task waited on this agent for the work before it (a check it was computing when
        the task came). The box then ends when it would have had the task started on arrival:
        a node that had a check to finish trains fewer steps this round instead of making
        every node of the round wait for it. At least one step (a box of a microsecond)."""
        if budget_s <= 0:
            return 0.0
        waited = max(0.0, self.started_at - self.received_at)
        return max(budget_s - waited, MIN_TIME_BOX_S)

    # -- cancellation ---------------------------------------------------------------------------

    def cancel(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise TaskCancelled(self.cancel_reason or "task cancelled")

    # -- helpers --------------------------------------------------------------------------------

    async def beside(self, work: Coroutine[Any, Any, None], what: str) -> None:
        """Hand ``work`` (``what`` it sends, for the log) to the worker to run beside the next
        task; without a worker, run it now. ``work`` reports its own failures."""
        if self.beside_next is None:
            await work
        else:
            await self.beside_next(work, what)

    async def run_compute(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, partial(fn, *args))

    async def run_beside(self, fn: Callable[..., T], *args: Any) -> T:
        """`run_compute` for work beside the next task: ``fn`` reads only what that task does
        not change (a finished round's own copies), never the program or the job's state."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.beside_executor or self.executor, partial(fn, *args))

    async def call(
        self, method: str, make_request: Callable[[], Any], timeout: float = 10.0
    ) -> Any:
        return await self.connection.call(
            method, make_request, timeout=timeout, deadline=self._report_deadline()
        )

    def _report_deadline(self) -> float:
        # Results may still be useful a little after the deadline (the coordinator decides).
        due = self.deadline
        if due is None:
            return time.monotonic() + DEFAULT_REPORT_WINDOW_S
        return max(due + 10.0, time.monotonic() + 5.0)

    async def fetch_blob(self, ref: common_pb2.BlobRef) -> Path:
        backoff = self.connection.new_backoff()
        integrity_failures = 0
        while True:
            self.check_cancelled()
            try:
                return await self.cache.get(ref, self.connection.fetch_stream)
            except CacheError as exc:
                integrity_failures += 1
                if integrity_failures >= MAX_INTEGRITY_FAILURES:
                    raise
                self.log.warning("blob %s: %s; fetching it again", ref.sha256, exc)
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                if not is_transient(exc):
                    raise
                self.log.warning(
                    "fetching blob %s failed (%s); retrying", ref.sha256, describe(exc)
                )
            delay = backoff.next_delay()
            due = self.deadline
            if due is not None and time.monotonic() + delay > due:
                raise Expired(f"could not fetch blob {ref.sha256} before the task's deadline")
            await asyncio.sleep(delay)

    async def report_progress(self, **fields: Any) -> agent_pb2.ReportProgressResponse | None:
        def request() -> agent_pb2.ReportProgressRequest:
            return agent_pb2.ReportProgressRequest(
                node_id=self.node_id, lease_id=self.lease_id, task_id=self.task.task_id, **fields
            )

        reply = await self.call("ReportProgress", request)
        return reply if isinstance(reply, agent_pb2.ReportProgressResponse) else None

    async def report_failure(self, error: str, *, job_fault: bool = False) -> None:
        """Report the task failed (once); errors of the report itself are logged, not raised.
        `job_fault`: the failure is the job's (its program), not this node's. A CHECK task's
        failure is its ReportCheck (failed=True), which has no job_fault: the error says."""
        if self.failure_reported:
            return
        self.failure_reported = True
        self.log.warning("reporting failure%s: %s", " (the job's fault)" * job_fault, error)
        try:
            if self.task.kind == agent_pb2.TASK_KIND_CHECK:
                await self.call(
                    "ReportCheck",
                    lambda: agent_pb2.ReportCheckRequest(
                        node_id=self.node_id,
                        lease_id=self.lease_id,
                        task_id=self.task.task_id,
                        failed=True,
                        error=error[:2000],
                    ),
                )
            else:
                await self.report_progress(failed=True, error=error[:2000], job_fault=job_fault)
        except (Stopped, Expired, grpc.aio.AioRpcError) as exc:
            self.log.warning("could not report the failure: %s", describe(exc))
