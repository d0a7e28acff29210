"""A node's memory cap and the job's micro_batch, with the real engine over real gRPC + TLS;
the agents are played by the test (tests/integration/fake_agent.py).

Two nodes of the same speed; the benchmark of one says at most 4 samples fit its memory in one
forward/backward pass. Without micro_batch that node gets at most 4 samples per round (the
other takes the rest). With micro_batch = 4 it computes its local batch in chunks of 4, one
chunk's activations at a time, so the cap does not bind and the global batch of 16 splits
8 / 8 by speed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from coordinator.engine.engine import Engine
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

pytestmark = pytest.mark.timeout(90)

GLOBAL_BATCH = 16
NUM_SAMPLES = 96  # six rounds
COMPUTE_S = 0.05


async def zero_gradient(agent: FakeAgent, task: agent_pb2.Task) -> None:
    """An update of the right shape and sample count (its values do not matter here), with the
    same compute time for any batch: equal nodes stay equal in the estimator. The compute
    takes the time it reports (the coordinator believes no more than it sees)."""
    _, params = await agent.pull(task.job_id, task.params_version)
    zeros = {n: torch.zeros_like(t) for n, t in params.items()}
    await asyncio.sleep(COMPUTE_S)
    await agent.push(
        task,
        zeros,
        kind="gradient",
        num_samples=len(task_indices(task)),
        compute_seconds=COMPUTE_S,
    )


@pytest.mark.parametrize(("micro_batch", "small_batches"), [(0, {4}), (4, {8})])
async def test_memory_cap_binds_only_without_micro_batches(
    tmp_path: Path, micro_batch: int, small_batches: set[int]
) -> None:
    train: dict[str, object] = {"epochs": 1, "global_batch": GLOBAL_BATCH}
    if micro_batch:
        train["micro_batch"] = micro_batch
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={"train": train, "cluster": {"min_nodes": 2, "max_nodes": 2}},
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    assert packed.spec.micro_batch == micro_batch
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=1.0
    ) as coord:
        big = await FakeAgent(coord, "big", 100.0, zero_gradient).start()
        small = await FakeAgent(coord, "small", 100.0, zero_gradient, max_batch_size=4).start()
        try:
            job = await submit_packed(coord, packed)
            await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED)
        finally:
            await big.stop()
            await small.stop()

    assert not big.errors and not small.errors
    assert {t.spec.micro_batch for t in small.tasks} == {micro_batch}
    assert len(small.tasks) == NUM_SAMPLES // GLOBAL_BATCH
    # The split follows the speeds the coordinator sees (a loaded host may show the small
    # node slower for a round): the cap is what must bind, or not.
    small_sizes = {t.local_batch for t in small.tasks}
    assert max(small_sizes) == max(small_batches), small_sizes
    assert sum(t.local_batch for t in small.tasks) + sum(t.local_batch for t in big.tasks) == (
        NUM_SAMPLES
    )
