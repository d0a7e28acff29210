"""SubmitJob checks programs in a confined child process: a program whose loading hangs or
crashes is refused with INVALID_ARGUMENT, nothing is stored, and the coordinator keeps
answering other calls meanwhile (blobs uploaded and jobs submitted by raw gRPC, no CLI)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from epochmesh.export_cache import ExportCache
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram, read_initial_state
from epochmesh.program.inspection import TEST_FAULT_ENV
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, job_pb2, job_pb2_grpc
from epochmesh.wire.tensors import to_safetensors
from tests.fixtures import write_mlp_job
from tests.fixtures.hostile_programs import HUGE_POWER, sparse_program, with_shape_expression
from tests.procs import aio_channel_for, in_process_coordinator

pytestmark = pytest.mark.timeout(90)

CHECK_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), num_samples=64)
    return build_job(load_spec(job), verify=False, cache=ExportCache.default())


async def upload(jobs: job_pb2_grpc.JobServiceStub, data: bytes) -> common_pb2.BlobRef:
    digest = hashlib.sha256(data).hexdigest()

    async def messages() -> AsyncIterator[job_pb2.UploadBlobRequest]:
        yield job_pb2.UploadBlobRequest(
            header=job_pb2.UploadBlobHeader(sha256=digest, size=len(data), offset=0)
        )
        for o in range(0, len(data), MAX_CHUNK_BYTES):
            chunk = common_pb2.DataChunk(offset=o, data=data[o : o + MAX_CHUNK_BYTES])
            yield job_pb2.UploadBlobRequest(chunk=chunk)

    resp = await jobs.UploadBlob(messages(), timeout=30)
    return resp.blob


async def submit_request(
    jobs: job_pb2_grpc.JobServiceStub, packed: PackedJob, program: bytes
) -> job_pb2.SubmitJobRequest:
    shards = [
        common_pb2.Shard(blob=await upload(jobs, data), start=start, count=count)
        for start, count, data in packed.shards
    ]
    return job_pb2.SubmitJobRequest(
        spec=packed.spec,
        program=await upload(jobs, program),
        initial_state=await upload(jobs, packed.initial_state),
        shards=shards,
    )


async def refusal(call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details() or ""


async def no_jobs(jobs: job_pb2_grpc.JobServiceStub, coord: Coordinator) -> None:
    assert list((await jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=10)).jobs) == []
    assert await coord.store.list_jobs() == []


async def submit_while_beating(
    coord: Coordinator, channel: grpc.aio.Channel, request: job_pb2.SubmitJobRequest
) -> tuple[str, float, list[float]]:
    """SubmitJob (expected refused) while a node heartbeats every 20 ms: the refusal's details,
    the submission's seconds, the heartbeats' latencies."""
    jobs = job_pb2_grpc.JobServiceStub(channel)
    agent = agent_pb2_grpc.AgentServiceStub(channel)
    reg = await agent.Register(agent_pb2.RegisterRequest(name="watcher"), timeout=10)
    latencies: list[float] = []
    done = asyncio.Event()

    async def heartbeats() -> None:
        beat = agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)
        while not done.is_set():
            t0 = time.monotonic()
            await agent.Heartbeat(beat, timeout=10)
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(0.02)

    beating = asyncio.create_task(heartbeats())
    t0 = time.monotonic()
    try:
        details = await refusal(jobs.SubmitJob(request, timeout=30))
    finally:
        done.set()
    elapsed = time.monotonic() - t0
    await beating
    return details, elapsed, latencies


def own_checks(tmp_path: Path) -> dict[str, Any]:
    """An in-process coordinator's engine and its own verdict directory: these tests count on
    their checks running, not on the run's shared verdicts (tests/procs.py)."""
    return {"engine_factory": Engine, "program_check_cache_root": tmp_path / "checks"}


async def test_a_power_in_a_shape_expression_is_refused_fast_while_heartbeats_stay_fast(
    tmp_path: Path, packed: PackedJob
) -> None:
    async with (
        in_process_coordinator(
            tmp_path / "data",
            **own_checks(tmp_path),
            program_check_spare=True,
        ) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        request = await submit_request(
            jobs, packed, with_shape_expression(packed.program, HUGE_POWER)
        )
        # The spare inspection child is started and ready (torch imported): the submission
        # below takes the check's time, not the start of a Python process.
        engine = coord.engine
        assert isinstance(engine, Engine)
        assert await engine.program_inspector.wait_warm()

        details, elapsed, latencies = await submit_while_beating(coord, channel, request)
        assert details.startswith("program refused: "), details
        assert f"{HUGE_POWER!r}" in details and "powers are refused" in details, details
        assert "\n" not in details
        assert elapsed < 5.0, elapsed
        assert latencies and max(latencies) < 1.0, latencies
        await no_jobs(jobs, coord)


async def test_a_hanging_program_is_refused_at_the_time_limit_while_heartbeats_stay_fast(
    tmp_path: Path, packed: PackedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The inspection child hangs after loading (its test hook); no spare child, so the one
    # started for the check gets the hook from this environment.
    monkeypatch.setenv(TEST_FAULT_ENV, "hang")
    async with (
        in_process_coordinator(
            tmp_path / "data",
            **own_checks(tmp_path),
            program_check_timeout_s=CHECK_TIMEOUT_S,
            program_check_spare=False,
        ) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        request = await submit_request(jobs, packed, packed.program)
        details, elapsed, latencies = await submit_while_beating(coord, channel, request)
        assert details == (
            f"program refused: loading the program took longer than {CHECK_TIMEOUT_S:g} s"
        )
        assert CHECK_TIMEOUT_S <= elapsed < 60.0, elapsed  # the child's start, then the limit
        assert len(latencies) >= 10, latencies
        assert max(latencies) < 1.0, max(latencies)
        await no_jobs(jobs, coord)


async def test_a_program_that_crashes_its_inspection_is_refused(
    tmp_path: Path, packed: PackedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No spare child: each check starts its own, with the environment of that moment.
    async with (
        in_process_coordinator(
            tmp_path / "data",
            **own_checks(tmp_path),
            program_check_spare=False,
        ) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        request = await submit_request(jobs, packed, packed.program)

        monkeypatch.setenv(TEST_FAULT_ENV, "segv")  # the child crashes before it answers
        details = await refusal(jobs.SubmitJob(request, timeout=60))
        assert details == "program refused: the program crashed its inspection (segmentation fault)"
        await no_jobs(jobs, coord)

        monkeypatch.delenv(TEST_FAULT_ENV)  # the coordinator still serves, and checks again
        job = await jobs.SubmitJob(request, timeout=60)
        assert job.state == common_pb2.JOB_STATE_QUEUED
        listed = (await jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=10)).jobs
        assert [j.job_id for j in listed] == [job.job_id]


async def test_a_sparse_program_is_refused_naming_its_operator(
    tmp_path: Path, packed: PackedJob
) -> None:
    async with (
        in_process_coordinator(tmp_path / "data", **own_checks(tmp_path)) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        request = await submit_request(jobs, packed, sparse_program()[0])
        details = await refusal(jobs.SubmitJob(request, timeout=60))
        assert re.fullmatch(
            r"program refused: operator "
            r"aten\.(sparse_coo_tensor|_sparse_coo_tensor_with_dims_and_tensors)\.\w+ is not "
            r"allowed \(not on epochmesh's operator allow-list: sparse, nested and quantized "
            r"tensors, raw storage/stride access and file operators are refused\)",
            details,
        ), details
        await no_jobs(jobs, coord)


async def test_a_state_without_its_parameter_list_is_loaded_in_a_child_not_in_the_coordinator(
    tmp_path: Path, packed: PackedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client other than the CLI may leave out the initial state's metadata: the job runner
    # then takes the parameter names from a confined inspection of the program.
    def not_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("the coordinator loaded a program in its own process")

    monkeypatch.setattr(TrainableProgram, "from_bytes", not_here)  # the child is unaffected
    init = read_initial_state(packed.initial_state)
    bare = to_safetensors(init.state)
    async with (
        in_process_coordinator(tmp_path / "data", **own_checks(tmp_path)) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        request = await submit_request(jobs, packed, packed.program)
        request.initial_state.CopyFrom(await upload(jobs, bare))
        job = await jobs.SubmitJob(request, timeout=60)
        engine = coord.engine
        assert isinstance(engine, Engine)
        runner = engine.runners[job.job_id]
        deadline = time.monotonic() + 60
        while not hasattr(runner, "ps") and time.monotonic() < deadline:
            assert job.state != common_pb2.JOB_STATE_FAILED, job.message
            await asyncio.sleep(0.05)
            job = await jobs.GetJob(job_pb2.GetJobRequest(job_id=job.job_id), timeout=10)
        assert init.param_names and runner.ps.names == init.param_names
        assert runner.state_names == packed.state_names
