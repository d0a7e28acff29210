"""The coordinator as a real process: kill -9 and restart, SIGTERM, data-dir lock, CLI."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.main import build_parser, config_from_args
from coordinator.store.sqlite import SqliteStore
from epochmesh.identity import Identity, coordinator_channel_options, identity_credentials
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import (
    console_script,
    identity_for,
    start_coordinator,
    sync_channel_for,
    wait_until,
)

MIB = 1 << 20
NS = common_pb2.NodeState


class Client:
    def __init__(self, address: str, identity: Identity | None = None) -> None:
        """A client as the helpers' operator, or as ``identity`` (the same user across a
        restart: partial uploads are per identity)."""
        if identity is None:
            self.channel = sync_channel_for(address)
        else:
            creds = identity_credentials(identity)
            self.channel = grpc.secure_channel(
                address, creds, options=coordinator_channel_options()
            )
        self.agent = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.sched = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def register(self, name: str) -> agent_pb2.RegisterResponse:
        return self.agent.Register(agent_pb2.RegisterRequest(name=name), timeout=10)

    def heartbeat(self, reg: agent_pb2.RegisterResponse) -> agent_pb2.HeartbeatResponse:
        return self.agent.Heartbeat(
            agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id), timeout=10
        )

    def node(self, node_id: str) -> common_pb2.NodeInfo:
        return self.sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id), timeout=10)

    def events(self, since_id: int = 0) -> list[common_pb2.Event]:
        req = scheduler_pb2.WatchEventsRequest(since_id=since_id)
        return list(self.sched.WatchEvents(req, timeout=10))

    def upload(
        self, data: bytes, upto: int | None = None, offset: int = 0
    ) -> job_pb2.UploadBlobResponse:
        digest = hashlib.sha256(data).hexdigest()
        end = len(data) if upto is None else upto

        def messages() -> Iterator[job_pb2.UploadBlobRequest]:
            yield job_pb2.UploadBlobRequest(
                header=job_pb2.UploadBlobHeader(sha256=digest, size=len(data), offset=offset)
            )
            for o in range(offset, end, MIB):
                piece = data[o : min(o + MIB, end)]
                yield job_pb2.UploadBlobRequest(chunk=common_pb2.DataChunk(offset=o, data=piece))

        return self.jobs.UploadBlob(messages(), timeout=30)

    def fetch(self, digest: str) -> bytes:
        parts = self.agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256=digest), timeout=30)
        return b"".join(p.chunk.data for p in parts)


def create_job_from_outside(db_path: Path) -> common_pb2.Job:
    """Write a finished job through a second connection while the coordinator runs (WAL allows
    it); finished, so the training engine leaves it alone (live jobs are resumed and are
    covered by the training tests)."""

    async def create() -> common_pb2.Job:
        store = await SqliteStore.open(db_path)
        try:
            return await store.create_job(
                common_pb2.Job(name="survivor", state=common_pb2.JOB_STATE_SUCCEEDED), "alice"
            )
        finally:
            await store.close()

    return asyncio.run(create())


@pytest.mark.timeout(90)
def test_kill9_and_restart_keeps_nodes_jobs_blobs_events(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    args = ("--heartbeat-interval", "0.3", "--lease-ttl", "4")
    with start_coordinator(data_dir, *args) as proc:
        operator = identity_for(proc.address)
        c = Client(proc.address, operator)
        alive = c.register("alive")
        cordoned = c.register("cordoned")
        silent = c.register("silent")
        c.sched.Cordon(scheduler_pb2.NodeRequest(node_id=cordoned.node_id), timeout=10)
        blob = os.urandom(2 * MIB + 77)
        blob_sha = hashlib.sha256(blob).hexdigest()
        assert c.upload(blob).blob.sha256 == blob_sha
        partial = os.urandom(3 * MIB)
        partial_sha = hashlib.sha256(partial).hexdigest()
        assert c.upload(partial, upto=2 * MIB).received_bytes == 2 * MIB
        job = create_job_from_outside(data_dir / "coordinator.db")
        for reg in (alive, cordoned, silent):
            c.heartbeat(reg)
        before_events = c.events()
        before_nodes = {n: c.node(n) for n in (alive.node_id, cordoned.node_id, silent.node_id)}
        c.close()

        proc.kill9()
        assert proc.proc is not None and proc.proc.returncode == -signal.SIGKILL
        proc.restart()

        c = Client(proc.address, operator)
        # Known nodes keep their lease across the restart: agents carry on heartbeating.
        assert c.heartbeat(alive).state == NS.NODE_STATE_ONLINE
        assert c.heartbeat(cordoned).state == NS.NODE_STATE_CORDONED
        for node_id, old in before_nodes.items():
            now = c.node(node_id)
            assert (now.name, now.registered_at_ms) == (old.name, old.registered_at_ms)
            assert now.last_heartbeat_ms >= old.registered_at_ms
        # Blobs: the complete one is intact, the partial one resumes where it stopped.
        assert c.fetch(blob_sha) == blob
        st = c.jobs.GetBlobStatus(job_pb2.GetBlobStatusRequest(sha256=partial_sha), timeout=10)
        assert (st.complete, st.received_bytes, st.size) == (False, 2 * MIB, 3 * MIB)
        assert c.upload(partial, offset=2 * MIB).blob.sha256 == partial_sha
        assert c.fetch(partial_sha) == partial
        # Jobs.
        got = c.jobs.GetJob(job_pb2.GetJobRequest(job_id=job.job_id), timeout=10)
        assert got == job
        # Events: the old ones, same ids, then the new ones; resuming from an old id works.
        after_events = c.events()
        assert after_events[: len(before_events)] == before_events
        newer = after_events[len(before_events) :]
        assert newer[0].kind == "coordinator.started"
        assert c.events(since_id=before_events[-1].id) == newer

        # The node that never heartbeats again lapses to OFFLINE; the others stay.
        def silent_offline() -> bool:
            c.heartbeat(alive)
            c.heartbeat(cordoned)
            return c.node(silent.node_id).state == NS.NODE_STATE_OFFLINE

        wait_until(silent_offline, timeout=20, interval=0.3)
        assert c.node(alive.node_id).state == NS.NODE_STATE_ONLINE

        # The state flips in memory before the event is stored: wait for the event.
        def offline_events() -> list[str]:
            return [e.node_id for e in c.events() if e.kind == "node.offline"]

        wait_until(offline_events, timeout=10, interval=0.05)
        assert offline_events() == [silent.node_id]
        c.close()
        assert proc.terminate() == 0


@pytest.mark.timeout(120)
def test_sigterm_goes_not_serving_first_and_exits_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with (
        start_coordinator(data_dir, "--shutdown-grace", "3") as proc,
        ThreadPoolExecutor(2) as pool,
    ):
        c = Client(proc.address)
        reg = c.register("poller")
        health = health_pb2_grpc.HealthStub(c.channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="epochmesh.v1.AgentService"))
        statuses = [next(watch).status]
        assert statuses == [health_pb2.HealthCheckResponse.SERVING]
        poll = pool.submit(
            c.agent.NextTask,
            agent_pb2.NextTaskRequest(node_id=reg.node_id, lease_id=reg.lease_id, wait_ms=25_000),
            timeout=30,
        )
        time.sleep(0.3)  # let the long poll reach the server (nothing to poll for)
        t0 = time.monotonic()
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        statuses.append(next(watch).status)
        assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        # The in-flight long poll is answered (not cut off) once shutdown begins, and the
        # coordinator exits without waiting it out: both before the poll's own 25 s wait
        # would have ended (a bound a loaded host's slower exit stays well within).
        assert poll.result(timeout=25).kind == agent_pb2.TASK_KIND_NONE
        assert proc.proc.wait(timeout=25) == 0
        assert time.monotonic() - t0 < 24
        c.close()
    assert not (data_dir / "coordinator.addr").exists()
    assert "coordinator stopped" in proc.log_tail()
    with sqlite3.connect(data_dir / "coordinator.db") as db:
        kinds = [r[0] for r in db.execute("SELECT kind FROM events ORDER BY id")]
    assert kinds[-1] == "coordinator.stopping"


@pytest.mark.timeout(60)
def test_second_coordinator_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with start_coordinator(data_dir) as proc:
        second = subprocess.run(
            [
                str(console_script("epochmesh-coordinator")),
                "--data-dir",
                str(data_dir),
                "--listen",
                "127.0.0.1:0",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 1
        assert "in use by another coordinator" in second.stderr
        assert proc.running()
        assert (data_dir / "coordinator.addr").read_text().strip() == proc.address


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "one") as proc:
        second = subprocess.run(
            [
                str(console_script("epochmesh-coordinator")),
                "serve",
                "--data-dir",
                str(tmp_path / "two"),
                "--listen",
                proc.address,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert second.returncode == 1
    assert f"cannot listen on {proc.address}" in second.stderr
    assert not (tmp_path / "two" / "coordinator.addr").exists()


@pytest.mark.timeout(60)
def test_cli_defaults_and_subcommand_form() -> None:
    parser = build_parser()
    config = config_from_args(parser.parse_args(["serve"]))
    assert str(config.data_dir) == ".epochmesh" and config.listen == "127.0.0.1:7070"
    assert config.heartbeat_interval_s == 2.0 and config.lease_ttl == 6.0
    custom = config_from_args(
        parser.parse_args(
            ["serve", "--listen", "0.0.0.0:0", "--heartbeat-interval", "1", "--max-blob-bytes", "9"]
        )
    )
    assert custom.lease_ttl == 3.0 and custom.max_blob_bytes == 9
    out = subprocess.run(
        [str(console_script("epochmesh-coordinator")), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "serve" in out.stdout
    bad = subprocess.run(
        [
            str(console_script("epochmesh-coordinator")),
            "--lease-ttl",
            "1",
            "--heartbeat-interval",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "must exceed the heartbeat interval" in bad.stderr
