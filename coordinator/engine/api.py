"""The seam between the control plane and the training engine.

The control plane (coordinator/app.py) serves the training RPCs by delegating to an object
implementing `TrainingEngine`. `Coordinator(config, engine_factory=...)` builds it: the factory
is called once, after the store, event log, blob store and node registry are up and before the
server starts, with a `CoordinatorContext`; `start()` is awaited right after the server starts
listening and `stop()` once the server has stopped (in-flight calls done or cancelled).

Before calling the engine, the services have already:
- checked node_id + lease_id of NextTask, PullParameters and ReportProgress (NOT_FOUND /
  FAILED_PRECONDITION otherwise); PushUpdate's header is the engine's to check
  (``context.registry.check_lease``),
- stored ReportBenchmark's result on the node (NodeInfo.benchmark) before `on_benchmark`,
- turned malformed protobuf into INVALID_ARGUMENT.
Engine methods may raise the `coordinator.store.base` domain errors (NotFoundError,
InvalidArgumentError, FailedPreconditionError, ...): they become the matching gRPC status;
any other exception becomes INTERNAL (and is logged). ``await ctx.abort(...)`` works too.
Streaming methods are plain ``def``s returning an async iterator (write them as ``async def``
generators). Long polls and streams should end when ``context.shutdown`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import grpc

from coordinator.core.errors import PermissionDeniedError, UnimplementedError
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, scheduler_pb2

if TYPE_CHECKING:
    from coordinator.core.config import CoordinatorConfig
    from coordinator.market.credit_ledger import CreditLedger
    from coordinator.nodes.registry import NodeRegistry
    from coordinator.scheduling.cluster_scheduler import JobPlan
    from coordinator.store.base import Store
    from coordinator.store.blobs import BlobStore
    from coordinator.store.events import EventLog

Ctx: TypeAlias = grpc.aio.ServicerContext


@dataclass
class CoordinatorContext:
    """What an engine gets to work with. ``shutdown`` is set when the coordinator begins to
    stop (SIGTERM): end long polls and streams then."""

    config: CoordinatorConfig
    store: Store
    blobs: BlobStore
    registry: NodeRegistry
    events: EventLog
    shutdown: asyncio.Event
    credits: CreditLedger


class SchedulerState(Protocol):
    """What the services read of the engine's cluster scheduler."""

    @property
    def weights(self) -> Mapping[str, float]:
        """Operator-set tenant weights (a tenant not listed weighs 1)."""
        ...


@runtime_checkable
class TrainingEngine(Protocol):
    # -- lifecycle and hooks ---------------------------------------------------------------------
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def check_benchmark(
        self, node_id: str, task_id: str, result: common_pb2.BenchmarkResult
    ) -> None:
        """Before a benchmark is stored or logged: a job's benchmark (``result.job_id`` set)
        must answer the benchmark task ``task_id`` the engine handed to ``node_id`` for that
        job and still awaits; else PermissionDeniedError (never asked of the node for the job)
        or FailedPreconditionError (no longer awaited). A reference benchmark always passes."""

    async def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        """A node reported a benchmark (already stored on its NodeInfo; a job's benchmark
        passed `check_benchmark`)."""

    async def on_node_offline(self, node_id: str) -> None:
        """A node's lease ended (expired, Leave, or replaced by a re-registration): reassign
        its work. Called after the OFFLINE state is stored."""

    def cancel_task(self, node_id: str, task_id: str) -> bool:
        """Heartbeat hot path (keep it cheap, no I/O): should the agent abandon ``task_id``?"""

    # -- AgentService ----------------------------------------------------------------------------
    async def next_task(self, req: agent_pb2.NextTaskRequest, ctx: Ctx) -> agent_pb2.Task: ...

    async def push_update(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: Ctx
    ) -> agent_pb2.PushUpdateResponse: ...

    def pull_parameters(
        self, req: agent_pb2.PullParametersRequest, ctx: Ctx
    ) -> AsyncIterator[agent_pb2.PullParametersResponse]: ...

    async def report_progress(
        self, req: agent_pb2.ReportProgressRequest, ctx: Ctx
    ) -> agent_pb2.ReportProgressResponse: ...

    async def commit_sketches(
        self, req: agent_pb2.CommitSketchesRequest
    ) -> agent_pb2.CommitSketchesResponse: ...

    async def report_check(self, req: agent_pb2.ReportCheckRequest) -> None: ...

    def authorize_state_transfer(self, job_id: str, source: str, requester: str) -> str | None:
        """None when `requester` was told to fetch job `job_id`'s state from node `source`
        (ring mode), else why not."""

    def may_fetch_blob(self, node_id: str, sha256: str) -> bool:
        """FetchBlob hot path (no I/O): whether the node may fetch the blob, one of a job it
        works for or has a check of (operators are not asked)."""

    # -- JobService ------------------------------------------------------------------------------
    async def submit_job(self, req: job_pb2.SubmitJobRequest, ctx: Ctx) -> common_pb2.Job: ...

    def watch_job(
        self, req: job_pb2.WatchJobRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.JobUpdate]: ...

    async def cancel_job(self, req: job_pb2.CancelJobRequest, ctx: Ctx) -> common_pb2.Job: ...

    def download_result(
        self, req: job_pb2.DownloadResultRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.DownloadResultResponse]: ...

    async def get_rounds(
        self, req: job_pb2.GetRoundsRequest, ctx: Ctx
    ) -> job_pb2.GetRoundsResponse: ...

    # -- SchedulerService ------------------------------------------------------------------------
    async def program_flops(
        self, program: common_pb2.BlobRef, initial_state: common_pb2.BlobRef
    ) -> float:
        """QuoteJob: the uploaded program's FLOPs per training sample as the coordinator's
        program check counts them (remembered per program; 0.0: not countable)."""
        ...

    async def get_allocation(
        self, req: scheduler_pb2.GetAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation: ...

    async def preview_allocation(
        self, req: scheduler_pb2.PreviewAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation: ...

    # -- the cluster scheduler (permissions are the services' to check) -----------------------
    @property
    def scheduling(self) -> SchedulerState: ...

    def queue(self) -> list[tuple[common_pb2.Job, JobPlan]]:
        """Every live job with what the scheduler gives it now, in submission order."""
        ...

    def job_rates(self, owner: str | None = None) -> dict[str, dict[str, float]]:
        """Each node's measured samples/s on the live jobs' programs: node id -> {job id:
        samples/s} (only the jobs of ``owner`` when given; None: every job)."""
        ...

    async def set_tenant_weight(self, tenant: str, weight: float) -> float:
        """Persists a tenant's weight; InvalidArgumentError unless it is a positive finite
        number (or for an empty tenant)."""
        ...

    async def set_job_priority(self, job_id: str, priority: str) -> common_pb2.Job:
        """Persists a live job's priority; InvalidArgumentError (unknown priority),
        NotFoundError, FailedPreconditionError (the job ended)."""
        ...

    # -- the market -------------------------------------------------------------------------------
    async def add_budget(self, job_id: str, amount: int) -> common_pb2.Job:
        """``amount`` micro-credits more from the job's tenant into its escrow (a job paused for
        its budget resumes); NotFoundError, FailedPreconditionError (ended, or the account
        holds too little)."""
        ...


EngineFactory = Callable[[CoordinatorContext], TrainingEngine]

NOT_AVAILABLE = "training engine not available"


@dataclass
class _NoScheduling:
    weights: dict[str, float]


class NullEngine:
    """The engine of a control plane without training: NextTask long-polls and answers
    TASK_KIND_NONE; every other training RPC is UNIMPLEMENTED."""

    def __init__(self, context: CoordinatorContext) -> None:
        self._context = context
        self.scheduling = _NoScheduling({})

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def check_benchmark(
        self, node_id: str, task_id: str, result: common_pb2.BenchmarkResult
    ) -> None:
        if result.job_id:  # no job here asks for a benchmark
            raise PermissionDeniedError(
                f"node {node_id} was asked for no benchmark of job {result.job_id}"
            )

    async def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        return None

    async def on_node_offline(self, node_id: str) -> None:
        return None

    def cancel_task(self, node_id: str, task_id: str) -> bool:
        return False

    async def next_task(self, req: agent_pb2.NextTaskRequest, ctx: Ctx) -> agent_pb2.Task:
        cap = self._context.config.max_long_poll_s
        wait_s = min(max(req.wait_ms, 0) / 1000.0, cap)
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._context.shutdown.wait(), timeout=wait_s)
        return agent_pb2.Task(kind=agent_pb2.TASK_KIND_NONE)

    async def push_update(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: Ctx
    ) -> agent_pb2.PushUpdateResponse:
        raise UnimplementedError(NOT_AVAILABLE)

    async def pull_parameters(
        self, req: agent_pb2.PullParametersRequest, ctx: Ctx
    ) -> AsyncIterator[agent_pb2.PullParametersResponse]:
        raise UnimplementedError(NOT_AVAILABLE)
        yield  # pragma: no cover  (makes this an async generator)

    async def report_progress(
        self, req: agent_pb2.ReportProgressRequest, ctx: Ctx
    ) -> agent_pb2.ReportProgressResponse:
        raise UnimplementedError(NOT_AVAILABLE)

    async def commit_sketches(
        self, req: agent_pb2.CommitSketchesRequest
    ) -> agent_pb2.CommitSketchesResponse:
        raise UnimplementedError(NOT_AVAILABLE)

    async def report_check(self, req: agent_pb2.ReportCheckRequest) -> None:
        raise UnimplementedError(NOT_AVAILABLE)

    def authorize_state_transfer(self, job_id: str, source: str, requester: str) -> str | None:
        raise UnimplementedError(NOT_AVAILABLE)

    def may_fetch_blob(self, node_id: str, sha256: str) -> bool:
        return False  # no jobs: a node has no blob to fetch

    async def submit_job(self, req: job_pb2.SubmitJobRequest, ctx: Ctx) -> common_pb2.Job:
        raise UnimplementedError(NOT_AVAILABLE)

    async def program_flops(
        self, program: common_pb2.BlobRef, initial_state: common_pb2.BlobRef
    ) -> float:
        return 0.0  # no program check without the engine

    async def watch_job(
        self, req: job_pb2.WatchJobRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.JobUpdate]:
        raise UnimplementedError(NOT_AVAILABLE)
        yield  # pragma: no cover

    async def cancel_job(self, req: job_pb2.CancelJobRequest, ctx: Ctx) -> common_pb2.Job:
        raise UnimplementedError(NOT_AVAILABLE)

    async def download_result(
        self, req: job_pb2.DownloadResultRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.DownloadResultResponse]:
        raise UnimplementedError(NOT_AVAILABLE)
        yield  # pragma: no cover

    async def get_rounds(
        self, req: job_pb2.GetRoundsRequest, ctx: Ctx
    ) -> job_pb2.GetRoundsResponse:
        raise UnimplementedError(NOT_AVAILABLE)

    async def get_allocation(
        self, req: scheduler_pb2.GetAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        raise UnimplementedError(NOT_AVAILABLE)

    async def preview_allocation(
        self, req: scheduler_pb2.PreviewAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        raise UnimplementedError(NOT_AVAILABLE)

    def queue(self) -> list[tuple[common_pb2.Job, JobPlan]]:
        raise UnimplementedError(NOT_AVAILABLE)

    def job_rates(self, owner: str | None = None) -> dict[str, dict[str, float]]:
        return {}

    async def set_tenant_weight(self, tenant: str, weight: float) -> float:
        raise UnimplementedError(NOT_AVAILABLE)

    async def set_job_priority(self, job_id: str, priority: str) -> common_pb2.Job:
        raise UnimplementedError(NOT_AVAILABLE)

    async def add_budget(self, job_id: str, amount: int) -> common_pb2.Job:
        raise UnimplementedError(NOT_AVAILABLE)
