"""The epoch ledger: exactly-once coverage of every sample of an epoch (pure logic).

Order of an epoch
-----------------
Every epoch trains the samples ``0 .. num_samples-1`` in a seeded order (:func:`epoch_order`).
The dataset is cut into *blocks* of ``block_size`` consecutive sample indices (use the shard
size, so a block is a shard; the last block may be shorter; ``None`` = one block, a plain
full shuffle). The order is: the blocks in a seeded random order, and inside each block its
samples in a seeded random order (or in index order with ``shuffle_within_blocks=False``).
A contiguous run of positions therefore touches few blocks: a node's segment maps to a few
shards it has to fetch, while each local batch is still a random draw from those shards and
the global batch mixes the segments of all nodes.

The order is the same on every machine and every NumPy version: it uses only
``SeedSequence([seed mod 2**64, epoch, DOMAIN])`` and the raw output of the PCG64 bit
generator (both under NumPy's stream-compatibility guarantee) and a stable sort (key: block
rank in the high 32 bits, a random 32-bit draw in the low ones), never
``Generator.permutation`` (whose algorithm may change). ``seed`` and ``epoch`` are separate
entropy words, so (seed=1, epoch=0) and (seed=0, epoch=1) differ. The order is never stored:
it is recomputed from (num_samples, epoch, seed, block_size) when needed.

States
------
Work is tracked as half-open ranges of POSITIONS in that order. Each position is in exactly
one state:

- PENDING and owned by a node: in that node's *segment* (its not yet handed-out work),
- PENDING in the pool (only while the ledger has no node at all),
- ASSIGNED to (node, round) by :meth:`EpochLedger.plan_round`,
- COMMITTED, by :meth:`EpochLedger.commit_round` for the nodes whose update was applied.

Assigned slices of nodes that were not applied (late, failed, rejected) go back to PENDING
in the same epoch, so they are trained in a later round of it. A node that trained only the
head of its slice (a time-boxed local SGD round) commits that head; the rest of the slice goes
back to PENDING at the head of its own segment. Once every position is
committed the epoch is complete: every sample exactly once, whatever failed.

Segments
--------
:meth:`EpochLedger.assign_segments` cuts the pending positions into contiguous segments
proportional to the nodes' throughput; each round a node consumes the head of its segment.
With ``b_i`` proportional to the same rates all segments run out together. When they do
not (speed drift, failures, joins) work moves between segments, always as contiguous tails:

- a node whose segment is exhausted steals from the tail of the node with the most spare
  work relative to its rate, enough to equalize the two (work stealing, few large moves);
- :meth:`EpochLedger.rebalance` moves the tails of over-full segments to under-full ones
  after rates were re-estimated, ignoring differences below ``min_transfer`` positions or
  ``tolerance`` (25%) of the target, so round-to-round noise moves nothing;
- returned or orphaned work (late slices, a failed node's segment) goes to the nodes that
  would run out first (lowest remaining/rate), in pieces of at least ``min_transfer``
  positions, so it does not shatter across hundreds of nodes;
- :meth:`EpochLedger.add_node` gives a joiner its share by stealing tails.

Where the work sits never changes what is trained, only who trains it: exactness does not
depend on any of these policies.

Rollback: a coordinator persists ``to_state()`` with each checkpoint. After a restart it
loads the state of the last checkpoint with :meth:`EpochLedger.from_state`; rounds applied
after that checkpoint are forgotten together with the parameters they produced, so their
positions are pending again, and rounds that were open at the checkpoint are aborted with
:meth:`EpochLedger.abort_open_rounds` (their tasks died with the old process).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.rounds.allocator import apportion, split_batch

__all__ = [
    "DEFAULT_MIN_TRANSFER",
    "EpochLedger",
    "LedgerInvariantError",
    "Range",
    "epoch_order",
    "index_runs",
]

Range = tuple[int, int]

STATE_VERSION = 1
DEFAULT_MIN_TRANSFER = 256
_DOMAIN = 0x65706F63686D6573  # "epochmes": separates this stream from other uses of the seed
_MASK64 = (1 << 64) - 1


class LedgerInvariantError(RuntimeError):
    """The ledger's internal state is inconsistent (a bug, or a corrupt saved state)."""


# --------------------------------------------------------------------------- the order
def epoch_order(
    num_samples: int,
    epoch: int,
    seed: int,
    block_size: int | None = None,
    shuffle_within_blocks: bool = True,
) -> np.ndarray:
    """Dataset index of every position of the epoch's order (int64 array, a permutation)."""
    if num_samples < 0 or epoch < 0:
        raise ValueError("num_samples and epoch must be >= 0")
    n = int(num_samples)
    bs = n if block_size is None else int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    bs = min(bs, n)
    bitgen = np.random.PCG64(np.random.SeedSequence([int(seed) & _MASK64, int(epoch), _DOMAIN]))
    nblocks = -(-n // bs)
    block_keys = bitgen.random_raw(nblocks)
    block_rank = np.empty(nblocks, dtype=np.int64)
    block_rank[np.argsort(block_keys, kind="stable")] = np.arange(nblocks, dtype=np.int64)
    if nblocks >= 1 << 32:
        raise ValueError(f"too many blocks ({nblocks}): use a larger block_size")
    ids = np.arange(n, dtype=np.int64)
    if shuffle_within_blocks:
        within = bitgen.random_raw(n)
        if nblocks == 1:
            return np.argsort(within, kind="stable").astype(np.int64)
        within >>= np.uint64(32)  # 32 random bits; equal keys keep index order (stable)
    else:
        within = np.zeros(n, dtype=np.uint64)
    key = (block_rank[ids // bs].astype(np.uint64) << np.uint64(32)) | within
    return np.argsort(key, kind="stable").astype(np.int64)


def index_runs(indices: np.ndarray | Sequence[int]) -> list[Range]:
    """Group a sequence of dataset indices into maximal runs ``[start, stop)`` of +1 steps,
    keeping the order (what a Task's ``ranges`` carries)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [idx.size]))
    return [(int(idx[s]), int(idx[e - 1]) + 1) for s, e in zip(starts, stops, strict=True)]


# --------------------------------------------------------------------------- range lists
# A range list is a Python list of disjoint, non-adjacent (merged) (start, stop) tuples,
# sorted by start.


def _count(rs: Iterable[Range]) -> int:
    return sum(b - a for a, b in rs)


def _normalize(rs: Iterable[Range]) -> list[Range]:
    out: list[Range] = []
    for a, b in sorted(r for r in rs if r[1] > r[0]):
        if out and a < out[-1][1]:
            raise LedgerInvariantError(f"overlapping ranges {out[-1]} and {(a, b)}")
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _insert(rs: list[Range], r: Range) -> None:
    a, b = r
    if b <= a:
        return
    i = bisect.bisect_left(rs, (a, a))
    if i > 0 and rs[i - 1][1] > a or i < len(rs) and rs[i][0] < b:
        raise LedgerInvariantError(f"range {r} overlaps a range already present")
    left = i > 0 and rs[i - 1][1] == a
    right = i < len(rs) and rs[i][0] == b
    if left and right:
        rs[i - 1] = (rs[i - 1][0], rs[i][1])
        del rs[i]
    elif left:
        rs[i - 1] = (rs[i - 1][0], b)
    elif right:
        rs[i] = (a, rs[i][1])
    else:
        rs.insert(i, (a, b))


def _take_head(rs: list[Range], k: int) -> list[Range]:
    out: list[Range] = []
    i = 0
    while k > 0 and i < len(rs):
        a, b = rs[i]
        if b - a <= k:
            out.append((a, b))
            k -= b - a
            i += 1
        else:
            out.append((a, a + k))
            rs[i] = (a + k, b)
            k = 0
    del rs[:i]
    return out


def _take_tail(rs: list[Range], k: int) -> list[Range]:
    out: list[Range] = []
    while k > 0 and rs:
        a, b = rs[-1]
        if b - a <= k:
            out.append((a, b))
            k -= b - a
            rs.pop()
        else:
            out.append((b - k, b))
            rs[-1] = (a, b - k)
            k = 0
    out.reverse()
    return out


def _cut(rs: Sequence[Range], sizes: Sequence[int]) -> list[list[Range]]:
    """Cut the positions of ``rs`` (in order) into consecutive pieces of the given sizes."""
    pieces: list[list[Range]] = []
    it = iter(rs)
    cur: Range | None = None
    for size in sizes:
        piece: list[Range] = []
        need = size
        while need > 0:
            if cur is None:
                cur = next(it)
            a, b = cur
            if b - a <= need:
                piece.append(cur)
                need -= b - a
                cur = None
            else:
                piece.append((a, a + need))
                cur = (a + need, b)
                need = 0
        pieces.append(piece)
    return pieces


def _as_ranges(obj: Any) -> list[Range]:
    return [(int(a), int(b)) for a, b in obj]


def _check_rate(node: str, rate: float) -> float:
    r = float(rate)
    if not math.isfinite(r) or r <= 0.0:
        raise ValueError(f"rate of node {node!r} must be a finite number > 0, got {rate!r}")
    return r


# --------------------------------------------------------------------------- the ledger
class _Donors:
    """Max-heap of nodes by spare work per unit of rate during one ``plan_round``.

    A node's spare is its remaining segment minus what it still has to take this round.
    Built on the first steal only; stale entries are skipped lazily.
    """

    def __init__(self, led: EpochLedger, want: Mapping[str, int], served: Mapping[str, Any]):
        self._led, self._want, self._served = led, want, served
        self._index = {n: i for i, n in enumerate(led._rates)}
        self._heap: list[tuple[float, int, str, int]] | None = None

    def spare(self, v: str) -> int:
        rem = self._led._remaining[v]
        return rem if v in self._served else rem - self._want.get(v, 0)

    def _push(self, v: str) -> None:
        s = self.spare(v)
        if s > 0 and self._heap is not None:
            heapq.heappush(self._heap, (-s / self._led._rates[v], self._index[v], v, s))

    def update(self, v: str) -> None:
        self._push(v)

    def best(self, thief: str) -> tuple[str, int]:
        if self._heap is None:
            self._heap = []
            for v in self._led._rates:
                self._push(v)
        while self._heap:
            _, _, v, s = heapq.heappop(self._heap)
            if v == thief or self.spare(v) != s:
                continue  # stale (a fresh entry was pushed when it changed) or the thief
            return v, s
        raise LedgerInvariantError("no spare work to steal although enough is pending")


class EpochLedger:
    """Which positions of one epoch are pending (owned by which node), assigned, committed.

    Node ids are strings, round ids integers. Not thread-safe: the coordinator serializes
    calls (one asyncio task per job). See the module docstring for the model.
    """

    def __init__(
        self,
        num_samples: int,
        epoch: int,
        seed: int,
        *,
        block_size: int | None = None,
        shuffle_within_blocks: bool = True,
        min_transfer: int = DEFAULT_MIN_TRANSFER,
    ) -> None:
        if num_samples < 0 or epoch < 0:
            raise ValueError("num_samples and epoch must be >= 0")
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be > 0 or None, got {block_size}")
        if min_transfer < 1:
            raise ValueError(f"min_transfer must be >= 1, got {min_transfer}")
        self.num_samples = int(num_samples)
        self.epoch = int(epoch)
        self.seed = int(seed)
        self.block_size = None if block_size is None else int(block_size)
        self.shuffle_within_blocks = bool(shuffle_within_blocks)
        self.min_transfer = int(min_transfer)
        self._rates: dict[str, float] = {}
        self._owned: dict[str, list[Range]] = {}
        self._remaining: dict[str, int] = {}
        self._pool: list[Range] = [(0, self.num_samples)] if self.num_samples else []
        self._pool_count = self.num_samples
        self._assigned: dict[int, dict[str, list[Range]]] = {}
        self._assigned_count = 0
        self._committed: list[Range] = []
        self._committed_count = 0
        self._order: np.ndarray | None = None
        # Transient counters for benchmarks and logs (not persisted).
        self.stats: dict[str, int] = {"steals": 0, "stolen": 0, "moved": 0, "returned": 0}

    # ------------------------------------------------------------------ queries
    @property
    def nodes(self) -> list[str]:
        """Nodes that own a segment, in insertion order."""
        return list(self._rates)

    @property
    def rates(self) -> dict[str, float]:
        """The rates the segments are currently weighted by."""
        return dict(self._rates)

    @property
    def committed_count(self) -> int:
        return self._committed_count

    @property
    def pending_count(self) -> int:
        """Positions not yet handed out (in segments or the pool)."""
        return self._pool_count + sum(self._remaining.values())

    @property
    def assigned_count(self) -> int:
        """Positions handed out in rounds that are still open."""
        return self._assigned_count

    @property
    def complete(self) -> bool:
        return self._committed_count == self.num_samples

    def remaining(self, node: str) -> int:
        """Pending positions in ``node``'s segment (0 for an unknown node)."""
        return self._remaining.get(node, 0)

    def pending_ranges(self, node: str) -> list[Range]:
        """The exact pending position ranges of ``node``'s segment."""
        return list(self._owned.get(node, []))

    def segment_of(self, node: str) -> Range | None:
        """Span ``(first, last + 1)`` of ``node``'s pending positions, None when it has none.

        At the start of an epoch this is exactly its contiguous segment; later the span may
        also enclose positions already consumed or moved (see ``pending_ranges``).
        """
        rs = self._owned.get(node)
        if not rs:
            return None
        return (rs[0][0], rs[-1][1])

    def open_rounds(self) -> list[int]:
        return sorted(self._assigned)

    def assigned_in(self, round_id: int) -> dict[str, list[Range]]:
        """The position ranges each node holds in open round ``round_id``."""
        parts = self._assigned.get(round_id)
        if parts is None:
            raise KeyError(f"round {round_id} is not open in epoch {self.epoch}")
        return {n: list(rs) for n, rs in parts.items()}

    def committed_ranges(self) -> list[Range]:
        return list(self._committed)

    # ------------------------------------------------------------------ order / indices
    @property
    def order(self) -> np.ndarray:
        """Dataset index at each position (computed once, not persisted)."""
        if self._order is None:
            self._order = epoch_order(
                self.num_samples,
                self.epoch,
                self.seed,
                self.block_size,
                self.shuffle_within_blocks,
            )
        return self._order

    def positions_to_indices(self, ranges: Iterable[Range]) -> np.ndarray:
        """Dataset indices of the given position ranges, in position order."""
        parts = [self.order[a:b] for a, b in ranges if b > a]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts)

    def positions_to_index_ranges(self, ranges: Iterable[Range]) -> list[Range]:
        """Position ranges -> dataset index runs ``[start, stop)``, in training order.

        With shuffling inside blocks most runs have length 1; they all fall in the few
        blocks (shards) that the positions cover.
        """
        return index_runs(self.positions_to_indices(ranges))

    def blocks_of(self, ranges: Iterable[Range]) -> list[int]:
        """Sorted block numbers (``index // block_size``) that the positions touch."""
        idx = self.positions_to_indices(ranges)
        bs = self.block_size or max(self.num_samples, 1)
        return sorted({int(b) for b in np.unique(idx // bs)})

    # ------------------------------------------------------------------ internal moves
    def _own_insert(self, node: str, rs: Iterable[Range]) -> None:
        owned = self._owned[node]
        for r in rs:
            _insert(owned, r)
            self._remaining[node] += r[1] - r[0]

    def _own_take_head(self, node: str, k: int) -> list[Range]:
        got = _take_head(self._owned[node], k)
        self._remaining[node] -= _count(got)
        return got

    def _own_take_tail(self, node: str, k: int) -> list[Range]:
        got = _take_tail(self._owned[node], k)
        self._remaining[node] -= _count(got)
        return got

    def _ratio(self, node: str) -> float:
        return self._remaining[node] / self._rates[node]

    def _distribute(self, rs: list[Range]) -> None:
        """Give orphaned pending positions to the nodes that will run out first."""
        rs = _normalize(rs)
        total = _count(rs)
        if total == 0:
            return
        self.stats["returned"] += total
        if not self._rates:
            for r in rs:
                _insert(self._pool, r)
            self._pool_count += total
            return
        k = min(len(self._rates), max(1, total // self.min_transfer))
        index = {n: i for i, n in enumerate(self._rates)}
        receivers = heapq.nsmallest(
            k, self._rates, key=lambda n: (self._ratio(n), -self._rates[n], index[n])
        )
        sizes = apportion(total, {n: self._rates[n] for n in receivers})
        for node, piece in zip(sizes, _cut(rs, list(sizes.values())), strict=True):
            self._own_insert(node, piece)

    def _steal_into(self, thief: str, victim: str, amount: int) -> None:
        moved = self._own_take_tail(victim, amount)
        self._own_insert(thief, moved)
        self.stats["steals"] += 1
        self.stats["stolen"] += amount

    # ------------------------------------------------------------------ membership
    def assign_segments(self, rates: Mapping[str, float]) -> None:
        """(Re)cut ALL pending positions into contiguous segments proportional to ``rates``.

        The participants become exactly the keys of ``rates``. Call at the start of an epoch;
        mid-epoch it re-segments what is pending (assigned and committed work is untouched).
        """
        new_rates = {str(n): _check_rate(n, r) for n, r in rates.items()}
        pending = list(self._pool)
        for rs in self._owned.values():
            pending.extend(rs)
        pending = _normalize(pending)
        total = _count(pending)
        self._rates = new_rates
        self._owned = {n: [] for n in new_rates}
        self._remaining = dict.fromkeys(new_rates, 0)
        self._pool, self._pool_count = [], 0
        if not new_rates:
            self._pool, self._pool_count = pending, total
            return
        sizes = apportion(total, new_rates)
        for node, piece in zip(sizes, _cut(pending, list(sizes.values())), strict=True):
            self._own_insert(node, piece)

    def add_node(self, node: str, rate: float) -> int:
        """A node joins mid-epoch: it takes its rate's share of the pending work.

        The share is stolen as contiguous tails from the nodes with the most work per unit of
        rate, each steal at most equalizing the pair. Returns the positions it received.
        """
        if node in self._rates:
            raise ValueError(f"node {node!r} is already in the ledger of epoch {self.epoch}")
        self._rates[node] = _check_rate(node, rate)
        self._owned[node] = []
        self._remaining[node] = 0
        if self._pool:
            pool, self._pool, self._pool_count = self._pool, [], 0
            self._own_insert(node, pool)
            return self._remaining[node]
        total = self.pending_count
        share = math.floor(total * self._rates[node] / sum(self._rates.values()))
        r_t = self._rates[node]
        while self._remaining[node] < share:
            victim = max(
                (v for v in self._rates if v != node and self._remaining[v] > 0),
                key=self._ratio,
                default=None,
            )
            if victim is None:
                break
            r_v = self._rates[victim]
            x = (self._remaining[victim] * r_t - self._remaining[node] * r_v) / (r_t + r_v)
            amount = min(share - self._remaining[node], math.ceil(x), self._remaining[victim])
            if amount <= 0:
                break
            self._steal_into(node, victim, amount)
        return self._remaining[node]

    def fail_node(self, node: str) -> int:
        """A node died or left: its slices in open rounds and its segment become pending and
        go to the remaining nodes. Idempotent. Returns the number of positions returned."""
        returned: list[Range] = []
        for parts in self._assigned.values():
            rs = parts.pop(node, None)
            if rs:
                returned.extend(rs)
                self._assigned_count -= _count(rs)
        if node in self._rates:
            returned.extend(self._owned.pop(node))
            self._remaining.pop(node)
            self._rates.pop(node)
        self._distribute(returned)
        return _count(returned)

    def rebalance(self, rates: Mapping[str, float] | None = None, tolerance: float = 0.25) -> int:
        """Re-weight segments by new ``rates`` and move unconsumed tails to match them.

        ``rates`` may name a subset of the nodes (the others keep their weight); every key
        must be a node of the ledger. A node whose remaining work is off its target by less
        than ``max(min_transfer, tolerance * target)`` is left alone: round-to-round noise in
        the rates then moves nothing (moves cost data locality; the batches, not the
        segments, decide the round time), while a node that became much slower or faster
        gives or gets work. Returns the positions moved.
        """
        if not 0.0 <= tolerance:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        for n, r in (rates or {}).items():
            if n not in self._rates:
                raise ValueError(f"cannot rebalance unknown node {n!r} (add_node first)")
            self._rates[n] = _check_rate(n, r)
        if not self._rates:
            return 0
        if self._pool:  # only possible when the ledger had no node; give it out
            pool, self._pool, self._pool_count = self._pool, [], 0
            self._distribute(pool)
        targets = apportion(self.pending_count, self._rates)
        off = {n: self._remaining[n] - targets[n] for n in self._rates}  # > 0: too much
        big = {n: max(self.min_transfer, tolerance * targets[n]) for n in self._rates}
        # A node far off its target (donor or receiver) triggers a move; its counterparts
        # may be any nodes off by at least min_transfer (so one straggler's excess can be
        # spread over many nodes that each lack only a little), largest gaps first.
        sig_give = sum(off[n] for n in self._rates if off[n] >= big[n])
        sig_take = sum(-off[n] for n in self._rates if -off[n] >= big[n])
        if sig_give == 0 and sig_take == 0:
            return 0
        if sig_give >= sig_take:
            donors = [n for n in self._rates if off[n] >= big[n]]
            receivers = [n for n in self._rates if -off[n] >= self.min_transfer]
        else:
            donors = [n for n in self._rates if off[n] >= self.min_transfer]
            receivers = [n for n in self._rates if -off[n] >= big[n]]
        donors.sort(key=lambda n: -off[n])
        receivers.sort(key=lambda n: off[n])
        need = min(sum(off[n] for n in donors), sum(-off[n] for n in receivers))
        supply: list[Range] = []
        left = need
        for d in donors:
            if left <= 0:
                break
            k = min(off[d], left)
            supply.extend(self._own_take_tail(d, k))
            left -= k
        sizes: list[int] = []
        left = need
        for n in receivers:
            k = min(-off[n], left)
            sizes.append(k)
            left -= k
        for n, piece in zip(receivers, _cut(supply, sizes), strict=True):
            self._own_insert(n, piece)
        self.stats["moved"] += need
        return need

    # ------------------------------------------------------------------ rounds
    def plan_round(self, round_id: int, batches: Mapping[str, int]) -> dict[str, list[Range]]:
        """Hand out round ``round_id``: the next ``b_i`` pending positions for each node.

        Each node takes the head of its own segment; a node whose segment runs dry steals the
        tail of the segment with the most spare work relative to its rate (enough to equalize
        the two, at least what it lacks). If fewer positions are pending than
        ``sum(batches)`` (the end of an epoch) the batches shrink proportionally
        (``split_batch`` with the requested b_i as weights and caps, so every node keeps
        >= 1 while there is at least one position per node).

        Returns ``{node: position ranges}`` for the nodes that got work (sorted ranges, in
        training order); the sizes are the actual local batches. An empty dict means nothing
        is pending. The slices become ASSIGNED to (node, round_id).
        """
        if round_id in self._assigned:
            raise ValueError(f"round {round_id} is already open in epoch {self.epoch}")
        want: dict[str, int] = {}
        for n, b in batches.items():
            if n not in self._rates:
                raise ValueError(f"node {n!r} has no segment in epoch {self.epoch} (add it first)")
            if isinstance(b, bool) or int(b) != b or b < 0:
                raise ValueError(f"batch of node {n!r} must be an integer >= 0, got {b!r}")
            if b > 0:
                want[n] = int(b)
        pending = self.pending_count
        if sum(want.values()) > pending:
            shrunk = split_batch(pending, {n: float(b) for n, b in want.items()}, want)
            want = {n: b for n, b in shrunk.items() if b > 0}
        out: dict[str, list[Range]] = {}
        donors = _Donors(self, want, out)
        for n, b in want.items():
            got = self._own_take_head(n, b)
            short = b - _count(got)
            while short > 0:
                victim, spare = donors.best(n)
                r_t, r_v = self._rates[n], self._rates[victim]
                # Take what is missing, or more if that equalizes the two nodes' remaining
                # work per unit of rate (so the thief does not come back every round).
                equalize = math.ceil((spare * r_t - self._remaining[n] * r_v) / (r_t + r_v))
                self._steal_into(n, victim, min(spare, max(short, equalize)))
                donors.update(victim)
                more = self._own_take_head(n, short)
                got.extend(more)
                short -= _count(more)
            out[n] = _normalize(got)
            donors.update(n)
        self._assigned[round_id] = out
        self._assigned_count += sum(_count(rs) for rs in out.values())
        return {n: list(rs) for n, rs in out.items()}

    def commit_round(
        self,
        round_id: int,
        nodes_applied: Iterable[str],
        consumed: Mapping[str, int] | None = None,
    ) -> dict[str, list[Range]]:
        """Close round ``round_id``: slices of applied nodes become COMMITTED; slices of every
        other node of the round return to PENDING (given to the nodes that will run out
        first) and are trained in a later round of this epoch.

        ``consumed``: for an applied node that trained only the first k positions of its slice
        (a time-boxed local SGD round stops when its time is up), k. Those k positions (in
        training order) are committed and the rest returns to PENDING, at the head of the
        node's own segment (it trains them next). A node not named consumed all of its slice.

        Raises ValueError if the round is not open, if an applied node holds nothing in
        it (e.g. it was failed meanwhile: its update must then not be applied), or if a
        consumed count is not in 1..(the node's slice) or names a node not applied.
        Returns the committed position ranges per applied node.
        """
        parts = self._assigned.get(round_id)
        if parts is None:
            raise ValueError(f"round {round_id} is not open in epoch {self.epoch}")
        applied = set(nodes_applied)
        stray = sorted(applied - parts.keys())
        if stray:
            raise ValueError(
                f"nodes {stray!r} hold no slice of round {round_id} (failed or never "
                "assigned); their updates must not be applied"
            )
        consumed = dict(consumed or {})
        for n, k in consumed.items():
            if n not in applied:
                raise ValueError(f"node {n!r} is not applied in round {round_id}")
            size = _count(parts[n])
            if isinstance(k, bool) or int(k) != k or not 1 <= k <= size:
                raise ValueError(
                    f"node {n!r} consumed {k!r} positions of round {round_id}; "
                    f"its slice holds {size}"
                )
        del self._assigned[round_id]
        committed: dict[str, list[Range]] = {}
        orphans: list[Range] = []
        for n, rs in parts.items():
            self._assigned_count -= _count(rs)
            if n in applied:
                done = list(rs)
                if n in consumed and consumed[n] < _count(rs):
                    rest = list(rs)
                    done = _take_head(rest, int(consumed[n]))
                    if n in self._rates:
                        self._own_insert(n, rest)
                    else:
                        orphans.extend(rest)
                for r in done:
                    _insert(self._committed, r)
                self._committed_count += _count(done)
                committed[n] = done
            else:
                orphans.extend(rs)
        self._distribute(orphans)
        return committed

    def abort_round(self, round_id: int) -> int:
        """Nothing of round ``round_id`` was applied: every slice returns to PENDING, into its
        node's own segment when the node is still here. Returns the positions returned."""
        parts = self._assigned.pop(round_id, None)
        if parts is None:
            raise ValueError(f"round {round_id} is not open in epoch {self.epoch}")
        orphans: list[Range] = []
        total = 0
        for n, rs in parts.items():
            c = _count(rs)
            total += c
            self._assigned_count -= c
            if n in self._rates:
                self._own_insert(n, rs)
            else:
                orphans.extend(rs)
        self._distribute(orphans)
        return total

    def abort_open_rounds(self) -> int:
        """Abort every open round (after a restart). Returns the positions returned."""
        return sum(self.abort_round(r) for r in list(self._assigned))

    def next_epoch(self, rates: Mapping[str, float] | None = None) -> EpochLedger:
        """A fresh ledger for the following epoch (same data and seed), its segments assigned
        by ``rates`` (default: this ledger's current rates)."""
        nxt = EpochLedger(
            self.num_samples,
            self.epoch + 1,
            self.seed,
            block_size=self.block_size,
            shuffle_within_blocks=self.shuffle_within_blocks,
            min_transfer=self.min_transfer,
        )
        nxt.assign_segments(self._rates if rates is None else rates)
        return nxt

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify that every position is in exactly one state and the counters agree.

        Raises LedgerInvariantError describing the first violation.
        """

        def fail(msg: str) -> None:
            raise LedgerInvariantError(f"epoch {self.epoch}: {msg}")

        lists: list[tuple[str, list[Range]]] = [
            ("pool", self._pool),
            ("committed", self._committed),
        ]
        lists += [(f"segment of {n}", rs) for n, rs in self._owned.items()]
        for rid, parts in self._assigned.items():
            lists += [(f"round {rid} of {n}", rs) for n, rs in parts.items()]
        everything: list[tuple[int, int, str]] = []
        for name, rs in lists:
            for i, (a, b) in enumerate(rs):
                if not 0 <= a < b <= self.num_samples:
                    fail(f"{name}: bad range {(a, b)}")
                if i and rs[i - 1][1] >= a:
                    fail(f"{name}: ranges not sorted, disjoint and merged at {(a, b)}")
                everything.append((a, b, name))
        everything.sort()
        pos = 0
        for a, b, name in everything:
            if a != pos:
                what = "missing" if a > pos else f"in two states (again in {name})"
                fail(f"positions from {min(a, pos)} are {what}")
            pos = b
        if pos != self.num_samples:
            fail(f"positions {pos}..{self.num_samples} are missing")
        if set(self._owned) != set(self._rates) or set(self._remaining) != set(self._rates):
            fail("segment table and rate table disagree")
        for n, rs in self._owned.items():
            if self._remaining[n] != _count(rs):
                fail(f"remaining counter of {n} is {self._remaining[n]}, holds {_count(rs)}")
            if not (math.isfinite(self._rates[n]) and self._rates[n] > 0):
                fail(f"rate of {n} is {self._rates[n]}")
        if self._pool_count != _count(self._pool):
            fail("pool counter is wrong")
        if self._rates and self._pool:
            fail("the pool must be empty while nodes own segments")
        if self._committed_count != _count(self._committed):
            fail("committed counter is wrong")
        held = sum(_count(rs) for parts in self._assigned.values() for rs in parts.values())
        if self._assigned_count != held:
            fail("assigned counter is wrong")

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> dict[str, Any]:
        """A JSON-able snapshot (plain dicts, lists, ints, floats, strings)."""
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "epoch": self.epoch,
            "seed": self.seed,
            "block_size": self.block_size,
            "shuffle_within_blocks": self.shuffle_within_blocks,
            "min_transfer": self.min_transfer,
            "rates": dict(self._rates),
            "segments": {n: [list(r) for r in rs] for n, rs in self._owned.items()},
            "pool": [list(r) for r in self._pool],
            "rounds": [
                {"round": rid, "parts": {n: [list(r) for r in rs] for n, rs in parts.items()}}
                for rid, parts in sorted(self._assigned.items())
            ],
            "committed": [list(r) for r in self._committed],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EpochLedger:
        """Rebuild a ledger from ``to_state()``; raises ValueError on a corrupt state."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported ledger state version {state.get('version')!r}")
        try:
            led = cls(
                int(state["num_samples"]),
                int(state["epoch"]),
                int(state["seed"]),
                block_size=None if state["block_size"] is None else int(state["block_size"]),
                shuffle_within_blocks=bool(state["shuffle_within_blocks"]),
                min_transfer=int(state["min_transfer"]),
            )
            led._rates = {str(n): _check_rate(n, r) for n, r in state["rates"].items()}
            led._owned = {str(n): _normalize(_as_ranges(rs)) for n, rs in state["segments"].items()}
            led._remaining = {n: _count(rs) for n, rs in led._owned.items()}
            led._pool = _normalize(_as_ranges(state["pool"]))
            led._pool_count = _count(led._pool)
            led._assigned = {}
            for entry in state["rounds"]:
                rid = int(entry["round"])
                if rid in led._assigned:
                    raise ValueError(f"round {rid} appears twice")
                led._assigned[rid] = {
                    str(n): _normalize(_as_ranges(rs)) for n, rs in entry["parts"].items()
                }
            led._assigned_count = sum(
                _count(rs) for parts in led._assigned.values() for rs in parts.values()
            )
            led._committed = _normalize(_as_ranges(state["committed"]))
            led._committed_count = _count(led._committed)
            led.check()
        except (KeyError, TypeError, LedgerInvariantError) as exc:
            raise ValueError(f"corrupt ledger state: {exc}") from exc
        return led
