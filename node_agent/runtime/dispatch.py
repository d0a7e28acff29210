"""Task dispatch: what the agent does with each Task that NextTask hands out.

- TASK_KIND_BENCHMARK: fetch the job's blobs (program, initial state, shards) through the
  cache, load the exported program (epochmesh.program.archive) and benchmark its loss-and-gradients
  step on batches drawn from the shards at the task's batch sizes (the reference model when
  the task names no program), measure the network, answer with
  ReportBenchmark(task_id, result with job_id).
- TASK_KIND_TRAIN with `task.ring` (ring members of an aggregation = "ring" job):
  `node_agent.training.ring_round.run_ring_task(ctx, task, ctx.peer)` (ring all-reduce between agents;
  an agent started with --no-peer reports such a task failed). Any other TRAIN task
  (parameter-server mode, and --no-peer nodes of a ring job, which the coordinator aggregates):
  `node_agent.training.ps_round.run_train_task(ctx, task)`. Without that module the task is reported
  failed ("unsupported task").
- TASK_KIND_CHECK (verification, issue 20): `node_agent.training.check_task.run_check_task(ctx, task)`
  recomputes one chunk of another node's part and answers ReportCheck.
- Any other kind is reported failed.

A handler that raises is reported failed with the error's message (ReportProgress failed=True;
for a CHECK task ReportCheck failed=True, the answer the coordinator waits for);
an exception never ends the agent. A ProgramFault (the job's program crashed, hung, hit a limit
or computed a non-finite loss or gradient) is reported with job_fault=True: the job's fault. A cancelled task (TaskCancelled) is reported failed with
"abandoned: <reason>", so that the coordinator can hand its work to another node.

`TaskContext` is everything a handler may use. It is the contract with node_agent/training/ps_round.py:

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
    ctx.peer               node_agent.training.ring_round.PeerRuntime (PeerServer, identity, ring
                           transport), or None when the agent runs none (--no-peer)

A TRAIN handler is `async def run_train_task(ctx: TaskContext, task: Task) -> None` (a plain
function is run on the compute thread). It reports its own results (PushUpdate,
ReportProgress); raising makes the dispatcher report the task failed.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from epochmesh.optim import build_optimizer, optimizer_step
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
from node_agent.sandbox.host import (
    ChildMemoryMeter,
    ProgramFault,
    ProgramHosts,
    job_memory_budget,
)
from node_agent.training.benchmark import (
    JOB_PLAN,
    BenchmarkCancelled,
    BenchmarkPlan,
    StepFactory,
    benchmark_model,
    build_result,
)
from node_agent.training.reference_model import reference_step_factory

log = logging.getLogger(__name__)

T = TypeVar("T")

# Give up on a blob whose downloads keep hashing wrong after this many tries.
MAX_INTEGRITY_FAILURES = 3
# Without a task deadline, results are retried for this long before they are dropped.
DEFAULT_REPORT_WINDOW_S = 120.0


class TaskCancelled(Exception):
    """The task was abandoned (coordinator cancel_task, or the drain grace ran out)."""


class _TaskLog(logging.LoggerAdapter):  # type: ignore[type-arg]
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
    cancel_reason: str = ""
    failure_reported: bool = False
    # Called once a parameter-server round's update is sent, before its answer (the agent
    # starts its next NextTask poll then).
    on_pushing: Callable[[], None] | None = None
    # node_agent.training.ring_round.PeerRuntime (not imported here: it imports this module)
    peer: Any = None
    log: logging.LoggerAdapter = field(init=False)  # type: ignore[type-arg]

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

    # -- cancellation ---------------------------------------------------------------------------

    def cancel(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise TaskCancelled(self.cancel_reason or "task cancelled")

    # -- helpers --------------------------------------------------------------------------------

    async def run_compute(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, partial(fn, *args))

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


# -- dispatch -----------------------------------------------------------------------------------


async def dispatch_task(ctx: TaskContext) -> None:
    """Run one task to its end; never raises except CancelledError (and Stopped)."""
    task = ctx.task
    kind = (
        agent_pb2.TaskKind.Name(task.kind)
        if task.kind in agent_pb2.TaskKind.values()
        else task.kind
    )
    ctx.log.info("starting %s for job %s", kind, task.job_id or "-")
    start = time.monotonic()
    try:
        if task.kind == agent_pb2.TASK_KIND_BENCHMARK:
            await run_benchmark_task(ctx)
        elif task.kind == agent_pb2.TASK_KIND_TRAIN:
            await run_train_task(ctx)
        elif task.kind == agent_pb2.TASK_KIND_CHECK:
            await run_check_task(ctx)
        else:
            await ctx.report_failure(f"unsupported task kind {kind}")
            return
    except (TaskCancelled, BenchmarkCancelled):
        await ctx.report_failure(f"abandoned: {ctx.cancel_reason or 'cancelled'}")
        return
    except Stopped:
        raise
    except Expired as exc:
        await ctx.report_failure(f"deadline passed: {exc}")
        return
    except ProgramFault as exc:
        await ctx.report_failure(str(exc), job_fault=True)
        return
    except grpc.aio.AioRpcError as exc:
        await ctx.report_failure(f"coordinator call failed: {describe(exc)}")
        return
    except Exception as exc:
        ctx.log.exception("task failed")
        await ctx.report_failure(f"{type(exc).__name__}: {exc}")
        return
    ctx.log.info("done in %.2fs", time.monotonic() - start)


async def run_train_task(ctx: TaskContext) -> None:
    if ctx.task.ring.node_ids:
        from node_agent.training import ring_round as ring_trainer

        if ctx.peer is None:
            await ctx.report_failure(
                "this agent runs no PeerService (--no-peer) and cannot be a ring member"
            )
            return
        await ring_trainer.run_ring_task(ctx, ctx.task, ctx.peer)
        return
    if importlib.util.find_spec("node_agent.training.ps_round") is None:
        await ctx.report_failure("unsupported task: this agent has no trainer")
        return
    trainer = importlib.import_module("node_agent.training.ps_round")
    handler = trainer.run_train_task
    if inspect.iscoroutinefunction(handler):
        await handler(ctx, ctx.task)
    else:
        result = await ctx.run_compute(handler, ctx, ctx.task)
        if inspect.isawaitable(result):
            await result


async def run_check_task(ctx: TaskContext) -> None:
    # Imported here: check_task imports the trainer, which imports this module.
    from node_agent.training import check_task

    await check_task.run_check_task(ctx, ctx.task)


# -- benchmark tasks ----------------------------------------------------------------------------


def _refs(task: agent_pb2.Task) -> list[common_pb2.BlobRef]:
    refs = [task.program, task.initial_state, *(s.blob for s in task.shards)]
    return [r for r in refs if r.sha256]


def program_step_factory(
    task: agent_pb2.Task,
    program: Path,
    initial_state: Path,
    shards: list[Path],
    programs: ProgramHosts,
    loaded: list[Any] | None = None,
) -> StepFactory:
    """Load the job's exported program (into a confined child) and its shards; `make_step(b)`
    then computes the loss and gradients of b samples drawn (cyclically) from the shards, as a
    TRAIN round would (in a local SGD job also an optimizer step, at learning rate 0).
    `loaded` (a list) receives (program, dataset), for the trainer to keep."""
    from epochmesh.dataset import ShardedDataset

    if not shards:
        raise ValueError("the benchmark task names no shard to draw sample batches from")
    prog = programs.load(program.read_bytes(), initial_state.read_bytes())
    dataset = ShardedDataset(
        [(s.start, s.count, path) for s, path in zip(task.shards, shards, strict=True)],
        inputs=list(task.spec.inputs),
        targets=list(task.spec.targets),
    )
    available = [i for start, stop in dataset.ranges for i in range(start, stop)]
    if loaded is not None:
        loaded[:] = [prog, dataset]
    # Local SGD: a round's inner step also runs the node's optimizer; so does the benchmark's
    # step, with a learning rate of 0 (same arithmetic, parameters unchanged: the program is
    # kept for training).
    inner: torch.optim.Optimizer | None = None
    if task.spec.sync == "local_sgd":
        frozen = common_pb2.JobSpec()
        frozen.CopyFrom(task.spec)
        frozen.lr = 0.0
        inner = build_optimizer(frozen, prog.parameters())
    params = prog.parameters()
    names = prog.param_names

    def make_step(batch_size: int) -> Callable[[], None]:
        indices = [available[i % len(available)] for i in range(batch_size)]
        inputs, targets = dataset.get_batch(indices)

        def step() -> None:
            _, grads = prog.loss_and_grads(inputs, targets)
            if inner is not None:
                optimizer_step(inner, params, names, grads)

        return step

    return make_step


def job_step_factory(
    ctx: TaskContext,
    program: Path | None,
    initial_state: Path | None,
    shards: list[Path],
    loaded: list[Any] | None = None,
) -> tuple[Callable[[], StepFactory], str]:
    """How to build the job's training step on ctx.device, and a description for the logs.

    A task without a program (or initial state) benchmarks the built-in reference model.
    `loaded`: see program_step_factory.
    """
    if program is None or initial_state is None:
        return partial(reference_step_factory, ctx.device), "reference model"
    return (
        partial(
            program_step_factory, ctx.task, program, initial_state, shards, ctx.programs, loaded
        ),
        "job's program (confined)",
    )


def _keep_for_training(ctx: TaskContext, job_id: str, loaded: list[Any]) -> bool:
    """Hand the benchmark's loaded program and shards to the trainer (see
    node_agent.training.ps_round.adopt_loaded); False when it did not take them."""
    if len(loaded) != 2 or importlib.util.find_spec("node_agent.training.ps_round") is None:
        return False
    trainer = importlib.import_module("node_agent.training.ps_round")
    if trainer.adopt_loaded(ctx.programs, job_id, loaded[0], loaded[1]):
        log.debug("job %s: the benchmark's program is kept for training", job_id)
        return True
    return False


async def run_benchmark_task(ctx: TaskContext) -> None:
    task = ctx.task
    for shard in task.shards:
        if not shard.blob.sha256:
            raise ValueError(f"shard at sample {shard.start} has no blob reference")
    paths: dict[str, Path] = {}
    for ref in _refs(task):
        paths[ref.sha256] = await ctx.fetch_blob(ref)
    program = paths.get(task.program.sha256) if task.program.sha256 else None
    state = paths.get(task.initial_state.sha256) if task.initial_state.sha256 else None
    shards = [paths[s.blob.sha256] for s in task.shards]
    ctx.check_cancelled()
    loaded: list[Any] = []
    build, what = job_step_factory(ctx, program, state, shards, loaded)
    meter = ChildMemoryMeter(lambda: loaded[0]) if program is not None else None
    plan = ctx.job_benchmark.with_batch_sizes(task.benchmark_batch_sizes)
    ctx.log.info("benchmarking the %s at batch sizes %s", what, list(plan.batch_sizes))
    kept = False
    try:
        points = await ctx.run_compute(
            partial(
                benchmark_model,
                build,
                ctx.device,
                plan,
                ctx.slowdown,
                memory_limit_bytes=ctx.memory_limit_bytes,
                should_stop=ctx.cancelled.is_set,
                meter=meter,
            )
        )
        ctx.check_cancelled()
        if task.job_id:
            kept = _keep_for_training(ctx, task.job_id, loaded)
    finally:
        if loaded and not kept:
            ctx.programs.release(loaded[0])
    rtt_ms, bandwidth = await ctx.connection.measure_network()
    result = build_result(
        points,
        ctx.device_info,
        slowdown=ctx.slowdown.factor,
        memory_limit_bytes=ctx.memory_limit_bytes,
        rtt_ms=rtt_ms,
        bandwidth=bandwidth,
        job_id=task.job_id,
    )
    if program is not None and task.job_id:
        budget = job_memory_budget(points, result.max_batch_size)
        ctx.programs.limit_job_memory(task.job_id, budget, loaded[0] if kept else None)
    await ctx.call(
        "ReportBenchmark",
        lambda: agent_pb2.ReportBenchmarkRequest(
            node_id=ctx.node_id, lease_id=ctx.lease_id, task_id=task.task_id, result=result
        ),
    )
    ctx.log.info(
        "benchmark reported: %.1f samples/s, max batch %d",
        result.samples_per_second,
        result.max_batch_size,
    )
