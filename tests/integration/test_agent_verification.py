"""The agent's side of verification (issue 20) against a stand-in coordinator over real gRPC on
loopback, with the job's program in its real confined child:

- a TRAIN round with verify_chunks pushes chunk commitments that fit its update, then (asked
  by the PushUpdate response) the sketches of its chunks, whose weighted sum is the update's;
- the child's batched chunk call gives exactly what one call per chunk gives;
- a CHECK task recomputes one of those chunks from the round's parameters and reports the
  same loss and sketch (same device and program: the same numbers), and leaves the job so that
  the next TRAIN round loads its own version; a check that cannot run reports failed;
- without verify_chunks the round is what it was (one gradient, no commitments);
- EPOCHMESH_TEST_CHEAT switches a cheat on from a round; a bad value fails the agent's start.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.sketch import combine, relative_distance, sketch
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from epochmesh.verification import chunk_bounds, commitment_problem
from epochmesh.wire.tensors import decode_bundle, encode_bundle
from node_agent.core.slowdown import SlowdownController
from node_agent.link.cache import BlobCache
from node_agent.link.connection import CoordinatorConnection
from node_agent.runtime.dispatch import dispatch_task
from node_agent.sandbox.host import (
    CRASHED,
    ChildLimits,
    ConfinedProgram,
    ProgramFault,
    ProgramHosts,
)
from node_agent.testing.cheat import CHEAT_ENV, SCALE, cheat_from_environment
from node_agent.training import jobs, ps_round
from node_agent.training.compute import accumulated_loss_and_grads
from node_agent.training.context import TaskContext
from node_agent.training.tamper import HONEST, Tamper
from tests.fixtures import write_mlp_job

pytestmark = pytest.mark.timeout(180)

N = 240
K = 12
BUCKETS = 256
JOB = "j-verify"
WORKER = "n-worker"  # the agent's node id: its checks of its own chunks name it as the worker


@dataclass
class StandIn(agent_pb2_grpc.AgentServiceServicer):
    """The coordinator's part the agent talks to in a round and a check; records everything."""

    ask: agent_pb2.CheckSpec | None = None
    refuse_sketches: bool = False
    updates: list[tuple[agent_pb2.UpdateHeader, dict[str, torch.Tensor]]] = field(
        default_factory=list
    )
    sketches: list[agent_pb2.CommitSketchesRequest] = field(default_factory=list)
    checks: list[agent_pb2.ReportCheckRequest] = field(default_factory=list)
    progress: list[agent_pb2.ReportProgressRequest] = field(default_factory=list)

    async def PushUpdate(self, request_iterator: Any, context: Any) -> Any:
        header, data = None, bytearray()
        async for msg in request_iterator:
            if msg.WhichOneof("part") == "header":
                header = msg.header
            else:
                data += msg.chunk.data
        assert header is not None
        self.updates.append((header, decode_bundle(header.bundle, bytes(data))))
        response = agent_pb2.PushUpdateResponse(accepted=True)
        if self.ask is not None:
            response.sketch.CopyFrom(self.ask)
        return response

    async def CommitSketches(self, request: Any, context: Any) -> Any:
        self.sketches.append(request)
        if self.refuse_sketches:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sketches refused")
        return agent_pb2.CommitSketchesResponse()

    async def ReportCheck(self, request: Any, context: Any) -> Any:
        self.checks.append(request)
        return agent_pb2.ReportCheckResponse()

    async def ReportProgress(self, request: Any, context: Any) -> Any:
        self.progress.append(request)
        return agent_pb2.ReportProgressResponse()

    async def PullParameters(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no version {request.version} kept")
        yield agent_pb2.PullParametersResponse()  # never reached: makes this a stream handler


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    return build_job(
        load_spec(write_mlp_job(tmp_path_factory.mktemp("mlp"), N)), cache=ExportCache.default()
    )


@dataclass
class Agent:
    stand_in: StandIn
    connection: CoordinatorConnection
    programs: ProgramHosts
    program: ConfinedProgram
    tmp: Path
    loaded_jobs: jobs.LoadedJobs

    def ctx(self, task: agent_pb2.Task, tamper: Tamper = HONEST) -> TaskContext:
        return TaskContext(
            task=task,
            connection=self.connection,
            cache=BlobCache(self.tmp / "cache"),
            device="cpu",
            device_info=common_pb2.Device(),
            slowdown=SlowdownController(),
            programs=self.programs,
            jobs=self.loaded_jobs,
            tamper=tamper,
        )

    @property
    def job(self) -> jobs.LoadedJob:
        job = self.loaded_jobs.get(JOB)
        assert job is not None
        return job


@pytest.fixture(scope="module")
def loaded(packed: PackedJob) -> Iterator[tuple[ProgramHosts, ConfinedProgram]]:
    """The job's program in a confined child (one for the module: a child starts in seconds)."""
    programs = ProgramHosts("cpu", 1, 512 << 20)
    try:
        yield programs, programs.load(packed.program, packed.initial_state, job_id=JOB)
    finally:
        programs.close_all()


@pytest.fixture
async def agent(
    packed: PackedJob, loaded: tuple[ProgramHosts, ConfinedProgram], tmp_path: Path
) -> AsyncIterator[Agent]:
    """A stand-in coordinator on loopback, and the agent's state for the job: its program
    loaded (as a benchmark leaves it), its shards loaded."""
    stand_in = StandIn()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(stand_in, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    connection = CoordinatorConnection(
        f"127.0.0.1:{port}", tmp_path / "agent", lambda: agent_pb2.RegisterRequest(), insecure=True
    )
    connection.node_id = WORKER
    programs, program = loaded
    dataset = ShardedDataset(packed.shards, inputs=["x"], targets=["y"])
    loaded_jobs = jobs.LoadedJobs()  # the program stays for the next test
    assert loaded_jobs.adopt(programs, JOB, program, dataset)
    try:
        yield Agent(stand_in, connection, programs, program, tmp_path, loaded_jobs)
    finally:
        await connection.close()
        await server.stop(None)


def params_of(version: int, packed: PackedJob, shift: float = 0.0) -> dict[str, Any]:
    """A task's inline parameters: the job's initial ones (+ shift)."""
    program = TrainableProgram.from_bytes(packed.program, packed.initial_state)
    params = {k: v + shift for k, v in program.get_parameters().items()}
    bundle, data = encode_bundle(params)
    return {"params_version": version, "params_bundle": bundle, "params_data": data}


def train_task(
    packed: PackedJob, round_: int, start: int, samples: int, verify_chunks: int, **params: Any
) -> agent_pb2.Task:
    task = agent_pb2.Task(
        task_id=f"t-{round_}-{start}-{verify_chunks}",
        kind=agent_pb2.TASK_KIND_TRAIN,
        job_id=JOB,
        spec=packed.spec,
        round=round_,
        local_batch=samples,
        verify_chunks=verify_chunks,
        deadline_seconds=60,
        **params,
    )
    task.ranges.add(start=start, stop=start + samples)
    return task


def check_task(
    packed: PackedJob, task_id: str, start: int, stop: int, seed: int, **params: Any
) -> agent_pb2.Task:
    task = agent_pb2.Task(
        task_id=task_id,
        kind=agent_pb2.TASK_KIND_CHECK,
        job_id=JOB,
        spec=packed.spec,
        deadline_seconds=60,
        check=agent_pb2.CheckSpec(seed=seed, buckets=BUCKETS),
        checked_node_id=WORKER,
        **params,
    )
    task.ranges.add(start=start, stop=stop)
    return task


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1).double() for k in sorted(tensors)])


def chunk_sketches(request: agent_pb2.CommitSketchesRequest) -> torch.Tensor:
    values = torch.tensor(list(request.sketches), dtype=torch.float64)
    return values.reshape(-1, BUCKETS)


def consistency_gap(header: agent_pb2.UpdateHeader, tensors: dict, request: Any) -> float:
    """The coordinator's sketch check: |sum_i w_i sketch_i - sketch(update)| / |...|."""
    per_chunk = chunk_sketches(request)
    n = header.num_samples
    combined = combine([(c.samples / n, per_chunk[i]) for i, c in enumerate(header.chunks)])
    return relative_distance(combined, sketch(tensors, request.seed, BUCKETS))


async def test_a_verified_round_commits_its_chunks_and_sends_their_sketches(
    agent: Agent, packed: PackedJob
) -> None:
    agent.stand_in.ask = agent_pb2.CheckSpec(seed=987654321, buckets=BUCKETS)
    task = train_task(packed, 3, 60, 60, K, **params_of(1, packed))
    await ps_round.run_train_task(agent.ctx(task), task)
    [(header, tensors)] = agent.stand_in.updates
    assert header.num_samples == 60 and len(header.chunks) == K
    chunks = [(c.samples, c.loss) for c in header.chunks]
    assert commitment_problem(chunks, 60, header.mean_loss, K) == ""
    # The update is the part's gradient (the job's program, computed in one call).
    batch = agent.job.dataset.get_batch(list(range(60, 120)))
    loss, grads = agent.program.loss_and_grads(*batch)
    diff = float((flat(tensors) - flat(grads)).norm() / flat(grads).norm())
    assert diff <= 1e-6 and header.mean_loss == pytest.approx(loss, rel=1e-6)
    # Asked for sketches: one per chunk under the seed sent, adding up to the update's.
    [request] = agent.stand_in.sketches
    assert (request.task_id, request.job_id, request.seed) == (task.task_id, JOB, 987654321)
    assert len(request.sketches) == K * BUCKETS
    assert consistency_gap(header, tensors, request) <= 1e-6
    # The batched call of the child gives what one call per chunk gives, bit for bit.
    inputs, targets = batch
    for i, (a, b) in enumerate(chunk_bounds(60, K)):
        chunk_loss, chunk_grads = accumulated_loss_and_grads(
            agent.program, [t[a:b] for t in inputs], [t[a:b] for t in targets]
        )
        assert chunk_loss == header.chunks[i].loss
        assert torch.equal(sketch(chunk_grads, request.seed, BUCKETS), chunk_sketches(request)[i])

    # A checker recomputes chunk 5 from the round's version: the same loss and sketch.
    a, b = chunk_bounds(60, K)[5]
    check = check_task(packed, "c-1", 60 + a, 60 + b, request.seed, params_version=1)
    await dispatch_task(agent.ctx(check))
    [report] = agent.stand_in.checks
    assert not report.failed and report.task_id == "c-1", report.error
    assert report.loss == header.chunks[5].loss and report.compute_seconds > 0
    theirs = torch.tensor(list(report.sketch), dtype=torch.float64)
    assert relative_distance(chunk_sketches(request)[5], theirs) == 0.0


async def test_a_check_of_another_version_leaves_the_job_to_load_its_own(
    agent: Agent, packed: PackedJob
) -> None:
    first = train_task(packed, 1, 0, 48, K, **params_of(1, packed))
    await ps_round.run_train_task(agent.ctx(first), first)
    # A check of an older version (inline: a small model), then the job's next round.
    check = check_task(packed, "c-2", 0, 4, 42, **params_of(7, packed, shift=0.01))
    await dispatch_task(agent.ctx(check))
    [report] = agent.stand_in.checks
    assert not report.failed, report.error
    assert agent.job.version == 7
    again = train_task(packed, 2, 0, 48, K, **params_of(1, packed))
    await ps_round.run_train_task(agent.ctx(again), again)
    (h1, t1), (h2, t2) = agent.stand_in.updates
    assert agent.job.version == 1
    assert [c.loss for c in h1.chunks] == [c.loss for c in h2.chunks]
    assert all(torch.equal(t1[k], t2[k]) for k in t1)
    # The check computed from version 7's parameters: not the round's loss.
    assert report.loss != h1.chunks[0].loss
    # No sketch asked: none sent.
    assert agent.stand_in.sketches == []


async def test_a_check_that_cannot_run_reports_failed(agent: Agent, packed: PackedJob) -> None:
    # Version 9 is neither held nor inline, and the coordinator has not kept it.
    missing = check_task(packed, "c-3", 0, 4, 1, params_version=9)
    await dispatch_task(agent.ctx(missing))
    bad = check_task(packed, "c-4", 0, 4, 1, params_version=9)
    bad.check.buckets = 0
    await dispatch_task(agent.ctx(bad))
    r1, r2 = agent.stand_in.checks
    assert r1.failed and "NOT_FOUND" in r1.error and "version 9" in r1.error
    assert r2.failed and "0 sketch buckets" in r2.error
    assert agent.stand_in.progress == []  # a check answers with ReportCheck only


async def test_without_verify_chunks_a_round_is_one_gradient(
    agent: Agent, packed: PackedJob
) -> None:
    agent.stand_in.ask = agent_pb2.CheckSpec(seed=5, buckets=BUCKETS)  # asked all the same
    task = train_task(packed, 1, 0, 60, 0, **params_of(1, packed))
    await ps_round.run_train_task(agent.ctx(task), task)
    [(header, tensors)] = agent.stand_in.updates
    assert len(header.chunks) == 0 and agent.stand_in.sketches == []
    loss, grads = agent.program.loss_and_grads(*agent.job.dataset.get_batch(list(range(60))))
    assert header.mean_loss == loss
    assert all(torch.equal(tensors[k], grads[k]) for k in grads)


async def test_a_refused_sketch_commitment_does_not_fail_the_round(
    agent: Agent, packed: PackedJob
) -> None:
    agent.stand_in.ask = agent_pb2.CheckSpec(seed=5, buckets=BUCKETS)
    agent.stand_in.refuse_sketches = True
    task = train_task(packed, 1, 0, 60, K, **params_of(1, packed))
    await dispatch_task(agent.ctx(task))
    assert len(agent.stand_in.updates) == 1 and len(agent.stand_in.sketches) == 1
    assert agent.stand_in.progress == []  # not reported failed


async def test_the_sketches_beside_the_next_task_do_not_wait_for_its_compute(
    agent: Agent, packed: PackedJob
) -> None:
    """The agent runs a round's compute on one thread and the sketches it owes beside its next
    task on another: they are sent while the next round still computes, not after it (on one
    thread they came a whole round late, past the coordinator's wait for them)."""
    agent.stand_in.ask = agent_pb2.CheckSpec(seed=11, buckets=BUCKETS)
    owed: list[Any] = []

    async def beside_next(work: Any, what: str) -> None:
        owed.append(work)

    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beside")
    next_round = threading.Event()
    try:
        task = train_task(packed, 2, 0, 60, K, **params_of(1, packed))
        ctx = agent.ctx(task)
        ctx.executor, ctx.beside_executor, ctx.beside_next = compute, beside, beside_next
        await ps_round.run_train_task(ctx, task)
        assert len(agent.stand_in.updates) == 1 and agent.stand_in.sketches == []
        [work] = owed
        busy = compute.submit(next_round.wait, 60)  # the next round computes
        await asyncio.wait_for(work, timeout=30)
        [request] = agent.stand_in.sketches
        assert request.task_id == task.task_id and len(request.sketches) == K * BUCKETS
        assert not busy.done()
    finally:
        next_round.set()
        compute.shutdown(wait=True)
        beside.shutdown(wait=True)


async def test_a_check_polls_for_the_next_task_before_it_computes(
    agent: Agent, packed: PackedJob
) -> None:
    """A check lets the agent poll for its next task once its inputs are in, before its
    compute: the next check's inputs (a local SGD check's are a start state of megabytes) or
    the next round's task come while it computes instead of after it."""

    class Recording(ThreadPoolExecutor):
        """The compute thread, naming what it was given to run."""

        def __init__(self) -> None:
            super().__init__(max_workers=1, thread_name_prefix="compute")
            self.ran: list[str] = []

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            self.ran.append(getattr(getattr(fn, "func", fn), "__name__", "?"))
            return super().submit(fn, *args, **kwargs)

    compute = Recording()
    ran_at_poll: list[list[str]] = []
    try:
        check = check_task(packed, "c-poll", 0, 4, 42, **params_of(3, packed))
        ctx = agent.ctx(check)
        ctx.executor = compute
        ctx.poll_next = lambda: ran_at_poll.append(list(compute.ran))
        await dispatch_task(ctx)
        [report] = agent.stand_in.checks
        assert report.task_id == "c-poll" and not report.failed, report.error
        assert "check_in_thread" in compute.ran
        [before] = ran_at_poll  # polled once, before the check's compute was handed over
        assert "check_in_thread" not in before
    finally:
        compute.shutdown(wait=True)


async def test_the_cheat_switch_starts_at_its_round(agent: Agent, packed: PackedJob) -> None:
    cheat = cheat_from_environment({CHEAT_ENV: "scaled:2"})  # as node_agent.main installs it
    assert cheat is not None
    agent.stand_in.ask = agent_pb2.CheckSpec(seed=77, buckets=BUCKETS)
    for round_ in (1, 2):
        task = train_task(packed, round_, 0, 60, K, **params_of(1, packed))
        await ps_round.run_train_task(agent.ctx(task, cheat), task)
    (h1, t1), (h2, t2) = agent.stand_in.updates
    ratio = float(flat(t2).norm() / flat(t1).norm())
    assert ratio == pytest.approx(SCALE, rel=1e-5)
    # A smart cheater: its sketches add up to what it sent.
    for (header, tensors), request in zip(
        agent.stand_in.updates, agent.stand_in.sketches, strict=True
    ):
        assert consistency_gap(header, tensors, request) <= 1e-6


def test_a_bad_cheat_value_stops_the_agent_at_start(tmp_path: Path) -> None:
    env = {**os.environ, CHEAT_ENV: "scaled:soon"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "node_agent.main",
            "--coordinator",
            "127.0.0.1:1",
            "--data-dir",
            str(tmp_path / "agent"),
            "--insecure",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "FROM_ROUND must be a whole number" in done.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "node_agent.main", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0 and "CHEAT" not in helped.stdout.upper()


def test_the_batched_chunk_call_survives_a_crash_of_its_child(
    packed: PackedJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_TEST_HOOKS", "1")
    fault = tmp_path / "fault"
    limits = ChildLimits(256 << 20, threads=1, fault_file=fault)
    prog = ConfinedProgram(packed.program, packed.initial_state, limits)
    try:
        dataset = ShardedDataset(packed.shards, inputs=["x"], targets=["y"])
        inputs, targets = dataset.get_batch(list(range(30)))
        bounds = chunk_bounds(30, K)
        first = prog.chunked_loss_and_grads(inputs, targets, bounds, 2)
        fault.write_text("crash")
        with pytest.raises(ProgramFault) as raised:
            prog.chunked_loss_and_grads(inputs, targets, bounds, 2)
        assert raised.value.kind == CRASHED
        # A fresh child gets the chunk region again and computes the same numbers.
        again = prog.chunked_loss_and_grads(inputs, targets, bounds, 2)
        assert prog.restarts == 1
        for (l1, g1), (l2, g2) in zip(first, again, strict=True):
            assert l1 == l2 and all(torch.equal(g1[k], g2[k]) for k in g1)
        # More chunks than before: the region grows.
        more = prog.chunked_loss_and_grads(inputs, targets, [(i, i + 1) for i in range(30)])
        assert len(more) == 30 and more[0][0] != first[0][0]
        with pytest.raises(ValueError, match="do not fit"):
            prog.chunked_loss_and_grads(inputs, targets, [(0, 31)])
    finally:
        prog.close()
