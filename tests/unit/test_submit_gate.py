"""The submission gate (check slots served round-robin between tenants, a cap on submissions
in progress per tenant) and the verdict cache (by content, bounded, one check for concurrent
submissions of one program)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from coordinator.core.errors import ResourceExhaustedError
from coordinator.engine.program_check_cache import CheckVerdict, VerdictCache, check_version
from coordinator.engine.submit_gate import SubmitGate
from epochmesh.program.inspection import Inspection, Verdict

pytestmark = pytest.mark.timeout(30)


async def until(cond: object) -> None:
    async with asyncio.timeout(10):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0)


async def test_slots_go_round_robin_between_principals() -> None:
    gate = SubmitGate(slots=1)
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        async with gate.slot("holder"):
            await release.wait()

    async def one(principal: str, i: int) -> None:
        async with gate.slot(principal):
            order.append(f"{principal}{i}")
            await asyncio.sleep(0)

    holder = asyncio.create_task(hold())
    await until(lambda: gate.busy == 1)
    tasks = [asyncio.create_task(one("a", i)) for i in range(5)]
    await until(lambda: gate.waiting("a") == 5)
    tasks += [asyncio.create_task(one("b", i)) for i in range(2)]
    tasks.append(asyncio.create_task(one("c", 0)))
    await until(lambda: gate.waiting() == 8)
    release.set()
    await asyncio.gather(holder, *tasks)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    assert gate.busy == 0 and gate.waiting() == 0


async def test_a_cancelled_waiter_leaves_its_place_and_a_granted_one_passes_it_on() -> None:
    gate = SubmitGate(slots=1)
    release = asyncio.Event()
    got: list[str] = []

    async def hold() -> None:
        async with gate.slot("x"):
            await release.wait()

    async def one(principal: str) -> None:
        async with gate.slot(principal):
            got.append(principal)

    holder = asyncio.create_task(hold())
    await until(lambda: gate.busy == 1)
    gone = asyncio.create_task(one("gone"))
    stays = asyncio.create_task(one("stays"))
    await until(lambda: gate.waiting() == 2)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert gate.waiting() == 1 and gate.waiting("gone") == 0
    release.set()
    await asyncio.gather(holder, stays)
    assert got == ["stays"] and gate.busy == 0

    # Granted, then cancelled before it ran: the slot goes on to the next.
    async with gate.slot("x"):
        granted = asyncio.create_task(one("granted"))
        after = asyncio.create_task(one("after"))
        await until(lambda: gate.waiting() == 2)
    # The release granted "granted" its turn; it is cancelled before its task resumes.
    granted.cancel()
    await asyncio.gather(granted, return_exceptions=True)
    await after
    assert got == ["stays", "after"] and gate.busy == 0 and gate.waiting() == 0


def test_submissions_in_progress_are_capped_per_principal() -> None:
    gate = SubmitGate(slots=2, per_principal=2)
    with gate.admit("u-alice"), gate.admit("u-alice"):
        with pytest.raises(ResourceExhaustedError) as info:
            with gate.admit("u-alice"):
                pass
        assert str(info.value) == (
            "tenant u-alice has 2 job submissions in progress (waiting for or in the program "
            "check), the most one tenant may have at once (2): wait for one to be answered, "
            "then submit again"
        )
        with gate.admit("u-bob"):  # another tenant is not affected
            assert gate.in_progress("u-bob") == 1
    with gate.admit("u-alice"):  # room again
        assert gate.in_progress("u-alice") == 1
    assert gate.in_progress("u-alice") == 0


def _inspection(verdict: Verdict, reason: str = "") -> Inspection:
    return Inspection(verdict, reason)


async def test_verdicts_are_remembered_by_content_bounded_and_only_the_programs_own() -> None:
    cache = VerdictCache(max_entries=2, version="v1")
    runs: list[str] = []

    def check(verdict: Verdict, name: str) -> object:
        async def run() -> Inspection:
            runs.append(name)
            return _inspection(verdict, f"{name} reason")

        return run

    a = cache.key("a" * 64, "s" * 64)
    out = await cache.verdict(a, check(Verdict.ACCEPTED, "a"))  # type: ignore[arg-type]
    assert out.checked and out.verdict == CheckVerdict(Verdict.ACCEPTED, "a reason")
    out = await cache.verdict(a, check(Verdict.ACCEPTED, "a"))  # type: ignore[arg-type]
    assert not out.checked and runs == ["a"]
    # Another state, another key.
    other_state = cache.key("a" * 64, "t" * 64)
    assert (await cache.verdict(other_state, check(Verdict.REFUSED, "t"))).checked  # type: ignore[arg-type]
    # Another check version, another key.
    assert VerdictCache(version="v2").key("a" * 64, "s" * 64) != a
    # A timeout is the machine's, not the program's: checked again.
    slow = cache.key("b" * 64, "s" * 64)
    for _ in range(2):
        out = await cache.verdict(slow, check(Verdict.TIMED_OUT, "slow"))  # type: ignore[arg-type]
        assert out.checked
    # Bounded: the least recently used goes.
    c = cache.key("c" * 64, "s" * 64)
    await cache.verdict(c, check(Verdict.ACCEPTED, "c"))  # type: ignore[arg-type]
    assert len(cache) == 2 and cache.get(a) is None and cache.get(c) is not None
    assert cache.checks == 5 and cache.hits == 1


async def test_concurrent_checks_of_one_key_are_one_check() -> None:
    cache = VerdictCache(version="v1")
    gate = asyncio.Event()
    runs = 0

    async def run() -> Inspection:
        nonlocal runs
        runs += 1
        await gate.wait()
        return _inspection(Verdict.REFUSED, "no")

    key = cache.key("a" * 64, "s" * 64)
    tasks = [asyncio.create_task(cache.verdict(key, run)) for _ in range(5)]
    await until(lambda: runs == 1)
    await asyncio.sleep(0)
    gate.set()
    outcomes = await asyncio.gather(*tasks)
    assert runs == 1 and [o.checked for o in outcomes].count(True) == 1
    assert {o.verdict for o in outcomes} == {CheckVerdict(Verdict.REFUSED, "no")}
    assert cache.checks == 1 and cache.hits == 4


async def test_a_cancelled_check_leaves_its_waiters_to_check_again() -> None:
    cache = VerdictCache(version="v1")
    started = asyncio.Event()
    runs = 0

    async def run() -> Inspection:
        nonlocal runs
        runs += 1
        if runs == 1:
            started.set()
            await asyncio.Event().wait()  # until cancelled
        return _inspection(Verdict.ACCEPTED)

    key = cache.key("a" * 64, "s" * 64)
    first = asyncio.create_task(cache.verdict(key, run))
    await started.wait()
    second = asyncio.create_task(cache.verdict(key, run))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    out = await second
    assert out.checked and runs == 2


def test_the_check_version_is_stable_and_names_the_code() -> None:
    assert check_version() == check_version()
    assert len(check_version()) == 64


def _never_checked() -> object:
    async def run() -> Inspection:
        raise AssertionError("a kept verdict was checked again")

    return run


async def test_verdicts_kept_in_a_directory_outlive_the_cache_and_are_shared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    program, state, other = "a" * 64, "b" * 64, "c" * 64

    async def accepted() -> Inspection:
        return Inspection(Verdict.ACCEPTED, "", flops_per_sample=12.5)

    async def timed_out() -> Inspection:
        return Inspection(Verdict.TIMED_OUT, "took too long")

    first = VerdictCache(version="v1", directory=tmp_path)
    assert (await first.verdict(first.key(program, state), accepted)).checked
    assert (await first.verdict(first.key(other, state), timed_out)).checked
    # A restarted coordinator (a new cache on the same directory) takes the program's verdict,
    # counts included; the machine's (a timeout) is checked again.
    second = VerdictCache(version="v1", directory=tmp_path)
    out = await second.verdict(second.key(program, state), _never_checked())  # type: ignore[arg-type]
    assert not out.checked
    assert out.verdict == CheckVerdict(Verdict.ACCEPTED, "", flops_per_sample=12.5)
    assert (await second.verdict(second.key(other, state), timed_out)).checked
    [kept] = tmp_path.rglob(f"{program}-{state}.json")
    # Another version (other code, other limits) does not.
    third = VerdictCache(version="v2", directory=tmp_path)
    assert (await third.verdict(third.key(program, state), accepted)).checked
    # A damaged file is ignored with a warning, and the check runs again and rewrites it.
    for damaged in (b"{not json", b'{"verdict": "timed_out", "reason": "", "version": "v1"}'):
        kept.write_bytes(damaged)
        fresh = VerdictCache(version="v1", directory=tmp_path)
        with caplog.at_level(logging.WARNING):
            assert (await fresh.verdict(fresh.key(program, state), accepted)).checked
        assert "verdict" in caplog.text and "ignored" in caplog.text
        caplog.clear()
    again = VerdictCache(version="v1", directory=tmp_path)
    out = await again.verdict(again.key(program, state), _never_checked())  # type: ignore[arg-type]
    assert not out.checked and out.verdict.flops_per_sample == 12.5


async def test_a_verdict_directory_that_cannot_be_written_fails_no_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    cache = VerdictCache(version="v1", directory=blocked)

    async def refused() -> Inspection:
        return Inspection(Verdict.REFUSED, "off the allow-list")

    with caplog.at_level(logging.WARNING):
        out = await cache.verdict(cache.key("a" * 64, "b" * 64), refused)
    assert out.checked and out.verdict == CheckVerdict(Verdict.REFUSED, "off the allow-list")
    assert "not kept" in caplog.text
    # Still remembered in memory.
    assert not (await cache.verdict(cache.key("a" * 64, "b" * 64), _never_checked())).checked  # type: ignore[arg-type]
    # Keys that are not two digests never name a file.
    odd = VerdictCache(version="v1", directory=tmp_path / "d")
    await odd.verdict(odd.key("../../x", "b" * 64), refused)
    assert not (tmp_path / "d").exists()


def test_the_check_version_digests_the_limits() -> None:
    assert check_version("60s 2147483648B") != check_version("60s 1073741824B")
    assert check_version("60s 2147483648B") == check_version("60s 2147483648B")
