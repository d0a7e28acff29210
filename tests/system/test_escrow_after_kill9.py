"""A cancelled job's money after a real crash: a coordinator (a real process, TLS, SQLite) and
a paid agent run a job; the submitter cancels it mid-run and the coordinator is killed with
SIGKILL as soon as the cancel returns. Restarted, the submitter holds its grant less what the
job's applied parts cost (nothing left in the job's escrow or held account), and a second
restart moves nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epochmesh.v1 import common_pb2
from tests.fixtures import write_job
from tests.procs import CoordinatorProc, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import MODEL, applied, job_doc, make_dataset

log = logging.getLogger(__name__)
JS = common_pb2.JobState
pytestmark = pytest.mark.timeout(300)

GRANT_MICRO = 5_000_000


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorProc, AgentProc]]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(
        tmp_path / "coord", "--listen", address, "--heartbeat-interval", "0.5"
    )
    agent: AgentProc | None = None
    try:
        agent = AgentProc(
            address, tmp_path / "agent", "--name", "paid", "--price", "100", "--slowdown", "2"
        )
        wait_until(
            lambda: any(n.benchmark.samples_per_second > 0 for n in list_nodes(address)),
            timeout=90,
            interval=0.2,
            message="the agent ready",
        )
        yield coord, agent
    finally:
        if agent is not None:
            agent.kill9()
        coord.kill9()


def balances(op: Cli) -> dict[str, int]:
    out = op.run("balance", "--all", "--output", "json")
    assert out.code == 0, out.stderr
    return {b["account"]: int(b["balance_micro"]) for b in out.json()["balances"]}


def test_a_cancel_then_kill9_leaves_the_submitter_its_grant_less_applied_charges(
    cluster: tuple[CoordinatorProc, AgentProc], tmp_path: Path
) -> None:
    coord, _ = cluster
    op = Cli(coord.address, tmp_path / "op")
    alice = Cli(coord.address, tmp_path / "alice", role="submitter")
    whoami = alice.run("whoami", "--output", "json")
    assert whoami.code == 0, whoami.stderr
    tenant = f"tenant:{whoami.json()['principal']}"
    assert op.run("credits", "grant", tenant, str(GRANT_MICRO / 1e6)).code == 0

    doc: dict[str, Any] = job_doc("cancelled", epochs=50, seed=3, min_nodes=1, max_nodes=1)
    doc["market"] = {"budget": "2"}
    job_toml = write_job(tmp_path / "job", MODEL, make_dataset(96), doc)
    out = alice.run("submit", str(job_toml), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])
    jobs = Jobs(coord.address)
    wait_until(
        lambda: sum(len(applied(r)) for r in jobs.rounds(job_id)) >= 2,
        timeout=180,
        interval=0.1,
        message=f"{job_id} applied parts",
    )

    cancelled = alice.run("cancel", job_id)
    assert cancelled.code == 0, cancelled.stderr
    coord.kill9()
    coord.restart()
    op = Cli(coord.address, tmp_path / "op")
    alice = Cli(coord.address, tmp_path / "alice", role="submitter")
    assert Jobs(coord.address).job(job_id).state == JS.JOB_STATE_CANCELLED

    statement = alice.run("statement", "--job", job_id, "--output", "json")
    assert statement.code == 0, statement.stderr
    escrow, held = f"escrow:{job_id}", f"held:{job_id}"
    charges = sum(
        e["amount_micro"]
        for e in statement.json()["entries"]
        if e["from"] == escrow and e["to"] != tenant
    )
    paid_parts = [r for r in Jobs(coord.address).rounds(job_id) if applied(r)]
    assert charges > 0 and paid_parts, statement.stdout
    first = balances(op)
    log.info("charges %d micro-credits for %d rounds; balances %s", charges, len(paid_parts), first)
    assert first[tenant] == GRANT_MICRO - charges
    assert first.get(escrow, 0) == 0 and first.get(held, 0) == 0

    coord.restart()  # the sweep finds nothing left to settle
    op = Cli(coord.address, tmp_path / "op")
    assert balances(op) == first
