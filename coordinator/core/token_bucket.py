"""Token buckets per key, with counted drops (pure: the clock comes in as ``now``).

A key (a node id) may spend ``burst`` tokens at once and earns ``per_second`` tokens back, up
to ``burst``. What it could not spend is counted per key until the caller takes the count
(`take_dropped`) to report it in one summary, instead of one record per refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BucketLimit", "TokenBuckets"]


@dataclass(frozen=True)
class BucketLimit:
    """``burst`` tokens at most, ``per_second`` tokens earned back."""

    burst: float
    per_second: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ValueError(f"burst must be a finite number >= 1, got {self.burst!r}")
        if not (math.isfinite(self.per_second) and self.per_second > 0):
            raise ValueError(f"per_second must be a finite number > 0, got {self.per_second!r}")


class TokenBuckets:
    """One bucket per key, created full on first use."""

    def __init__(self, limit: BucketLimit) -> None:
        self.limit = limit
        self._tokens: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of)
        self._dropped: dict[str, int] = {}
        self.dropped_total = 0

    def take(self, key: str, now: float) -> bool:
        """Spend a token of ``key`` at time ``now`` (seconds, monotonic); False (counted as a
        drop) when it has none."""
        # Popped and put back: the buckets stay in the order they were last used, which is
        # what lets `forget_idle` stop at the first one still in use.
        tokens, then = self._tokens.pop(key, (self.limit.burst, now))
        tokens = min(self.limit.burst, tokens + max(0.0, now - then) * self.limit.per_second)
        if tokens >= 1.0:
            self._tokens[key] = (tokens - 1.0, now)
            return True
        self._tokens[key] = (tokens, now)
        self._dropped[key] = self._dropped.get(key, 0) + 1
        self.dropped_total += 1
        return False

    def dropped(self, key: str) -> int:
        """Drops of ``key`` not taken yet."""
        return self._dropped.get(key, 0)

    def pending(self) -> list[str]:
        """The keys with drops not taken yet."""
        return sorted(self._dropped)

    def take_dropped(self, key: str) -> int:
        """The drops of ``key`` since the last call (they are reported now)."""
        return self._dropped.pop(key, 0)

    def forget_idle(self, now: float) -> None:
        """Drop full buckets (their keys start full again anyway): bounded memory. Walks the
        buckets from the least recently used and stops at the first one used within the
        horizon: its cost is the buckets it drops, not all of them (at 10,000 nodes a full walk
        held the coordinator's event loop for tens of milliseconds)."""
        horizon = self.limit.burst / self.limit.per_second
        idle: list[str] = []
        for key, (_, then) in self._tokens.items():
            if now - then < horizon:
                break
            if key not in self._dropped:
                idle.append(key)
        for key in idle:
            del self._tokens[key]
