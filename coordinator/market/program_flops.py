"""The FLOPs per training sample of the programs this coordinator checked, by program sha256:
counted by the coordinator's own program check (epochmesh/program/inspection.py, at SubmitJob
and when a quote names an uploaded program), never taken from a client. Quotes rate nodes by
them, and a job's measured steps calibrate other programs' quotes through them.

Kept in the scheduler state (PROGRAM_FLOPS_KEY: a JSON object, the newest MAX_PROGRAMS), so a
coordinator restart keeps them.
"""

from __future__ import annotations

import json
import logging
import math

from coordinator.store.base import Store

log = logging.getLogger(__name__)

PROGRAM_FLOPS_KEY = "program_flops"  # coordinator-counted figures only
MAX_PROGRAMS = 1000


async def known_flops(store: Store) -> dict[str, float]:
    """Every remembered program's FLOPs per sample, oldest first."""
    raw = await store.get_scheduler_state(PROGRAM_FLOPS_KEY)
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
        out = {str(k): float(v) for k, v in data.items()}
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("program FLOPs unreadable (%s): starting afresh", e)
        return {}
    return {k: v for k, v in out.items() if math.isfinite(v) and v > 0}


async def remember_flops(store: Store, sha: str, flops: float) -> None:
    """Remember ``sha``'s FLOPs per sample (counted by this coordinator; ignored when not a
    positive finite number)."""
    if not sha or not (math.isfinite(flops) and flops > 0):
        return
    known = await known_flops(store)
    if known.get(sha) == flops:
        return
    known.pop(sha, None)
    known[sha] = flops
    while len(known) > MAX_PROGRAMS:
        known.pop(next(iter(known)))
    await store.put_scheduler_state(PROGRAM_FLOPS_KEY, json.dumps(known).encode())
