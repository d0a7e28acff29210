"""coordinator.market.job_billing on a real SQLite store: a round is handed out only when the escrow
covers it, applied parts are charged by the rule (re-runs of paid samples by the platform, the
fee on top), pending charges count against the escrow until written, the paid samples are
rebuilt from stored rounds, the refund empties the escrow."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from coordinator.accounting.billing import earned_micro, per_credit, quantized_rate
from coordinator.accounting.credit_book import Entry, fund_escrow, grant
from coordinator.market.credit_ledger import CreditLedger
from coordinator.market.job_billing import AboveMaxPrice, BudgetExhausted, JobBilling
from coordinator.rounds.round_state import Part, part_record
from coordinator.store.sqlite import SqliteStore
from epochmesh.quote import max_price_of
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(30)

JOB = "j-0123456789"
PRICE = 36_000_000  # 36 credits/h: 10 micro-credits per sample at 1 sample/ms


def part(node: str, start: int, stop: int, status: str = "applied") -> Part:
    n = stop - start
    return Part(
        node_id=node,
        task_id=f"t-{node}",
        ranges=np.array([[start, stop]], dtype=np.int64),
        local_batch=n,
        samples=n,
        assigned=n,
        status=status,
    )


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


@pytest.fixture
async def ledger(store: SqliteStore) -> AsyncIterator[CreditLedger]:
    ledger = CreditLedger(store)
    await ledger.reload()
    await ledger.post([grant("tenant:u-a", 10_000, at_ms=1)])
    await ledger.post([fund_escrow(JOB, "u-a", 1_000, at_ms=2, reason="budget")])
    yield ledger


def job(budget: int = 1_000) -> common_pb2.Job:
    spec = common_pb2.JobSpec(budget_micro=budget)
    return common_pb2.Job(job_id=JOB, owner="u-a", num_samples=100, spec=spec)


async def test_a_round_goes_out_only_when_the_escrow_covers_it(ledger: CreditLedger) -> None:
    billing = JobBilling(job(), ledger, fee_ppm=100_000)  # a 10 % fee
    parts = {"n1": part("n1", 0, 40), "n2": part("n2", 40, 80)}
    billing.price_parts(parts, {"n1": PRICE, "n2": 0}, {"n1": 1000.0, "n2": 5.0})
    assert parts["n1"].price == PRICE and parts["n1"].rate == 1000.0 and parts["n2"].price == 0
    # 40 samples at 10 each + 10 % = 440 <= 1000; 100 samples would be 1100 > 1000
    big = {"n1": part("n1", 0, 100)}
    with pytest.raises(BudgetExhausted, match="could cost 0.0011 credits.*holds 0.001"):
        billing.price_parts(big, {"n1": PRICE}, {"n1": 1000.0})


async def test_charges_follow_the_rule_and_reruns_are_the_platforms(ledger: CreditLedger) -> None:
    billing = JobBilling(job(), ledger, fee_ppm=100_000)
    first = {"n1": part("n1", 0, 30), "n2": part("n2", 30, 50, status="late")}
    billing.price_parts(first, {"n1": PRICE, "n2": PRICE}, {"n1": 1000.0, "n2": 1000.0})
    entries = billing.charge_round(0, 1, first.values())
    assert [(e.from_account, e.to_account, e.amount, e.samples) for e in entries] == [
        (f"escrow:{JOB}", "donor:n1", 300, 30),
        (f"escrow:{JOB}", "platform", 30, 30),
    ]
    assert billing.available() == 1_000 - 330  # pending until written
    await ledger.post(entries)
    billing.written(entries)
    assert billing.available() == 670 and billing.job.spent_micro == 330
    # Samples 20..30 were paid already (a rolled-back round): their re-run is the platform's.
    again = {"n2": part("n2", 20, 40)}
    billing.price_parts(again, {"n2": PRICE}, {"n2": 1000.0})
    entries = billing.charge_round(0, 2, again.values())
    assert [(e.from_account, e.to_account, e.amount, e.samples) for e in entries] == [
        (f"escrow:{JOB}", "donor:n2", 100, 10),
        ("platform", "donor:n2", 100, 10),
        (f"escrow:{JOB}", "platform", 10, 10),
    ]
    await ledger.post(entries)
    billing.written(entries)
    assert ledger.balance("donor:n2") == earned_micro(PRICE, 20, 1000.0) == 200
    assert sum(ledger.balances().values()) == 0
    # The refund empties the escrow into the tenant's account.
    assert await billing.refund() == 1_000 - 330 - 110
    assert ledger.balance(f"escrow:{JOB}") == 0 and billing.job.escrow_micro == 0
    assert ledger.balance("tenant:u-a") == 10_000 - 440


async def test_paid_samples_and_spending_come_back_from_the_store(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger)
    parts = {"n1": part("n1", 0, 30)}
    billing.price_parts(parts, {"n1": PRICE}, {"n1": 1000.0})
    entries = billing.charge_round(0, 1, parts.values())
    await ledger.post(entries)
    record = common_pb2.RoundRecord(job_id=JOB, epoch=0, round=1, parts=[part_record(parts["n1"])])
    restored = JobBilling(job(), ledger)
    await restored.restore(store, [record])
    assert restored.job.spent_micro == 300 and restored.available() == 700
    rerun = {"n1": part("n1", 10, 20)}
    restored.price_parts(rerun, {"n1": PRICE}, {"n1": 1000.0})
    entries = restored.charge_round(0, 2, rerun.values())
    assert [(e.from_account, e.to_account, e.amount) for e in entries] == [
        ("platform", "donor:n1", 100)
    ]


def test_the_price_rules_of_a_spec() -> None:
    spec = common_pb2.JobSpec()
    assert max_price_of(spec) == 0 and not per_credit(spec)  # no budget: donated nodes only
    spec.budget_micro = 5
    assert max_price_of(spec) is None and per_credit(spec)
    spec.max_price_micro_per_hour = 7
    assert max_price_of(spec) == 7
    spec.deadline_seconds = 60.0
    assert not per_credit(spec)  # a deadline prefers speed
    assert quantized_rate(1234.56789012) == 1234.56789 and quantized_rate(-1.0) == 0.0


async def test_a_node_whose_price_rose_above_the_cap_is_named(ledger: CreditLedger) -> None:
    free_only = JobBilling(job(budget=0), ledger)  # no budget: donated nodes only
    parts = {"n1": part("n1", 0, 10), "n2": part("n2", 10, 20)}
    with pytest.raises(AboveMaxPrice) as raised:
        free_only.price_parts(parts, {"n1": 0, "n2": 1}, {"n1": 1.0, "n2": 1.0})
    assert raised.value.nodes == ["n2"]
    capped = job()
    capped.spec.max_price_micro_per_hour = PRICE - 1
    with pytest.raises(AboveMaxPrice):
        JobBilling(capped, ledger).price_parts(parts, dict.fromkeys(parts, PRICE), {})


async def charged(billing: JobBilling, ledger: CreditLedger, round_id: int, *parts: Part) -> None:
    by_node = {p.node_id: p for p in parts}
    billing.price_parts(by_node, dict.fromkeys(by_node, PRICE), dict.fromkeys(by_node, 1000.0))
    entries = billing.charge_round(0, round_id, parts)
    await ledger.post(entries)
    billing.written(entries)


async def test_verified_pay_is_held_then_released_or_forfeited(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger, fee_ppm=100_000)
    billing.hold = True
    held = f"held:{JOB}"
    await charged(billing, ledger, 1, part("good", 0, 10), part("cheat", 10, 20))
    await charged(billing, ledger, 2, part("good", 20, 30), part("cheat", 30, 40))
    # Nobody is paid yet: 4 parts of 10 samples (100 each) wait in the held account; the
    # fee went to the platform.
    assert ledger.balance(held) == 400 and billing.held() == 400
    assert ledger.balance("donor:good") == 0 and ledger.balance("platform") == 40
    assert billing.job.spent_micro == 440
    # A check of good's round 1 vouches for round 1 only.
    assert await billing.release("good", up_to_round=1) == 100
    assert ledger.balance("donor:good") == 100 and billing.held("good") == 100
    # cheat fails a check: both its parts are forfeited, the fee returned.
    assert await billing.forfeit("cheat") == 200
    assert ledger.balance("donor:cheat") == 0 and ledger.balance("platform") == 20
    assert billing.job.spent_micro == 440 - 220
    assert billing.available() == 1_000 - 440 + 220 == ledger.balance(f"escrow:{JOB}")
    # The submitter pays for cheat's samples again when they are re-run (not the platform),
    # and good's stay paid.
    rerun = {"good": part("good", 10, 25)}
    billing.price_parts(rerun, {"good": PRICE}, {"good": 1000.0})
    entries = billing.charge_round(0, 3, rerun.values())
    assert [(e.from_account, e.to_account, e.amount, e.samples) for e in entries] == [
        (f"escrow:{JOB}", held, 100, 10),
        ("platform", held, 50, 5),
        (f"escrow:{JOB}", "platform", 10, 10),
    ]
    await ledger.post(entries)
    billing.written(entries)
    # The job ends: what is still held for nodes no check found wrong is paid.
    assert await billing.release_all(except_nodes={"cheat"}) == 100 + 150
    assert ledger.balance("donor:good") == 350 and ledger.balance(held) == 0
    assert sum(ledger.balances().values()) == 0
    reasons = {e.reason for _, e in await store.list_ledger_entries(job_id=JOB)}
    assert {"held until verified", "forfeited: failed verification"} <= reasons


async def test_pay_held_before_a_restart_is_held_again_and_forfeits_stay_unpaid(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger, fee_ppm=100_000)
    billing.hold = True
    p1, p2, p3 = part("good", 0, 10), part("cheat", 10, 20), part("late", 20, 30)
    await charged(billing, ledger, 1, p1, p2, p3)
    await billing.forfeit("cheat")
    rerun = part("good", 10, 25)  # 10 samples cheat's forfeit left unpaid, 5 re-run
    await charged(billing, ledger, 2, rerun)
    records = [
        common_pb2.RoundRecord(
            job_id=JOB, epoch=0, round=1, parts=[part_record(p) for p in (p1, p2, p3)]
        ),
        common_pb2.RoundRecord(job_id=JOB, epoch=0, round=2, parts=[part_record(rerun)]),
    ]
    spent = billing.job.spent_micro
    restored = JobBilling(job(), ledger, fee_ppm=100_000)
    restored.hold = True
    await restored.restore(store, records)
    # Held again, part by part, nothing paid out at the restart; the forfeited samples were
    # paid again by the re-run.
    held = f"held:{JOB}"
    assert restored.held("good") == 100 + 150 and restored.held("late") == 100
    assert ledger.balance(held) == 350 and ledger.balance("donor:good") == 0
    assert restored.job.spent_micro == spent and restored.available() == billing.available()
    assert restored.billed.split(0, np.array([[0, 30]])) == (0, 30)
    # A check vouches for good's round 1 only; late is caught: its pay and fee go back and
    # its samples are the submitter's to pay again.
    assert await restored.release("good", up_to_round=1) == 100
    assert await restored.forfeit("late") == 100
    assert ledger.balance("donor:good") == 100 and ledger.balance("donor:late") == 0
    assert restored.billed.split(0, np.array([[20, 30]])) == (10, 0)
    assert restored.job.spent_micro == spent - 110
    # The job ends: the rest of good's is paid, nothing is left held.
    assert await restored.release_all() == 150
    assert ledger.balance(held) == 0 and sum(ledger.balances().values()) == 0


async def test_held_pay_of_a_job_that_no_longer_holds_is_released_at_the_restart(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger)
    billing.hold = True
    p1 = part("good", 0, 10)
    await charged(billing, ledger, 1, p1)
    restored = JobBilling(job(), ledger)
    await restored.restore(
        store, [common_pb2.RoundRecord(job_id=JOB, epoch=0, round=1, parts=[part_record(p1)])]
    )
    assert ledger.balance("donor:good") == 100 and ledger.balance(f"held:{JOB}") == 0
    assert restored.held() == 0


async def test_a_release_and_a_forfeit_at_once_move_each_hold_once(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger)
    billing.hold = True
    for r in range(1, 5):
        await charged(billing, ledger, r, part("n1", 10 * r, 10 * r + 10))
    # A check of round 2 passes while another of the node's checks fails: both post to the
    # store at once (each awaits its write).
    released, forfeited = await asyncio.gather(billing.release("n1", 2), billing.forfeit("n1"))
    assert released + forfeited == 400 and released in (0, 200)
    assert ledger.balance(f"held:{JOB}") == 0 and billing.held() == 0
    assert await billing.release_all() == 0
    assert ledger.balance("donor:n1") == released


async def test_a_release_while_the_job_ends_is_paid_once(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    """A check of round 2 passes while the job is cancelled: the end's settlement reads the
    stored ledger and posts what is still held, so it must not run between the release's
    read of its holds and its write (it would pay rounds 1-2 again, and be refused)."""
    billing = JobBilling(job(), ledger)
    billing.hold = True
    for r in range(1, 5):
        await charged(billing, ledger, r, part("n1", 10 * r, 10 * r + 10))

    async def settle() -> list[Entry]:
        async with billing.settling():
            return await billing.settle_ended(store, ())

    released, settled = await asyncio.gather(billing.release("n1", 2), settle())
    assert released == 200
    assert ledger.balance("donor:n1") == 400 and ledger.balance(f"held:{JOB}") == 0
    assert billing.held() == 0 and await billing.release_all() == 0
    assert ledger.balance(f"escrow:{JOB}") == 0 and settled


async def test_a_release_waiting_for_the_store_while_the_end_is_settled_in_a_transaction(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    """The end's settlement runs in the store transaction that records the end (holding the
    store's write lock). A release that got in first waits for that lock after taking the
    billing's: were the billing's lock taken inside the transaction, each would wait for the
    other for ever. Taken before it (`settling`), the release waits and then finds the pay
    already settled."""
    billing = JobBilling(job(), ledger)
    billing.hold = True
    for r in range(1, 5):
        await charged(billing, ledger, r, part("n1", 10 * r, 10 * r + 10))
    release: asyncio.Task[int] | None = None

    async def end() -> list[Entry]:
        nonlocal release
        async with billing.settling(), store.transaction():
            # A check's verdict arrives while the transaction is open.
            release = asyncio.create_task(billing.release("n1", 2))
            await asyncio.sleep(0.05)
            return await billing.settle_ended(store, ())

    settled = await asyncio.wait_for(end(), timeout=10)
    assert release is not None
    assert await asyncio.wait_for(release, timeout=10) == 0  # settled already
    assert settled and ledger.balance("donor:n1") == 400 and ledger.balance(f"held:{JOB}") == 0
    assert billing.held() == 0


async def test_the_ends_settlement_is_refused_outside_settling(
    store: SqliteStore, ledger: CreditLedger
) -> None:
    billing = JobBilling(job(), ledger)
    with pytest.raises(RuntimeError, match="settling"):
        await billing.settle_ended(store, ())
    assert ledger.balance(f"escrow:{JOB}") == 1_000  # nothing moved
