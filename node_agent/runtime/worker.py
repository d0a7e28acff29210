"""The agent's life: start, register, benchmark, take tasks, drain, leave.

Start-up order (registration comes first so that a node shows up within a couple of seconds):
1. load the node id (DATA_DIR/node.json), discover devices, write DATA_DIR/slowdown and
   DATA_DIR/price (SIGUSR1 re-reads both; a new price goes out with a heartbeat at once); start
   the PeerService on --peer-listen (unless --no-peer): mutual TLS with the node's certificate, or
   plaintext with --insecure; it serves ring all-reduce chunks and this agent's ring state
   (the worker's node_agent.training.ring_jobs.RingJobs.provide_state);
2. Register with the advertised PeerService address (retried with backoff until the
   coordinator answers; every re-registration sends it again), start the heartbeat task;
3. reference benchmark of the built-in model on the training device (on the compute thread),
   RTT and bandwidth probes, ReportBenchmark (job_id empty), also written to
   DATA_DIR/benchmark.json; the report is sent again after every later registration;
4. the work loop: NextTask long-poll, run the task (node_agent.runtime.dispatch), repeat.
   What a finished task still owes and nothing waits on (a check's report, a checked part's
   sketches and start state: `TaskContext.beside`) is sent beside the next task, at most
   `MAX_BESIDE` of them at once; the agent waits for them (up to `BESIDE_WAIT_S`) before
   it leaves.

An operator's drain (the coordinator reports the node DRAINING) or cordon does not stop the
agent: it gets no new work, finishes its task, and stays up and idle until uncordoned.
Leaving is explicit: after ``epochmesh drain --stop`` the coordinator's heartbeat answers carry
``leave``; the agent takes no new task, lets the current one finish (no grace limit: the
coordinator's round deadline bounds it), then drains as below (Leave, exit 0). An uncordon
before the task is done withdraws the request.

Draining (SIGTERM, SIGINT): take no new task,
tell the coordinator (a Heartbeat with draining=True), let the current task finish for up to
--drain-grace seconds, else abandon it and report it failed so the coordinator re-queues it,
then Leave, stop the PeerService and exit 0. A second signal abandons the current task at once.

Refused (the coordinator answers UNAUTHENTICATED: this node's certificate was revoked, has
expired, or is not from its CA): retrying cannot help, so the agent says why and what to do
(enroll again with a new token), abandons any task and exits 7 (as the CLI's "not authorized").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal, TypeVar

import grpc
import torch
from google.protobuf import json_format

from epochmesh import __version__
from epochmesh.money import format_credits
from epochmesh.ring.seal import SEAL_DIGESTS
from epochmesh.ring.weights import RING_FEATURES
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.core.config import AgentConfig, advertised_peer_address, parse_price
from node_agent.core.devices import DeviceError, Discovered, discover_devices
from node_agent.core.identity import transport_identity
from node_agent.core.slowdown import SlowdownController
from node_agent.core.watch_file import WatchedValue
from node_agent.link.cache import BlobCache
from node_agent.link.connection import (
    HEARTBEAT_LEASE_CODES,
    CoordinatorConnection,
    Expired,
    HeartbeatHooks,
    Refused,
    Stopped,
    describe,
    device_summary,
)
from node_agent.link.metrics import AgentMetrics, process_tree_rss
from node_agent.ring.runtime import PeerRuntime
from node_agent.ring.service import PeerServer
from node_agent.runtime.dispatch import dispatch_task
from node_agent.sandbox.host import TEST_FAULT_FILE, ProgramHosts, child_memory_budget
from node_agent.training.benchmark import (
    FULL_PLAN,
    JOB_PLAN,
    QUICK_JOB_PLAN,
    QUICK_PLAN,
    BenchmarkCancelled,
    benchmark_model,
    build_result,
)
from node_agent.training.context import TaskContext
from node_agent.training.jobs import LoadedJobs
from node_agent.training.reference_model import reference_step_factory
from node_agent.training.ring_jobs import RingJobs
from node_agent.training.tamper import HONEST, Tamper

log = logging.getLogger(__name__)

T = TypeVar("T")

# Why the agent leaves after an operator's ``epochmesh drain --stop`` (its Leave's reason).
LEAVE_REASON = "an operator asked this node to leave (drain --stop)"
# After abandoning a task, how long to wait for its handler to notice before leaving anyway.
ABANDON_WAIT_S = 5.0
# Reports sent beside the next task (TaskContext.beside): at most this many at once (a new one
# waits for a slot), and how long the agent waits for them when it leaves.
MAX_BESIDE = 4
BESIDE_WAIT_S = 15.0
# The longest the agent waits for its heartbeat loop to stop (a heartbeat in flight has a
# timeout of at most max(1 s, the heartbeat interval)).
HEARTBEAT_STOP_WAIT_S = 10.0

EXIT_OK = 0
EXIT_CONFIG = 2
# The coordinator refuses this agent's certificate (revoked, expired, another CA): as the CLI's
# "not authorized".
EXIT_REFUSED = 7
# How long a ring stream from a neighbour may wait for this node to join its all-reduce (it may
# still be computing); each sender bounds its own wait by the round's deadline.
PEER_JOIN_TIMEOUT_S = 600.0
# Grace for in-flight peer calls (a state transfer) when the agent stops.
PEER_STOP_GRACE_S = 1.0


class Agent:
    def __init__(
        self, config: AgentConfig, metrics: AgentMetrics | None = None, tamper: Tamper = HONEST
    ) -> None:
        self.config = config
        self.metrics = metrics
        # Handed to every task: the jobs kept loaded and the ring state between rounds, and how
        # the rounds' work is done (HONEST but for the test entry point's fault injection).
        self.jobs = LoadedJobs()
        self.ring_jobs = RingJobs()
        self.tamper = tamper
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        # Verification beside the next task (TaskContext.run_beside): a finished round's
        # sketches are computed while the next round computes, not after it.
        self.beside_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beside")
        self.current: TaskContext | None = None
        self.programs = ProgramHosts("cpu", None, None)  # replaced once the device is known
        self.reference_result: common_pb2.BenchmarkResult | None = None
        self.drain_reason = ""
        # The coordinator holds this node back from new work (drained or cordoned).
        self._held = False
        # An operator asks this node to leave once its current task is done (drain --stop).
        self._leave_requested = False
        self.peer: PeerRuntime | None = None
        self.peer_address = ""
        # Created in run(), inside the event loop.
        self._drain: asyncio.Event
        self._hurry: asyncio.Event
        self._stop: asyncio.Event
        self._wake_heartbeat: asyncio.Event
        self._draining_flag = threading.Event()  # readable from the compute thread
        self.slowdown: SlowdownController
        self.price: WatchedValue[int]  # micro-credits per hour
        self.discovered: Discovered
        self.cache: BlobCache
        self.connection: CoordinatorConnection
        self._early_poll: asyncio.Task[tuple[agent_pb2.Task, float] | None] | None = None
        # Reports of finished tasks sent beside the current one (TaskContext.beside).
        self._besides: set[asyncio.Task[None]] = set()
        # One waiter on the drain event for every `_until_drain` (two per round: a task and a
        # cancellation less each time than a waiter of their own).
        self._drain_waiter: asyncio.Task[Literal[True]] | None = None

    # -- control --------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining_flag.is_set()

    def request_drain(self, reason: str) -> None:
        """Start draining; a second request abandons the current task at once."""
        if self._drain.is_set():
            if not self._hurry.is_set():
                log.warning("%s again: abandoning the current task now", reason)
                self._hurry.set()
            return
        log.info("draining (%s): no new tasks; finishing the current one", reason)
        self.drain_reason = reason
        self._draining_flag.set()
        self._drain.set()
        self._wake_heartbeat.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain, signal.Signals(sig).name)
        loop.add_signal_handler(signal.SIGUSR1, self._reload_settings)

    def _reload_settings(self) -> None:
        """SIGUSR1: re-read DATA_DIR/slowdown and DATA_DIR/price; a new price goes to the
        coordinator with a heartbeat at once."""
        self.slowdown.reload()
        if self.price.reload():
            self._wake_heartbeat.set()

    def _on_node_state(self, state: int) -> None:
        """The state the coordinator reports. DRAINING (an operator's ``epochmesh drain``) is
        not a stop: the coordinator gives a drained node no new work, its current task
        finishes, and the agent stays up and idle, heartbeating, until ``epochmesh uncordon``
        puts it back to work (drained = up and idle, as in Slurm and Kubernetes)."""
        if self.draining:  # stopping on its own (SIGTERM): the coordinator only echoes it
            return
        drained = state in (common_pb2.NODE_STATE_DRAINING, common_pb2.NODE_STATE_CORDONED)
        if drained and not self._held:
            log.info(
                "the coordinator %s this node: no new work; staying up and idle until an "
                "operator uncordons it (`epochmesh drain --stop` or SIGTERM stops the agent)",
                "drains" if state == common_pb2.NODE_STATE_DRAINING else "cordons",
            )
        elif not drained and self._held and state != common_pb2.NODE_STATE_UNSPECIFIED:
            log.info("the coordinator gives this node work again")
        self._held = drained

    def _on_leave_request(self, wanted: bool) -> None:
        """The coordinator says (after every heartbeat) whether an operator asks this node to
        leave (``epochmesh drain --stop``). Idle, it drains at once; with a task, it lets the
        task finish and drains then (`_work_loop`). A withdrawn request (uncordon) counts as
        long as the drain has not started."""
        if self.draining or wanted == self._leave_requested:
            return
        self._leave_requested = wanted
        if not wanted:
            log.info("the coordinator withdrew its leave request: staying")
        elif self.current is None:
            log.info("the coordinator asks this node to leave: leaving")
            self.request_drain(LEAVE_REASON)
        else:
            log.info("the coordinator asks this node to leave: finishing the current task first")

    def _on_cancel_task(self, task_id: str) -> None:
        ctx = self.current
        if ctx is not None and ctx.task.task_id == task_id and not ctx.cancelled.is_set():
            ctx.log.warning("the coordinator cancelled this task")  # once, not every heartbeat
            ctx.cancel("cancelled by the coordinator")

    async def _until_drain(self, aw: Awaitable[T]) -> T | None:
        """Await `aw`, unless a drain starts first (then it is cancelled and None returned)."""
        task = asyncio.ensure_future(aw)
        if self._drain_waiter is None:
            self._drain_waiter = asyncio.ensure_future(self._drain.wait())
        await asyncio.wait({task, self._drain_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Stopped, grpc.aio.AioRpcError):
            await task
        return None

    # -- main -----------------------------------------------------------------------------------

    async def run(self) -> int:
        self._drain = asyncio.Event()
        self._drain_waiter = None
        self._hurry = asyncio.Event()
        self._stop = asyncio.Event()
        self._wake_heartbeat = asyncio.Event()
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.slowdown = SlowdownController(config.slowdown, config.slowdown_file)
        self.price = WatchedValue(
            config.price_micro_per_hour,
            config.price_file,
            parse=parse_price,
            show=format_credits,
            what="price",
            unit="credits/h",
        )
        self._install_signal_handlers()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        try:
            self.discovered = await asyncio.to_thread(discover_devices, config.device)
        except DeviceError as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        for device in self.discovered.devices:
            log.info("device: %s", device_summary(device))
        self.programs = ProgramHosts(
            self.discovered.torch_device,
            config.threads,
            child_memory_budget(self.discovered.selected, config.memory_limit_bytes),
            config.data_dir / TEST_FAULT_FILE,
        )
        if self.discovered.torch_device == "cpu":
            # Jobs' programs compute in child processes: their CPU time is the device's too.
            programs = self.programs
            self.slowdown.measure_cpu_time(lambda: time.process_time() + programs.cpu_seconds())
        log.info("training on %s (slowdown %g)", self.discovered.torch_device, self.slowdown.factor)
        price = self.price.get()
        if price:
            log.info("offering this node at %s credits per hour", format_credits(price))
        else:
            log.info("donating this node (price 0)")
        if not config.no_peer:
            try:
                await self._start_peer_server()
            except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError for bind errors
                log.error(
                    "cannot start the PeerService on --peer-listen %s: %s", config.peer_listen, exc
                )
                return EXIT_CONFIG
        else:
            log.info("--no-peer: no PeerService; ring jobs go through the coordinator")
        self.cache = BlobCache(config.cache_dir, max_bytes=config.cache_max_bytes)
        self.connection = CoordinatorConnection(
            config.coordinators or config.coordinator,
            config.data_dir,
            self._register_request,
            stop=self._stop,
            on_registered=self._after_registration,
            on_refused=self._on_refused,
            price=self.price.get,
            interceptors=self.metrics.interceptors() if self.metrics is not None else (),
            insecure=config.insecure,
        )
        if self.metrics is not None:
            self.metrics.watch(config.cache_dir, self._device_memory)
        heartbeats: asyncio.Task[None] | None = None
        try:
            await self._until_drain(self.connection.register())
            if self.connection.registered:
                heartbeats = asyncio.create_task(
                    self.connection.heartbeat_loop(
                        HeartbeatHooks(
                            current_task_id=self._current_task_id,
                            draining=lambda: self.draining,
                            on_state=self._on_node_state,
                            on_cancel_task=self._on_cancel_task,
                            on_leave_request=self._on_leave_request,
                        ),
                        self._wake_heartbeat,
                    ),
                    name="heartbeats",
                )
            if not self.draining and config.benchmark != "off":
                await self._reference_benchmark()
            if not self.draining:
                await self._work_loop()
        except Refused:
            pass  # _on_refused has said why and started the drain
        finally:
            await self._shutdown(heartbeats)
        return EXIT_REFUSED if self.connection.refused else EXIT_OK

    def _on_refused(self, why: str) -> None:
        """The coordinator no longer accepts this agent's certificate: stop for good (a task
        in progress could not report anyway)."""
        log.error(
            "the coordinator refuses this agent (%s): stopping; enroll it again with a new "
            "node token (epochmesh-agent --token ...) and a fresh --data-dir",
            why,
        )
        self.request_drain("refused by the coordinator")
        self._hurry.set()

    async def _shutdown(self, heartbeats: asyncio.Task[None] | None) -> None:
        await self._finish_besides()
        if self.connection.registered:
            await self.connection.send_draining(task_id="")
        self._stop.set()  # ends the heartbeat loop even if the cancellation below is lost
        if heartbeats is not None:
            heartbeats.cancel()
            done, _ = await asyncio.wait({heartbeats}, timeout=HEARTBEAT_STOP_WAIT_S)
            if not done:
                log.warning("the heartbeat loop did not stop; leaving without it")
        await self.connection.leave(self.drain_reason or "agent stopped")
        await self.connection.close()
        await self._stop_peer_server()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.beside_executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.programs.close_all)
        if self._drain_waiter is not None:
            self._drain_waiter.cancel()
        log.info("agent stopped")

    def _register_request(self) -> agent_pb2.RegisterRequest:
        return agent_pb2.RegisterRequest(
            name=self.config.name,
            devices=self.discovered.devices,
            agent_version=__version__,
            labels={"device": self.discovered.torch_device, **self.config.labels},
            peer_address=self.peer_address,
            price_micro_per_hour=self.price.get(),
            ring_seal_digests=SEAL_DIGESTS,
            ring_features=RING_FEATURES,
        )

    # -- PeerService ----------------------------------------------------------------------------

    async def _authorize_state_transfer(self, job_id: str, requester: str) -> str | None:
        """Ask the coordinator whether it sent `requester` here for job `job_id`'s state
        (None: yes; else why not, including "could not ask")."""
        conn = self.connection

        def request() -> agent_pb2.AuthorizeStateTransferRequest:
            return agent_pb2.AuthorizeStateTransferRequest(
                node_id=conn.node_id,
                lease_id=conn.lease_id,
                job_id=job_id,
                requester_node_id=requester,
            )

        try:
            reply = await conn.call(
                "AuthorizeStateTransfer",
                request,
                timeout=5.0,
                deadline=time.monotonic() + 15.0,
            )
        except (grpc.aio.AioRpcError, Stopped, Expired) as exc:
            log.warning("could not ask the coordinator about a state transfer: %s", exc)
            return f"the coordinator could not confirm the transfer: {describe(exc)}"
        return None if reply.allowed else reply.reason or "not allowed"

    async def _start_peer_server(self) -> None:
        """Listen on --peer-listen (OSError when that fails) and work out the address to
        advertise. TLS with the node certificate unless --insecure."""
        config = self.config
        identity = transport_identity(config.data_dir, config.insecure)
        server = PeerServer(
            config.peer_listen,
            state_provider=self.ring_jobs.provide_state,
            state_authorizer=self._authorize_state_transfer,
            join_timeout_s=PEER_JOIN_TIMEOUT_S,
            identity=identity,
        )
        await server.start()
        self.peer = PeerRuntime(server, identity)
        self.peer_address = advertised_peer_address(
            config.peer_listen, config.peer_advertise, server.port
        )
        if not config.peer_advertise and config.peer_listen.rsplit(":", 1)[0] in (
            "0.0.0.0",
            "[::]",
        ):
            log.warning(
                "--peer-listen %s without --peer-advertise: advertising %s, which only agents "
                "on this machine can reach",
                config.peer_listen,
                self.peer_address,
            )
        log.info(
            "PeerService on %s, advertised as %s (%s)",
            config.peer_listen,
            self.peer_address,
            "mutual TLS with node certificates" if identity is not None else "plaintext",
        )

    async def _stop_peer_server(self) -> None:
        peer, self.peer = self.peer, None
        if peer is None:
            return
        await peer.close()
        if peer.server is not None:
            await peer.server.stop(PEER_STOP_GRACE_S)

    def _current_task_id(self) -> str:
        return self.current.task.task_id if self.current is not None else ""

    async def _after_registration(self) -> None:
        """After a re-registration, the coordinator hears the reference benchmark again."""
        if self.reference_result is not None and self.connection.registrations > 1:
            await self._report_reference()

    # -- reference benchmark --------------------------------------------------------------------

    async def _reference_benchmark(self) -> None:
        plan = QUICK_PLAN if self.config.benchmark == "quick" else FULL_PLAN
        device = self.discovered.torch_device
        loop = asyncio.get_running_loop()
        try:
            points = await loop.run_in_executor(
                self.executor,
                partial(
                    benchmark_model,
                    partial(reference_step_factory, device),
                    device,
                    plan,
                    self.slowdown,
                    memory_limit_bytes=self.config.memory_limit_bytes,
                    should_stop=self._draining_flag.is_set,
                ),
            )
        except BenchmarkCancelled:
            log.info("reference benchmark abandoned (draining)")
            return
        network = await self._until_drain(self.connection.measure_network())
        rtt_ms, bandwidth = network if network is not None else (0.0, 0.0)
        result = build_result(
            points,
            self.discovered.selected,
            slowdown=self.slowdown.factor,
            memory_limit_bytes=self.config.memory_limit_bytes,
            rtt_ms=rtt_ms,
            bandwidth=bandwidth,
        )
        self.reference_result = result
        log.info(
            "reference benchmark: %.1f samples/s, max batch %d (%s)",
            result.samples_per_second,
            result.max_batch_size,
            ", ".join(
                f"b{p.batch_size}: {'OOM' if p.out_of_memory else f'{p.samples_per_second:.0f}/s'}"
                for p in result.points
            ),
        )
        self._write_benchmark_file(result)
        await self._until_drain(self._report_reference())

    def _write_benchmark_file(self, result: common_pb2.BenchmarkResult) -> None:
        path = self.config.benchmark_file
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(json_format.MessageToDict(result), indent=2))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    async def _report_reference(self) -> None:
        result = self.reference_result
        assert result is not None
        try:
            await self.connection.call(
                "ReportBenchmark",
                lambda: agent_pb2.ReportBenchmarkRequest(
                    node_id=self.connection.node_id,
                    lease_id=self.connection.lease_id,
                    result=result,
                ),
            )
        except Stopped:
            return
        except grpc.aio.AioRpcError as exc:
            log.error("the coordinator refused the benchmark report: %s", describe(exc))
            return
        log.info("reference benchmark reported")

    # -- work loop ------------------------------------------------------------------------------

    async def _work_loop(self) -> None:
        try:
            while not self.draining:
                polled = self._early_poll
                self._early_poll = None
                got = await self._until_drain(polled if polled is not None else self._poll())
                if got is None:  # draining, or the agent stops
                    return
                task, received_at = got
                if task.kind == agent_pb2.TASK_KIND_NONE:
                    continue
                await self._run_task(task, received_at)
                if self._leave_requested and not self.draining:
                    log.info("task done: leaving, as the coordinator asked")
                    self.request_drain(LEAVE_REASON)
        finally:
            await self._drop_early_poll()

    async def _drop_early_poll(self) -> None:
        """The work loop ends (drain, stop) with an early poll out: cancel it, and report a
        task it already brought as failed, so that its samples go back to pending now rather
        than when the coordinator notices the node is gone."""
        polled, self._early_poll = self._early_poll, None
        if polled is None:
            return
        polled.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await polled
        if polled.cancelled() or polled.exception() is not None:
            return
        got = polled.result()
        if got is not None and got[0].kind != agent_pb2.TASK_KIND_NONE:
            ctx = self._task_context(*got)
            why = self.drain_reason or "the agent stops"
            await ctx.report_failure(f"not started: draining ({why})")

    async def _poll(self) -> tuple[agent_pb2.Task, float] | None:
        """One NextTask long-poll: the task (TASK_KIND_NONE: nothing yet) and when it arrived,
        or None when the agent stops. A refused poll is logged and retried after a backoff."""
        wait_ms = self.config.poll_wait_ms
        backoff = self.connection.new_backoff()

        def request() -> agent_pb2.NextTaskRequest:
            return agent_pb2.NextTaskRequest(
                node_id=self.connection.node_id,
                lease_id=self.connection.lease_id,
                wait_ms=wait_ms,
            )

        while True:
            try:
                task: Any = await self.connection.call(
                    "NextTask",
                    request,
                    timeout=wait_ms / 1000.0 + 10.0,
                    lease_codes=HEARTBEAT_LEASE_CODES,
                )
            except Stopped:
                return None
            except grpc.aio.AioRpcError as exc:
                log.error("NextTask refused: %s", describe(exc))
                await asyncio.sleep(max(1.0, backoff.next_delay()))
                continue
            if task is None:
                return None
            return task, time.monotonic()

    def _poll_early(self) -> None:
        """Called by a task once what is left of it needs nothing from the coordinator's next
        task (`TaskContext.poll_next`: a parameter-server round's update is sent, a ring
        round's result applied, a check's inputs in): the next NextTask poll starts now, so
        that it waits at the coordinator when the round closes, or brings the next check's
        inputs while this one computes, and the next task comes without another request
        after this one (on a WAN link, a round trip less on every round's critical path:
        measured 0.117 -> 0.070 s per round at 50 ms RTT for the parameter server; a local SGD
        check's inputs are the checked node's start state, ~4 MB for bench_wan's model). The
        task runs once the current one has finished."""
        if self._early_poll is None and not self.draining and not self._leave_requested:
            self._early_poll = asyncio.create_task(self._poll(), name="next-task-poll")

    async def _beside(self, work: Coroutine[Any, Any, None], what: str) -> None:
        """Run ``work`` (a finished task's report) on its own while the agent goes on with its
        next task; with `MAX_BESIDE` already out, wait for one of them first."""
        while len(self._besides) >= MAX_BESIDE:
            await asyncio.wait(set(self._besides), return_when=asyncio.FIRST_COMPLETED)
        job = asyncio.create_task(self._guarded(work, what), name=what)
        self._besides.add(job)
        job.add_done_callback(self._besides.discard)

    @staticmethod
    async def _guarded(work: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await work
        except Stopped:
            log.info("%s was not sent: the agent stops", what)
        except Exception as exc:  # its task is over: nobody else would hear of it
            log.warning("%s could not be sent: %s", what, describe(exc))

    async def _finish_besides(self) -> None:
        """Before the agent leaves: let the reports still out finish (up to BESIDE_WAIT_S),
        then give up on the rest."""
        if not self._besides:
            return
        _, late = await asyncio.wait(set(self._besides), timeout=BESIDE_WAIT_S)
        for job in late:
            log.warning("%s: not sent within %.0fs; giving up", job.get_name(), BESIDE_WAIT_S)
            job.cancel()
        if late:
            await asyncio.wait(late)

    def _task_context(self, task: agent_pb2.Task, received_at: float) -> TaskContext:
        return TaskContext(
            task=task,
            received_at=received_at,
            poll_next=self._poll_early,
            connection=self.connection,
            cache=self.cache,
            device=self.discovered.torch_device,
            device_info=self.discovered.selected,
            slowdown=self.slowdown,
            executor=self.executor,
            beside_executor=self.beside_executor,
            memory_limit_bytes=self.config.memory_limit_bytes,
            programs=self.programs,
            job_benchmark=QUICK_JOB_PLAN if self.config.benchmark == "quick" else JOB_PLAN,
            peer=self.peer,
            jobs=self.jobs,
            ring_jobs=self.ring_jobs,
            tamper=self.tamper,
            beside_next=self._beside,
        )

    async def _run_task(self, task: agent_pb2.Task, received_at: float) -> None:
        ctx = self._task_context(task, received_at)
        self.current = ctx
        # The next regular heartbeat names the task (no extra one per task: a round of a small
        # model takes a fraction of a second, and one Heartbeat per node per round is a good
        # part of the coordinator's work at the moment every node starts computing).
        job = asyncio.create_task(dispatch_task(ctx), name=f"task-{task.task_id}")
        try:
            await self._until_drain(asyncio.shield(job))
            if job.done():
                self._reap(job)
                return
            grace = self.config.drain_grace_seconds
            ctx.log.info("draining: letting the task finish (up to %.1fs)", grace)
            hurry = asyncio.ensure_future(self._hurry.wait())
            try:
                await asyncio.wait({job, hurry}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hurry.cancel()
            if job.done():
                self._reap(job)
                return
            ctx.cancel("the agent is draining")
            done, _ = await asyncio.wait({job}, timeout=ABANDON_WAIT_S)
            if done:
                self._reap(job)
                return
            ctx.log.warning("the task does not stop; leaving it behind")
            await ctx.report_failure("abandoned: the agent is draining")
        finally:
            self.current = None
            if self.metrics is not None and job.done():
                failed = job.cancelled() or job.exception() is not None or ctx.failure_reported
                self.metrics.task_finished(task, failed, ctx.cancelled.is_set())

    def _device_memory(self) -> tuple[str, int, int]:
        """(device, bytes in use, bytes in all) for the metrics (a scrape's thread)."""
        device = self.discovered.torch_device
        if device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info(torch.device(device))
            return device, total - free, total
        total = self.discovered.selected.total_memory_bytes
        return device, process_tree_rss(os.getpid()), total

    @staticmethod
    def _reap(job: asyncio.Task[None]) -> None:
        if job.cancelled():
            return
        exc = job.exception()
        if exc is not None and not isinstance(exc, Stopped):
            log.error("task handler crashed: %s", describe(exc))
