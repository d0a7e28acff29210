"""``epochmesh blobs delete``: a submitter gives up a job's inputs through the real console
script against a real coordinator process (issue 22: the storage quota's way out)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator
from tests.system.test_cli_support import Cli, assert_clean_error

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    with start_coordinator(tmp_path / "coordinator") as coord:
        yield Cli(coord.address, tmp_path / "config", role="submitter")


def test_a_submitter_deletes_the_inputs_of_its_ended_job(cli: Cli, tmp_path: Path) -> None:
    submitted = cli.run(
        "submit", str(write_mlp_job(tmp_path / "job")), "--output", "json", timeout=150
    )
    assert submitted.code == 0, submitted.stderr
    job = submitted.json()
    inputs = {job["program"]["sha256"], job["initial_state"]["sha256"]}
    inputs |= {s["blob"]["sha256"] for s in job["shards"]}

    # Queued (no agent): its inputs are in use.
    refused = cli.run("blobs", "delete", "--job", job["job_id"])
    assert_clean_error(refused, 6, "in progress", job["job_id"])

    assert cli.run("cancel", job["job_id"]).code == 0
    # The stored blobs: the inputs and what the coordinator made of them (its first checkpoint,
    # written in the background: perhaps not yet).
    stored = cli.run("stats", "--output", "json").json()["blobs"]
    assert stored >= len(inputs)
    done = cli.run("blobs", "delete", "--job", job["job_id"], "--output", "json")
    assert done.code == 0, done.stderr
    rows = done.json()["blobs"]
    assert {r["sha256"] for r in rows} == inputs
    assert all(r["deleted"] and r["released_bytes"] > 0 for r in rows), rows
    after = cli.run("stats", "--output", "json").json()["blobs"]
    assert stored - len(inputs) <= after <= stored - len(inputs) + 1  # (+1: that checkpoint)

    # Again: nothing of the job's is the submitter's any more (skipped, no error).
    again = cli.run("blobs", "delete", "--job", job["job_id"])
    assert again.code == 0, again.stderr
    assert again.stdout.count("skipped") == len(inputs), again.stdout
    # A hash that is nobody's: not found, exit code 3; nothing named: a usage error.
    assert_clean_error(cli.run("blobs", "delete", "0" * 64), 3, "of yours")
    assert_clean_error(cli.run("blobs", "delete"), 2, "nothing to delete")
