"""Money and log holes closed, with the real engine over real gRPC + TLS and a real SQLite store
(the agents are played by the test: tests/integration/fake_agent.py).

- A node's ReportBenchmark for a job is taken only as the answer to a benchmark task of that
  job handed to that node: another node's (a real node identity) is refused and never reaches
  the job's runner or its owner's log.
- An ended job's escrow and held pay are settled with its end: a store left as a crash between
  a cancel and its refund leaves it (the job CANCELLED, its escrow full, pay held) is settled by
  the coordinator's start-up sweep, once (a second start moves nothing).
- A node flipping its price 500 times makes a bounded number of events; the market uses its
  last price at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc
import pytest

from coordinator.accounting.credit_book import (
    HELD,
    PLATFORM_FEE,
    Entry,
    donor_account,
    escrow_account,
    fund_escrow,
    grant,
    held_account,
    tenant_account,
)
from coordinator.app import Coordinator
from coordinator.core.config import CoordinatorConfig
from coordinator.engine.engine import Engine
from coordinator.engine.job_pay import JobPay
from coordinator.engine.round_writer import RoundWriter
from coordinator.market.job_billing import JobBilling
from coordinator.nodes.registry import PRICE_EVENT_INTERVAL_S
from coordinator.store.events import NODE_EVENTS_BURST, NODE_EVENTS_PER_S
from coordinator.store.sqlite import SqliteStore
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import FakeAgent, submit_packed
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(120)

JS = common_pb2.JobState


async def _never_trains(agent: FakeAgent, task: agent_pb2.Task) -> None:
    await asyncio.sleep(3600)


async def test_a_benchmark_for_a_job_not_asked_of_the_node_is_refused_and_not_logged(
    tmp_path: Path,
) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        64,
        overrides={
            "train": {"epochs": 1, "global_batch": 16},
            "cluster": {"min_nodes": 1, "max_nodes": 1},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:
        asked = await FakeAgent(coord, "asked", 100.0, _never_trains).start()
        try:
            job = await submit_packed(coord, packed)
            # The job benchmarks `asked` (its only node: max_nodes 1) and hands it a part.
            await async_wait_until(lambda: bool(asked.tasks), timeout=60)
            runner = coord.engine.runners[job.job_id]  # type: ignore[attr-defined]
            assert asked.node_id in runner.bench  # its own answer was taken
            # A second node, with its own real identity and lease, never asked for one.
            stranger = await FakeAgent(coord, "stranger", 100.0, _never_trains).start()
            try:
                forged = common_pb2.BenchmarkResult(job_id=job.job_id, samples_per_second=1e-5)
                for task_id in ("", "t-000000000000", asked.tasks[0].task_id):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stranger.stub.ReportBenchmark(
                            agent_pb2.ReportBenchmarkRequest(
                                node_id=stranger.node_id,
                                lease_id=stranger.lease_id,
                                task_id=task_id,
                                result=forged,
                            ),
                            timeout=10,
                        )
                    assert err.value.code() in (
                        grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.FAILED_PRECONDITION,
                    ), err.value
                    assert "benchmark" in (err.value.details() or "")
                assert stranger.node_id not in runner.bench
                events = await coord.store.list_events(job_id=job.job_id, kinds=["node.benchmark"])
                assert [e.node_id for e in events] == [asked.node_id], events
                # `asked` reporting again for a task that is no longer awaited: refused too.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asked.stub.ReportBenchmark(
                        agent_pb2.ReportBenchmarkRequest(
                            node_id=asked.node_id,
                            lease_id=asked.lease_id,
                            task_id=asked.tasks[0].task_id,
                            result=forged,
                        ),
                        timeout=10,
                    )
                assert err.value.code() in (
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
                assert runner.bench[asked.node_id].samples_per_second == 100.0
            finally:
                await stranger.stop()
        finally:
            await asked.stop()


JOB = "j-0a1b2c3d4e"
TENANT = "u-alice"


async def _crashed_cancel(db: Path, donor_node: str) -> None:
    """The store as a kill -9 right after a cancel leaves it: the job CANCELLED, its escrow
    holding what the rounds did not spend, a part's pay still held (written through the real
    store, as the coordinator writes them)."""
    store = await SqliteStore.open(db)
    try:
        spec = common_pb2.JobSpec(budget_micro=5_000_000, epochs=1, global_batch=8)
        await store.create_job(
            common_pb2.Job(job_id=JOB, name="x", state=JS.JOB_STATE_CANCELLED, spec=spec),
            owner=TENANT,
        )
        await store.add_ledger_entries(
            [
                grant(tenant_account(TENANT), 10_000_000, at_ms=1),
                fund_escrow(JOB, TENANT, 5_000_000, at_ms=2, reason="budget"),
                Entry(3, escrow_account(JOB), held_account(JOB), 700, HELD, JOB, 1, donor_node, 7),
                Entry(3, escrow_account(JOB), "platform", 7, PLATFORM_FEE, JOB, 1, donor_node, 7),
            ]
        )
    finally:
        await store.close()


async def test_an_ended_job_left_with_its_escrow_by_a_crash_is_settled_at_start_once(
    tmp_path: Path,
) -> None:
    data = tmp_path / "coord"
    data.mkdir()
    node = "n-0123456789"
    await _crashed_cancel(CoordinatorConfig(data_dir=data).db_path, node)
    for start in range(2):
        async with in_process_coordinator(data, engine_factory=Engine) as coord:
            credits = coord.credits
            assert credits.balance(escrow_account(JOB)) == 0
            assert credits.balance(held_account(JOB)) == 0
            # The held pay is the donor's (no check found the node wrong), the rest refunded.
            assert credits.balance(donor_account(node)) == 700
            assert credits.balance(tenant_account(TENANT)) == 10_000_000 - 707
            assert sum(credits.balances().values()) == 0
            refunds = [
                e
                for _, e in await coord.store.list_ledger_entries(job_id=JOB)
                if e.reason == "refund"
            ]
            assert [e.amount for e in refunds] == [5_000_000 - 707], start  # exactly once
            job = await coord.store.get_job(JOB)
            assert job is not None and job.state == JS.JOB_STATE_CANCELLED
            assert job.escrow_micro == 0


async def queued_with_escrow(coord: Coordinator) -> None:
    """JOB, queued and without a runner (as one submitted on another coordinator), with 600 of
    its tenant's 1,000 micro-credits in its escrow."""
    await coord.store.create_job(
        common_pb2.Job(job_id=JOB, name="x", state=JS.JOB_STATE_QUEUED), owner=TENANT
    )
    await coord.credits.post(
        [
            grant(tenant_account(TENANT), 1_000, at_ms=1),
            fund_escrow(JOB, TENANT, 600, at_ms=2, reason="budget"),
        ]
    )


async def assert_cancelled_and_refunded(coord: Coordinator) -> None:
    """JOB is stored CANCELLED with its escrow back with its tenant."""
    assert coord.credits.balance(escrow_account(JOB)) == 0
    assert coord.credits.balance(tenant_account(TENANT)) == 1_000
    stored = await coord.store.get_job(JOB)
    assert stored is not None and stored.state == JS.JOB_STATE_CANCELLED
    assert stored.escrow_micro == 0


async def test_a_cancel_records_the_end_and_its_refund_together(tmp_path: Path) -> None:
    """A job cancelled on a coordinator that has no runner for it (none started yet) is
    refunded with its CANCELLED record, not left holding its escrow."""
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        await queued_with_escrow(coord)
        engine: Engine = coord.engine  # type: ignore[assignment]
        assert JOB not in engine.runners
        await engine.cancel_job(job_pb2.CancelJobRequest(job_id=JOB), None)  # type: ignore[arg-type]
        await assert_cancelled_and_refunded(coord)


async def test_a_cancel_and_its_runners_last_settlement_refund_the_escrow_once(
    tmp_path: Path,
) -> None:
    """A cancel records the job's end and settles its money on the cancel's task while the
    job's runner, seeing the job ended, settles on its own: the runner's settlement waits for
    the recording, so the escrow is refunded once and the cancel does not fail (it did: the
    runner's refund emptied the escrow in the ledger, while the cancel's settlement, computed
    from the store where that refund was not written yet, wanted it again)."""
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        await queued_with_escrow(coord)
        job = await coord.store.get_job(JOB)
        assert job is not None
        ctx = coord.engine.ctx  # type: ignore[attr-defined]

        async def stored() -> None:
            return None

        writer = RoundWriter(ctx, job, background=False, on_stored=stored)
        pay = JobPay(ctx, job, JobBilling(job, coord.credits), writer)
        previous = job.state
        job.state = JS.JOB_STATE_CANCELLED  # as the runner's _set_state, then record_end
        await asyncio.wait_for(
            asyncio.gather(pay.record_end(previous, set()), pay.settle_at_exit(set())), 30
        )
        refunds = [
            e for _, e in await coord.store.list_ledger_entries(job_id=JOB) if e.reason == "refund"
        ]
        assert [e.amount for e in refunds] == [600]
        await assert_cancelled_and_refunded(coord)


async def test_a_node_flipping_its_price_makes_few_events_and_its_last_price_counts(
    tmp_path: Path,
) -> None:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:
        agent = await FakeAgent(coord, "flipper", 100.0, _never_trains).start()
        try:
            before = await coord.store.count_events()
            last = 0
            for i in range(500):
                last = agent.price = 1_000_000 * (1 + i % 2) + i
                await agent.stub.Heartbeat(
                    agent_pb2.HeartbeatRequest(
                        node_id=agent.node_id,
                        lease_id=agent.lease_id,
                        price_micro_per_hour=last,
                    ),
                    timeout=10,
                )
            # The market reads the last price at once.
            assert coord.registry.require(agent.node_id).price_micro_per_hour == last
            async with coord_channel(coord) as sched:
                info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=agent.node_id))
            assert info.price_micro_per_hour == last
            prices = await coord.store.list_events(node_id=agent.node_id, kinds=["node.price"])
            # One event per interval (the first at once, the latest when its interval is over).
            assert 1 <= len(prices) <= 2, [e.message for e in prices]
            written = await coord.store.count_events() - before
            assert written <= 10, written

            # Then the latest price is stored and logged once its interval is over.
            async def logged() -> bool:
                await coord.registry.flush_prices()
                evs = await coord.store.list_events(node_id=agent.node_id, kinds=["node.price"])
                return evs[-1].attrs["price_micro_per_hour"] == str(last)

            await async_wait_until(logged, timeout=PRICE_EVENT_INTERVAL_S + 10)
            stored = await coord.store.get_node(agent.node_id)
            assert stored is not None and stored.info.price_micro_per_hour == last
        finally:
            await agent.stop()


async def test_a_nodes_event_flood_is_cut_and_its_drops_reported_in_one_event(
    tmp_path: Path,
) -> None:
    """Whatever a node does to cause events (reference benchmarks here, each one stored and
    logged), what it can write is bounded; the drops are counted in one summary event."""
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:
        agent = await FakeAgent(coord, "chatty", 100.0, _never_trains).start()
        try:
            began = time.monotonic()
            for i in range(400):
                await agent.stub.ReportBenchmark(
                    agent_pb2.ReportBenchmarkRequest(
                        node_id=agent.node_id,
                        lease_id=agent.lease_id,
                        result=common_pb2.BenchmarkResult(samples_per_second=100.0 + i),
                    ),
                    timeout=10,
                )
            await coord.events.report_drops()
            mine = await coord.store.list_events(node_id=agent.node_id)
            # However long a busy host makes the flood last: the node's budget refills at its
            # rate meanwhile, and its drops are reported at each heartbeat flush (one summary
            # per flush at most) and once more here.
            took = time.monotonic() - began
            flushes = math.floor(took / coord.config.heartbeat_flush_interval_s)
            assert len(mine) <= NODE_EVENTS_BURST + NODE_EVENTS_PER_S * took + 40, (len(mine), took)
            summaries = [e for e in mine if e.kind == "node.events_dropped"]
            dropped = sum(int(e.attrs["dropped"]) for e in summaries)
            assert dropped > 0 and coord.events.dropped_total >= dropped
            assert len(summaries) <= flushes + 3, (len(summaries), took)
            # The node's latest figure is still the one kept.
            assert coord.registry.require(agent.node_id).benchmark.samples_per_second == 499.0
        finally:
            await agent.stop()


def coord_channel(coord: object):  # type: ignore[no-untyped-def]
    """A SchedulerService stub over an operator's channel."""
    import contextlib

    from epochmesh import identity as idm

    @contextlib.asynccontextmanager
    async def open_():  # type: ignore[no-untyped-def]
        async with idm.secure_aio_channel(
            coord.address,  # type: ignore[attr-defined]
            coord.issue_identity("operator"),  # type: ignore[attr-defined]
        ) as ch:
            yield scheduler_pb2_grpc.SchedulerServiceStub(ch)

    return open_()
