# ruff: noqa: F811
"""QuoteJob rates nodes by the program's FLOPs as the coordinator's own program check counts
them, never by the figure the client sends: a real in-process coordinator (its engine and its
confined program check), the program and initial state uploaded over gRPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from coordinator.engine.engine import Engine
from coordinator.market.program_flops import known_flops
from epochmesh import identity as idm
from epochmesh.money import MICRO
from epochmesh.packaging import PackedJob
from epochmesh.program.archive import TrainableProgram
from epochmesh.program.flops import declared_flops_per_sample, training_flops_per_sample
from epochmesh.v1 import (
    agent_pb2,
    common_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from epochmesh.wire.tensors import from_safetensors
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_program_check import packed, upload  # noqa: F401 (fixture)
from tests.procs import async_wait_until, in_process_coordinator

# The module's packed MLP and the upload helper are test_program_check's.
pytestmark = pytest.mark.timeout(120)


async def _never_trains(agent: FakeAgent, task: agent_pb2.Task) -> None:
    return None


async def start_priced_agent(coord: object) -> FakeAgent:
    """One agent with a reference benchmark and a price, registered and seen priced."""
    agent = FakeAgent(coord, "a", 1000.0, _never_trains)  # type: ignore[arg-type]
    agent.price = 3 * MICRO
    await agent.start()
    await agent.stub.ReportBenchmark(
        agent_pb2.ReportBenchmarkRequest(
            node_id=agent.node_id,
            lease_id=agent.lease_id,
            result=common_pb2.BenchmarkResult(samples_per_second=1000.0),
        ),
        timeout=10,
    )

    def priced() -> bool:
        info = coord.registry.get(agent.node_id)  # type: ignore[attr-defined]
        return (
            info is not None
            and info.benchmark.samples_per_second > 0
            and info.price_micro_per_hour == agent.price
        )

    await async_wait_until(priced, timeout=30)
    return agent


def quote_request(program: str, state: str, client_flops: float) -> scheduler_pb2.QuoteJobRequest:
    spec = common_pb2.JobSpec(name="q", epochs=2, global_batch=32, min_nodes=1, max_nodes=1)
    spec.budget_micro = 10 * MICRO
    return scheduler_pb2.QuoteJobRequest(
        spec=spec,
        num_samples=1000,
        flops_per_sample=client_flops,
        program_sha256=program,
        initial_state_sha256=state,
        state_bytes=1000,
    )


async def test_a_false_client_flop_figure_does_not_change_the_quote(
    tmp_path: Path, packed: PackedJob
) -> None:
    data = from_safetensors(packed.shards[0][2])
    spec = packed.spec
    client_count = training_flops_per_sample(
        packed.program,
        packed.initial_state,
        [data[k][:4] for k in spec.inputs],
        [data[k][:4] for k in spec.targets],
    )
    own = declared_flops_per_sample(
        TrainableProgram.from_bytes(packed.program, packed.initial_state)
    )
    assert own == client_count > 0  # zeros of the declared shapes count as real samples do
    async with in_process_coordinator(
        tmp_path, engine_factory=Engine, heartbeat_interval_s=0.2
    ) as coord:
        agent = await start_priced_agent(coord)
        try:
            submitter = coord.issue_identity("operator")
            async with idm.secure_aio_channel(coord.address, submitter) as channel:
                jobs = job_pb2_grpc.JobServiceStub(channel)
                scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                # A program never uploaded: the coordinator cannot count it, and says so.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await scheduler.QuoteJob(
                        quote_request("cd" * 32, "ef" * 32, client_count), timeout=30
                    )
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "not uploaded" in (info.value.details() or "")
                program = (await upload(jobs, packed.program)).sha256
                state = (await upload(jobs, packed.initial_state)).sha256
                replies = [
                    await scheduler.QuoteJob(quote_request(program, state, f), timeout=60)
                    for f in (client_count, client_count * 1e6, 1.0, 0.0)
                ]
            remembered = await known_flops(coord.store)
        finally:
            await agent.stop()
    honest = replies[0]
    assert honest.fits and honest.flops_per_sample == pytest.approx(own)
    for liar in replies[1:]:
        assert liar.flops_per_sample == honest.flops_per_sample
        assert liar.total_seconds == honest.total_seconds
        assert liar.total_cost_micro == honest.total_cost_micro
        assert [n.samples_per_second for n in liar.nodes] == [
            n.samples_per_second for n in honest.nodes
        ]
    # Stored with the program, for the calibration of other quotes: the coordinator's count.
    assert remembered == {program: pytest.approx(own)}
