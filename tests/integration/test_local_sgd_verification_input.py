"""Local SGD verification's bad input (issue 20), with the real engine over real gRPC + TLS; the
agents are played by the test (tests/integration/fake_agent.py).

- A local SGD part's commitments carry each chunk's start digest: without them the update is
  INVALID_ARGUMENT with a strike.
- The chunk to recompute is named only in the answer to the node's sketches; the start state
  of another chunk is INVALID_ARGUMENT with a strike (and the right one is still taken).
- A start state that is not the one the node committed to quarantines it with the evidence
  (check "snapshot", both digests), and its applied updates are undone; the job still
  succeeds on the honest nodes.
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
from epochmesh.sketch import sketch
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import state_digest
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

# 16 rounds of 96 samples (more with retried parts): enough for the plan even when updates come
# late on a busy host (a late step is tried again; the job must not end before the plan's end).
NUM_SAMPLES, GLOBAL_BATCH, H = 768, 24, 4
RATE = 100.0
PLAN = ["nodigest", "honest", "wrongchunk", "honest", "forged"]


def delta_of(task: agent_pb2.Task, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, 0.001) for n, t in params.items()}


async def params_of(agent: FakeAgent, task: agent_pb2.Task) -> dict[str, torch.Tensor]:
    _, params = await agent.pull(task.job_id, task.params_version)
    return params


async def honest(agent: FakeAgent, task: agent_pb2.Task) -> None:
    delta = delta_of(task, await params_of(agent, task))
    n = len(task_indices(task))
    await asyncio.sleep(n / RATE)
    await agent.push(task, delta, kind="pseudo_gradient", num_samples=n, compute_seconds=n / RATE)


async def test_start_digests_and_start_states_from_a_hostile_node(tmp_path: Path) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={
            "train": {
                "epochs": 2,
                "global_batch": GLOBAL_BATCH,
                "sync": "local_sgd",
                "inner_steps": H,
            },
            # Both nodes from the first round (the hostile one must take part); once it is
            # quarantined a spare takes its place.
            "cluster": {"min_nodes": 2, "max_nodes": 2, "checkpoint_every": 2},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    seen: list[str] = []
    uploads: dict[str, object] = {}

    async def hostile(agent: FakeAgent, task: agent_pb2.Task) -> None:
        assert task.verify_chunks > 0 and not task.HasField("check")
        n = len(task_indices(task))
        delta = delta_of(task, await params_of(agent, task))
        await asyncio.sleep(n / RATE)
        step = PLAN[len(seen)] if len(seen) < len(PLAN) else "honest"
        if step == "honest":
            response = await agent.push(
                task, delta, kind="pseudo_gradient", num_samples=n, compute_seconds=n / RATE
            )
            if response.accepted and len(seen) < len(PLAN):
                seen.append(step)
            return
        chunks, starts = await agent.local_chunks(task, delta, n, 1.0)
        if step == "nodigest":
            bare = [agent_pb2.ChunkCommitment(samples=c.samples, loss=c.loss) for c in chunks]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.push(task, delta, kind="pseudo_gradient", num_samples=n, chunks=bare)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "start digest of 0 bytes" in (err.value.details() or "")
            seen.append(step)
            return
        response = await agent.push(
            task,
            delta,
            kind="pseudo_gradient",
            num_samples=n,
            compute_seconds=n / RATE,
            chunks=chunks,
            sketches=False,
        )
        if not response.accepted:
            return  # late: the step is tried again
        assert response.sketch.buckets > 0  # new: every part is checked
        one = sketch(delta, response.sketch.seed, response.sketch.buckets).tolist()
        drawn = await agent.stub.CommitSketches(
            agent_pb2.CommitSketchesRequest(
                node_id=agent.node_id,
                lease_id=agent.lease_id,
                job_id=task.job_id,
                task_id=task.task_id,
                seed=response.sketch.seed,
                sketches=one + [0.0] * (len(one) * (len(chunks) - 1)),
            ),
            timeout=10,
        )
        assert drawn.snapshot_wanted and 0 <= drawn.snapshot_chunk < len(chunks)
        k = drawn.snapshot_chunk
        if step == "wrongchunk":
            other = (k + 1) % len(chunks)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.push_snapshot(task, starts[other], other)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"chunk {k} was drawn" in (err.value.details() or "")
            reply = await agent.push_snapshot(task, starts[k], k)
            assert reply.accepted
        else:  # forged: another state than the one committed
            forged = {name: t + 0.5 for name, t in starts[k].items()}
            uploads["committed"] = state_digest(starts[k]).hex()
            uploads["uploaded"] = state_digest(forged).hex()
            await agent.push_snapshot(task, forged, k)
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

            await async_wait_until(caught, timeout=150, message="the forged start state caught")
            spare = await FakeAgent(coord, "spare", RATE, honest).start()
            await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED, timeout=120)
            events = await job_events(coord, job.job_id)
        finally:
            for a in (good, bad, spare):
                if a is not None:
                    await a.stop()
            await asyncio.sleep(0)

    assert seen == PLAN, seen
    info = coord.registry.find(bad.node_id)
    assert info.strikes == 2, info  # no digests; another chunk's start state
    quarantined = [e for e in events if e.kind == "node.quarantined" and e.node_id == bad.node_id]
    assert quarantined, [e.kind for e in events]
    evidence = dict(quarantined[-1].attrs)
    assert evidence["check"] == "snapshot", evidence
    assert evidence["committed_digest"] == uploads["committed"], evidence
    assert evidence["uploaded_digest"] == uploads["uploaded"], evidence
    assert any(e.kind == "job.rolled_back" for e in events), [e.kind for e in events]
    assert coord.registry.find(good.node_id).strikes == 0
    assert good.errors == []
