"""Wall-clock helpers (milliseconds since the epoch, as used on the wire)."""

import math
import re
import time

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def now_ms() -> int:
    return int(time.time() * 1000)


def duration_seconds(value: str | int | float) -> float | None:
    """Seconds of a number or of text like ``90``, ``30s``, ``15m``, ``2h``, ``1.5d``; None if
    it reads as neither (ranges are the caller's to check)."""
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    match = _DURATION.fullmatch(value)
    if match is None:
        return None
    return float(match.group(1)) * _UNITS[match.group(2)]
