"""Verification's bad input, with the real engine over real gRPC + TLS; the agents are played by
the test (tests/integration/fake_agent.py).

- The coordinator asks every parameter-server part for chunk commitments, and nothing a node
  receives before its update says whether or how it will be checked (no seed, no chunk).
- An update without commitments, or whose commitments do not fit it, is INVALID_ARGUMENT with
  a strike; malformed sketches too.
- Sketches that do not add up to the update the node sent (it added something its chunks do
  not contain) quarantine the node with the evidence in the event, and its applied updates are
  undone (a `job.rolled_back` event); the job still succeeds on the honest node.
- A node that reports a check it was not given gets FAILED_PRECONDITION, and no strike.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.engine.engine import Engine
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import chunk_bounds
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import (
    FakeAgent,
    job_events,
    submit_packed,
    task_indices,
    wait_for_job_state,
)
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(300)

# 16 rounds: enough for the longest plan even when updates come late on a busy host (a late
# step is tried again; the job must not end before the plan's last step).
NUM_SAMPLES, GLOBAL_BATCH = 192, 24
# Both agents compute at the speed their benchmark says and report what they took: the
# planner keeps them equal, so the hostile node's part is a required share of every round (a
# node that answers in no time would be measured far faster than its benchmark, and the other
# left a best-effort part below one sample, taken only when it happens to come first).
RATE = 100.0


async def compute(task: agent_pb2.Task) -> float:
    seconds = len(task_indices(task)) / RATE
    await asyncio.sleep(seconds)
    return seconds


async def honest(agent: FakeAgent, task: agent_pb2.Task) -> None:
    _, params = await agent.pull(task.job_id, task.params_version)
    grads = {n: torch.full_like(t, 0.01) for n, t in params.items()}
    took = await compute(task)
    await agent.push(
        task, grads, kind="gradient", num_samples=len(task_indices(task)), compute_seconds=took
    )


@pytest.mark.parametrize(
    ("plan", "strikes"),
    # Honest rounds in between: three failed parts in a row would exclude it from the job.
    [
        (["none", "honest", "misfit", "honest", "scaled"], 2),
        (["malformed", "honest", "report", "scaled"], 1),
    ],
)
async def test_commitments_sketches_and_reports_from_a_hostile_node(
    tmp_path: Path, plan: list[str], strikes: int
) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={
            "train": {"epochs": 2, "global_batch": GLOBAL_BATCH},
            # Both nodes from the first round (the hostile one must take part); once it is
            # quarantined a spare takes its place.
            "cluster": {"min_nodes": 2, "max_nodes": 2, "checkpoint_every": 2},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    seen: list[str] = []

    async def hostile(agent: FakeAgent, task: agent_pb2.Task) -> None:
        """Round by round, the plan's misdeeds: no commitments; commitments that do not fit;
        malformed sketches; a report of a check it was not given (then an honest update);
        sketches of honest chunks for an update it scaled by 100."""
        assert task.verify_chunks > 0 and not task.HasField("check")
        n = len(task_indices(task))
        _, params = await agent.pull(task.job_id, task.params_version)
        grads = {k: torch.full_like(t, 0.01) for k, t in params.items()}
        took = await compute(task)
        step = plan[len(seen)] if len(seen) < len(plan) else "honest"
        # A step counts once the coordinator judged it: an update that came after its round's
        # deadline (a slow pull on a busy host) is only noted as late; the step is tried again.
        if step == "honest":
            response = await agent.push(
                task, grads, kind="gradient", num_samples=n, compute_seconds=took
            )
            if response.accepted and len(seen) < len(plan):
                seen.append(step)
        elif step in ("none", "misfit"):
            # "misfit": the chunks' losses do not average to the update's mean_loss (1.0).
            chunks = [] if step == "none" else _chunks(task, n, loss=2.0)
            try:
                response = await agent.push(
                    task, grads, kind="gradient", num_samples=n, compute_seconds=took, chunks=chunks
                )
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                if step == "none":
                    assert "no chunk commitments" in (err.details() or "")
                seen.append(step)
            else:
                assert not response.accepted, "an update without fitting commitments was taken"
        elif step == "malformed":
            # Honest commitments, but sketches of the wrong size.
            response = await agent.push(
                task,
                grads,
                kind="gradient",
                num_samples=n,
                compute_seconds=took,
                chunks=_chunks(task, n),
                sketches=False,
            )
            if response.accepted and response.sketch.buckets:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent.stub.CommitSketches(
                        agent_pb2.CommitSketchesRequest(
                            node_id=agent.node_id,
                            lease_id=agent.lease_id,
                            job_id=task.job_id,
                            task_id=task.task_id,
                            seed=response.sketch.seed,
                            sketches=[0.0] * 3,
                        ),
                        timeout=10,
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                seen.append(step)
        elif step == "report":
            # A check it was never given: refused, no strike.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.stub.ReportCheck(
                    agent_pb2.ReportCheckRequest(
                        node_id=agent.node_id,
                        lease_id=agent.lease_id,
                        task_id="c-000000000000",
                        loss=1.0,
                        sketch=[0.0] * 256,
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            seen.append(step)
            await agent.push(task, grads, kind="gradient", num_samples=n, compute_seconds=took)
        elif step == "scaled":
            response = await push_scaled(agent, task, grads, took)
            if response.accepted:
                assert response.sketch.buckets > 0  # new: every round is checked
                seen.append(step)

    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=1.0, lease_ttl_s=30.0
    ) as coord:
        good = await FakeAgent(coord, "good", RATE, honest).start()
        bad = await FakeAgent(coord, "bad", RATE, hostile).start()
        spare: FakeAgent | None = None
        try:
            job = await submit_packed(coord, packed)

            async def caught() -> bool:
                info = coord.registry.find(bad.node_id)
                return info.state == common_pb2.NODE_STATE_QUARANTINED

            await async_wait_until(caught, timeout=150, message="the scaled update caught")
            spare = await FakeAgent(coord, "spare", RATE, honest).start()
            await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED, timeout=120)
            events = await job_events(coord, job.job_id)
        finally:
            await good.stop()
            await bad.stop()
            if spare is not None:
                await spare.stop()
            await asyncio.sleep(0)

    assert seen == plan, seen
    info = coord.registry.find(bad.node_id)
    assert info.strikes == strikes, info
    quarantined = [e for e in events if e.kind == "node.quarantined" and e.node_id == bad.node_id]
    assert quarantined, [e.kind for e in events]
    evidence = dict(quarantined[-1].attrs)
    assert evidence["check"] == "consistency", evidence
    assert float(evidence["distance"]) > float(evidence["tolerance"]), evidence
    assert any(e.kind == "job.rolled_back" for e in events), [e.kind for e in events]
    assert coord.registry.find(good.node_id).strikes == 0
    assert good.errors == []


async def push_scaled(
    agent: FakeAgent, task: agent_pb2.Task, grads: dict[str, torch.Tensor], took: float
) -> agent_pb2.PushUpdateResponse:
    """Push ``grads`` scaled by 100 with the commitments and sketches of the honest chunks:
    they do not add up to the update (the consistency check catches it)."""
    n = len(task_indices(task))
    scaled = {k: 100 * v for k, v in grads.items()}
    return await agent.push(
        task,
        scaled,
        kind="gradient",
        num_samples=n,
        compute_seconds=took,
        chunks=_chunks(task, n),
        sketch_of=grads,
    )


def _chunks(task: agent_pb2.Task, n: int, loss: float = 1.0) -> list[agent_pb2.ChunkCommitment]:
    """Commitments of the right count and sizes, every chunk with ``loss`` (the pushed
    mean_loss is 1.0: another loss makes them not fit)."""
    return [
        agent_pb2.ChunkCommitment(samples=e - s, loss=loss)
        for s, e in chunk_bounds(n, task.verify_chunks)
    ]
