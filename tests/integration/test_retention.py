"""Retention played out against a real coordinator (in process, the real engine, gRPC + TLS) with
agents played by the test (tests/integration/fake_agent.py): disk use stays bounded over a long
run of checkpoints, old events go while recent ones and those of running jobs stay, and a
garbage collection killed with SIGKILL at its worst moments leaves every referenced blob intact
for a restarted coordinator, which resumes the job to its end and serves its result."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from coordinator.store.checkpoint import CheckpointManifest
from coordinator.store.retention import job_references
from coordinator.store.sqlite import SqliteStore
from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import (
    FakeAgent,
    submit_packed,
    task_indices,
    wait_for_job_state,
)
from tests.procs import async_wait_until, in_process_coordinator

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 16
KEEP = 3
COMPUTE_S = 0.05
ROUNDS = 60


async def small_gradient(agent: FakeAgent, task: agent_pb2.Task) -> None:
    """A gradient that moves every parameter: each checkpoint's tensors differ."""
    _, params = await agent.pull(task.job_id, task.params_version)
    grads = {n: torch.full_like(t, 0.01) for n, t in params.items()}
    await asyncio.sleep(COMPUTE_S)  # the compute it reports takes its time
    await agent.push(
        task,
        grads,
        kind="gradient",
        num_samples=len(task_indices(task)),
        compute_seconds=COMPUTE_S,
    )


def packed_job(tmp_path: Path, num_samples: int, epochs: int) -> PackedJob:
    job_toml = write_mlp_job(
        tmp_path / "job",
        num_samples,
        overrides={
            "train": {"epochs": epochs, "global_batch": GLOBAL_BATCH, "momentum": 0.0},
            "cluster": {"checkpoint_every": 1, "min_nodes": 1, "max_nodes": 1},
        },
    )
    return build_job(load_spec(job_toml), cache=ExportCache.default())


def blob_files(data_dir: Path) -> dict[str, int]:
    root = data_dir / "blobs"
    return {
        p.name: p.stat().st_size
        for p in root.glob("??/*")
        if p.is_file() and p.parent.name != "partial"
    }


async def download_result(coord: Coordinator, job_id: str) -> bytes:
    async with idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as ch:
        stub = job_pb2_grpc.JobServiceStub(ch)
        parts = [
            msg.chunk.data
            async for msg in stub.DownloadResult(
                job_pb2.DownloadResultRequest(job_id=job_id), timeout=30
            )
        ]
    return b"".join(parts)


async def test_disk_use_stays_bounded_and_old_events_go(tmp_path: Path) -> None:
    packed = packed_job(tmp_path, num_samples=GLOBAL_BATCH * ROUNDS // 2, epochs=2)
    data_dir = tmp_path / "coord"
    async with in_process_coordinator(
        data_dir,
        engine_factory=Engine,
        heartbeat_interval_s=1.0,
        keep_checkpoints=KEEP,
        gc_interval_s=0.2,
        gc_checkpoint_grace_s=0.0,
        event_retention_s=3600.0,
    ) as coord:
        store = coord.store
        old_node = await store.append_event("node.registered", node_id="n-old", time_ms=1_000)
        agent = await FakeAgent(coord, "a", 100.0, small_gradient).start()
        peak_bytes, peak_checkpoints, samples = 0, 0, 0
        stop = asyncio.Event()

        async def sample() -> None:
            nonlocal peak_bytes, peak_checkpoints, samples
            while not stop.is_set():
                peak_bytes = max(peak_bytes, sum(blob_files(data_dir).values()))
                peak_checkpoints = max(peak_checkpoints, len(await store.list_checkpoints()))
                samples += 1
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        try:
            job = await submit_packed(coord, packed)
            # An old event of the running job: kept while it runs.
            old_job = await store.append_event("job.note", job_id=job.job_id, time_ms=1_000)
            await coord.gc.run_once()
            kept = {e.id for e in await store.list_events(limit=0)}
            assert old_node.id not in kept and old_job.id in kept
            job = await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_SUCCEEDED)
        finally:
            stop.set()
            await sampler
            await agent.stop()
        rounds = await store.list_rounds(job.job_id)
        assert len(rounds) == ROUNDS

        # The ended job keeps its last checkpoint; the others' tensors are gone from disk.
        async def settled() -> bool:
            await coord.gc.run_once()
            return len(await store.list_checkpoints(job.job_id)) == 1

        await async_wait_until(settled, timeout=10, message="checkpoints never dropped")
        ((_, last_round, manifest_bytes),) = await store.list_checkpoints(job.job_id)
        assert last_round == ROUNDS
        manifest = CheckpointManifest.from_bytes(manifest_bytes)
        files = blob_files(data_dir)
        expected = job_references(job) | {manifest.tensors_sha256}
        assert set(files) == expected
        checkpoint_bytes = files[manifest.tensors_sha256]
        base = sum(files.values()) - checkpoint_bytes
        # At most KEEP checkpoints, the one a rollback may need, and those written within a
        # collection interval (0.2 s, rounds of at least COMPUTE_S).
        assert peak_checkpoints <= KEEP + 8, (peak_checkpoints, coord.gc.passes)
        assert peak_bytes <= base + (KEEP + 8) * checkpoint_bytes, (peak_bytes, base)
        written = len(rounds) * checkpoint_bytes
        log.info(
            f"disk: peak {peak_bytes} bytes ({peak_checkpoints} checkpoints at most, "
            f"{samples} samples), final {sum(files.values())}; job blobs {base}, "
            f"checkpoint {checkpoint_bytes} bytes x {len(rounds)} rounds = {written} written"
        )
        # The job's events stay after it ended while they are recent; the old one goes now.
        await coord.gc.run_once()
        kept = {e.id for e in await store.list_events(limit=0)}
        assert old_job.id not in kept
        assert await store.list_events(job_id=job.job_id, kinds=["job.succeeded"])
        assert hashlib.sha256(await download_result(coord, job.job_id)).hexdigest() == (
            job.result.sha256
        )


GC_SCRIPT = """
import asyncio, sys
from pathlib import Path
from coordinator.store.blobs import BlobStore
from coordinator.store.gc import GarbageCollector
from coordinator.store.retention import RetentionPolicy
from coordinator.store.sqlite import SqliteStore

async def main(data_dir):
    store = await SqliteStore.open(data_dir / "coordinator.db")
    blobs = BlobStore(data_dir / "blobs", store, max_blob_bytes=1 << 30)
    await blobs.start()
    policy = RetentionPolicy(keep_checkpoints=2, blob_grace_ms=0, released_grace_ms=0)
    await GarbageCollector(store, blobs, policy, interval_s=60).run_once()
    await store.close()

asyncio.run(main(Path(sys.argv[1])))
"""


async def check_consistent(data_dir: Path) -> None:
    """Every blob a job or checkpoint names is on disk with its bytes, and recorded."""
    store = await SqliteStore.open(data_dir / "coordinator.db")
    try:
        referenced: set[str] = set()
        for job in await store.list_jobs():
            referenced |= job_references(job)
        checkpoints = await store.list_checkpoints()
        assert checkpoints, "no checkpoint survived"
        for _, _, manifest in checkpoints:
            referenced.add(CheckpointManifest.from_bytes(manifest).tensors_sha256)
        recorded = {b.sha256 for b in await store.list_blobs()}
    finally:
        await store.close()
    for sha in referenced:
        path = data_dir / "blobs" / sha[:2] / sha
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        assert sha in recorded


@pytest.mark.timeout(180)
async def test_gc_killed_mid_pass_leaves_referenced_blobs_intact(tmp_path: Path) -> None:
    packed = packed_job(tmp_path, num_samples=GLOBAL_BATCH * 10, epochs=3)  # 30 rounds
    first = tmp_path / "first"
    # A job part done with many checkpoints (nothing collected: keep them all), then stopped.
    async with in_process_coordinator(
        first, engine_factory=Engine, heartbeat_interval_s=1.0, keep_checkpoints=1000
    ) as coord:
        agent = await FakeAgent(coord, "a", 100.0, small_gradient).start()
        try:
            job = await submit_packed(coord, packed)

            async def enough() -> bool:
                return len(await coord.store.list_checkpoints(job.job_id)) >= 8

            await async_wait_until(enough, timeout=60, message="too few checkpoints")
        finally:
            await agent.stop()
    store = await SqliteStore.open(first / "coordinator.db")
    try:
        latest_checkpoint = await store.latest_checkpoint(job.job_id)
    finally:
        await store.close()
    assert latest_checkpoint is not None
    latest = latest_checkpoint[0]
    env = {**os.environ, "EPOCHMESH_TEST_HOOKS": "1"}
    for point in ("after_drop", "after_sweep", "mid_unlink"):
        data_dir = tmp_path / point
        shutil.copytree(first, data_dir)
        env["EPOCHMESH_TEST_GC_KILL_AT"] = point
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", GC_SCRIPT, str(data_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-2000:])
        await check_consistent(data_dir)

    # A coordinator restarted on what a kill left resumes the job, finishes it and serves its
    # result; the files the kill left without a record are recorded again, then collected.
    for point in ("after_sweep", "mid_unlink"):
        await finish_after_kill(tmp_path / point, job.job_id, latest)


async def finish_after_kill(data_dir: Path, job_id: str, latest: int) -> None:
    async with in_process_coordinator(
        data_dir,
        engine_factory=Engine,
        heartbeat_interval_s=0.5,  # the node of before the kill is given up on sooner
        keep_checkpoints=2,
        gc_interval_s=0.2,
        gc_blob_grace_s=0.0,
        gc_checkpoint_grace_s=0.0,
    ) as coord:
        agent = await FakeAgent(coord, "a", 100.0, small_gradient).start()
        try:
            done = await wait_for_job_state(coord, job_id, common_pb2.JOB_STATE_SUCCEEDED)
        finally:
            await agent.stop()
        result = await download_result(coord, job_id)
        assert hashlib.sha256(result).hexdigest() == done.result.sha256
        (restored,) = await coord.store.list_events(job_id=job_id, kinds=["job.restored"])
        assert int(restored.attrs["checkpoint_round"]) == latest, restored.message
        gc = coord.gc
        assert gc is not None

        async def nothing_left() -> bool:
            await gc.run_once()
            referenced = job_references(done)
            for _, _, manifest in await coord.store.list_checkpoints():
                referenced.add(CheckpointManifest.from_bytes(manifest).tensors_sha256)
            return set(blob_files(data_dir)) == referenced

        await async_wait_until(nothing_left, timeout=10, message="blobs left behind")
    await check_consistent(data_dir)
