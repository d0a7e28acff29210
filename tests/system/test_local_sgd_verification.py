"""Verification of local SGD parts end to end (issue 20), with real processes and TLS: a
coordinator, three honest agents of mixed speeds and one that cheats (EPOCHMESH_TEST_CHEAT)
from a given round on, each agent its own donor, on a time-boxed local SGD job whose inner
optimizer keeps momentum across rounds.

The cheater commits chunks, start states and sketches that all fit its made-up update (a smart
cheater), so only a checker's recomputation of a chunk's inner steps from the uploaded start
state can catch it: it is quarantined with the evidence within two of its cheated parts (three
on a loaded host), its cheated updates are undone, and the job succeeds with every sample of
every epoch trained exactly once in the live rounds. No honest node is struck, and their records show verified
rounds (their local SGD chunks were recomputed and matched).
"""

from __future__ import annotations

import json
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
from tests.system.test_fault_tolerance import (
    MODEL,
    events_of,
    job_doc,
    make_dataset,
)
from tests.system.test_market import all_rounds
from tests.system.verification_checks import check_cheater_undone

JS = common_pb2.JobState
NS = common_pb2.NodeState
pytestmark = pytest.mark.timeout(300)

N, EPOCHS, BATCH, H = 384, 2, 24, 4
CHEAT_FROM = 3
HONEST = {"h1": 1, "h2": 2, "h3": 2}  # name -> slowdown


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProc]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(
        tmp_path / "coord", "--listen", address, "--heartbeat-interval", "0.5"
    )
    try:
        yield coord
    finally:
        coord.kill9()


def test_a_local_sgd_cheater_is_caught_by_recomputing_its_inner_steps(
    coordinator: CoordinatorProc, tmp_path: Path
) -> None:
    address = coordinator.address
    agents = {
        name: AgentProc(address, tmp_path / name, "--name", name, "--slowdown", str(slow))
        for name, slow in HONEST.items()
    }
    agents["cheat"] = AgentProc(
        address,
        tmp_path / "cheat",
        "--name",
        "cheat",
        "--slowdown",
        "1",
        env={"EPOCHMESH_TEST_CHEAT": f"scaled:{CHEAT_FROM}"},
    )
    try:
        wait_until(
            lambda: sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == 4,
            timeout=90,
            interval=0.2,
            message="four agents ready",
        )
        doc: dict[str, Any] = job_doc(
            "local-cheat", epochs=EPOCHS, seed=5, min_nodes=3, max_nodes=4
        )
        doc["train"].update(
            global_batch=BATCH, sync="local_sgd", inner_steps=H, outer_lr=0.7, outer_momentum=0.5
        )
        job_dir = tmp_path / "job"
        write_job(job_dir, MODEL, make_dataset(N), doc)
        alice = Cli(address, tmp_path / "alice", role="submitter")
        out = alice.run("submit", str(job_dir / "job.toml"), "--output", "json", timeout=120)
        assert out.code == 0, out.stderr
        job_id = str(json.loads(out.stdout)["job_id"])
        jobs = Jobs(address)
        jobs.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=240)

        nodes = {n.name: n for n in list_nodes(address)}
        cheater = nodes["cheat"]
        assert cheater.state == NS.NODE_STATE_QUARANTINED, cheater
        events = jobs.events(job_id)
        caught = [e for e in events_of(events, "node.quarantined") if e.node_id == cheater.node_id]
        assert len(caught) == 1, [e.message for e in events_of(events, "node.quarantined")]
        evidence = dict(caught[0].attrs)
        # Its chunks, start states and sketches all fit: a recomputation caught it.
        assert evidence["check"] == "recomputation", evidence
        assert float(evidence["distance1"]) > float(evidence["tolerance"]), evidence
        assert evidence["checker1"] != cheater.node_id

        every_round = all_rounds(jobs, job_id)
        cheater_rounds = sorted(
            r.round
            for r in every_round
            if r.round >= CHEAT_FROM and any(p.node_id == cheater.node_id for p in r.parts)
        )
        # Checked every round while new: caught by the check of its first cheated part or of
        # the next (scripts/bench_verify.py measures it); on a loaded host a check can end
        # undecided (no checker answered in time), leaving it to the one after.
        assert int(evidence["round"]) in cheater_rounds[:3], (cheater_rounds, evidence)

        check_cheater_undone(
            jobs, job_id, events, nodes, cheater, HONEST, cheater_rounds[0], N, EPOCHS
        )
    finally:
        for a in agents.values():
            a.kill9()
