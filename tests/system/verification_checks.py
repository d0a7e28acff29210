"""The steps every end-to-end verification test with one cheater shares
(tests/system/test_local_sgd_verification.py, test_ring_verification.py): submit its job and
wait for it to succeed, read the cheater's quarantine, and check the job once it is done."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from epochmesh.v1 import common_pb2
from tests.fixtures import write_job
from tests.system.test_agent import list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import (
    MODEL,
    applied,
    check_exactly_once,
    events_of,
    make_dataset,
)
from tests.system.test_market import all_rounds

NS = common_pb2.NodeState


def run_job(address: str, tmp_path: Path, doc: dict[str, Any], samples: int) -> tuple[Jobs, str]:
    """Submit the fault-tolerance model's job ``doc`` on ``samples`` samples with the CLI and
    wait for it to succeed: (the operator's view of jobs, the job id)."""
    job_dir = tmp_path / "job"
    write_job(job_dir, MODEL, make_dataset(samples), doc)
    alice = Cli(address, tmp_path / "alice", role="submitter")
    out = alice.run("submit", str(job_dir / "job.toml"), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])
    jobs = Jobs(address)
    jobs.wait_state(job_id, common_pb2.JOB_STATE_SUCCEEDED, timeout=240)
    return jobs, job_id


def quarantined_cheater(
    address: str, jobs: Jobs, job_id: str, name: str = "cheat"
) -> tuple[dict[str, common_pb2.NodeInfo], common_pb2.NodeInfo, list[common_pb2.Event], dict]:  # type: ignore[type-arg]
    """The agent ``name`` was quarantined once, by this job: (the nodes by name, it, the job's
    events, the quarantine's evidence)."""
    nodes = {n.name: n for n in list_nodes(address)}
    cheater = nodes[name]
    assert cheater.state == NS.NODE_STATE_QUARANTINED, cheater
    events = jobs.events(job_id)
    caught = [e for e in events_of(events, "node.quarantined") if e.node_id == cheater.node_id]
    assert len(caught) == 1, [e.message for e in events_of(events, "node.quarantined")]
    return nodes, cheater, events, dict(caught[0].attrs)


def cheater_parts(
    jobs: Jobs, job_id: str, cheater: common_pb2.NodeInfo, cheat_from: int
) -> list[int]:
    """The rounds (rolled back ones too) in which the cheater had a part, from ``cheat_from``."""
    return sorted(
        r.round
        for r in all_rounds(jobs, job_id)
        if r.round >= cheat_from and any(p.node_id == cheater.node_id for p in r.parts)
    )


def check_cheater_undone(
    jobs: Jobs,
    job_id: str,
    events: list[common_pb2.Event],
    nodes: Mapping[str, common_pb2.NodeInfo],
    cheater: common_pb2.NodeInfo,
    honest: Iterable[str],
    first_cheated: int,
    samples: int,
    epochs: int,
) -> None:
    """Every sample of every epoch trained once in the live rounds, none of the cheater's parts
    from round ``first_cheated`` on still applied, no honest node struck, quarantined or failed
    a check (those that worked have verified rounds), and the job's figures: one failed check,
    some passed."""
    live = jobs.rounds(job_id)
    check_exactly_once(live, samples, epochs)
    kept = [
        r.round
        for r in live
        for p in applied(r)
        if p.node_id == cheater.node_id and r.round >= first_cheated
    ]
    assert not kept, f"the cheater's updates of rounds {kept} are still applied"
    worked = {p.node_id for r in live for p in applied(r)}
    for name in honest:
        node = nodes[name]
        assert node.state != NS.NODE_STATE_QUARANTINED and node.strikes == 0, node
        assert node.reputation.failed_total == 0, node
        assert node.reputation.verified_total > 0 or node.node_id not in worked, node
    assert not [e for e in events_of(events, "node.quarantined") if e.node_id != cheater.node_id]
    summary = dict(events_of(events, "job.verification")[-1].attrs)
    assert int(summary["failed"]) == 1 and int(summary["passed"]) > 0, summary
