"""Verification across a coordinator restart, with the real engine over real gRPC + TLS; the
agents are played by the test (tests/integration/fake_agent.py).

Two nodes train a parameter-server job; no check of theirs can pass (a fake agent does not
recompute: its checks end undecided), so every round of theirs stays unverified. The coordinator
stops and starts again on the same data directory. One node then sends an update its committed
chunks do not add up to: it is quarantined and the job undoes its updates from its first
unverified round, from before the restart (the restarted coordinator knew them: job state
``verification``); the job still succeeds on the other node, exactly once, and the
``job.verification`` figures count the samples of both coordinators' lives.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from coordinator.engine.engine import Engine
from coordinator.engine.verification_store import STATE_KEY
from coordinator.store.sqlite import SqliteStore
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import (
    CHECK_WAIT_S,
    FakeAgent,
    job_events,
    submit_packed,
    wait_for_job_state,
)
from tests.integration.test_verification_input import RATE, compute, honest, push_scaled
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(300)

NUM_SAMPLES, GLOBAL_BATCH, EPOCHS = 192, 24, 3


def applied_nodes(rounds: list[common_pb2.RoundRecord]) -> dict[int, set[str]]:
    """Round -> the nodes whose parts were applied in it."""
    return {r.round: {p.node_id for p in r.parts if p.status == "applied"} for r in rounds}


async def test_unverified_rounds_from_before_a_restart_are_undone_when_their_node_is_caught(
    tmp_path: Path,
) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={
            "train": {"epochs": EPOCHS, "global_batch": GLOBAL_BATCH},
            # Room for the good node's new lease beside its old one (leased until it lapses,
            # 30 s) and the bad node, after the restart.
            "cluster": {"min_nodes": 1, "max_nodes": 3, "checkpoint_every": 1},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    cheating = asyncio.Event()

    async def bad(agent: FakeAgent, task: agent_pb2.Task) -> None:
        """Honest until `cheating` is set; then an update scaled by 100 with the sketches of
        the honest chunks (they do not add up to it)."""
        if not cheating.is_set():
            await honest(agent, task)
            return
        _, params = await agent.pull(task.job_id, task.params_version)
        grads = {k: torch.full_like(t, 0.01) for k, t in params.items()}
        took = await compute(task)
        await push_scaled(agent, task, grads, took)

    data_dir = tmp_path / "coord"
    kw = {
        "engine_factory": Engine,
        "heartbeat_interval_s": 1.0,
        "lease_ttl_s": 30.0,
        "check_wait_s": CHECK_WAIT_S,
    }
    async with in_process_coordinator(data_dir, **kw) as coord:
        good = await FakeAgent(coord, "good", RATE, honest).start()
        cheat = await FakeAgent(coord, "bad", RATE, bad).start()
        bad_id, bad_identity = cheat.node_id, cheat._identity
        try:
            job = await submit_packed(coord, packed)

            async def both_applied_twice() -> bool:
                rounds = applied_nodes(await coord.store.list_rounds(job.job_id))
                return sum(1 for nodes in rounds.values() if len(nodes) == 2) >= 2

            await async_wait_until(both_applied_twice, timeout=120, message="two rounds of both")
        finally:
            await good.stop()
            await cheat.stop()
    before = await applied_rounds_from(data_dir, job.job_id)
    first_of_bad = min(r for r, nodes in before.items() if bad_id in nodes)
    state = await stored_state(data_dir, job.job_id)
    assert first_of_bad in state["unverified"][bad_id], state
    trained_before = sum(state["trained"].values())
    assert trained_before > 0, state

    async with in_process_coordinator(data_dir, **kw) as coord:
        cheat = FakeAgent(coord, "bad", RATE, bad)
        cheat._identity = bad_identity  # the same node as before the restart
        cheating.set()
        await cheat.start()
        assert cheat.node_id == bad_id
        good = await FakeAgent(coord, "good", RATE, honest).start()
        try:

            async def quarantined() -> bool:
                info = coord.registry.find(bad_id)
                return info.state == common_pb2.NODE_STATE_QUARANTINED

            await async_wait_until(quarantined, timeout=120, message="the cheat not caught")
            await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED, timeout=120)
            events = await job_events(coord, job.job_id)
            live = await coord.store.list_rounds(job.job_id)
        finally:
            await good.stop()
            await cheat.stop()

    restored = next(e for e in events if e.kind == "job.restored")
    kept = int(restored.attrs["checkpoint_round"])
    assert first_of_bad <= kept, (first_of_bad, kept)
    rolled = [e for e in events if e.kind == "job.rolled_back" and e.id > restored.id]
    assert rolled, [e.kind for e in events]
    # Back to before the bad node's first update, which the first coordinator applied.
    assert int(rolled[0].attrs["after_round"]) < first_of_bad, (rolled[0].attrs, first_of_bad)
    # Exactly once: every epoch of the live rounds covers every sample once, none from the
    # bad node.
    per_epoch: dict[int, list[int]] = {}
    for r in live:
        for p in r.parts:
            if p.status == "applied":
                assert p.node_id != bad_id, r.round
                per_epoch.setdefault(r.epoch, []).extend(
                    i for rng in p.ranges for i in range(rng.start, rng.stop)
                )
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, indices in per_epoch.items():
        assert sorted(indices) == list(range(NUM_SAMPLES)), epoch
    summary = next(e for e in events if e.kind == "job.verification")
    trained = sum(int(summary.attrs[f"trained_{s}"]) for s in ("new", "building", "trusted"))
    assert trained > trained_before, (dict(summary.attrs), trained_before)


async def applied_rounds_from(data_dir: Path, job_id: str) -> dict[int, set[str]]:
    store = await SqliteStore.open(data_dir / "coordinator.db")
    try:
        return applied_nodes(await store.list_rounds(job_id))
    finally:
        await store.close()


async def stored_state(data_dir: Path, job_id: str) -> dict:  # type: ignore[type-arg]
    store = await SqliteStore.open(data_dir / "coordinator.db")
    try:
        raw = await store.get_job_state(job_id, STATE_KEY)
    finally:
        await store.close()
    assert raw is not None, "no verification state stored"
    return json.loads(raw.decode())
