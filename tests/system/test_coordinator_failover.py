# ruff: noqa: F811
"""Two coordinator processes on one PostgreSQL database (tests/pg.py) and one blob directory
(``serve --blob-dir``): the second stands by (health NOT_SERVING, every other call UNAVAILABLE
naming the active one in the ``epochmesh-active`` trailing metadata); kill -9 of the active
makes it active, the agent (given both addresses) follows, and after the first is started
again (a standby now) and the second killed, the first takes the job back: it completes with
every sample applied exactly once and every charge made once, by the billing rule. And
stepping down: an active whose lease connection is ended stops serving, stands by, takes the
lease back and finishes the job it had accepted, in the same process."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest

from coordinator.accounting.billing import earned_micro
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
    start_coordinator,
    token_for,
    wait_until,
)
from tests.system.test_agent import AgentProc
from tests.system.test_fault_tolerance import (
    HEARTBEAT_S,
    Cluster,
    applied,
    check_exactly_once,
    job_doc,
    part_indices,
)
from tests.unit.test_ha_lease import terminate_lease_holder_sql

JS = common_pb2.JobState
JOB_SERVICE = "epochmesh.v1.JobService"


def serve_args(address: str, url: str, blob_dir: Path) -> list[str]:
    return [
        "--listen",
        address,
        "--store",
        url,
        "--blob-dir",
        str(blob_dir),
        "--heartbeat-interval",
        str(HEARTBEAT_S),
        "--http-listen",
        "",
    ]


class SharedCluster(Cluster):
    """The fault-tolerance tests' cluster, its coordinator on the PostgreSQL database ``url``
    with its blobs in ``root/blobs``."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.address = f"127.0.0.1:{free_port()}"
        self.coord = start_coordinator(
            root / "coord", *serve_args(self.address, url, root / "blobs")
        )
        self.agents = {}
        self.slowdowns = {}
        self._channel = None
        self._stub = None

    def point_at(self, address: str) -> None:
        """The test's own calls go to ``address`` from now on."""
        if self._channel is not None:
            self._channel.close()
        self.address = address
        self._channel = None
        self._stub = None


def start_standby(
    data_dir: Path, address: str, url: str, blob_dir: Path
) -> subprocess.Popen[bytes]:
    """A coordinator on ``url`` at ``address``; returns once it listens (health answers)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "coordinator-stderr.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [
            str(console_script("epochmesh-coordinator")),
            "--data-dir",
            str(data_dir),
            *serve_args(address, url, blob_dir),
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
    # Until its first look at the lease row a standby knows no active one to name.
    err = wait_until(
        lambda: (e := refusal_of(address, active)).details().endswith(active) and e,
        timeout=30,
        interval=0.2,
        message=f"the standby at {address} never named {active}",
    )
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == f"standby coordinator; the active coordinator is at {active}"
    assert dict(err.trailing_metadata() or ())["epochmesh-active"] == active


def charges_by_the_rule(pg_server: PgServer, database: str, cluster: Cluster, job_id: str) -> None:
    """Every donor's pay for the job is the billing rule applied to its applied parts (rolled
    back rounds included: a re-run is the platform's), and nothing is paid twice."""
    rows = pg_server.sql(
        "SELECT reason, round, node_id, from_account, to_account FROM ledger_entries "
        f"WHERE job_id = '{job_id}' AND round >= 0",
        database,
    ).splitlines()
    assert [row for row, n in Counter(rows).items() if n > 1] == []
    paid: dict[tuple[int, str], int] = defaultdict(int)
    for row in pg_server.sql(
        "SELECT round, node_id, amount FROM ledger_entries "
        f"WHERE job_id = '{job_id}' AND to_account LIKE 'donor:%'",
        database,
    ).splitlines():
        rnd, node, amount = row.split("|")
        paid[(int(rnd), node)] += int(amount)
    expected: dict[tuple[int, str], int] = {}
    for r in cluster.rounds(job_id, rolled_back=True):
        for p in applied(r):
            earned = earned_micro(p.price_micro_per_hour, len(part_indices(p)), p.billed_rate)
            if earned:
                expected[(r.round, p.node_id)] = expected.get((r.round, p.node_id), 0) + earned
    assert dict(paid) == expected


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def wait_serving(address: str, what: str) -> float:
    """Until ``address`` serves; how long that took."""
    began = time.monotonic()
    wait_until(lambda: health_status(address) == "SERVING", timeout=60, interval=0.1, message=what)
    return time.monotonic() - began


def applied_count(cluster: Cluster, job_id: str) -> int:
    return sum(1 for r in cluster.rounds(job_id) if applied(r))


@pytest.mark.timeout(480)
def test_the_standby_takes_over_a_running_job_after_a_kill9_and_back_again(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    blobs = tmp_path / "blobs"
    cluster = SharedCluster(tmp_path, pg_url)
    first = cluster.address
    second = f"127.0.0.1:{free_port()}"
    standby = start_standby(tmp_path / "coord2", second, pg_url, blobs)
    try:
        check_standby(second, first)
        assert (tmp_path / "coord2" / "ca.pem").read_bytes() == (
            tmp_path / "coord" / "ca.pem"
        ).read_bytes()
        assert not (tmp_path / "coord" / "blobs").exists()
        token = token_for(first, "node")
        assert token
        cluster.agents["a"] = AgentProc(
            f"{first},{second}",
            tmp_path / "agent-a",
            "--name",
            "a",
            "--slowdown",
            "2",
            "--token",
            token,
        )
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
        took = wait_serving(second, "the standby never became active")
        logging.getLogger(__name__).info("takeover after kill -9: %.1fs", took)
        cluster.point_at(second)
        # The agent follows to the second; the job goes on there.
        done = applied_count(cluster, job_id)
        cluster.wait_rounds(
            job_id,
            lambda rs: sum(1 for r in rs if applied(r)) >= done + 2,
            timeout=120,
            what="rounds on the second coordinator",
        )
        assert cluster.job(job_id).state == JS.JOB_STATE_RUNNING

        # The first comes back as a standby; the second is killed; the first takes over.
        restarted = start_standby(tmp_path / "coord", first, pg_url, blobs)
        try:
            check_standby(first, second)
            stop(standby)
            wait_serving(first, "the restarted coordinator never became active")
            cluster.point_at(first)
            cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=240)
            rounds = cluster.rounds(job_id)
            check_exactly_once(rounds, n, epochs)
            numbers = [r.round for r in rounds]
            assert numbers == sorted(set(numbers))
            charges_by_the_rule(pg_server, database, cluster, job_id)
            epoch = pg_server.sql("SELECT epoch FROM coordinator_lease", database).strip()
            assert epoch == "3"
            agent_log = cluster.agents["a"].log_text()
            assert second in agent_log and first in agent_log
        finally:
            stop(restarted)
    finally:
        cluster.stop()
        stop(standby)


@pytest.mark.timeout(300)
def test_an_active_whose_lease_connection_dies_stands_by_and_serves_again(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    cluster = SharedCluster(tmp_path, pg_url)
    address = cluster.address
    try:
        cluster.start_agent("a", 2.0)
        cluster.wait_ready(["a"], timeout=90)
        n, epochs = 96, 2
        job_id = cluster.submit(tmp_path / "job", job_doc("steps-down", epochs=epochs), n)
        cluster.wait_rounds(
            job_id, lambda rs: any(applied(r) for r in rs), timeout=120, what="a first round"
        )
        pg_server.sql(terminate_lease_holder_sql(database))
        wait_until(
            lambda: health_status(address) == "NOT_SERVING",
            timeout=60,
            interval=0.05,
            message="the active never stepped down",
        )
        wait_serving(address, "the coordinator never took the lease back")
        assert cluster.coord.running()
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=180)
        check_exactly_once(cluster.rounds(job_id), n, epochs)
        charges_by_the_rule(pg_server, database, cluster, job_id)
        log = cluster.coord.log_tail(50000)
        assert "stepping down" in log and "standing by for the coordinator lease again" in log
        lease = pg_server.sql("SELECT epoch, address FROM coordinator_lease", database)
        assert lease.strip().split("|") == ["2", address]
        started = pg_server.sql(
            "SELECT count(*) FROM events WHERE kind = 'coordinator.started'", database
        )
        assert started.strip() == "2"
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_blob_dir_of_another_database_is_refused_at_start(
    tmp_path: Path, pg_server: PgServer, pg_url: str
) -> None:
    blobs = tmp_path / "blobs"
    coord = start_coordinator(
        tmp_path / "a", *serve_args(f"127.0.0.1:{free_port()}", pg_url, blobs)
    )
    coord.terminate()
    other = pg_server.create_database()
    try:
        done = subprocess.run(
            [
                str(console_script("epochmesh-coordinator")),
                "--data-dir",
                str(tmp_path / "b"),
                *serve_args("127.0.0.1:0", pg_server.url(other), blobs),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    finally:
        pg_server.drop_database(other)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1, done.stderr
    assert f"blob dir {blobs} holds the blobs of another database" in errors[0]
    assert pg_url.rsplit("/", 1)[1] in errors[0] and "--blob-dir" in errors[0]
