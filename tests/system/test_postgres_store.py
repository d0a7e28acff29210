# ruff: noqa: F811
"""The coordinator on PostgreSQL (``serve --store postgresql://...``), on a real server
(tests/pg.py): a real coordinator process and agent train a job to completion through a kill -9
of the coordinator and its restart on the same database, as the SQLite restart tests do; and a
database it cannot use stops the start at once with one line saying why."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from epochmesh.v1 import common_pb2
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)
from tests.procs import console_script, free_port, start_coordinator
from tests.system.test_fault_tolerance import (
    HEARTBEAT_S,
    Cluster,
    applied,
    check_exactly_once,
    events_of,
    job_doc,
)

JS = common_pb2.JobState


def _serve(data_dir: Path, *args: str, timeout: float = 30) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [
            str(console_script("epochmesh-coordinator")),
            "serve",
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return done.returncode, done.stderr, time.monotonic() - started


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line or "Traceback" in line]


@pytest.mark.timeout(60)
def test_an_unreachable_database_stops_the_start_at_once(tmp_path: Path) -> None:
    url = f"postgresql://epochmesh:s3cret@127.0.0.1:{free_port()}/coordinator"
    code, stderr, took = _serve(tmp_path / "coord", "--store", url)
    assert code != 0
    assert took < 20, f"took {took:.1f}s: a hang, not a refusal"
    errors = _error_lines(stderr)
    assert len(errors) == 1, stderr
    assert "cannot connect to PostgreSQL at postgresql://epochmesh:***@127.0.0.1" in errors[0]
    assert "s3cret" not in stderr


@pytest.mark.timeout(60)
def test_a_missing_database_or_a_wrong_url_stops_the_start(
    tmp_path: Path, pg_server: PgServer
) -> None:
    code, stderr, _ = _serve(tmp_path / "a", "--store", pg_server.url("no_such_db"))
    assert code != 0
    errors = _error_lines(stderr)
    assert len(errors) == 1 and 'database "no_such_db" does not exist' in errors[0], stderr
    code, stderr, _ = _serve(tmp_path / "b", "--store", "mysql://root@127.0.0.1/x")
    assert code == 2
    errors = _error_lines(stderr)
    assert len(errors) == 1 and "postgresql://" in errors[0], stderr


class PgCluster(Cluster):
    """The fault-tolerance tests' cluster (a coordinator on a fixed port, named agents), its
    coordinator keeping its state in the PostgreSQL database ``url``."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.address = f"127.0.0.1:{free_port()}"
        self.coord = start_coordinator(
            root / "coord",
            "--listen",
            self.address,
            "--store",
            url,
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--http-listen",
            "",
        )
        self.agents = {}
        self.slowdowns = {}
        self._channel = None
        self._stub = None


@pytest.mark.timeout(240)
def test_a_job_on_postgresql_survives_a_coordinator_kill9(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `token create` (the helpers' node and operator tokens) must write where serve reads.
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    cluster = PgCluster(tmp_path, pg_url)
    coord = cluster.coord
    try:
        assert not (tmp_path / "coord" / "coordinator.db").exists()
        cluster.start_agent("a", 2.0)
        cluster.wait_ready(["a"], timeout=90)
        n, epochs, every = 192, 3, 4
        job_id = cluster.submit(
            tmp_path / "job", job_doc("on-postgres", epochs=epochs, checkpoint_every=every), n
        )
        cluster.wait_rounds(
            job_id,
            lambda rs: sum(1 for r in rs if applied(r)) >= every + 2,
            timeout=90,
            what="rounds past the first checkpoint",
        )
        coord.kill9()
        restart_ms = int(time.time() * 1000)
        coord.start()  # same data dir, same address, same database
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=120)
        rounds = cluster.rounds(job_id)
        check_exactly_once(rounds, n, epochs)
        numbers = [r.round for r in rounds]
        assert numbers == sorted(set(numbers))
        assert any(r.finished_ms > restart_ms for r in rounds), "no round after the restart"
        restored = events_of(cluster.events(job_id), "job.restored")
        assert len(restored) == 1, restored
        assert not (tmp_path / "coord" / "coordinator.db").exists()
    finally:
        cluster.stop()
