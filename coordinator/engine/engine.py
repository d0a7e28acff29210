"""The training engine: jobs, task hand-out, the parameter server's RPCs.

`Engine` implements `coordinator.engine.api.TrainingEngine`. It owns one `JobRunner` per live
job (coordinator/engine/job_runner.py, with the round strategy of coordinator/engine/strategies/parameter_server.py or, for
aggregation = "ring", coordinator/engine/strategies/ring.py), a task queue per node (NextTask long
polls on it), and the node -> job claims: a node works for at most one job at a time. Which
job holds which node is the cluster scheduler's decision (coordinator/scheduling/cluster_scheduler.py):
a runner gets its nodes from `nodes_for` and only hands back the ones it stops using. The
runners see the engine as a `coordinator.engine.host.RunnerHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Collection
from functools import partial

from coordinator.accounting.credit_book import InsufficientCredits, fund_escrow, tenant_account
from coordinator.core.errors import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from coordinator.core.ids import from_another_process
from coordinator.core.principal import current_principal_id
from coordinator.engine.api import CoordinatorContext, Ctx
from coordinator.engine.cluster_scheduling import ClusterScheduling
from coordinator.engine.job_pay import settle_ended, settle_ended_jobs
from coordinator.engine.job_runner import TERMINAL, JobRunner
from coordinator.engine.strategies import STRATEGIES, ParameterServerRounds, RingRounds
from coordinator.engine.submission import SubmitChecks
from coordinator.engine.verification_store import stored_accused
from coordinator.rounds.allocator import segments, split_batch
from coordinator.scheduling.cluster_scheduler import JobPlan, Plan
from coordinator.scheduling.task_queue import TaskQueue
from epochmesh.errors import CodecError
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.money import format_credits
from epochmesh.program.inspection import InspectionLimits, ProgramInspector
from epochmesh.spec import DEFAULT_PRIORITY, PRIORITIES
from epochmesh.timeutil import now_ms
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, scheduler_pb2
from epochmesh.verification import MAX_CHUNKS
from epochmesh.wire.tensors import DTYPES, BundleAssembler, iter_chunks

log = logging.getLogger(__name__)

JS = common_pb2.JobState
# WatchJob sends an update at least this often while nothing changes (keeps ETA fresh).
WATCH_REFRESH_S = 1.0
# ... and at most this often: a job of many rounds a second changes several times per round
# (hand-out, stored record); each watcher then gets the rounds and events of a few rounds per
# update, and watching does not load the coordinator in proportion to the round rate.
WATCH_MIN_INTERVAL_S = 0.25
WATCH_EVENTS_LIMIT = 1000
# A node in a round that has not heartbeated for this many heartbeat intervals is presumed
# dead (kill -9, network cut, hang) and the round closes without it; the agent heartbeats
# every interval from its event loop, also while it computes. Its lease (3 intervals) later
# makes it OFFLINE; a false alarm only costs its part of one round (returned to pending).
SILENCE_HEARTBEATS = 1.5


KIND_CHECKPOINT = "checkpoint"
KIND_SNAPSHOT = "snapshot"


def job_codec(spec: common_pb2.JobSpec) -> str:
    """The wire codec of a job's updates (gradients or pseudo-gradients)."""
    return spec.compression or "none"


def job_blob_shas(job: common_pb2.Job) -> list[str]:
    """The blobs a job's nodes fetch: its program, initial state and shards."""
    refs = [job.program.sha256, job.initial_state.sha256, *(s.blob.sha256 for s in job.shards)]
    return [sha for sha in dict.fromkeys(refs) if sha]


def check_update_codecs(bundle: common_pb2.TensorBundle, spec: common_pb2.JobSpec) -> None:
    """CodecError unless every floating tensor of an update uses exactly the job's codec
    (non-floating tensors travel "none"; validate_header refuses lossy codecs for them)."""
    codec = job_codec(spec)
    for ts in bundle.tensors:
        dtype = DTYPES.get(ts.dtype)
        floating = dtype is not None and dtype.is_floating_point
        want = codec if floating else "none"
        if ts.codec != want:
            raise CodecError(
                f"tensor {ts.name!r} is encoded {ts.codec!r}; this job's updates use "
                f"compression {want!r}"
            )


class Engine:
    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx
        self.runners: dict[str, JobRunner] = {}
        self.queues: dict[str, TaskQueue] = {}
        self.queue_events: dict[str, asyncio.Event] = {}
        self.claims: dict[str, str] = {}  # node_id -> job_id
        # Which job may claim which node: the cluster scheduler (its state between passes).
        self.scheduling = ClusterScheduling(ctx.store, ctx.config.scheduler_hold_s)
        # node -> (the job that let it go, {job the scheduler moved that job's nodes to: why})
        self._left_by: dict[str, tuple[str, dict[str, str]]] = {}
        self._scheduler_events: list[tuple[str, str, str, str]] = []
        self.task_owner: dict[str, tuple[str, str]] = {}  # task_id -> (node_id, job_id)
        # job_id -> the blobs its nodes may fetch (may_fetch_blob; a job's refs never change).
        self._blob_shas: dict[str, frozenset[str]] = {}
        # Heartbeat times loaded from the store after a restart are old: nobody is judged
        # silent for a gap that began before this engine started.
        self.started_ms = now_ms()
        config = ctx.config
        # Submitted programs are checked and loaded in confined child processes.
        self.program_inspector = ProgramInspector(
            InspectionLimits(
                timeout_s=config.program_check_timeout_s,
                memory_base_bytes=config.program_check_memory_bytes,
            ),
            concurrency=config.program_check_concurrency,
            spare=config.program_check_spare,
        )
        self.submit_checks = SubmitChecks(ctx, self.program_inspector)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.scheduling.load()
        await settle_ended_jobs(self.ctx, partial(stored_accused, self.ctx.store))
        live = (JS.JOB_STATE_QUEUED, JS.JOB_STATE_RUNNING, JS.JOB_STATE_PAUSED)
        jobs = await self.ctx.store.list_jobs(states=live)
        for job in sorted(jobs, key=lambda j: j.created_ms):
            self._start_runner(job)

    async def stop(self) -> None:
        runners = list(self.runners.values())
        self.runners.clear()
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        await self.program_inspector.close()

    def _start_runner(self, job: common_pb2.Job) -> JobRunner:
        aggregation = STRATEGIES.get(job.spec.aggregation, ParameterServerRounds)
        runner = JobRunner(self, job, aggregation)
        self.runners[job.job_id] = runner
        self.scheduling.invalidate()
        runner.start()
        return runner

    def _wake_all(self) -> None:
        for r in self.runners.values():
            r.wake()

    # -- nodes ----------------------------------------------------------------------------------

    def reference_rate(self, node_id: str) -> float:
        info = self.ctx.registry.get(node_id)
        return info.benchmark.samples_per_second if info is not None else 0.0

    def silence_limit_s(self) -> float:
        """How long a leased node may go without a heartbeat before it is presumed dead for
        the round in progress (its lease, 3 intervals by default, decides when it is OFFLINE)."""
        return SILENCE_HEARTBEATS * self.ctx.registry.heartbeat_interval_s

    def silent_until_ms(self, node_id: str) -> int | None:
        """Wall-clock ms at which ``node_id`` counts as silent (already past: it is); None
        for a node that is unknown or OFFLINE."""
        info = self.ctx.registry.get(node_id)
        if info is None or info.state == common_pb2.NODE_STATE_OFFLINE:
            return None
        heard = max(info.last_heartbeat_ms, self.started_ms)
        return heard + int(self.silence_limit_s() * 1000)

    def is_silent(self, node_id: str) -> bool:
        until = self.silent_until_ms(node_id)
        return until is None or now_ms() > until

    def scheduling_plan(self) -> Plan:
        """A pass of the cluster scheduler over the live jobs, the eligible nodes and who
        holds them now (coordinator/scheduling/cluster_scheduler.py)."""
        return self.scheduling.plan(
            now_ms(), self.runners.values(), self.ctx.registry.eligible_nodes(), self.claims
        )

    async def nodes_for(self, job_id: str, refused: Collection[str] = ()) -> list[str]:
        """The nodes the scheduler gives the job that no other job holds now, held by the job
        from now on (a node the scheduler takes from another job becomes the job's once that
        job let it go at its round boundary); ``refused``: nodes the job will not use (it
        excluded them), neither held nor returned. Says in events which nodes it takes from
        the job, and which changed hands."""
        plan = self.scheduling_plan()
        await self._flush_scheduler_events()
        preempted = self.scheduling.preemption(job_id, self.claims)
        if preempted is not None:
            await self.ctx.events.append(
                "job.preempted",
                job_id=job_id,
                message=(
                    f"{len(preempted.nodes)} node(s) leave at this round boundary: "
                    f"{preempted.reason}"
                ),
                attrs={"nodes": ",".join(preempted.nodes)},
            )
        live = [r.job_id for r in self.runners.values() if not r.terminal]
        await self.scheduling.save_if_due(now_ms(), live)
        mine = plan.jobs.get(job_id)
        if mine is None:
            return []
        planned = [
            n for n in mine.nodes if n not in refused and self.claims.get(n) in (None, job_id)
        ]
        given = []
        for n in planned:
            if self.claims.get(n) not in (None, job_id):
                continue  # claimed by another job while this loop awaited
            if self.claims.get(n) != job_id:
                try:  # the node may have gone offline (or been quarantined) since the pass
                    await self.ctx.registry.set_busy(n, job_id)
                except FailedPreconditionError as exc:
                    log.info("job %s: skipping node %s: %s", job_id, n, exc)
                    continue
                self._claim(n, job_id)
            given.append(n)
        await self._flush_scheduler_events()
        return given

    async def _flush_scheduler_events(self) -> None:
        events, self._scheduler_events = self._scheduler_events, []
        for node_id, before, after, reason in events:
            await self.ctx.events.append(
                "node.reassigned",
                node_id=node_id,
                job_id=after,
                message=f"node {node_id} moves from job {before} to job {after}: {reason}",
                attrs={"from_job": before, "to_job": after},
            )

    def planned_nodes(self, job_id: str) -> list[str]:
        mine = self.scheduling_plan().jobs.get(job_id)
        return list(mine.nodes) if mine is not None else []

    def _claim(self, node_id: str, job_id: str) -> None:
        self.scheduling.claimed(node_id, now_ms())
        left = self._left_by.pop(node_id, None)
        if left is not None and job_id in left[1]:
            self._scheduler_events.append((node_id, left[0], job_id, left[1][job_id]))
        self.claims[node_id] = job_id

    def wait_reason(self, job_id: str) -> str:
        """Why the scheduler's last pass gave the job no node ("" if it gave it some)."""
        plan = self.scheduling.last_plan
        mine = plan.jobs.get(job_id) if plan is not None else None
        return mine.reason if mine is not None and mine.waiting else ""

    async def set_tenant_weight(self, tenant: str, weight: float) -> float:
        try:
            weight = await self.scheduling.set_weight(tenant, weight)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from e
        await self.ctx.events.append(
            "tenant.weight", message=f"tenant {tenant} weighs {weight:g}", attrs={"tenant": tenant}
        )
        self._wake_all()
        return weight

    async def set_job_priority(self, job_id: str, priority: str) -> common_pb2.Job:
        """Change a live job's priority tier (persisted with its spec)."""
        if priority not in PRIORITIES:
            raise InvalidArgumentError(
                f"unknown priority {priority!r}: use one of {', '.join(PRIORITIES)}"
            )
        job = await self._job(job_id)
        if job.state in TERMINAL:
            name = JS.Name(job.state).removeprefix("JOB_STATE_")
            raise FailedPreconditionError(f"job {job_id} already ended ({name})")
        runner = self.runners.get(job_id)
        target = runner.job if runner is not None else job
        before = target.spec.priority or DEFAULT_PRIORITY
        target.spec.priority = priority  # the runner's spec is its job's
        self.scheduling.invalidate()
        await self.ctx.store.update_job(target)
        if before != priority:
            await self.ctx.events.append(
                "job.priority",
                job_id=job_id,
                message=f"priority {before} -> {priority}",
                attrs={"from": before, "to": priority},
            )
        self._wake_all()
        return target

    def queue(self) -> list[tuple[common_pb2.Job, JobPlan]]:
        """Every live job with what the scheduler gives it now, in submission order."""
        plan = self.scheduling_plan()
        out = []
        for r in sorted(self.runners.values(), key=lambda r: (r.job.created_ms, r.job_id)):
            p = plan.jobs.get(r.job_id)
            if p is not None:
                out.append((r.job, p))
        return out

    def job_rates(self, owner: str | None = None) -> dict[str, dict[str, float]]:
        """Node id -> {job id: samples/s} over the live jobs (of ``owner`` only, if given): a
        member's throughput estimate, else (benchmarked, not or no longer training) its job
        benchmark's rate."""
        rates: dict[str, dict[str, float]] = {}
        for runner in self.runners.values():
            if runner.terminal or (owner is not None and runner.job.owner != owner):
                continue
            estimator = runner.planner.estimator
            found = estimator.rates([n for n in runner.nodes if n in estimator])
            for node_id, result in runner.bench.items():
                found.setdefault(node_id, result.samples_per_second)
            for node_id, rate in found.items():
                if rate > 0 and math.isfinite(rate):
                    rates.setdefault(node_id, {})[runner.job_id] = rate
        return rates

    async def release(self, node_id: str, job_id: str) -> None:
        """The job stops using the node: it is free (idle) for the next scheduling pass."""
        if self.claims.get(node_id) != job_id:
            return
        del self.claims[node_id]
        self.scheduling.released(node_id)
        moves = self.scheduling.moves_from(node_id, job_id)
        if moves:  # the scheduler gives the job's nodes to others: say so once one claims it
            self._left_by[node_id] = (job_id, moves)
        self.queues.pop(node_id, None)
        self._wake_all()
        if self.ctx.registry.is_alive(node_id):
            await self.ctx.registry.set_busy(node_id, None)

    def enqueue(self, node_id: str, task: agent_pb2.Task, job_id: str) -> None:
        """Queue a task for the node: round tasks before checks before the rest, none passed
        by more than one later task (`TaskQueue`)."""
        self.task_owner[task.task_id] = (node_id, job_id)
        self.queues.setdefault(node_id, TaskQueue()).push(task, job_id)
        self.queue_events.setdefault(node_id, asyncio.Event()).set()

    def round_finished(self, job_id: str, open_tasks: Collection[str]) -> None:
        """Forget the task ids of the job's closed rounds (bounded memory), all but
        ``open_tasks`` (its benchmark tasks stay until they are answered)."""
        for task_id, (_, owner) in list(self.task_owner.items()):
            if owner == job_id and task_id not in open_tasks:
                del self.task_owner[task_id]

    def check_benchmark(
        self, node_id: str, task_id: str, result: common_pb2.BenchmarkResult
    ) -> None:
        """A job's benchmark is taken only as the answer to the benchmark task the job's runner
        handed to the node and still awaits (see TrainingEngine.check_benchmark)."""
        job_id = result.job_id
        if not job_id:
            return
        runner = self.runners.get(job_id)
        if self.task_owner.get(task_id) != (node_id, job_id) or runner is None:
            raise PermissionDeniedError(
                f"node {node_id} was asked for no benchmark of job {job_id}"
                + (f" (task {task_id!r})" if task_id else " (no task_id given)")
            )
        if runner.terminal or not runner.node_set.is_benchmark_task(node_id, task_id):
            raise FailedPreconditionError(
                f"job {job_id} no longer awaits benchmark task {task_id} of node {node_id}"
            )

    async def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        self.scheduling.invalidate()  # a node's speed (for a job, or its reference)
        if result.job_id:
            runner = self.runners.get(result.job_id)
            if runner is not None:
                runner.on_benchmark(node_id, result)
        else:
            self._wake_all()

    async def on_node_offline(self, node_id: str) -> None:
        self.queues.pop(node_id, None)
        self.claims.pop(node_id, None)
        self.scheduling.released(node_id)
        self._left_by.pop(node_id, None)
        # Every runner hears it, not only the claimant: a runner may have released the node
        # already (its lease lapsed a moment before the sweeper said so) and must still forget
        # its benchmark, so that the node is benchmarked again when it comes back.
        for runner in self.runners.values():
            runner.on_node_offline(node_id)
        self._wake_all()

    def cancel_task(self, node_id: str, task_id: str) -> bool:
        """Whether the node should abandon the task it runs (told in its heartbeat's answer)."""
        owner = self.task_owner.get(task_id)
        if owner is None:
            # Handed out by another coordinator process (before a restart or a takeover):
            # nothing waits for it, and a ring member stuck in it would hold its next ring for
            # its whole join timeout. Unknown but ours (a check or part of a closed round, whose
            # ids are forgotten): let it report; a late answer is refused or still counted.
            return from_another_process(task_id)
        runner = self.runners.get(owner[1])
        return runner is None or runner.terminal or not runner.task_is_live(node_id, task_id)

    # -- AgentService ---------------------------------------------------------------------------

    async def next_task(self, req: agent_pb2.NextTaskRequest, ctx: Ctx) -> agent_pb2.Task:
        node_id = req.node_id
        wait_s = min(max(req.wait_ms, 0) / 1000.0, self.ctx.config.max_long_poll_s)
        self._wake_all()  # a polling node may be what a paused job waits for
        event = self.queue_events.setdefault(node_id, asyncio.Event())
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            queue = self.queues.get(node_id)
            while queue:
                task, job_id = queue.pop()
                runner = self.runners.get(job_id)
                if runner is None or runner.terminal:
                    continue
                if not runner.task_is_live(node_id, task.task_id):
                    continue
                runner.part_seen(node_id, task.task_id, "delivered")
                return task
            event.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or self.ctx.shutdown.is_set():
                return agent_pb2.Task(kind=agent_pb2.TASK_KIND_NONE)
            waiter = asyncio.ensure_future(event.wait())
            stopper = asyncio.ensure_future(self.ctx.shutdown.wait())
            try:
                await asyncio.wait({waiter, stopper}, timeout=left, return_when="FIRST_COMPLETED")
            finally:
                waiter.cancel()
                stopper.cancel()

    def _runner_for_task(self, node_id: str, task_id: str, job_id: str) -> JobRunner:
        owner = self.task_owner.get(task_id)
        if owner is None or owner[0] != node_id or (job_id and owner[1] != job_id):
            raise FailedPreconditionError(
                f"task {task_id!r} is not an open task of node {node_id} (finished, expired, "
                "or from before a coordinator restart)"
            )
        runner = self.runners.get(owner[1])
        if runner is None:
            raise FailedPreconditionError(f"job {owner[1]} is no longer running")
        return runner

    async def push_update(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: Ctx
    ) -> agent_pb2.PushUpdateResponse:
        first = None
        async for msg in request_iterator:
            first = msg
            break
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgumentError("PushUpdate must start with a header message")
        h = first.header
        arrived = time.monotonic()
        self.ctx.registry.check_lease(h.node_id, h.lease_id)
        if h.kind == KIND_SNAPSHOT:  # after the update: its TRAIN task may be closed by now
            return await self._push_snapshot(h, request_iterator)
        late_runner = self.runners.get(h.job_id)
        if late_runner is not None and late_runner.planner.note_late_update(
            h.node_id, h.task_id, h.num_samples, h.compute_seconds
        ):
            return agent_pb2.PushUpdateResponse(
                accepted=False,
                reason="the round closed before this update arrived; its speed was noted",
            )
        runner = self._runner_for_task(h.node_id, h.task_id, h.job_id)
        info = self.ctx.registry.get(h.node_id)
        if info is not None and info.state == common_pb2.NODE_STATE_QUARANTINED:
            runner.fail_part(h.node_id, h.task_id, "the node is quarantined")
            raise FailedPreconditionError(
                f"node {h.node_id} is quarantined: its updates are refused"
            )
        if h.kind == KIND_CHECKPOINT:
            return await self._push_checkpoint(runner, h, request_iterator)
        expected_samples = runner.rounds.expected_samples(h.node_id, h.task_id)
        if expected_samples is None or not runner.task_is_live(h.node_id, h.task_id):
            return agent_pb2.PushUpdateResponse(
                accepted=False, reason="the round is closed (the update came after its deadline)"
            )
        problem = ""
        want_kind = "pseudo_gradient" if runner.spec.sync == "local_sgd" else "gradient"
        if h.kind not in (want_kind, "" if want_kind == "gradient" else want_kind):
            problem = f"update kind {h.kind!r}; this job expects {want_kind!r} updates"
        elif h.num_samples != expected_samples and (
            reason := runner.samples_problem(h.node_id, h.task_id, h.num_samples)
        ):
            problem = reason
        elif not math.isfinite(h.mean_loss):
            problem = f"mean_loss is {h.mean_loss}"
        elif not math.isfinite(h.compute_seconds) or h.compute_seconds < 0:
            problem = f"compute_seconds is {h.compute_seconds}"
        elif len(h.chunks) > MAX_CHUNKS:
            problem = f"{len(h.chunks)} chunk commitments (at most {MAX_CHUNKS})"
        elif commitment := runner.verifier.commitment_problem(
            h, runner.round_state.parts.get(h.node_id) if runner.round_state else None
        ):
            problem = f"chunk commitments: {commitment}"
        if problem:
            runner.reject(h.node_id, h.task_id, problem)
            raise InvalidArgumentError(f"update refused: {problem}")
        try:
            check_update_codecs(h.bundle, runner.spec)
            assembler = BundleAssembler(h.bundle, expected=runner.ps.expected())
            async for msg in request_iterator:
                if msg.WhichOneof("part") != "chunk":
                    raise CodecError("only chunks may follow the header")
                assembler.add(msg.chunk)
        except CodecError as exc:
            runner.reject(h.node_id, h.task_id, str(exc))
            raise InvalidArgumentError(f"update refused: {exc}") from None
        if not assembler.complete:
            # The stream ended early: the sender died or was cut off mid-update. Its part
            # fails (its slice returns to pending) but this is no bad input: no strike.
            error = f"update stream ended after {assembler.received} of {assembler.total} bytes"
            runner.fail_part(h.node_id, h.task_id, error)
            raise AbortedError(error)
        try:
            grads = assembler.finish()
        except CodecError as exc:
            runner.reject(h.node_id, h.task_id, str(exc))
            raise InvalidArgumentError(f"update refused: {exc}") from None
        part = runner.round_state.parts.get(h.node_id) if runner.round_state else None
        reason = runner.submit_update(
            h.node_id, h.task_id, h.num_samples, h.mean_loss, h.compute_seconds, grads, arrived
        )
        response = agent_pb2.PushUpdateResponse(accepted=not reason, reason=reason)
        if not reason:
            check = await runner.verifier.on_update(h, grads, part)
            if check is not None:
                response.sketch.CopyFrom(check)
        return response

    async def commit_sketches(
        self, req: agent_pb2.CommitSketchesRequest
    ) -> agent_pb2.CommitSketchesResponse:
        """A node's sketches of its chunks (coordinator/engine/verifier.py)."""
        runner = self.runners.get(req.job_id)
        if runner is None:
            raise FailedPreconditionError(f"job {req.job_id!r} is not running")
        return await runner.verifier.on_sketches(req)

    async def report_check(self, req: agent_pb2.ReportCheckRequest) -> None:
        """A checker's recomputation (coordinator/engine/verifier.py)."""
        owner = self.task_owner.get(req.task_id)
        runner = self.runners.get(owner[1]) if owner is not None else None
        if owner is None or owner[0] != req.node_id or runner is None:
            raise FailedPreconditionError(
                f"task {req.task_id!r} is not an open check of node {req.node_id}"
            )
        await runner.verifier.on_check_report(req)

    async def _push_snapshot(
        self,
        h: agent_pb2.UpdateHeader,
        request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest],
    ) -> agent_pb2.PushUpdateResponse:
        """A local SGD node's start state of its chunk drawn for a check (coordinator/
        verifier.py)."""
        runner = self.runners.get(h.job_id)
        if runner is None:
            raise FailedPreconditionError(f"job {h.job_id!r} is not running")
        try:
            assembler = await _receive_state(h, request_iterator, "a start state")
            data = bytes(assembler.payload())
            tensors = await asyncio.to_thread(assembler.finish)
        except CodecError as exc:
            raise InvalidArgumentError(f"start state refused: {exc}") from None
        await runner.verifier.on_snapshot(h, tensors, (h.bundle, data))
        return agent_pb2.PushUpdateResponse(accepted=True)

    async def _push_checkpoint(
        self,
        runner: JobRunner,
        h: agent_pb2.UpdateHeader,
        request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest],
    ) -> agent_pb2.PushUpdateResponse:
        """A ring member's state after a round (parameters and optimizer state), asked for
        with Task.push_state: the coordinator checkpoints it and serves it to joiners."""
        if not runner.rounds.wants_checkpoint(h.node_id, h.task_id):
            return agent_pb2.PushUpdateResponse(
                accepted=False, reason="no checkpoint of this task is expected (any more)"
            )
        try:
            assembler = await _receive_state(h, request_iterator, "a checkpoint")
            tensors = await asyncio.to_thread(assembler.finish)
            reason = await runner.rounds.submit_checkpoint(h, tensors)
        except CodecError as exc:
            raise InvalidArgumentError(f"checkpoint refused: {exc}") from None
        return agent_pb2.PushUpdateResponse(accepted=not reason, reason=reason)

    async def pull_parameters(
        self, req: agent_pb2.PullParametersRequest, ctx: Ctx
    ) -> AsyncIterator[agent_pb2.PullParametersResponse]:
        runner = self.runners.get(req.job_id)
        if runner is None:
            raise NotFoundError(f"no running job {req.job_id!r}")
        if self.claims.get(req.node_id) != req.job_id and not runner.verifier.checks_on(
            req.node_id
        ):
            raise FailedPreconditionError(f"node {req.node_id} does not work for {req.job_id}")
        version, header, data = await runner.rounds.parameters_payload(req)
        yield agent_pb2.PullParametersResponse(
            header=agent_pb2.ParametersHeader(job_id=req.job_id, version=version, bundle=header)
        )
        for chunk in iter_chunks(data):
            yield agent_pb2.PullParametersResponse(chunk=chunk)
        if version == runner.rounds.version:
            runner.part_seen(req.node_id, "", "pulled")

    def may_fetch_blob(self, node_id: str, sha256: str) -> bool:
        """Whether the node may fetch the blob: one of a job that holds the node, or whose
        check the node has to run (the rule of pull_parameters)."""
        claimed = self.claims.get(node_id)
        for job_id, runner in self.runners.items():
            if job_id != claimed and not runner.verifier.checks_on(node_id):
                continue
            shas = self._blob_shas.get(job_id)
            if shas is None:
                if len(self._blob_shas) > 2 * len(self.runners) + 16:
                    self._blob_shas = {
                        j: b for j, b in self._blob_shas.items() if j in self.runners
                    }
                shas = self._blob_shas[job_id] = frozenset(job_blob_shas(runner.job))
            if sha256 in shas:
                return True
        return False

    def authorize_state_transfer(self, job_id: str, source: str, requester: str) -> str | None:
        runner = self.runners.get(job_id)
        if runner is None:
            return f"job {job_id!r} is not running"
        return runner.rounds.authorize_state_transfer(source, requester)

    async def report_progress(
        self, req: agent_pb2.ReportProgressRequest, ctx: Ctx
    ) -> agent_pb2.ReportProgressResponse:
        owner = self.task_owner.get(req.task_id)
        if owner is None or owner[0] != req.node_id:
            return agent_pb2.ReportProgressResponse()  # a stale task: nothing to do
        runner = self.runners.get(owner[1])
        response = agent_pb2.ReportProgressResponse()
        if runner is None:
            return response
        if req.failed:
            log.info("node %s reports task %s failed: %s", req.node_id, req.task_id, req.error)
        rs = runner.round_state
        part = rs.parts.get(req.node_id) if rs is not None else None
        live = part is not None and part.task_id == req.task_id and part.member
        if live and not req.failed and len(req.chunks) > MAX_CHUNKS:
            problem = f"{len(req.chunks)} chunk commitments (at most {MAX_CHUNKS})"
        elif live and part is not None and not req.failed:
            problem = runner.verifier.ring_commitment_problem(req, part)
        else:
            problem = ""
        if problem:
            # Verification (coordinator/engine/verifier.py): the member's report is refused as a
            # parameter server refuses an update whose commitments do not fit it.
            runner.reject(req.node_id, req.task_id, f"chunk commitments: {problem}")
            why = f"report refused: chunk commitments: {problem}"
            await self.ctx.registry.add_strike(req.node_id, why, job_id=runner.job_id)
            raise InvalidArgumentError(why)
        was = part.status if part is not None else ""
        attempt = runner.rounds.attempt if isinstance(runner.rounds, RingRounds) else None
        runner.rounds.on_report(req)
        if live and part is not None and rs is not None and attempt is not None:
            if was == "pending" and part.status == "reported":
                check, audit = runner.verifier.on_ring_report(req, part, rs, attempt)
                if check is not None:
                    response.sketch.CopyFrom(check)
                if audit is not None:
                    response.ring_audit.CopyFrom(audit)
        return response

    # -- JobService -----------------------------------------------------------------------------

    async def submit_job(self, req: job_pb2.SubmitJobRequest, ctx: Ctx) -> common_pb2.Job:
        owner, checks = (
            current_principal_id(),
            self.submit_checks,
        )  # coordinator/engine/submission.py
        with checks.gate.admit(owner):
            num_samples = await checks.validate(req)
            how = "checked" if await checks.check_program(req, owner) else "cached"
            spec = req.spec
            job = common_pb2.Job(
                name=spec.name,
                state=JS.JOB_STATE_QUEUED,
                spec=spec,
                program=req.program,
                initial_state=req.initial_state,
                shards=req.shards,
                num_samples=num_samples,
                samples_total=num_samples * spec.epochs,
                last_loss=float("nan"),
                message="waiting for nodes",
            )
            async with checks.live_jobs.hold(owner):
                job = await self._create_with_escrow(job)
        await self.ctx.events.append(
            "job.submitted",
            job_id=job.job_id,
            message=(
                f"job {spec.name!r} submitted: {num_samples} samples, {spec.epochs} epochs, "
                f"global batch {spec.global_batch}"
            ),
            attrs={"program_check": how},
        )
        self._start_runner(job)
        return job

    async def program_flops(
        self, program: common_pb2.BlobRef, initial_state: common_pb2.BlobRef
    ) -> float:
        owner = current_principal_id()
        return await self.submit_checks.program_flops(program, initial_state, owner)

    async def _create_with_escrow(self, job: common_pb2.Job) -> common_pb2.Job:
        """Store the job and move its budget from its tenant's account into its escrow, in one
        transaction: refused (nothing stored) when the account holds too little."""
        budget = job.spec.budget_micro
        try:
            async with self.ctx.store.transaction():
                job = await self.ctx.store.create_job(job, owner=current_principal_id())
                await self.ctx.store.add_job_blobs(job.job_id, job_blob_shas(job))
                if budget > 0:
                    entry = fund_escrow(job.job_id, job.owner, budget, now_ms(), "budget")
                    await self.ctx.credits.post([entry])
        except InsufficientCredits as exc:
            raise FailedPreconditionError(
                f"the budget of {format_credits(budget)} credits is more than your account "
                f"{tenant_account(job.owner)} holds ({format_credits(exc.balance)}): lower "
                "[market] budget, or ask an operator for credits (epochmesh credits grant)"
            ) from None
        except BaseException:
            await self.ctx.credits.reload()  # the posting may be in the book, not the store
            raise
        return job

    async def add_budget(self, job_id: str, amount: int) -> common_pb2.Job:
        """``amount`` more from the job's tenant into its escrow; a job paused for its budget
        resumes. FailedPreconditionError for an ended job or a short account."""
        job = await self._job(job_id)
        if job.state in TERMINAL:
            name = JS.Name(job.state).removeprefix("JOB_STATE_").lower()
            raise FailedPreconditionError(f"job {job_id} already ended ({name}): nothing to fund")
        runner = self.runners.get(job_id)
        if runner is None:
            raise FailedPreconditionError(f"job {job_id} is not running on this coordinator")
        try:
            await runner.add_budget(amount)
        except InsufficientCredits as exc:
            raise FailedPreconditionError(
                f"your account {tenant_account(job.owner)} holds {format_credits(exc.balance)} "
                f"credits, less than {format_credits(amount)}"
            ) from None
        self.scheduling.invalidate()
        self._wake_all()
        return runner.job

    def _runner(self, job_id: str) -> JobRunner | None:
        return self.runners.get(job_id)

    async def _job(self, job_id: str) -> common_pb2.Job:
        runner = self.runners.get(job_id)
        if runner is not None:
            return runner.job
        job = await self.ctx.store.get_job(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}")
        return job

    async def watch_job(
        self, req: job_pb2.WatchJobRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.JobUpdate]:
        job = await self._job(req.job_id)
        since_round = req.since_round
        since_event = 0
        loop = asyncio.get_running_loop()
        while True:
            runner = self.runners.get(req.job_id)
            # Read before the events: a runner's job turns terminal before its last events are
            # stored (the state's, the nodes' release); the stream ends with an update after.
            ended = runner is None or runner.ended
            job = runner.job if runner is not None else await self._job(req.job_id)
            update = job_pb2.JobUpdate()
            update.job.CopyFrom(job)
            if runner is not None:
                update.allocation.CopyFrom(runner.allocation())
            # The store is read only when it holds something new for this watcher (a running
            # job knows its newest stored round; the event log its newest committed event).
            stored = runner.writer.stored_round if runner is not None else None
            if stored is None or stored > since_round:
                rounds = await self.ctx.store.list_rounds(req.job_id, since_round=since_round)
                update.rounds.extend(rounds)
                if rounds:
                    since_round = rounds[-1].round
            last_event = self.ctx.events.last_id
            if last_event > since_event:
                events = await self.ctx.store.list_events(
                    since_event, job_id=req.job_id, limit=WATCH_EVENTS_LIMIT
                )
                update.events.extend(events)
                if len(events) < WATCH_EVENTS_LIMIT:
                    since_event = last_event  # none of this job's events left up to there
                else:
                    since_event = events[-1].id
            yield update
            sent = loop.time()
            if self.ctx.shutdown.is_set() or (job.state in TERMINAL and ended):
                return
            if runner is None:
                await asyncio.sleep(WATCH_REFRESH_S)
                continue
            async with runner.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runner.changed.wait(), timeout=WATCH_REFRESH_S)
            pause = sent + WATCH_MIN_INTERVAL_S - loop.time()
            if pause > 0 and not runner.terminal:
                await asyncio.sleep(pause)

    async def cancel_job(self, req: job_pb2.CancelJobRequest, ctx: Ctx) -> common_pb2.Job:
        job = await self._job(req.job_id)
        if job.state in TERMINAL:
            name = JS.Name(job.state).removeprefix("JOB_STATE_")
            raise FailedPreconditionError(f"job {req.job_id} already ended ({name})")
        runner = self.runners.get(req.job_id)
        if runner is not None:
            await runner.cancel()
            return runner.job
        job.state, job.updated_ms = JS.JOB_STATE_CANCELLED, now_ms()
        # The record and its money in one transaction.
        await settle_ended(self.ctx, job, await stored_accused(self.ctx.store, job.job_id))
        return job

    async def download_result(
        self, req: job_pb2.DownloadResultRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.DownloadResultResponse]:
        job = await self._job(req.job_id)
        if job.state != JS.JOB_STATE_SUCCEEDED or not job.result.sha256:
            name = JS.Name(job.state).removeprefix("JOB_STATE_")
            raise FailedPreconditionError(
                f"job {req.job_id} is {name}: its model can be downloaded once it has SUCCEEDED"
            )
        size = job.result.size
        if req.offset < 0 or req.offset > size:
            raise InvalidArgumentError(f"offset {req.offset} is outside the result (0..{size})")
        with await self.ctx.blobs.open(job.result.sha256) as f:
            f.seek(req.offset)
            offset = req.offset
            while True:
                data = f.read(MAX_CHUNK_BYTES)
                if not data:
                    break
                yield job_pb2.DownloadResultResponse(
                    total_size=size,
                    sha256=job.result.sha256,
                    chunk=common_pb2.DataChunk(offset=offset, data=data),
                )
                offset += len(data)
        if offset == req.offset:  # an empty tail still tells the size and hash
            yield job_pb2.DownloadResultResponse(total_size=size, sha256=job.result.sha256)

    async def get_rounds(
        self, req: job_pb2.GetRoundsRequest, ctx: Ctx
    ) -> job_pb2.GetRoundsResponse:
        await self._job(req.job_id)
        rounds = await self.ctx.store.list_rounds(
            req.job_id,
            since_round=req.since_round,
            limit=max(0, req.limit),
            include_rolled_back=req.include_rolled_back,
        )
        return job_pb2.GetRoundsResponse(rounds=rounds)

    # -- SchedulerService -----------------------------------------------------------------------

    async def get_allocation(
        self, req: scheduler_pb2.GetAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        job = await self._job(req.job_id)
        runner = self.runners.get(req.job_id)
        if runner is None:
            return common_pb2.Allocation(job_id=job.job_id, epoch=job.epoch, round=job.round)
        return runner.allocation()

    async def preview_allocation(
        self, req: scheduler_pb2.PreviewAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        if req.global_batch <= 0:
            raise InvalidArgumentError("global_batch must be > 0")
        if req.num_samples < 0:
            raise InvalidArgumentError("num_samples must be >= 0")
        if req.node_ids:
            infos = [self.ctx.registry.find(n) for n in req.node_ids]
        else:
            infos = self.ctx.registry.eligible_nodes()
        rated = [i for i in infos if i.benchmark.samples_per_second > 0]
        if not rated:
            raise FailedPreconditionError("no benchmarked node to allocate to")
        rates = {i.node_id: i.benchmark.samples_per_second for i in rated}
        caps = {i.node_id: (i.benchmark.max_batch_size or req.global_batch) for i in rated}
        try:
            batches = split_batch(req.global_batch, rates, caps)
        except ValueError as exc:
            raise FailedPreconditionError(str(exc)) from None
        segs = segments(req.num_samples, rates) if req.num_samples else {}
        out = common_pb2.Allocation()
        for i in rated:
            na = common_pb2.NodeAllocation(
                node_id=i.node_id,
                name=i.name,
                samples_per_second=rates[i.node_id],
                share=batches[i.node_id] / req.global_batch,
                local_batch=batches[i.node_id],
                max_batch=caps[i.node_id],
                rtt_ms=i.benchmark.rtt_ms,
                bandwidth_bytes_per_second=i.benchmark.bandwidth_bytes_per_second,
            )
            if i.node_id in segs:
                na.segment.start, na.segment.stop = segs[i.node_id]
                na.remaining = segs[i.node_id][1] - segs[i.node_id][0]
            out.nodes.append(na)
        return out


async def _receive_state(
    h: agent_pb2.UpdateHeader,
    request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest],
    what: str,
) -> BundleAssembler:
    """The rest of a PushUpdate stream that carries ``what`` (a whole state, uncompressed):
    CodecError for a compressed tensor or a message other than a chunk, AbortedError when the
    stream ends early."""
    for ts in h.bundle.tensors:
        if ts.codec != "none":
            raise CodecError(
                f"state tensor {ts.name!r} is encoded {ts.codec!r}; {what} travels uncompressed"
            )
    assembler = BundleAssembler(h.bundle)
    async for msg in request_iterator:
        if msg.WhichOneof("part") != "chunk":
            raise CodecError("only chunks may follow the header")
        assembler.add(msg.chunk)
    if not assembler.complete:
        raise AbortedError(
            f"{what} stream ended after {assembler.received} of {assembler.total} bytes"
        )
    return assembler
