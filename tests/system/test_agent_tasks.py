"""Agent processes working on tasks handed out by a real in-process coordinator (real gRPC on
loopback) whose training engine is a small scripted one: benchmarks of a job's exported
program, the blob cache (a corrupted entry is detected and fetched again), task errors,
cancellation from the coordinator, a slowdown changed at run time, drain on SIGTERM with
a task in progress (finished within the grace, or abandoned and reported failed), and the
next task's poll waiting at the coordinator before a round's update is answered."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coordinator.core.errors import FailedPreconditionError
from coordinator.engine.api import CoordinatorContext, NullEngine
from epochmesh.packaging import LossWrapper, export_program
from epochmesh.program.archive import TrainableProgram
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import encode_bundle, to_safetensors
from tests.procs import async_wait_until, in_process_coordinator
from tests.system.test_agent import AgentProc

log = logging.getLogger(__name__)

NS = common_pb2.NodeState
SAMPLES = 64
PUSH_HOLD_S = 5.0


class ScriptedEngine(NullEngine):
    """Hands out the tasks a test queues for a node, and records what the agents report."""

    def __init__(self, context: CoordinatorContext) -> None:
        super().__init__(context)
        self.queues: defaultdict[str, asyncio.Queue[agent_pb2.Task]] = defaultdict(asyncio.Queue)
        self.handed: dict[str, str] = {}  # task id -> node id
        self.blobs_of: defaultdict[str, set[str]] = defaultdict(set)  # of tasks handed out
        self.benchmarks: list[tuple[str, common_pb2.BenchmarkResult]] = []
        self.progress: list[agent_pb2.ReportProgressRequest] = []
        self.cancelled: set[str] = set()
        self.refuse: set[str] = set()  # task ids whose reports are refused
        self.refused: list[str] = []
        self.polls: defaultdict[str, int] = defaultdict(int)  # NextTask calls per node
        self.polled = asyncio.Condition()
        self.polls_at: dict[str, int] = {}  # task id -> the node's NextTask calls then
        self.pushed: list[tuple[str, bool]] = []  # (task id, the next poll came before)
        self.answer_pushes = asyncio.Event()  # cleared: updates are not answered meanwhile
        self.answer_pushes.set()

    def push(self, node_id: str, task: agent_pb2.Task) -> None:
        self.queues[node_id].put_nowait(task)

    async def next_task(self, req: agent_pb2.NextTaskRequest, ctx: object) -> agent_pb2.Task:
        wait_s = min(req.wait_ms / 1000.0, self._context.config.max_long_poll_s)
        get = asyncio.ensure_future(self.queues[req.node_id].get())
        stop = asyncio.ensure_future(self._context.shutdown.wait())
        async with self.polled:
            self.polls[req.node_id] += 1
            self.polled.notify_all()
        await asyncio.wait({get, stop}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if get.done():
            task = get.result()
            self.handed[task.task_id] = req.node_id
            refs = [task.program, task.initial_state, *(s.blob for s in task.shards)]
            self.blobs_of[req.node_id].update(r.sha256 for r in refs if r.sha256)
            self.polls_at[task.task_id] = self.polls[req.node_id]
            return task
        get.cancel()
        return agent_pb2.Task(kind=agent_pb2.TASK_KIND_NONE)

    async def push_update(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: object
    ) -> agent_pb2.PushUpdateResponse:
        """Takes the update, then answers once the node's next NextTask poll (any since the
        task was handed out) has come, at most PUSH_HOLD_S later: an agent that polls only
        after the answer is recorded as such."""
        header = agent_pb2.UpdateHeader()
        async for msg in request_iterator:
            if msg.WhichOneof("part") == "header":
                header = msg.header
        node, before = header.node_id, self.polls_at[header.task_id]
        async with self.polled:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.polled.wait_for(lambda: self.polls[node] > before), PUSH_HOLD_S
                )
        self.pushed.append((header.task_id, self.polls[node] > before))
        await self.answer_pushes.wait()
        return agent_pb2.PushUpdateResponse(accepted=True)

    def check_benchmark(
        self, node_id: str, task_id: str, result: common_pb2.BenchmarkResult
    ) -> None:
        if result.job_id and self.handed.get(task_id) != node_id:
            super().check_benchmark(node_id, task_id, result)  # refused: not handed out here

    async def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        self.benchmarks.append((node_id, result))

    def cancel_task(self, node_id: str, task_id: str) -> bool:
        return task_id in self.cancelled

    def may_fetch_blob(self, node_id: str, sha256: str) -> bool:
        return sha256 in self.blobs_of[node_id]

    async def report_progress(
        self, req: agent_pb2.ReportProgressRequest, ctx: object
    ) -> agent_pb2.ReportProgressResponse:
        if req.task_id in self.refuse:
            self.refused.append(req.task_id)
            raise FailedPreconditionError(f"task {req.task_id} is no longer current")
        self.progress.append(req)
        return agent_pb2.ReportProgressResponse()

    # -- test helpers ---------------------------------------------------------------------------

    def benchmark_of(self, node_id: str, job_id: str) -> common_pb2.BenchmarkResult | None:
        for node, result in self.benchmarks:
            if node == node_id and result.job_id == job_id:
                return result
        return None

    def progress_of(self, task_id: str) -> agent_pb2.ReportProgressRequest | None:
        return next((p for p in self.progress if p.task_id == task_id), None)


@pytest.fixture(scope="module")
def job_blobs() -> dict[str, bytes]:
    """A tiny job as packaging makes it: exported program, initial state, one shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    x = torch.randn(SAMPLES, 8)
    y = torch.randint(0, 3, (SAMPLES,))
    example = (x[:4].clone(), y[:4].clone())  # not views: those would pin the batch size
    program = export_program(LossWrapper(model, F.cross_entropy, 1), example)
    return {
        "program": program,
        "initial_state": to_safetensors(model.state_dict()),
        "shard": to_safetensors({"x": x, "y": y}),
    }


def benchmark_task(
    task_id: str, job_id: str, refs: dict[str, common_pb2.BlobRef], batch_sizes: list[int]
) -> agent_pb2.Task:
    return agent_pb2.Task(
        task_id=task_id,
        kind=agent_pb2.TASK_KIND_BENCHMARK,
        job_id=job_id,
        spec=common_pb2.JobSpec(name="tiny", inputs=["x"], targets=["y"]),
        program=refs["program"],
        initial_state=refs["initial_state"],
        shards=[common_pb2.Shard(blob=refs["shard"], start=0, count=SAMPLES)],
        benchmark_batch_sizes=batch_sizes,
        deadline_seconds=120,
    )


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def wait_for(pred: Callable[[], object], agent: AgentProc, what: str, timeout: float = 30):  # type: ignore[no-untyped-def]
    def check() -> object:
        if not agent.running():
            raise AssertionError(f"agent exited with {agent.proc.returncode} ({what})\n{agent}")
        return pred()

    try:
        return await async_wait_until(check, timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}\n{agent}") from None


async def start_agent(
    engine: ScriptedEngine, address: str, data_dir: Path, *args: str
) -> tuple[AgentProc, str]:
    agent = AgentProc(address, data_dir, *args)
    node_id = str(await wait_for(agent.node_id, agent, "registration"))
    await wait_for(
        lambda: engine.benchmark_of(node_id, "") is not None, agent, "reference benchmark"
    )
    return agent, node_id


@pytest.mark.timeout(120)
async def test_job_benchmark_cache_corruption_errors_and_cancel(
    tmp_path: Path, job_blobs: dict[str, bytes]
) -> None:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=ScriptedEngine, heartbeat_interval_s=0.2, lease_ttl_s=2.0
    ) as coord:
        engine: ScriptedEngine = coord.engine  # type: ignore[assignment]
        refs = {name: await coord.blobs.put_bytes(data) for name, data in job_blobs.items()}
        data_dir = tmp_path / "agent"
        agent, node_id = await start_agent(engine, coord.address, data_dir)
        try:
            # a job's program, benchmarked at the task's batch sizes
            engine.push(node_id, benchmark_task("t1", "j-1", refs, [8, 32]))
            r1 = await wait_for(lambda: engine.benchmark_of(node_id, "j-1"), agent, "t1 report")
            assert [p.batch_size for p in r1.points] == [8, 32]
            assert all(p.samples_per_second > 0 and p.peak_memory_bytes > 0 for p in r1.points)
            assert r1.device.kind == "cpu" and r1.slowdown == 1.0 and r1.max_batch_size >= 32
            assert r1.rtt_ms > 0 and r1.bandwidth_bytes_per_second > 0
            assert "benchmarking the job's program" in agent.log_text()

            cache = data_dir / "cache"
            for ref in refs.values():
                assert sha256_of(cache / ref.sha256) == ref.sha256
            shard = cache / refs["shard"].sha256

            # corrupt the shard in the cache between two tasks (same size, same mtime)
            st = os.stat(shard)
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

            engine.push(node_id, benchmark_task("t2", "j-2", refs, [8]))
            await wait_for(lambda: engine.benchmark_of(node_id, "j-2"), agent, "t2 report")
            assert sha256_of(shard) == refs["shard"].sha256
            text = agent.log_text()
            assert f"cache entry {refs['shard'].sha256} is corrupt" in text
            assert text.count(f"cached blob {refs['shard'].sha256}") == 2  # fetched again...
            assert text.count(f"cached blob {refs['program'].sha256}") == 1  # ...alone

            # failing tasks are reported, and the agent goes on
            engine.push(node_id, agent_pb2.Task(task_id="t3", kind=99, job_id="j-3"))  # type: ignore[arg-type]
            missing = common_pb2.BlobRef(sha256="0" * 64, size=10)
            engine.push(node_id, benchmark_task("t4", "j-4", {**refs, "program": missing}, [8]))
            p3 = await wait_for(lambda: engine.progress_of("t3"), agent, "t3 failure")
            assert p3.failed and "unsupported task kind" in p3.error
            p4 = await wait_for(lambda: engine.progress_of("t4"), agent, "t4 failure")
            assert p4.failed and "NOT_FOUND" in p4.error
            # FAILED_PRECONDITION that is not about the lease: no re-registration, no crash
            engine.refuse.add("t7")
            engine.push(node_id, agent_pb2.Task(task_id="t7", kind=99, job_id="j-7"))  # type: ignore[arg-type]
            await wait_for(lambda: "t7" in engine.refused, agent, "t7 refused")

            # a slowdown raised at run time, and a long task the coordinator cancels
            (data_dir / "slowdown").write_text("50\n")
            engine.push(node_id, benchmark_task("t5", "j-5", refs, [8, 16, 32, 64, 128, 256]))
            await wait_for(lambda: "t5" in engine.handed, agent, "t5 handed out")
            # The factor is read when a step starts: cancel only once a (slowed) step runs.
            await wait_for(
                lambda: "slowdown factor is now 50" in agent.log_text(), agent, "slowdown 50"
            )
            engine.cancelled.add("t5")
            p5 = await wait_for(lambda: engine.progress_of("t5"), agent, "t5 abandoned")
            assert p5.failed and "cancelled by the coordinator" in p5.error
            assert engine.benchmark_of(node_id, "j-5") is None

            (data_dir / "slowdown").write_text("1\n")
            engine.push(node_id, benchmark_task("t6", "j-6", refs, [8]))
            r6 = await wait_for(lambda: engine.benchmark_of(node_id, "j-6"), agent, "t6 report")
            assert r6.slowdown == 1.0
            assert not [p for p in engine.progress if p.task_id in ("t1", "t2", "t6")]
            assert "registering again" not in agent.log_text()
            assert engine.refused == ["t7"]

            assert await asyncio.to_thread(agent.terminate) == 0, str(agent)
        finally:
            await asyncio.to_thread(agent.kill9)


@pytest.mark.timeout(120)
async def test_sigterm_finishes_or_abandons_the_current_task(
    tmp_path: Path, job_blobs: dict[str, bytes]
) -> None:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=ScriptedEngine, heartbeat_interval_s=0.2, lease_ttl_s=2.0
    ) as coord:
        engine: ScriptedEngine = coord.engine  # type: ignore[assignment]
        refs = {name: await coord.blobs.put_bytes(data) for name, data in job_blobs.items()}
        finisher, finisher_id = await start_agent(
            engine, coord.address, tmp_path / "finisher", "--slowdown", "50", "--drain-grace", "60"
        )
        quitter, quitter_id = await start_agent(
            engine, coord.address, tmp_path / "quitter", "--slowdown", "50", "--drain-grace", "0"
        )
        try:
            engine.push(finisher_id, benchmark_task("f1", "j-f", refs, [8, 16]))
            engine.push(quitter_id, benchmark_task("q1", "j-q", refs, [8, 16, 32, 64]))
            await wait_for(lambda: "f1" in engine.handed, finisher, "f1 handed out")
            await wait_for(lambda: "q1" in engine.handed, quitter, "q1 handed out")
            finisher.send(signal.SIGTERM)
            quitter.send(signal.SIGTERM)
            rc_f, rc_q = await asyncio.gather(
                asyncio.to_thread(finisher.proc.wait, 90), asyncio.to_thread(quitter.proc.wait, 90)
            )
            assert rc_f == 0, str(finisher)
            assert rc_q == 0, str(quitter)

            # the finisher completed its task within the grace, reported it, then left
            assert "draining: letting the task finish" in finisher.log_text()
            assert engine.benchmark_of(finisher_id, "j-f") is not None
            assert engine.progress_of("f1") is None
            # the quitter abandoned its task and reported it failed, so it can be re-queued
            q1 = engine.progress_of("q1")
            assert q1 is not None and q1.failed and "draining" in q1.error
            assert engine.benchmark_of(quitter_id, "j-q") is None
            for node_id in (finisher_id, quitter_id):
                info = coord.registry.get(node_id)
                assert info is not None and info.state == NS.NODE_STATE_OFFLINE
        finally:
            await asyncio.to_thread(finisher.kill9)
            await asyncio.to_thread(quitter.kill9)


def train_task(
    task_id: str, job_id: str, refs: dict[str, common_pb2.BlobRef], blobs: dict[str, bytes]
) -> agent_pb2.Task:
    """A parameter-server round of the tiny job: 16 samples, its parameters inline."""
    program = TrainableProgram.from_bytes(blobs["program"], blobs["initial_state"])
    bundle, data = encode_bundle(program.get_parameters())
    return agent_pb2.Task(
        task_id=task_id,
        kind=agent_pb2.TASK_KIND_TRAIN,
        job_id=job_id,
        spec=common_pb2.JobSpec(name="tiny", inputs=["x"], targets=["y"], aggregation="ps"),
        program=refs["program"],
        initial_state=refs["initial_state"],
        shards=[common_pb2.Shard(blob=refs["shard"], start=0, count=SAMPLES)],
        round=int(task_id.rsplit("-", 1)[1]),
        ranges=[common_pb2.SampleRange(start=0, stop=16)],
        local_batch=16,
        params_version=1,
        params_bundle=bundle,
        params_data=data,
        deadline_seconds=60,
    )


@pytest.mark.timeout(120)
async def test_the_next_poll_waits_at_the_coordinator_before_the_update_is_answered(
    tmp_path: Path, job_blobs: dict[str, bytes]
) -> None:
    """After pushing a round's update the agent does not wait for the answer to ask for its
    next task: the poll is at the coordinator when the round closes (on a WAN link, one round
    trip less per round). The tasks still run one after the other, in order."""
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=ScriptedEngine, heartbeat_interval_s=0.2, lease_ttl_s=2.0
    ) as coord:
        engine: ScriptedEngine = coord.engine  # type: ignore[assignment]
        refs = {name: await coord.blobs.put_bytes(data) for name, data in job_blobs.items()}
        agent, node_id = await start_agent(engine, coord.address, tmp_path / "agent")
        try:
            for i in (1, 2, 3):
                engine.push(node_id, train_task(f"r-{i}", "j-t", refs, job_blobs))
            await wait_for(lambda: len(engine.pushed) == 3, agent, "three updates")
            assert engine.pushed == [("r-1", True), ("r-2", True), ("r-3", True)], engine.pushed
            assert not engine.progress, engine.progress  # no task failed

            # Drained while an update waits for its answer, with the next task already brought
            # by the early poll: the current task finishes, the next one is reported failed
            # (its samples go back to pending at once) rather than silently dropped.
            engine.answer_pushes.clear()
            for i in (4, 5):
                engine.push(node_id, train_task(f"r-{i}", "j-t", refs, job_blobs))
            await wait_for(lambda: len(engine.pushed) == 4, agent, "the fourth update")
            await wait_for(lambda: "r-5" in engine.handed, agent, "r-5 brought by the poll")
            agent.send(signal.SIGTERM)
            await wait_for(lambda: "draining" in agent.log_text(), agent, "the drain")
            engine.answer_pushes.set()
            assert await asyncio.to_thread(agent.proc.wait, 60) == 0, str(agent)
            assert engine.pushed[3] == ("r-4", True)
            assert engine.progress_of("r-4") is None
            r5 = engine.progress_of("r-5")
            assert r5 is not None and r5.failed and "not started: draining" in r5.error, r5
        finally:
            await asyncio.to_thread(agent.kill9)
