"""Drained = up and idle; leaving is explicit. Real processes: a coordinator with the training
engine, one agent (``epochmesh-agent``) and the ``epochmesh`` CLI.

`epochmesh drain` keeps the agent alive, heartbeating, and gives it no task (a job that only
it could train waits); `undrain` puts it back to work; `drain --stop` makes it finish
its task, leave the coordinator and exit 0, and the node shows as offline (left)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2
from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_agent import AgentProc, get_node, wait_node
from tests.system.test_cli_support import Cli, engine_available

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not engine_available(),
        reason="epochmesh-coordinator runs without the training engine",
    ),
]

NS = common_pb2.NodeState
HEARTBEAT_S = 0.3
# Heartbeats (and so scheduling passes) a drained node must go through without a task.
IDLE_HEARTBEATS = 8
# The agent must be gone this long after `drain --stop`: its task ends within its round's
# deadline, then Leave and shutdown take a second or two.
EXIT_TIMEOUT_S = 90.0


def test_drain_keeps_the_agent_idle_and_drain_stop_makes_it_exit(tmp_path: Path) -> None:
    # A lease that outlasts a busy machine's stalls (the export at submit takes both cores).
    lease = ("--heartbeat-interval", str(HEARTBEAT_S), "--lease-ttl", "10")
    with start_coordinator(tmp_path / "coord", *lease) as coord:
        address = coord.address
        cli = Cli(address, tmp_path / "config")
        with AgentProc(address, tmp_path / "solo", "--name", "solo") as agent:
            node_id = agent.wait_node_id()
            wait_node(
                address,
                node_id,
                lambda n: n.state == NS.NODE_STATE_ONLINE and n.benchmark.samples_per_second > 0,
                timeout=60,
                what=f"an online node with its reference benchmark\n{agent}",
            )

            # drain: the agent stays up and idle, heartbeating.
            drained = cli.run("drain", "solo", "--output", "json")
            assert drained.code == 0, drained.stderr
            assert drained.json()["state"] == "draining"
            wait_until(
                lambda: "the coordinator drains this node" in agent.log_text(),
                timeout=30,
                message=f"the agent never heard of its drain\n{agent}",
            )

            # A job that only this node could train: it waits, the agent gets no task.
            spec = write_mlp_job(
                tmp_path / "job",
                2048,
                overrides={"name": "held-back", "train": {"epochs": 100}},
            )
            submitted = cli.run("submit", str(spec))
            assert submitted.code == 0, submitted.stderr
            job_id = submitted.stdout.strip().splitlines()[0]
            since = now_ms()
            wait_node(
                address,
                node_id,
                lambda n: n.last_heartbeat_ms > since + IDLE_HEARTBEATS * HEARTBEAT_S * 1000,
                what=f"a drained node that goes on heartbeating\n{agent}",
            )
            assert agent.running(), str(agent)
            info = get_node(address, node_id)
            # DRAINING; CORDONED had its lease lapsed all the same (a drained node comes back so)
            assert info is not None
            assert info.state in (NS.NODE_STATE_DRAINING, NS.NODE_STATE_CORDONED), info.state
            assert not info.current_job_id
            assert f"for job {job_id}" not in agent.log_text(), str(agent)
            # By name and by id prefix (epochmesh/job_ref.py's rule): still waiting for a node.
            for ref in ("held-back", job_id[:5]):
                status = cli.run("status", ref, "--output", "json")
                assert status.code == 0, status.stderr
                assert status.json()["job_id"] == job_id
                assert status.json()["state"] in ("queued", "paused")  # waits for a node
                assert not status.json().get("samples_done")

            # A second job of the same name: the name, or a prefix of both ids, is ambiguous.
            again = cli.run("submit", str(spec))
            assert again.code == 0, again.stderr
            second_id = again.stdout.strip().splitlines()[0]
            for ref in ("held-back", "j-"):
                ambiguous = cli.run("status", ref)
                assert ambiguous.code == 2, (ambiguous.stdout, ambiguous.stderr)
                assert f"{ref!r} matches 2 jobs" in ambiguous.stderr, ambiguous.stderr
                assert "give the full job id" in ambiguous.stderr
            assert cli.run("cancel", second_id).code == 0

            # undrain (uncordon's alias): the node gets the job's work.
            undrained = cli.run("undrain", "solo")
            assert undrained.code == 0, undrained.stderr
            assert re.search(r"uncordoned: now (online|busy)", undrained.stdout), undrained.stdout
            wait_until(
                lambda: f"for job {job_id}" in agent.log_text(),
                timeout=60,
                message=f"the undrained agent got no task\n{agent}",
            )

            # drain --stop: the agent finishes its task, leaves and exits 0.
            stopped = cli.run("drain", "solo", "--stop")
            assert stopped.code == 0, stopped.stderr
            assert "asked to leave: now draining" in stopped.stdout, stopped.stdout
            assert agent.proc.wait(timeout=EXIT_TIMEOUT_S) == 0, str(agent)
            text = agent.log_text()
            assert "the coordinator asks this node to leave" in text, str(agent)
            assert "left the coordinator (an operator asked this node to leave" in text

            listed = cli.run("nodes", "--state", "offline", "--output", "json")
            assert listed.code == 0, listed.stderr
            assert [n["node_id"] for n in listed.json()["nodes"]] == [node_id]
            events = cli.run("events", "--output", "json").json_lines()
            left = [e for e in events if e["kind"] == "node.left" and e["node_id"] == node_id]
            assert len(left) == 1 and "drain --stop" in left[0]["message"], left

            cancelled = cli.run("cancel", job_id)
            assert cancelled.code == 0, cancelled.stderr
