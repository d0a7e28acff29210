"""A training part's dataset indices as index runs, and their protobuf wire form.

A part's samples are held as an (k, 2) int64 array of [start, stop) runs in training order,
never as Python tuples or SampleRange messages (a local SGD round has tens of thousands of
runs); this module turns indices into runs, finds the shards they touch and writes the wire
bytes of ``repeated SampleRange`` directly.
"""

from __future__ import annotations

import numpy as np

# Field numbers of `repeated SampleRange ranges` in Task and in RoundPart (agent.proto,
# common.proto), for encode_ranges_field.
TASK_RANGES_FIELD = 9
ROUND_PART_RANGES_FIELD = 3
# Up to this many runs are encoded in plain Python (`_encode_few`), more through arrays.
SMALL_RUNS = 16


def index_run_array(indices: np.ndarray) -> np.ndarray:
    """Dataset indices in training order -> their maximal runs of +1 steps as an (k, 2) int64
    array of [start, stop) rows, in order (what a Task's ``ranges`` carries). With shuffling
    inside shards most runs hold one sample: a local SGD round of H x B samples has about as
    many runs, so they stay in numpy (tens of thousands of Python tuples and protobuf messages
    per round cost the event loop a large part of a second)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [idx.size]))
    return np.stack([idx[starts], idx[ends - 1] + 1], axis=1)


def touched_shards(shard_starts: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """Indices of the shards that ``runs`` ((k, 2) [start, stop) rows, non-empty) touch, in
    order, for shards contiguous from 0 that start at ``shard_starts`` (ascending): two binary
    searches per run (a per-shard scan costs the event loop milliseconds a round once a
    dataset has hundreds of shards)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    n = len(shard_starts)
    if n == 0 or len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.searchsorted(shard_starts, runs[:, 0], side="right") - 1
    last = np.searchsorted(shard_starts, runs[:, 1] - 1, side="right") - 1
    opens = np.bincount(np.clip(first, 0, n - 1), minlength=n + 1)
    closes = np.bincount(np.clip(last, 0, n - 1) + 1, minlength=n + 1)
    return np.flatnonzero(np.cumsum(opens[:n] - closes[:n]) > 0)


def _varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Protobuf varint encoding of non-negative int64 values: (n, 10) bytes and the number of
    bytes each value uses."""
    v = values.astype(np.uint64)
    shifts = np.arange(10, dtype=np.uint64) * np.uint64(7)
    groups = ((v[:, None] >> shifts[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    lengths = 1 + (v[:, None] >= (np.uint64(1) << shifts[None, 1:])).sum(axis=1)
    cont = np.arange(10)[None, :] < (lengths[:, None] - 1)
    return groups | (cont.astype(np.uint8) << 7), lengths


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_few(field_number: int, runs: list[list[int]]) -> bytes:
    """`encode_ranges_field` for a few runs (a round's part, a check's chunk): plain Python,
    without the dozen array operations that cost more than the encoding itself."""
    tag = bytes([(field_number << 3) | 2])
    out = []
    for start, stop in runs:
        a, b = _varint(start), _varint(stop)
        out.append(b"%s%c\x08%s\x10%s" % (tag, 2 + len(a) + len(b), a, b))
    return b"".join(out)


def encode_ranges_field(field_number: int, runs: np.ndarray) -> bytes:
    """The wire bytes of ``repeated SampleRange <field_number>`` holding ``runs`` ((k, 2)
    [start, stop) rows, >= 0): merged into a message with ``MergeFromString`` they append the
    ranges, as ``SampleRange(start=, stop=)`` messages would, in a few milliseconds."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    n = len(runs)
    if n == 0:
        return b""
    if int(runs.min()) < 0:
        raise ValueError("sample ranges must not be negative")
    if not 0 < field_number < 16:
        raise ValueError(f"field number {field_number} needs a one-byte tag")
    if n <= SMALL_RUNS:
        return _encode_few(field_number, runs.tolist())
    start, start_len = _varints(runs[:, 0])
    stop, stop_len = _varints(runs[:, 1])
    # Columns: tag, length, 0x08, start (10), 0x10, stop (10); unused varint bytes masked out.
    rows = np.zeros((n, 24), dtype=np.uint8)
    rows[:, 0] = (field_number << 3) | 2
    rows[:, 1] = 2 + start_len + stop_len
    rows[:, 2] = 0x08
    rows[:, 3:13] = start
    rows[:, 13] = 0x10
    rows[:, 14:24] = stop
    mask = np.ones((n, 24), dtype=bool)
    cols = np.arange(10)[None, :]
    mask[:, 3:13] = cols < start_len[:, None]
    mask[:, 14:24] = cols < stop_len[:, None]
    return rows[mask].tobytes()


def head_of_runs(runs: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` indices of (k, 2) [start, stop) index runs, as runs (n >= 0)."""
    lengths = runs[:, 1] - runs[:, 0]
    ends = np.cumsum(lengths)
    k = int(np.searchsorted(ends, n, side="left"))
    if k >= len(runs):
        return runs.copy()
    head = runs[: k + 1].copy()
    before = int(ends[k - 1]) if k > 0 else 0
    head[k, 1] = head[k, 0] + (n - before)
    return head[head[:, 1] > head[:, 0]]
