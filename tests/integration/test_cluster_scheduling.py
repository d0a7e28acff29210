"""Several jobs at once under the cluster scheduler, with the real engine over real gRPC + TLS;
the agents are played by the test (tests/integration/fake_agent.py). Each submission comes
from its own identity: a tenant of its own.

- A second tenant's job gets half of the nodes from the first tenant's running job at a round
  boundary (once the first job's hold on them has passed); both cover every sample of every
  epoch exactly once.
- A high-priority job takes the nodes it needs at once, hold or not; the job it preempts keeps
  its exactly-once accounting and finishes after it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from coordinator.engine import Engine
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
from tests.procs import async_wait_until, in_process_coordinator

if TYPE_CHECKING:
    from coordinator.server import Coordinator

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 16


async def zero_gradient(agent: FakeAgent, task: agent_pb2.Task) -> None:
    """An update of the right shape and sample count, after a short compute time (rounds of
    a few tens of ms: the test sees round boundaries)."""
    _, params = await agent.pull(task.job_id, task.params_version)
    await asyncio.sleep(0.02)  # the "compute" of the round, not a wait for a condition
    zeros = {n: torch.zeros_like(t) for n, t in params.items()}
    await agent.push(task, zeros, kind="gradient", num_samples=len(task_indices(task)))


def packed_job(tmp_path: Path, name: str, samples: int, epochs: int, **cluster: object):
    job_toml = write_mlp_job(
        tmp_path / name,
        samples,
        overrides={
            "name": name,
            "train": {"epochs": epochs, "global_batch": GLOBAL_BATCH},
            "cluster": {"min_nodes": 1, "max_nodes": 4, **cluster},
        },
    )
    return build_job(load_spec(job_toml))


def nodes_of(agents: list[FakeAgent], job_id: str, since: int = 0) -> set[str]:
    """The agents that got a TRAIN task of the job (among their tasks from index `since`)."""
    return {
        a.name
        for a in agents
        if any(t.job_id == job_id and t.kind == agent_pb2.TASK_KIND_TRAIN for t in a.tasks[since:])
    }


async def check_exactly_once(coord: Coordinator, job_id: str, samples: int, epochs: int) -> None:
    """Every epoch of the job trained every sample exactly once among the applied parts of
    its recorded rounds (a part cut off by a preemption went back to pending)."""
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in await coord.store.list_rounds(job_id):
        for part in rnd.parts:
            if part.status == "applied":
                by_epoch[rnd.epoch].extend(i for r in part.ranges for i in range(r.start, r.stop))
    assert sorted(by_epoch) == list(range(epochs))
    for seen in by_epoch.values():
        assert sorted(seen) == list(range(samples))


async def test_a_second_tenant_gets_half_and_a_high_priority_job_preempts(
    tmp_path: Path,
) -> None:
    long_a = packed_job(tmp_path, "tenant-a", 1600, 2)
    job_b = packed_job(tmp_path, "tenant-b", 640, 1)
    urgent = packed_job(tmp_path, "urgent", 320, 1, min_nodes=3, max_nodes=3, priority="high")
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=1.0, scheduler_hold_s=0.5
    ) as coord:
        agents = [await FakeAgent(coord, f"n{i}", 100.0, zero_gradient).start() for i in range(4)]
        try:
            a = await submit_packed(coord, long_a)
            await async_wait_until(
                lambda: len(nodes_of(agents, a.job_id)) == 4, timeout=30, message="A on 4 nodes"
            )
            b = await submit_packed(coord, job_b)

            def split_in_half() -> bool:
                # the last task of each agent: two work for A, two for B
                last = [x.tasks[-1].job_id for x in agents if x.tasks]
                return sorted(last) == sorted([a.job_id] * 2 + [b.job_id] * 2)

            await async_wait_until(split_in_half, timeout=30, message="A and B on 2 nodes each")
            assert len(nodes_of(agents, b.job_id)) == 2
            u = await submit_packed(coord, urgent)
            await wait_for_job_state(coord, u.job_id, common_pb2.JOB_STATE_SUCCEEDED)
            assert len(nodes_of(agents, u.job_id)) == 3
            await wait_for_job_state(coord, b.job_id, common_pb2.JOB_STATE_SUCCEEDED)
            await wait_for_job_state(coord, a.job_id, common_pb2.JOB_STATE_SUCCEEDED, 90)
            await check_exactly_once(coord, a.job_id, 1600, 2)
            await check_exactly_once(coord, b.job_id, 640, 1)
            await check_exactly_once(coord, u.job_id, 320, 1)
        finally:
            for x in agents:
                await x.stop()
    assert all(not x.errors for x in agents), [x.errors for x in agents]
