"""The CLI follows a takeover: two coordinator processes on one PostgreSQL database
(tests/pg.py) and one blob directory; a job waits for nodes (no agents). An ``epochmesh
watch`` given both addresses is streaming the job when the active coordinator is killed (kill
-9): it reconnects to the standby that took over and ends when the job is cancelled there.
Clients made before the kill, on the dead coordinator's channel: a read (GetJob) is asked again
on the new active one and answered; a change (CancelJob) is not repeated and fails with one
message naming both coordinators."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from client.rpc import CliError, Coordinator, ExitCode
from epochmesh.identity import Identity
from epochmesh.v1 import common_pb2, job_pb2
from tests.fixtures import write_mlp_job
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)
from tests.system.test_cli_support import Cli, LineReader
from tests.system.test_coordinator_failover import (
    start_active_and_standby,
    stop,
    wait_serving,
)


@pytest.mark.timeout(300)
def test_watch_and_reads_follow_the_standby_that_takes_over(
    tmp_path: Path,
    pg_server: PgServer,  # noqa: F811
    pg_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)  # for `token create` on the coordinators
    first, second, standby = start_active_and_standby(tmp_path, pg_url)
    both = f"{first.address},{second}"
    watch: subprocess.Popen[str] | None = None
    try:
        alice = Cli(first.address, tmp_path / "alice", role="submitter")
        toml = write_mlp_job(
            tmp_path / "job",
            64,
            overrides={"name": "waits", "cluster": {"min_nodes": 1, "max_nodes": 1}},
        )
        submitted = alice.run("--coordinator", both, "submit", str(toml), "--output", "json")
        assert submitted.code == 0, submitted.stderr
        job_id = str(submitted.json()["job_id"])

        watch = alice.popen("--coordinator", both, "watch", job_id, "--output", "json")
        lines = LineReader(watch.stdout)
        assert json.loads(lines.next_line(timeout=60))["job"]["job_id"] == job_id

        identity = Identity.load(alice.config_home / "epochmesh" / "credentials")
        reader = Coordinator(first.address, identity=identity, addresses=(first.address, second))
        changer = Coordinator(first.address, identity=identity, addresses=(first.address, second))
        for coord in (reader, changer):
            coord.call("GetJob", coord.jobs.GetJob, job_pb2.GetJobRequest(job_id=job_id))

        first.kill9()
        wait_serving(second, "the standby never became active")

        # A read on the dead coordinator's channel is answered by the new active one.
        job = reader.call("GetJob", reader.jobs.GetJob, job_pb2.GetJobRequest(job_id=job_id))
        assert job.job_id == job_id and reader.address == second
        # A change is not sent twice: the caller is told where to look.
        with pytest.raises(CliError) as refused:
            changer.call(
                "CancelJob", changer.jobs.CancelJob, job_pb2.CancelJobRequest(job_id=job_id)
            )
        assert refused.value.code == ExitCode.UNREACHABLE
        assert f"{first.address} went away during CancelJob" in str(refused.value)
        assert f"{second} is active now" in str(refused.value)
        job = reader.call("GetJob", reader.jobs.GetJob, job_pb2.GetJobRequest(job_id=job_id))
        assert job.state != common_pb2.JOB_STATE_CANCELLED  # the refused change did not happen

        # The watch, still running, follows the new active one and sees the cancel made there.
        cancelled = alice.run("--coordinator", both, "cancel", job_id)
        assert cancelled.code == 0, cancelled.stderr
        # Its stdout is read by `lines` (a thread): the updates since are taken from there.
        updates = []
        while line := lines.next_line(timeout=120):
            updates.append(json.loads(line))
        _, err = watch.communicate(timeout=60)
        assert watch.returncode == ExitCode.JOB_FAILED, err
        assert f"following the active coordinator at {second} (was {first.address})" in err, err
        # The cancel happened on the second coordinator only: the watch heard it from there.
        assert updates and updates[-1]["job"]["state"] == "cancelled", updates[-1:]
        for coord in (reader, changer):
            coord.close()
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.communicate(timeout=30)
        first.kill9()
        stop(standby)
