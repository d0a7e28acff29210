"""Honest randomness never looks like cheating, end to end: real processes and TLS, a
coordinator and four honest agents of mixed speeds (each its own donor) training a model whose
program draws random numbers (tests/random_models.py: `nn.Dropout`, `torch.rand_like` noise, a
`torch.randperm` feature order, an uninitialised `torch.empty` buffer) with verification on,
in a parameter-server job, a local SGD job and a ring job.

Every part of a new node is checked (its chunk recomputed by two checkers of other donors, who
seed the program's draws with the checked node's id): checks run and pass, no honest node is
struck, quarantined or fails a check, no program is declared nondeterministic, and the job
succeeds with every sample of every epoch trained exactly once. A cheater (the agent's test-only
EPOCHMESH_TEST_CHEAT) on the same random model is still caught and quarantined.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epochmesh.v1 import common_pb2
from tests.fixtures import write_job
from tests.procs import STEADY_LEASES, CoordinatorProc, free_port, start_coordinator, wait_until
from tests.random_models import RANDOM_CONV_MODEL
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import (
    applied,
    check_exactly_once,
    events_of,
    job_doc,
    make_dataset,
)
from tests.system.verification_checks import (
    cheater_parts,
    check_cheater_undone,
    quarantined_cheater,
)

pytestmark = pytest.mark.timeout(420)

JS = common_pb2.JobState
NS = common_pb2.NodeState
N, EPOCHS, BATCH, H = 240, 2, 24, 4
CHEAT_FROM = 3
HONEST = {"h1": 1, "h2": 2, "h3": 2, "h4": 1}  # name -> slowdown


def _coordinator(root: Path) -> CoordinatorProc:
    address = f"127.0.0.1:{free_port()}"
    return start_coordinator(root / "coord", "--listen", address, *STEADY_LEASES)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProc]:
    coord = _coordinator(tmp_path)
    try:
        yield coord
    finally:
        coord.kill9()


@pytest.fixture(scope="module")
def honest_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One coordinator and the four honest agents (with a PeerService, for the ring job) for
    the honest tests, one job after another: a later job finds the nodes no longer new, so
    fewer of its parts are checked, but checks still run and must all pass. (The cheater's
    test, with a cluster of its own, comes first in the file: this one then lives only while
    the honest tests run.)"""
    root = tmp_path_factory.mktemp("random-honest")
    coord = _coordinator(root)
    agents: dict[str, AgentProc] = {}
    try:
        agents = start(coord.address, root, ring=True)
        yield coord.address
    finally:
        for a in agents.values():
            a.kill9()
        coord.kill9()


def agent(address: str, root: Path, name: str, slowdown: int, ring: bool, **env: str) -> AgentProc:
    extra = ("--peer-listen", "127.0.0.1:0") if ring else ()
    return AgentProc(
        address,
        root / name,
        "--name",
        name,
        "--slowdown",
        str(slowdown),
        *extra,
        env=env or None,
    )


def random_job(mode: str, name: str) -> dict[str, Any]:
    ring = mode.startswith("ring")
    doc: dict[str, Any] = job_doc(
        name,
        epochs=EPOCHS,
        global_batch=BATCH,
        seed=5,
        aggregation="ring" if ring else "ps",
        min_nodes=3,
        max_nodes=5,
    )
    if mode.endswith("local_sgd"):
        doc["train"].update(
            sync="local_sgd", inner_steps=H, outer_lr=0.7, outer_momentum=0.5, momentum=0.0
        )
    return doc


def run(address: str, tmp_path: Path, doc: dict[str, Any]) -> tuple[Jobs, str]:
    """Submit the random model's job with the CLI and wait for it to succeed."""
    job_dir = tmp_path / "job"
    write_job(job_dir, RANDOM_CONV_MODEL, make_dataset(N), doc)
    alice = Cli(address, tmp_path / "alice", role="submitter")
    out = alice.run("submit", str(job_dir / "job.toml"), "--output", "json", timeout=180)
    assert out.code == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])
    jobs = Jobs(address)
    jobs.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=360)
    return jobs, job_id


def start(address: str, tmp_path: Path, ring: bool, cheat: str = "") -> dict[str, AgentProc]:
    agents = {n: agent(address, tmp_path, n, slow, ring) for n, slow in HONEST.items()}
    if cheat:
        agents["cheat"] = agent(
            address, tmp_path, "cheat", 1, ring, EPOCHMESH_TEST_CHEAT=f"{cheat}:{CHEAT_FROM}"
        )
    try:
        wait_until(
            lambda: (
                sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == len(agents)
            ),
            timeout=180,
            interval=0.2,
            message="agents ready",
        )
    except BaseException:
        for a in agents.values():
            a.kill9()
        raise
    return agents


def test_a_cheater_with_a_random_program_is_still_caught(
    coordinator: CoordinatorProc, tmp_path: Path
) -> None:
    address = coordinator.address
    agents = start(address, tmp_path, ring=False, cheat="flipped")
    try:
        jobs, job_id = run(address, tmp_path, random_job("ps", "random-cheat"))
        nodes, cheater, events, evidence = quarantined_cheater(address, jobs, job_id)
        assert evidence["check"] in ("recomputation", "consistency"), evidence
        if evidence["check"] == "recomputation":
            # Two checkers of two other donors agreed with each other, not with it.
            assert float(evidence["distance1"]) > float(evidence["tolerance"]), evidence
            assert float(evidence["distance2"]) > float(evidence["tolerance"]), evidence
            assert len({evidence["checker1"], evidence["checker2"], cheater.node_id}) == 3
        assert not events_of(events, "job.nondeterministic")
        cheater_rounds = cheater_parts(jobs, job_id, cheater, CHEAT_FROM)
        assert int(evidence["round"]) in cheater_rounds[:3], (cheater_rounds, evidence)
        check_cheater_undone(
            jobs, job_id, events, nodes, cheater, HONEST, cheater_rounds[0], N, EPOCHS
        )
    finally:
        for a in agents.values():
            a.kill9()


@pytest.mark.parametrize("mode", ["ps", "ps_local_sgd", "ring"])
def test_honest_nodes_with_a_random_program_pass_their_checks(
    honest_cluster: str, tmp_path: Path, mode: str
) -> None:
    address = honest_cluster
    jobs, job_id = run(address, tmp_path, random_job(mode, f"random-{mode}"))
    live = jobs.rounds(job_id)
    check_exactly_once(live, N, EPOCHS)
    events = jobs.events(job_id)
    assert not events_of(events, "node.quarantined"), [e.message for e in events]
    assert not events_of(events, "job.nondeterministic"), [e.message for e in events]
    summary = dict(events_of(events, "job.verification")[-1].attrs)
    recomputed = sum(int(summary[f"recomputed_{s}"]) for s in ("new", "building", "trusted"))
    assert recomputed > 0 and int(summary["passed"]) > 0, summary
    assert int(summary["failed"]) == 0, summary
    assert int(summary.get("nondeterministic", "0")) == 0, summary
    nodes = {n.name: n for n in list_nodes(address)}
    worked = {p.node_id for r in live for p in applied(r)}
    assert len(worked) >= 3, worked
    for name in HONEST:
        node = nodes[name]
        assert node.state != NS.NODE_STATE_QUARANTINED and node.strikes == 0, node
        assert node.reputation.failed_total == 0, node
    assert any(nodes[n].reputation.verified_total > 0 for n in HONEST), nodes
