"""A node's claim does not set its pay, end to end: a coordinator and two agents of the same
price and speed (real processes, TLS), one of which lies in every job benchmark it reports
(EPOCHMESH_TEST_CHEAT=slowclaim: 1e-5 samples/s, i.e. "pay me a day per sample"); and a liar
alone in its job (nothing observed, no other claim: only its device model's reference floor
bounds its claim), against an honest node alone in a separate run of the same job.

Believed, the liar's first part would be billed at the claim (hundreds of credits for one
sample) and a round would cost more than the job's escrow, pausing the job for its budget every
round. Bounded, it earns per applied sample no more than twice what the honest node earns, and
the job finishes on its budget without a budget pause.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from epochmesh.v1 import common_pb2
from tests.fixtures import write_job
from tests.procs import STEADY_LEASES, CoordinatorProc, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import (
    MODEL,
    applied,
    job_doc,
    make_dataset,
    part_indices,
)

log = logging.getLogger(__name__)
JS = common_pb2.JobState
pytestmark = pytest.mark.timeout(300)

PRICE = "100"  # credits per node-hour, both agents
N, EPOCHS = 96, 2


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorProc, dict[str, AgentProc]]]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(tmp_path / "coord", "--listen", address, *STEADY_LEASES)
    agents: dict[str, AgentProc] = {}
    try:
        for name, env in (("honest", {}), ("liar", {"EPOCHMESH_TEST_CHEAT": "slowclaim"})):
            agents[name] = AgentProc(
                address,
                tmp_path / f"agent-{name}",
                "--name",
                name,
                "--price",
                PRICE,
                "--slowdown",
                "2",
                env=env,
            )
        wait_until(
            lambda: sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == 2,
            timeout=180,
            interval=0.2,
            message="two agents ready",
        )
        yield coord, agents
    finally:
        for a in agents.values():
            a.kill9()
        coord.kill9()


def test_a_node_claiming_to_be_slow_earns_no_more_per_sample_than_an_honest_one(
    cluster: tuple[CoordinatorProc, dict[str, AgentProc]], tmp_path: Path
) -> None:
    coord, agents = cluster
    address = coord.address
    op = Cli(address, tmp_path / "op")
    alice = Cli(address, tmp_path / "alice", role="submitter")
    jobs = Jobs(address)
    whoami = alice.run("whoami", "--output", "json")
    assert whoami.code == 0, whoami.stderr
    assert op.run("credits", "grant", f"tenant:{whoami.json()['principal']}", "5").code == 0

    doc: dict[str, Any] = job_doc("claims", epochs=EPOCHS, seed=3, min_nodes=2, max_nodes=2)
    doc["market"] = {"budget": "2"}
    job_toml = write_job(tmp_path / "job", MODEL, make_dataset(N), doc)
    out = alice.run("submit", str(job_toml), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])

    def done() -> bool:
        job = jobs.job(job_id)
        assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job.message
        # The claim never makes a round cost more than the escrow.
        assert not (job.state == JS.JOB_STATE_PAUSED and job.message.startswith("budget")), (
            job.message
        )
        return job.state == JS.JOB_STATE_SUCCEEDED

    wait_until(done, timeout=240, interval=0.1, message=f"{job_id} succeeded")
    assert "slowclaim" in agents["liar"].log_path.read_text()  # it did lie

    names = {n.node_id: n.name for n in list_nodes(address)}
    samples: dict[str, int] = defaultdict(int)
    for r in jobs.rounds(job_id):
        for p in applied(r):
            samples[names[p.node_id]] += len(part_indices(p))
    statement = alice.run("statement", "--job", job_id, "--output", "json")
    assert statement.code == 0, statement.stderr
    earned: dict[str, int] = defaultdict(int)
    for e in statement.json()["entries"]:
        if e["to"].startswith("donor:"):
            earned[names[e["node"]]] += e["amount_micro"]
    log.info("samples %s, earned %s", dict(samples), dict(earned))
    assert samples["honest"] > 0 and samples["liar"] > 0, dict(samples)
    honest_rate = earned["honest"] / samples["honest"]
    liar_rate = earned["liar"] / samples["liar"]
    assert honest_rate > 0
    assert liar_rate <= 2 * honest_rate, (liar_rate, honest_rate, dict(samples), dict(earned))


def lone_run(tmp_path: Path, env: dict[str, str]) -> tuple[float, str]:
    """One coordinator and one agent (``env``: its cheat, if any) run the job alone; the job
    must succeed without a budget pause. The micro-credits earned per applied sample, and the
    agent's log."""
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(tmp_path / "coord", "--listen", address, *STEADY_LEASES)
    agent: AgentProc | None = None
    try:
        agent = AgentProc(address, tmp_path / "agent", "--name", "lone", "--price", PRICE, env=env)
        wait_until(
            lambda: any(n.benchmark.samples_per_second > 0 for n in list_nodes(address)),
            timeout=180,
            interval=0.2,
            message="the agent ready",
        )
        op = Cli(address, tmp_path / "op")
        alice = Cli(address, tmp_path / "alice", role="submitter")
        jobs = Jobs(address)
        whoami = alice.run("whoami", "--output", "json")
        assert whoami.code == 0, whoami.stderr
        tenant = f"tenant:{whoami.json()['principal']}"
        assert op.run("credits", "grant", tenant, "5").code == 0
        doc: dict[str, Any] = job_doc("lone", epochs=EPOCHS, seed=3, min_nodes=1, max_nodes=1)
        doc["market"] = {"budget": "2"}
        job_toml = write_job(tmp_path / "job", MODEL, make_dataset(N), doc)
        out = alice.run("submit", str(job_toml), "--output", "json", timeout=120)
        assert out.code == 0, out.stderr
        job_id = str(json.loads(out.stdout)["job_id"])

        def done() -> bool:
            job = jobs.job(job_id)
            assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job.message
            assert not (job.state == JS.JOB_STATE_PAUSED and job.message.startswith("budget")), (
                job.message
            )
            return job.state == JS.JOB_STATE_SUCCEEDED

        wait_until(done, timeout=240, interval=0.1, message=f"{job_id} succeeded")
        samples = sum(len(part_indices(p)) for r in jobs.rounds(job_id) for p in applied(r))
        statement = alice.run("statement", "--job", job_id, "--output", "json")
        assert statement.code == 0, statement.stderr
        earned = sum(
            e["amount_micro"] for e in statement.json()["entries"] if e["to"].startswith("donor:")
        )
        assert samples > 0 and earned > 0, (samples, earned)
        return earned / samples, agent.log_path.read_text()
    finally:
        if agent is not None:
            agent.kill9()
        coord.kill9()


@pytest.mark.timeout(600)
def test_a_lone_node_claiming_to_be_slow_is_paid_as_an_honest_lone_node(tmp_path: Path) -> None:
    # The two runs at the same time (their own coordinators and agents): each waits on its
    # processes most of the time, and both see the same load.
    with ThreadPoolExecutor(max_workers=2) as pool:
        honest_run = pool.submit(lone_run, tmp_path / "honest", {})
        liar_run = pool.submit(lone_run, tmp_path / "liar", {"EPOCHMESH_TEST_CHEAT": "slowclaim"})
        honest, _ = honest_run.result()
        liar, liar_log = liar_run.result()
    assert "slowclaim" in liar_log  # it did lie
    log.info("earned per sample: honest %.1f, liar %.1f micro-credits", honest, liar)
    assert liar <= 2 * honest, (liar, honest)
