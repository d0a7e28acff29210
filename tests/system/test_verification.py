"""Verification end to end (issue 20), with real processes and TLS: a coordinator, four honest
agents of mixed speeds and one that cheats (the agent's test-only EPOCHMESH_TEST_CHEAT switch)
from a given round on, each agent its own donor.

The cheater is quarantined, with an event that carries the evidence, within two rounds of its
first cheat; its updates since its last verified round are undone (a `job.rolled_back`
event); the job succeeds with every sample of every epoch trained exactly once in the live
rounds, and its result equals a plain PyTorch replay of those rounds — so nothing the cheater
sent after it began cheating is in the model. No honest node is struck or quarantined, and
their records show verified rounds. Every agent asks a price: pay waits in the job's held
account until a check vouches for it; the cheater's pay for its undone parts is forfeited,
never paid out, and the accounts add up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from epochmesh.v1 import common_pb2
from tests.fixtures import write_job
from tests.procs import STEADY_LEASES, CoordinatorProc, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import (
    MODEL,
    applied,
    check_exactly_once,
    events_of,
    job_doc,
    make_dataset,
    replay,
)
from tests.system.test_market import all_rounds

JS = common_pb2.JobState
NS = common_pb2.NodeState
pytestmark = pytest.mark.timeout(300)

N, EPOCHS, BATCH = 480, 3, 96
CHEAT_FROM = 4  # the first round the cheater cheats in
HONEST = {"h1": 1, "h2": 2, "h3": 2, "h4": 3}  # name -> slowdown
PRICE = "10"  # credits per hour, every agent


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProc]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(tmp_path / "coord", "--listen", address, *STEADY_LEASES)
    try:
        yield coord
    finally:
        coord.kill9()


def start_agents(address: str, tmp_path: Path, cheat: str) -> dict[str, AgentProc]:
    agents = {
        name: AgentProc(
            address, tmp_path / name, "--name", name, "--slowdown", str(slow), "--price", PRICE
        )
        for name, slow in HONEST.items()
    }
    agents["cheat"] = AgentProc(
        address,
        tmp_path / "cheat",
        "--name",
        "cheat",
        "--slowdown",
        "1",
        "--price",
        PRICE,
        env={"EPOCHMESH_TEST_CHEAT": f"{cheat}:{CHEAT_FROM}"},
    )
    wait_until(
        lambda: sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == 5,
        timeout=180,
        interval=0.2,
        message="five agents ready",
    )
    return agents


@pytest.mark.parametrize("cheat", ["flipped", "stale"])
def test_a_cheater_is_caught_undone_and_quarantined_while_honest_nodes_are_verified(
    coordinator: CoordinatorProc, tmp_path: Path, cheat: str
) -> None:
    address = coordinator.address
    agents = start_agents(address, tmp_path, cheat)
    try:
        # At least three nodes: two honest ones besides the cheater (a slow one may join late).
        doc: dict[str, Any] = job_doc(cheat, epochs=EPOCHS, seed=5, min_nodes=3, max_nodes=5)
        doc["train"]["global_batch"] = BATCH
        doc["market"] = {"budget": "2"}
        job_dir = tmp_path / "job"
        write_job(job_dir, MODEL, make_dataset(N), doc)
        alice = Cli(address, tmp_path / "alice", role="submitter")
        op = Cli(address, tmp_path / "op")
        whoami = alice.run("whoami", "--output", "json")
        assert whoami.code == 0, whoami.stderr
        assert op.run("credits", "grant", f"tenant:{whoami.json()['principal']}", "2").code == 0
        out = alice.run("submit", str(job_dir / "job.toml"), "--output", "json", timeout=120)
        assert out.code == 0, out.stderr
        job_id = str(json.loads(out.stdout)["job_id"])
        jobs = Jobs(address)
        jobs.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=240)

        nodes = {n.name: n for n in list_nodes(address)}
        cheater = nodes["cheat"]
        assert cheater.state == NS.NODE_STATE_QUARANTINED
        assert cheater.reputation.failed_total >= 1 and cheater.reputation.verified_in_a_row == 0
        live = jobs.rounds(job_id)
        worked = {p.node_id for r in live for p in applied(r)}
        honest_worked = [name for name in HONEST if nodes[name].node_id in worked]
        assert len(honest_worked) >= 2, honest_worked  # a slow agent may join after the end
        for name in HONEST:
            node = nodes[name]
            assert node.state != NS.NODE_STATE_QUARANTINED and node.strikes == 0, node
            assert node.reputation.failed_total == 0, node
            assert node.reputation.verified_total > 0 or name not in honest_worked, node

        events = jobs.events(job_id)
        caught = [e for e in events_of(events, "node.quarantined") if e.node_id == cheater.node_id]
        assert len(caught) == 1, events
        evidence = dict(caught[0].attrs)
        assert evidence["check"] in ("recomputation", "consistency"), evidence
        # Checked every round while new: caught by the check of its first cheated round or of
        # the next (checks run concurrently; stale's first cheat, with no earlier round of its
        # own kept, is an honest update). It joins when its benchmark is in, which on a busy
        # host can be after CHEAT_FROM: its first cheat is its first part from CHEAT_FROM on.
        every_round = all_rounds(jobs, job_id)
        cheater_rounds = sorted(
            r.round
            for r in every_round
            if r.round >= CHEAT_FROM and any(p.node_id == cheater.node_id for p in r.parts)
        )
        first_cheat = cheater_rounds[0]
        caught_in = int(evidence["round"])
        # Flipped: caught by the check of its first cheated part or of the next (the issue asks
        # for 2 rounds). Stale (5 allowed): its first part from CHEAT_FROM on may be an honest
        # one (no earlier update to resend), and on a loaded host a check can end undecided
        # (no checker in time), leaving it to the next.
        # (A stale cheater can resend only when its new part has the old one's size: with
        # shares that move from round to round it is an honest node until then.)
        allowed = 2 if cheat == "flipped" else len(cheater_rounds)
        assert caught_in in cheater_rounds[:allowed], (cheater_rounds, evidence)
        if evidence["check"] == "recomputation":
            assert float(evidence["distance1"]) > float(evidence["tolerance"]), evidence
            assert evidence["checker1"] != cheater.node_id != evidence["checker2"]
        assert not [
            e for e in events_of(events, "node.quarantined") if e.node_id != cheater.node_id
        ]
        summary = dict(events_of(events, "job.verification")[-1].attrs)
        assert int(summary["failed"]) == 1 and int(summary["passed"]) > 0, summary

        check_exactly_once(live, N, EPOCHS)
        # (stale's first part from CHEAT_FROM on resends its last update; with none before it,
        # it is an honest one, verified: it may stay. The round it was caught in is a cheat.)
        cheated_from = caught_in if cheat == "stale" else first_cheat
        cheats_kept = [
            r.round
            for r in live
            for p in applied(r)
            if p.node_id == cheater.node_id and r.round >= cheated_from
        ]
        assert not cheats_kept, f"the cheater's updates of rounds {cheats_kept} are still applied"
        # A cheated update that was applied before its check failed was undone by a rollback
        # (one caught while its round was still open was discarded before it was applied).
        applied_cheats = [
            r.round
            for r in every_round
            for p in applied(r)
            if p.node_id == cheater.node_id and r.round >= cheated_from
        ]
        if applied_cheats:
            assert events_of(events, "job.rolled_back"), (applied_cheats, [e.kind for e in events])
            forfeits = [
                e for e in events_of(events, "node.pay_forfeited") if e.node_id == cheater.node_id
            ]
            assert forfeits and int(forfeits[0].attrs["amount_micro"]) > 0, forfeits
        # Pay: held until verified, none of the cheater's cheated parts paid out, every held
        # credit paid or forfeited, the book balanced.
        entries = alice.run("statement", "--job", job_id, "--output", "json").json()["entries"]
        held = f"held:{job_id}"
        assert {e["from"] for e in entries if e["to"].startswith("donor:")} == {held}
        paid_cheats = [
            e["round"]
            for e in entries
            if e["to"].startswith("donor:")
            and e["node"] == cheater.node_id
            and e["round"] >= cheated_from
        ]
        assert not paid_cheats, f"the cheater was paid for its rounds {paid_cheats}"
        assert any(e["to"].startswith("donor:") and e["node"] != cheater.node_id for e in entries)
        balances = op.run("balance", "--all", "--output", "json").json()["balances"]
        by_account = {b["account"]: b["balance_micro"] for b in balances}
        outstanding: dict[tuple[int, str], int] = {}
        for e in entries:
            key = (e["round"], e["node"])
            sign = (e["to"] == held) - (e["from"] == held)
            outstanding[key] = outstanding.get(key, 0) + sign * e["amount_micro"]
        left = {k: v for k, v in outstanding.items() if v}
        assert by_account.get(held, 0) == 0 and not left, (left, cheater.node_id)
        assert sum(by_account.values()) == 0, by_account
        # The result is the live rounds replayed in plain PyTorch: nothing undone is in it.
        result = alice.run("download", job_id, "-o", str(tmp_path / "result"), timeout=60)
        assert result.code == 0, result.stderr
        trained = load_file(str(tmp_path / "result" / "model.safetensors"))
        expected = replay(job_dir, live, make_dataset(N), seed=5)
        diff = max((trained[k] - v).abs().max().item() for k, v in expected.items())
        assert diff <= 1e-5, f"the result is {diff} off the replay of the live rounds"

        listed = alice.run("offers", "--all", "--output", "json")
        assert listed.code == 0, listed.stderr
        by_name = {o["name"]: o for o in listed.json()["offers"]}
        assert by_name["cheat"]["failed_checks"] == 1
        assert all(by_name[n]["verified_total"] > 0 for n in honest_worked)
    finally:
        for a in agents.values():
            a.kill9()
