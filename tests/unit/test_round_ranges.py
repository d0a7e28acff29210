"""Unit tests of the sample-range encoding of coordinator.rounds.sample_ranges (index runs of a round's
parts, appended to Task / RoundPart messages as wire bytes instead of message objects)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.rounds.ledger import EpochLedger, index_runs
from coordinator.rounds.sample_ranges import (
    ROUND_PART_RANGES_FIELD,
    TASK_RANGES_FIELD,
    encode_ranges_field,
    head_of_runs,
    index_run_array,
    touched_shards,
)
from epochmesh.dataset import ranges_to_indices
from epochmesh.v1 import agent_pb2, common_pb2

pytestmark = pytest.mark.timeout(60)


def test_index_runs_match_the_ledgers() -> None:
    idx = np.array([5, 6, 7, 0, 9, 10, 3, 4, 2])
    assert index_run_array(idx).tolist() == [list(r) for r in index_runs(idx)]
    assert index_run_array(np.zeros(0, dtype=np.int64)).shape == (0, 2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**61), st.integers(0, 2**61)).map(lambda t: (t[0], t[0] + t[1])),
        max_size=40,
    )
)
def test_wire_bytes_parse_as_the_messages_would(runs: list[tuple[int, int]]) -> None:
    arr = np.array(runs, dtype=np.int64).reshape(-1, 2)
    task = agent_pb2.Task(task_id="t", local_batch=3)
    task.MergeFromString(encode_ranges_field(TASK_RANGES_FIELD, arr))
    want = agent_pb2.Task(
        task_id="t",
        local_batch=3,
        ranges=[common_pb2.SampleRange(start=a, stop=b) for a, b in runs],
    )
    assert task == want
    part = common_pb2.RoundPart(node_id="n")
    part.MergeFromString(encode_ranges_field(ROUND_PART_RANGES_FIELD, arr))
    assert [(r.start, r.stop) for r in part.ranges] == runs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 9)), max_size=12),
    st.integers(0, 200),
)
def test_head_of_runs_is_the_first_indices_in_order(runs: list[tuple[int, int]], n: int) -> None:
    arr = np.array([(a, a + k) for a, k in runs], dtype=np.int64).reshape(-1, 2)
    flat = [i for a, b in arr.tolist() for i in range(a, b)]
    head = head_of_runs(arr, min(n, len(flat)))
    assert [i for a, b in head.tolist() for i in range(a, b)] == flat[: min(n, len(flat))]
    assert head.shape[1] == 2 and bool((head[:, 1] > head[:, 0]).all())


def test_refuses_negative_ranges_and_long_tags() -> None:
    with pytest.raises(ValueError):
        encode_ranges_field(TASK_RANGES_FIELD, np.array([[-1, 2]]))
    with pytest.raises(ValueError):
        encode_ranges_field(16, np.array([[1, 2]]))


def test_a_local_sgd_round_of_67200_shuffled_samples_is_cheap() -> None:
    n = 67200  # H = 700 x B = 96 (scripts/bench_wan.py), one shard shuffled inside
    led = EpochLedger(n, 0, 0, block_size=n)
    led.assign_segments({"a": 1.0, "b": 1.0, "c": 1.0})
    plan = led.plan_round(1, {"a": n // 3, "b": n // 3, "c": n // 3})
    # CPU time of this process: what the work costs, whatever else the host is running.
    t0 = time.process_time()
    tasks = []
    for positions in plan.values():
        runs = index_run_array(led.positions_to_indices(positions))
        task = agent_pb2.Task(task_id="t")
        task.MergeFromString(encode_ranges_field(TASK_RANGES_FIELD, runs))
        tasks.append(task)
    elapsed = time.process_time() - t0
    seen = np.concatenate([ranges_to_indices(t.ranges) for t in tasks])
    assert sorted(seen.tolist()) == list(range(n))
    # Message objects took ~0.4 s here (index runs as tuples, then SampleRange messages).
    assert elapsed < 0.15, elapsed


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 60)), max_size=20),
)
def test_touched_shards_are_the_shards_a_scan_finds(
    counts: list[int], raw_runs: list[tuple[int, int]]
) -> None:
    starts = np.cumsum([0, *counts[:-1]]).astype(np.int64)
    total = sum(counts)
    runs = np.array(
        [[a % total, min(total, a % total + n)] for a, n in raw_runs], dtype=np.int64
    ).reshape(-1, 2)
    scan = [
        i
        for i, (s, c) in enumerate(zip(starts.tolist(), counts, strict=True))
        if bool(np.any((runs[:, 0] < s + c) & (runs[:, 1] > s)))
    ]
    assert touched_shards(starts, runs).tolist() == scan


def test_touched_shards_of_a_round_on_a_large_dataset_take_little_time() -> None:
    starts = np.arange(0, 1_000_000, 100, dtype=np.int64)  # 10 000 shards
    rng = np.random.default_rng(0)
    runs = index_run_array(rng.permutation(1_000_000)[:4096])
    t0 = time.process_time()  # CPU time: the cost, not the host's load
    got = touched_shards(starts, runs)
    assert time.process_time() - t0 < 1.0
    assert set(got.tolist()) == {i // 100 for a, b in runs.tolist() for i in range(a, b)}
