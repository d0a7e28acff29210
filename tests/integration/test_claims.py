"""Claims are not trusted (coordinator/rounds/claims.py), with the real engine over real gRPC + TLS;
the agents are played by the test (tests/integration/fake_agent.py).

Three nodes compute at the same real speed (each part takes samples / 200 seconds). One of them
lies: its benchmark says 1e12 samples/s and every update says its compute took a microsecond.
Believed, it would get nearly every sample of every round and nearly all the weight. The
coordinator sees when each node took its task, pulled its parameters and pushed its update:
the liar gets a bounded first round and, once observed, the share of an equal node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from coordinator.engine.engine import Engine
from coordinator.rounds.claims import BENCHMARK_CAP
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import (
    FakeAgent,
    submit_packed,
    task_indices,
    wait_for_job_state,
)
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(120)

RATE = 200.0  # the real speed of every node, samples/s
GLOBAL_BATCH = 60
ROUNDS = 10


def worker(claimed_seconds: float | None):
    async def train(agent: FakeAgent, task: agent_pb2.Task) -> None:
        _, params = await agent.pull(task.job_id, task.params_version)
        n = len(task_indices(task))
        await asyncio.sleep(n / RATE)  # the compute itself
        zeros = {k: torch.zeros_like(t) for k, t in params.items()}
        seconds = n / RATE if claimed_seconds is None else claimed_seconds
        await agent.push(task, zeros, kind="gradient", num_samples=n, compute_seconds=seconds)

    return train


async def test_a_node_that_lies_about_its_speed_gets_an_equal_nodes_share(
    tmp_path: Path,
) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        GLOBAL_BATCH * ROUNDS,
        overrides={
            "train": {"epochs": 1, "global_batch": GLOBAL_BATCH},
            "cluster": {"min_nodes": 3, "max_nodes": 3},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=1.0
    ) as coord:
        honest = [await FakeAgent(coord, f"h{i}", RATE, worker(None)).start() for i in range(2)]
        liar = await FakeAgent(coord, "liar", 1e12, worker(1e-6)).start()
        try:
            job = await submit_packed(coord, packed)
            await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED)
        finally:
            for a in [*honest, liar]:
                await a.stop()

    assert not liar.errors and not any(a.errors for a in honest)
    by_round = {t.round: t.local_batch for t in liar.tasks}
    first, *later = sorted(by_round)
    # Its first round: its benchmark capped at BENCHMARK_CAP x the median claim (the honest
    # nodes are planned at 0.75 of theirs while unobserved).
    cap = BENCHMARK_CAP / (BENCHMARK_CAP + 2 * 0.75)
    assert by_round[first] <= round(GLOBAL_BATCH * cap) + 1, by_round
    # Observed, it is an equal node: a third of the batch, give or take the timing noise of a
    # shared host (believed, it would take nearly all 60 samples of every round).
    settled = [by_round[r] for r in later[1:]]
    assert settled and max(settled) <= GLOBAL_BATCH // 2, by_round
    assert sum(settled) / len(settled) <= GLOBAL_BATCH * 0.45, by_round
