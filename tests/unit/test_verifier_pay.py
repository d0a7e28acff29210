"""The pay a check's verdict releases, when verdicts of one node overlap (coordinator/engine/
verifier.py). The runner is played by the test through the verifier's port; its registry
calls wait on a gate the test opens, so that two verdicts are acted on at once, as two
ReportCheck calls are on a busy coordinator.

Held pay is released up to the round a passing check vouches for, short of every round whose
check still runs and of a failure being acted on: a node caught in round 6 is not paid for
round 6 or 7 because the check of its round 7 passed while round 6's was still open.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from coordinator.core.config import CoordinatorConfig
from coordinator.engine.recomputation import PendingCheck
from coordinator.engine.verifier import Verifier
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(30)

NODE = "n-cheat"


class Registry:
    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def record_check(self, node: str, round_id: int, ok: bool, text: str = "") -> None:
        await self.gate.wait()

    async def quarantine(self, node: str, text: str, attrs: Any, job_id: str = "") -> None:
        await self.gate.wait()


class Store:
    async def put_job_state(self, job_id: str, key: str, data: bytes) -> None:
        return None


class Runner:
    """What the verifier's verdicts call on its runner, recorded."""

    job_id = "j-pay"

    def __init__(self) -> None:
        self.registry = Registry()
        self.ctx = SimpleNamespace(
            config=CoordinatorConfig(), registry=self.registry, store=Store()
        )
        self.spec = common_pb2.JobSpec(aggregation="ps", sync="sync")
        self.released: list[tuple[str, int]] = []
        self.undone: list[tuple[str, int | None]] = []
        self.forfeit_gate = asyncio.Event()
        self.forfeit_gate.set()

    async def release_pay(self, node_id: str, up_to_round: int) -> None:
        self.released.append((node_id, up_to_round))

    async def on_verification_failed(
        self, node_id: str, first_round: int | None, reason: str, *, accuse: bool
    ) -> None:
        self.undone.append((node_id, first_round))
        await self.forfeit_gate.wait()  # the forfeit, on its way


def _check(verifier: Verifier, round_id: int) -> PendingCheck:
    pc = PendingCheck(
        node_id=NODE,
        task_id=f"t-{round_id}",
        round=round_id,
        version=round_id,
        ranges=np.zeros((0, 2), dtype=np.int64),
        chunks=[],
        codec="",
        seed=0,
        buckets=0,
        update_sketch=None,
        deadline=0.0,
    )
    verifier._pending[pc.task_id] = pc
    verifier._unverified.setdefault(NODE, set()).add(round_id)
    return pc


async def _until_blocked() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_pass_acted_on_with_an_earlier_rounds_failure_releases_nothing_from_it() -> None:
    runner = Runner()
    verifier = Verifier(runner)  # type: ignore[arg-type]
    round6, round7 = _check(verifier, 6), _check(verifier, 7)
    # Round 7's check passes first and waits on the registry; round 6's fails meanwhile.
    passing = asyncio.create_task(verifier.passed(round7))
    await _until_blocked()
    failing = asyncio.create_task(verifier.failed(round6, "wrong", {}, accuse=True))
    await _until_blocked()
    runner.registry.gate.set()
    await asyncio.gather(passing, failing)
    assert runner.undone == [(NODE, 6)]
    assert runner.released == [(NODE, 5)]  # not 7: round 6 was still being checked
    await verifier.stop()


async def test_a_pass_while_a_failure_is_acted_on_releases_nothing_from_its_first_round() -> None:
    runner = Runner()
    runner.registry.gate.set()
    runner.forfeit_gate.clear()
    verifier = Verifier(runner)  # type: ignore[arg-type]
    round6 = _check(verifier, 6)
    # A failure that is no accusation (a missed deadline): the node stays in the job, and a
    # later part of it is checked while the failure's forfeit is still on its way.
    failing = asyncio.create_task(verifier.failed(round6, "no sketches", {}, accuse=False))
    await _until_blocked()
    assert runner.undone == [(NODE, 6)]
    await verifier.passed(_check(verifier, 10))
    assert runner.released == [(NODE, 5)]
    runner.forfeit_gate.set()
    await failing
    await verifier.passed(_check(verifier, 12))  # once the forfeit is done: as usual
    assert runner.released == [(NODE, 5), (NODE, 12)]
    await verifier.stop()
