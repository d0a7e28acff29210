"""How often an agent knocks on a coordinator it cannot reach, and when it says so.

Pure: no clock, no I/O (the caller passes the time and sleeps). Two pieces:

- `RetrySchedule`: the wait before attempt n+1 is ``base * 2**n`` capped at ``cap`` (1 s, 2 s,
  4 s ... 60 s), each shortened by a random part of at most ``jitter`` of itself, so that
  agents started together do not knock in step while the waits still grow (with the default
  jitter 0.25 a wait is never below 3/4 of its ceiling, twice the previous ceiling, so every
  wait is longer than the one before, until the cap).
- `UnreachableReport`: a warning at the first failure (the caller says what it tries and when
  it retries), a reminder warning every ``remind_every_s`` while it lasts, and a debug line
  for every other failed attempt; `succeeded` says whether the coordinator was unreachable
  (to log "reachable again" once).

The calls that fail on a coordinator that was reachable a moment ago (heartbeats, tasks) keep
their short backoff (node_agent/link/connection.py `Backoff`): those outages are brief.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

RECONNECT_BASE_S = 1.0
RECONNECT_CAP_S = 60.0
RECONNECT_JITTER = 0.25
REMIND_EVERY_S = 600.0


class RetrySchedule:
    """Waits between attempts to reach an unreachable coordinator (see the module doc)."""

    def __init__(
        self,
        base: float = RECONNECT_BASE_S,
        cap: float = RECONNECT_CAP_S,
        jitter: float = RECONNECT_JITTER,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"a retry schedule needs 0 < base <= cap, got {base} and {cap}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be within [0, 1), got {jitter}")
        self.base = base
        self.cap = cap
        self.jitter = jitter
        self.attempts = 0
        self._rng = rng or random.Random()

    def ceiling(self) -> float:
        """The longest the next wait may be."""
        return min(self.cap, self.base * 2.0 ** min(self.attempts, 62))

    def next_delay(self) -> float:
        """The wait before the next attempt (and count this one)."""
        ceiling = self.ceiling()
        self.attempts += 1
        return ceiling * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self.attempts = 0


@dataclass
class UnreachableReport:
    """When a failed attempt to reach the coordinator deserves a warning (see the module
    doc). Times are the caller's monotonic seconds."""

    remind_every_s: float = REMIND_EVERY_S
    failures: int = 0
    first_failure_at: float = 0.0
    _last_warning_at: float = 0.0

    def failed(self, now: float) -> bool:
        """Count a failed attempt; True when it is to be reported as a warning."""
        self.failures += 1
        if self.failures == 1:
            self.first_failure_at = self._last_warning_at = now
            return True
        if now - self._last_warning_at >= self.remind_every_s:
            self._last_warning_at = now
            return True
        return False

    def succeeded(self) -> bool:
        """An attempt got through: True when earlier ones had failed (then say so once)."""
        was_down = self.failures > 0
        self.failures = 0
        return was_down

    def down_for(self, now: float) -> float:
        """Seconds since the first failure of this outage (0 while reachable)."""
        return now - self.first_failure_at if self.failures else 0.0
