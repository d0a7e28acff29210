"""QuoteJob against a real in-process coordinator: the coordinator's platform fee
(``--platform-fee``) is on the quote, per part, as the billing rule charges it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.engine.engine import Engine
from epochmesh import identity as idm
from epochmesh.money import MICRO
from epochmesh.packaging import PackedJob
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_quote_flops import packed, upload
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(120)

__all__ = ["packed"]  # the fixture

FEE_PPM = 100_000  # 10 %


async def _never_trains(agent: FakeAgent, task: agent_pb2.Task) -> None:
    return None


async def _quote(data: Path, fee_ppm: int, packed: PackedJob) -> scheduler_pb2.QuoteJobResponse:
    async with in_process_coordinator(
        data, engine_factory=Engine, heartbeat_interval_s=0.2, platform_fee_ppm=fee_ppm
    ) as coord:
        agent = FakeAgent(coord, "a", 1000.0, _never_trains)
        agent.price = 3 * MICRO
        await agent.start()
        try:
            await agent.stub.ReportBenchmark(  # its reference benchmark, as an agent reports it
                agent_pb2.ReportBenchmarkRequest(
                    node_id=agent.node_id,
                    lease_id=agent.lease_id,
                    result=common_pb2.BenchmarkResult(samples_per_second=1000.0),
                ),
                timeout=10,
            )

            def priced() -> bool:
                info = coord.registry.get(agent.node_id)
                return (
                    info is not None
                    and info.benchmark.samples_per_second > 0
                    and info.price_micro_per_hour == agent.price
                )

            await async_wait_until(priced, timeout=30)
            operator = coord.issue_identity("operator")
            async with idm.secure_aio_channel(coord.address, operator) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                spec = common_pb2.JobSpec(
                    name="q", epochs=2, global_batch=32, min_nodes=1, max_nodes=1
                )
                spec.budget_micro = 10 * MICRO
                jobs = job_pb2_grpc.JobServiceStub(channel)
                reply: scheduler_pb2.QuoteJobResponse = await stub.QuoteJob(
                    scheduler_pb2.QuoteJobRequest(
                        spec=spec,
                        num_samples=1000,
                        program_sha256=(await upload(jobs, packed.program)).sha256,
                        initial_state_sha256=(await upload(jobs, packed.initial_state)).sha256,
                    ),
                    timeout=60,
                )
                return reply
        finally:
            await agent.stop()


async def test_the_platform_fee_is_on_the_quote(tmp_path: Path, packed: PackedJob) -> None:
    plain = await _quote(tmp_path / "plain", 0, packed)
    with_fee = await _quote(tmp_path / "fee", FEE_PPM, packed)
    assert plain.fits and with_fee.fits
    assert plain.fee_micro == 0 and plain.total_cost_micro > 0
    assert with_fee.fee_micro > 0
    # The fee comes on top of what the donors earn, about FEE_PPM of it (rounded per part).
    earned = with_fee.total_cost_micro - with_fee.fee_micro
    assert earned == pytest.approx(plain.total_cost_micro, rel=0.05)
    assert with_fee.fee_micro == pytest.approx(earned * FEE_PPM / 1_000_000, rel=0.05)
