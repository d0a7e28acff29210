"""Verification of ring members end to end (issue 20), with real processes and mutual TLS: a
coordinator, three honest agents of mixed speeds and one that cheats (EPOCHMESH_TEST_CHEAT)
from a given round on, each agent its own donor and a ring member (``--peer-listen``), on a
synchronous ring job, and a local SGD one. Two cheats:

- ``scaled``: its gradient (in local SGD its pseudo-gradient, with chunk start states that fit
  its made-up chunks) x100, with chunks that add up to it, put into the ring as it is;
- ``contribution``: honest chunks, update and report, but 100 x its contribution put into the
  all-reduce, and its evidence of the round computed as if the honest one had been sent.

The coordinator never sees a member's update: the member commits its chunks with its report,
learns in the answer whether it is checked, sends its chunk and update sketches, and uploads
the parameters its round started from, which must hash to what its ring agreed on. A checker
of another donor recomputes a chunk from them (catching ``scaled``), and every member's
evidence of the audited round is judged (catching ``contribution``, whose books do not balance
against the ring's sum): the cheater is quarantined with the evidence within its first cheated
parts, its cheated rounds are undone (the ring rolls back to a
checkpoint and its members pull the state from the coordinator), and the job succeeds with
every sample of every epoch trained exactly once in the live rounds. No honest member is
struck, and their records show verified rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import STEADY_LEASES, CoordinatorProc, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_fault_tolerance import (
    events_of,
    job_doc,
)
from tests.system.verification_checks import (
    cheater_parts,
    check_cheater_undone,
    quarantined_cheater,
    run_job,
)

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(300)

N, EPOCHS, BATCH = 384, 2, 24
H = 4  # inner steps of the local SGD job
CHEAT_FROM = 3
HONEST = {"r1": 1, "r2": 2, "r3": 2}  # name -> slowdown


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProc]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(tmp_path / "coord", "--listen", address, *STEADY_LEASES)
    try:
        yield coord
    finally:
        coord.kill9()


def ring_agent(address: str, root: Path, name: str, slowdown: int, **env: str) -> AgentProc:
    return AgentProc(
        address,
        root / name,
        "--name",
        name,
        "--slowdown",
        str(slowdown),
        "--peer-listen",
        "127.0.0.1:0",
        env=env or None,
    )


@pytest.mark.parametrize(
    ("cheat", "check", "sync"),
    [
        ("scaled", "recomputation", "sync"),
        ("contribution", "ring_contribution", "sync"),
        ("scaled", "recomputation", "local_sgd"),
        # Time-boxed local SGD rounds: x100 also on the weight it appends (epochmesh.ring.weights).
        ("contribution", "ring_contribution", "local_sgd"),
    ],
)
def test_a_cheating_ring_member_is_caught(
    coordinator: CoordinatorProc, tmp_path: Path, cheat: str, check: str, sync: str
) -> None:
    address = coordinator.address
    agents = {name: ring_agent(address, tmp_path, name, slow) for name, slow in HONEST.items()}
    agents["cheat"] = ring_agent(
        address, tmp_path, "cheat", 1, EPOCHMESH_TEST_CHEAT=f"{cheat}:{CHEAT_FROM}"
    )
    try:
        wait_until(
            lambda: sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == 4,
            timeout=90,
            interval=0.2,
            message="four agents ready",
        )
        doc: dict[str, Any] = job_doc(
            "ring-cheat",
            epochs=EPOCHS,
            global_batch=BATCH,
            seed=5,
            aggregation="ring",
            min_nodes=3,
            max_nodes=4,
        )
        if sync == "local_sgd":
            doc["train"].update(
                sync="local_sgd", inner_steps=H, outer_lr=0.7, outer_momentum=0.5, momentum=0.0
            )
        jobs, job_id = run_job(address, tmp_path, doc, N)
        nodes, cheater, events, evidence = quarantined_cheater(address, jobs, job_id)
        assert evidence["check"] == check, evidence
        if check == "recomputation":
            # Its chunks and sketches fit its update, its start parameters are the ring's (and
            # in local SGD its chunks' start states fit its sketches): only the recomputation
            # can catch it.
            assert float(evidence["distance1"]) > float(evidence["tolerance"]), evidence
            assert evidence["checker1"] != cheater.node_id
        else:
            # Its chunks are honest (they pass), but not what it put into the ring.
            assert "which it owns" in evidence["why"], evidence

        cheater_rounds = cheater_parts(jobs, job_id, cheater, CHEAT_FROM)
        # Checked every round while new: caught by the check of its first cheated part or of
        # the next; on a loaded host a check can end undecided (no checker answered in time).
        undecided = [e.message for e in events_of(events, "node.check_undecided")]
        log.info(
            "caught by the check of round %s; undecided checks: %s", evidence["round"], undecided
        )
        assert int(evidence["round"]) in cheater_rounds[:3], (cheater_rounds, evidence, undecided)
        assert events_of(events, "job.rolled_back"), "its cheated rounds were not undone"

        check_cheater_undone(
            jobs, job_id, events, nodes, cheater, HONEST, cheater_rounds[0], N, EPOCHS
        )
        if sync == "local_sgd":
            # The honest members' inner momentum came from the undone rounds: after the
            # rollback each of them that trained again started a fresh inner optimizer.
            fresh = [n for n in HONEST if "a fresh inner optimizer" in agents[n].log_text()]
            assert fresh, "no honest member started a fresh inner optimizer after the rollback"
    finally:
        for a in agents.values():
            a.kill9()
