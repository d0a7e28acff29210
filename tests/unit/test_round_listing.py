"""Unit tests of coordinator.engine.with_unwritten: GetRounds/WatchJob show the records of
closed rounds still being written (in the background, while the next round runs) after the
stored ones, each round once, within since_round and limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.engine import with_unwritten
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(60)


def rec(n: int) -> common_pb2.RoundRecord:
    return common_pb2.RoundRecord(job_id="j", round=n)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 12),  # rounds 1..closed are closed
    st.integers(0, 12),  # the first `stored` of them are in the store
    st.integers(0, 3),  # and the last `overlap` stored ones are still listed as unwritten
    st.integers(0, 14),
    st.integers(0, 15),
)
def test_every_closed_round_is_listed_once_in_order(
    closed: int, stored: int, overlap: int, since_round: int, limit: int
) -> None:
    stored = min(stored, closed)
    overlap = min(overlap, stored)
    in_store = [rec(n) for n in range(1, stored + 1)]
    unwritten = [rec(n) for n in range(stored + 1 - overlap, closed + 1)]
    # What the store returns for the filter (rounds after since_round, at most limit).
    read = [r for r in in_store if r.round > since_round]
    read = read[:limit] if limit > 0 else read
    got = [r.round for r in with_unwritten(read, unwritten, since_round, limit)]
    want = [n for n in range(1, closed + 1) if n > since_round]
    assert got == (want[:limit] if limit > 0 else want)


def test_nothing_unwritten_lists_the_store() -> None:
    stored = [rec(1), rec(2)]
    assert with_unwritten(stored, [], 0, 0) == stored
    assert with_unwritten([], [], 5, 0) == []
