"""The agent's schedule for an unreachable coordinator (node_agent/link/backoff.py) and the
shared job reference rule (epochmesh/job_ref.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epochmesh.job_ref import MAX_REF_CHARS, check_job_ref, match_jobs
from node_agent.link.backoff import RetrySchedule, UnreachableReport

pytestmark = pytest.mark.timeout(60)


def test_waits_double_from_one_second_to_the_cap() -> None:
    schedule = RetrySchedule(base=1.0, cap=60.0, jitter=0.0)
    assert [schedule.next_delay() for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    schedule.reset()
    assert schedule.next_delay() == 1.0


@given(seed=st.integers(0, 2**32), jitter=st.floats(0.0, 0.49))
def test_jittered_waits_still_grow_until_the_cap(seed: int, jitter: float) -> None:
    schedule = RetrySchedule(base=1.0, cap=60.0, jitter=jitter, rng=random.Random(seed))
    waits = [schedule.next_delay() for _ in range(12)]
    for n, wait in enumerate(waits):
        ceiling = min(60.0, 2.0**n)
        assert ceiling * (1 - jitter) <= wait <= ceiling
    growing = [w for n, w in enumerate(waits) if 2.0**n <= 60.0 * (1 - jitter)]
    assert growing == sorted(growing) and len(set(growing)) == len(growing)


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        RetrySchedule(base=0.0)
    with pytest.raises(ValueError):
        RetrySchedule(base=2.0, cap=1.0)
    with pytest.raises(ValueError):
        RetrySchedule(jitter=1.0)


def test_a_warning_at_the_first_failure_then_a_reminder_every_ten_minutes() -> None:
    report = UnreachableReport(remind_every_s=600.0)
    warned = [t for t in (0, 1, 3, 7, 15, 31, 63, 123, 183, 603, 663, 1203) if report.failed(t)]
    assert warned == [0, 603, 1203]
    assert report.failures == 12 and report.down_for(1203) == 1203
    assert report.succeeded() is True
    assert report.succeeded() is False  # said once
    assert report.failed(2000) is True  # a new outage warns at once


@dataclass
class Job:
    job_id: str
    name: str


JOBS = [
    Job("j-0123456789", "zen-of-python"),
    Job("j-01aaaaaaaa", "twin"),
    Job("j-ffffffffff", "twin"),
    Job("j-abcdef0123", "has spaces / and slashes"),
]


@pytest.mark.parametrize(
    ("ref", "ids"),
    [
        ("j-0123456789", ["j-0123456789"]),  # the full id
        ("j-0123", ["j-0123456789"]),  # a unique prefix
        ("j-01", ["j-0123456789", "j-01aaaaaaaa"]),  # an ambiguous one
        ("zen-of-python", ["j-0123456789"]),  # a name
        ("twin", ["j-01aaaaaaaa", "j-ffffffffff"]),
        ("has spaces / and slashes", ["j-abcdef0123"]),
        ("nothing", []),
    ],
)
def test_a_reference_names_ids_prefixes_and_names(ref: str, ids: list[str]) -> None:
    assert [j.job_id for j in match_jobs(ref, JOBS)] == ids


def test_references_that_cannot_name_a_job_are_refused() -> None:
    assert check_job_ref("  zen-of-python \n") == "zen-of-python"
    for bad in ("", "   ", "x" * (MAX_REF_CHARS + 1), "a\x00b"):
        with pytest.raises(ValueError):
            check_job_ref(bad)
