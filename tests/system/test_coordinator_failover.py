# ruff: noqa: F811
"""Two coordinator processes on one PostgreSQL database (tests/pg.py): the second stands by
(health NOT_SERVING, every other call UNAVAILABLE naming the active one in the
``epochmesh-active`` trailing metadata); kill -9 of the active makes it active, and a job
running at the kill completes with every sample applied exactly once and no charge made
twice, the agent enrolled through the first accepted by the second. And fencing: the active
whose lease connection is ended steps down (exit status 3) while the standby takes over."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from epochmesh.identity import coordinator_channel_options, identity_credentials
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)
from tests.procs import (
    _remember,
    _Trust,
    console_script,
    free_port,
    health_status,
    identity_for,
    wait_until,
)
from tests.system.test_agent import AgentProc
from tests.system.test_fault_tolerance import (
    HEARTBEAT_S,
    applied,
    check_exactly_once,
    events_of,
    job_doc,
)
from tests.system.test_postgres_store import PgCluster
from tests.unit.test_ha_lease import terminate_lease_holder_sql

JS = common_pb2.JobState
JOB_SERVICE = "epochmesh.v1.JobService"


def start_standby(data_dir: Path, address: str, url: str) -> subprocess.Popen[bytes]:
    """A coordinator on ``url`` at ``address``; returns once it listens (health answers)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "coordinator-stderr.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [
            str(console_script("epochmesh-coordinator")),
            "--data-dir",
            str(data_dir),
            "--listen",
            address,
            "--store",
            url,
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--http-listen",
            "",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    log.close()
    _remember(address, _Trust(data_dir, False))

    def listening() -> bool:
        assert proc.poll() is None, (data_dir / "coordinator-stderr.log").read_text()[-3000:]
        return (data_dir / "ca.pem").exists() and health_status(address) is not None

    wait_until(listening, timeout=90, interval=0.2, message="the standby never listened")
    return proc


def refusal_of(address: str, via: str) -> grpc.RpcError:
    """The error a JobService call to ``address`` gets, as an operator of ``via``'s CA."""
    ident = identity_for(via, "operator")
    assert ident is not None
    channel = grpc.secure_channel(
        address, identity_credentials(ident), options=coordinator_channel_options()
    )
    with channel:
        stub = job_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListJobs(job_pb2.ListJobsRequest(), timeout=10)
    return caught.value


def check_standby(address: str, active: str) -> None:
    assert health_status(address) == "NOT_SERVING"
    assert health_status(address, JOB_SERVICE) == "NOT_SERVING"
    err = refusal_of(address, active)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == f"standby coordinator; the active coordinator is at {active}"
    assert dict(err.trailing_metadata() or ())["epochmesh-active"] == active


def charges_made_twice(pg_server: PgServer, database: str, job_id: str) -> list[str]:
    rows = pg_server.sql(
        "SELECT reason, round, node_id, from_account, to_account FROM ledger_entries "
        f"WHERE job_id = '{job_id}' AND round >= 0",
        database,
    ).splitlines()
    return [row for row, n in Counter(rows).items() if n > 1]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(420)
def test_the_standby_takes_over_a_running_job_after_a_kill9(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    cluster = PgCluster(tmp_path, pg_url)
    first = cluster.address
    second = f"127.0.0.1:{free_port()}"
    # Blobs live in DATA_DIR/blobs: the two data dirs share one (as a shared filesystem would).
    (tmp_path / "coord2").mkdir()
    (tmp_path / "coord2" / "blobs").symlink_to(tmp_path / "coord" / "blobs")
    standby = start_standby(tmp_path / "coord2", second, pg_url)
    try:
        check_standby(second, first)
        assert (tmp_path / "coord2" / "ca.pem").read_bytes() == (
            tmp_path / "coord" / "ca.pem"
        ).read_bytes()
        cluster.start_agent("a", 2.0)
        cluster.wait_ready(["a"], timeout=90)
        n, epochs, every = 192, 3, 4
        job_id = cluster.submit(
            tmp_path / "job", job_doc("failover", epochs=epochs, checkpoint_every=every), n
        )
        cluster.wait_rounds(
            job_id,
            lambda rs: sum(1 for r in rs if applied(r)) >= every + 2,
            timeout=120,
            what="rounds past the first checkpoint",
        )
        cluster.coord.kill9()
        killed = time.monotonic()
        wait_until(
            lambda: health_status(second) == "SERVING",
            timeout=60,
            interval=0.1,
            message="the standby never became active",
        )
        took = time.monotonic() - killed
        logging.getLogger(__name__).info("takeover after kill -9: %.1fs", took)

        # The agent enrolled through the first coordinator, now pointed at the second.
        cluster.agents["a"].kill9()
        agent = AgentProc(second, tmp_path / "agent-a", "--name", "a", "--slowdown", "2")
        cluster.agents["a"] = agent
        cluster.address = second
        cluster._stub = None
        cluster._channel = None
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=180)
        assert "--token" not in " ".join(agent.proc.args)  # type: ignore[arg-type]
        rounds = cluster.rounds(job_id)
        check_exactly_once(rounds, n, epochs)
        numbers = [r.round for r in rounds]
        assert numbers == sorted(set(numbers))
        assert len(events_of(cluster.events(job_id), "job.restored")) == 1
        assert charges_made_twice(pg_server, database, job_id) == []
        epoch = pg_server.sql("SELECT epoch FROM coordinator_lease", database).strip()
        assert epoch == "2"
    finally:
        cluster.stop()
        stop(standby)


@pytest.mark.timeout(300)
def test_an_active_whose_lease_connection_dies_steps_down_and_writes_nothing_more(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    cluster = PgCluster(tmp_path, pg_url)
    first = cluster.address
    second = f"127.0.0.1:{free_port()}"
    standby = start_standby(tmp_path / "coord2", second, pg_url)
    try:
        check_standby(second, first)
        pg_server.sql(terminate_lease_holder_sql(database))
        proc = cluster.coord.proc
        assert proc is not None
        assert proc.wait(timeout=120) == 3, cluster.coord.log_tail()
        log = cluster.coord.log_tail(20000)
        assert "stepping down" in log and "lost the coordinator lease" in log
        wait_until(
            lambda: health_status(second) == "SERVING",
            timeout=60,
            interval=0.1,
            message="the standby never became active",
        )
        # One start per epoch; the first coordinator is gone, its store fenced before it went.
        started = pg_server.sql(
            "SELECT count(*) FROM events WHERE kind = 'coordinator.started'", database
        )
        assert started.strip() == "2"
        lease = pg_server.sql("SELECT epoch, address FROM coordinator_lease", database)
        assert lease.strip().split("|") == ["2", second]
        assert health_status(first) is None
    finally:
        cluster.stop()
        stop(standby)
