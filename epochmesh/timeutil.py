"""Wall-clock helpers (milliseconds since the epoch, as used on the wire)."""

import time


def now_ms() -> int:
    return int(time.time() * 1000)
