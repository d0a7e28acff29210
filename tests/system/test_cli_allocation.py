"""`epochmesh allocation JOB`: per node and in total, the time computing vs communicating.

Pure parts first (totals, the per-node sums from round records, the formatting helpers), then
end to end: a real coordinator, two real agents that dial it through emulated links (20 ms RTT,
50 Mbit/s, epochmesh/testing/wan.py), a local SGD job, and the `epochmesh` CLI as a subprocess. While
the job runs, the live allocation shows each node's compute and communicate seconds, its RTT
(at least the link's 20 ms) and bandwidth, and totals that are the sums; once the job has been
cancelled, the times come from the recorded rounds and match them exactly.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.commands.allocation import (
    TimeTotals,
    nodes_from_rounds,
    time_rows,
    time_totals,
    total_line,
)
from client.render import fmt_bandwidth, fmt_rtt, fmt_seconds, time_split_bar
from epochmesh.testing.wan import WanLink, WanThread
from epochmesh.v1 import common_pb2
from tests.fixtures import write_mlp_job
from tests.procs import console_script, start_coordinator, token_for, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import engine_available, logged_in_env

AGENTS = 2
RTT_MS = 20.0
BANDWIDTH_BPS = 50e6


# -- pure parts ---------------------------------------------------------------------------------


def _part(node: str, status: str, secs: float, comm: float, b: int, h: int) -> common_pb2.RoundPart:
    return common_pb2.RoundPart(
        node_id=node,
        status=status,
        seconds=secs,
        communicate_seconds=comm,
        local_batch=b,
        inner_steps=h,
    )


def test_nodes_from_rounds_sums_applied_parts_only() -> None:
    records = [
        common_pb2.RoundRecord(
            round=1,
            parts=[
                _part("n-a", "applied", 2.0, 0.5, 10, 4),
                _part("n-b", "applied", 1.0, 0.25, 5, 4),
            ],
        ),
        common_pb2.RoundRecord(
            round=2,
            parts=[_part("n-b", "late", 9.0, 9.0, 5, 4), _part("n-a", "applied", 3.0, 0.5, 12, 4)],
        ),
    ]
    info = common_pb2.NodeInfo(node_id="n-a", name="alpha")
    info.benchmark.rtt_ms = 21.5
    info.benchmark.bandwidth_bytes_per_second = 6.0e6
    nodes = nodes_from_rounds(records, {"n-a": info})
    assert [n.node_id for n in nodes] == ["n-a", "n-b"]
    a, b = nodes
    assert (a.compute_seconds, a.communicate_seconds, a.local_batch, a.inner_steps) == (
        5.0,
        1.0,
        12,
        4,
    )
    assert (a.name, a.rtt_ms, a.bandwidth_bytes_per_second) == ("alpha", 21.5, 6.0e6)
    assert (b.compute_seconds, b.communicate_seconds, b.name, b.rtt_ms) == (1.0, 0.25, "", 0.0)
    totals = time_totals(nodes)
    assert (totals.compute_seconds, totals.communicate_seconds) == (6.0, 1.25)
    assert totals.compute_fraction == pytest.approx(6.0 / 7.25)
    rows = time_rows(nodes)
    assert rows[0] == ["n-a", "alpha", "21.5 ms", "48.0 Mbit/s", "5.00s", "1.00s", "83.3%"]
    assert rows[1][1:4] == ["-", "-", "-"]


def test_time_totals_before_any_time_and_negative_figures() -> None:
    empty = time_totals([])
    assert empty.compute_fraction is None
    assert empty.to_dict() == {
        "compute_seconds": 0.0,
        "communicate_seconds": 0.0,
        "compute_fraction": None,
    }
    odd = time_totals([common_pb2.NodeAllocation(compute_seconds=-1, communicate_seconds=2)])
    assert (odd.compute_seconds, odd.communicate_seconds) == (0.0, 2.0)
    assert "0.0% computing" in total_line(odd)


def test_formatting_helpers() -> None:
    assert fmt_bandwidth(12.5e6) == "100.0 Mbit/s"
    assert fmt_bandwidth(1.5e9 / 8) == "1.5 Gbit/s"
    assert fmt_bandwidth(100) == "800 bit/s"
    assert fmt_bandwidth(0) == fmt_bandwidth(math.nan) == "-"
    assert fmt_rtt(50.04) == "50.0 ms"
    assert fmt_rtt(0.213) == "0.21 ms"
    assert fmt_rtt(0) == "-"
    assert fmt_seconds(0.421) == "0.42s"
    assert fmt_seconds(12.34) == "12.3s"
    assert fmt_seconds(245) == "4m05s"
    assert fmt_seconds(-1) == "-"
    assert time_split_bar(9, 1, width=10) == "[#########.]"
    assert time_split_bar(0, 0, width=4) == "[    ]"
    line = total_line(TimeTotals(90.0, 10.0))
    assert line.startswith("total: computing 1m30s, communicating 10.0s: 90.0% computing [")


# -- end to end ---------------------------------------------------------------------------------


@dataclass
class Setup:
    address: str
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if not engine_available():
        pytest.skip("coordinator without training engine")
    root = tmp_path_factory.mktemp("cli-allocation")
    with start_coordinator(root / "coord", "--heartbeat-interval", "0.5") as coord:
        links = [
            WanLink("127.0.0.1:0", coord.address, BANDWIDTH_BPS, RTT_MS, name=f"n{i}", seed=i)
            for i in range(AGENTS)
        ]
        with WanThread(*links):
            agents: list[AgentProc] = []
            try:
                for i, link in enumerate(links):
                    token = token_for(coord.address, "node")
                    assert token
                    agents.append(
                        AgentProc(
                            link.address,
                            root / f"agent{i}",
                            "--token",
                            token,
                            "--name",
                            f"far{i}",
                            "--no-peer",
                            "--slowdown",
                            "2",
                        )
                    )
                wait_until(
                    lambda: (
                        len([n for n in list_nodes(coord.address) if n.benchmark.rtt_ms > 0])
                        == AGENTS
                    ),
                    timeout=60,
                    interval=0.2,
                    message="agents did not register and benchmark through the links",
                )
                yield Setup(coord.address, root)
            finally:
                for a in agents:
                    a.kill9()


def cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(console_script("epochmesh")), "--coordinator", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**logged_in_env(address), "COLUMNS": "160"},
    )


def allocation_json(address: str, job_id: str) -> dict:
    out = cli(address, "allocation", job_id, "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_totals(doc: dict) -> None:
    nodes = doc["nodes"]
    comp = sum(n["compute_seconds"] for n in nodes)
    comm = sum(n["communicate_seconds"] for n in nodes)
    assert doc["totals"]["compute_seconds"] == pytest.approx(comp)
    assert doc["totals"]["communicate_seconds"] == pytest.approx(comm)
    assert doc["totals"]["compute_fraction"] == pytest.approx(comp / (comp + comm))


@pytest.mark.timeout(120)
def test_allocation_shows_compute_vs_communicate_live_and_after(cluster: Setup) -> None:
    job_toml = write_mlp_job(
        cluster.root / "job",
        1536,
        overrides={
            "name": "alloc-times",
            "train": {
                # Long enough never to end by itself within the test: it is cancelled once the
                # live view has been checked (a short job could end between two CLI calls).
                "epochs": 50,
                "global_batch": 32,
                "sync": "local_sgd",
                "inner_steps": 8,
                "compression": "int8",
            },
            "cluster": {"min_nodes": AGENTS, "max_nodes": AGENTS, "checkpoint_every": 1000},
        },
    )
    out = cli(cluster.address, "submit", str(job_toml), "--output", "json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]

    def live_with_times() -> dict | None:
        doc = allocation_json(cluster.address, job_id)
        nodes = doc["nodes"]
        if doc["source"] != "allocation" or len(nodes) != AGENTS:
            return None
        # Every node has finished a part.
        if not all(n["compute_seconds"] > 0 and n["communicate_seconds"] > 0 for n in nodes):
            return None
        return doc

    live = wait_until(live_with_times, timeout=60, interval=0.5, message="no live times")
    assert isinstance(live, dict)
    check_totals(live)
    for n in live["nodes"]:
        assert n["rtt_ms"] >= RTT_MS * 0.95, n  # measured through the 20 ms link
        assert 0 < n["bandwidth_bytes_per_second"] <= BANDWIDTH_BPS / 8 * 1.2, n
        assert n["inner_steps"] == 8, n
    table = cli(cluster.address, "allocation", job_id)
    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert "COMPUTE" in text and "COMMUNICATE" in text and "COMPUTE%" in text, text
    assert "\ntotal: computing " in text, text
    assert " ms " in text and "Mbit/s" in text, text
    for n in live["nodes"]:
        assert n["name"] in text

    out = cli(cluster.address, "cancel", job_id)
    assert out.returncode == 0, out.stderr

    def ended() -> bool:
        res = cli(cluster.address, "status", job_id, "--output", "json")
        state = json.loads(res.stdout)["state"]
        assert state not in ("failed", "succeeded"), res.stdout
        return state == "cancelled"

    wait_until(ended, timeout=60, interval=0.5, message="job was not cancelled")
    after = allocation_json(cluster.address, job_id)
    assert after["source"] == "rounds", after
    check_totals(after)
    rounds = [
        json.loads(line)
        for line in cli(cluster.address, "rounds", job_id, "--output", "json").stdout.splitlines()
        if line.strip()
    ]
    applied = [p for r in rounds for p in r["parts"] if p["status"] == "applied"]
    assert after["totals"]["compute_seconds"] == pytest.approx(sum(p["seconds"] for p in applied))
    assert after["totals"]["communicate_seconds"] == pytest.approx(
        sum(p["communicate_seconds"] for p in applied)
    )
    assert {n["name"] for n in after["nodes"]} == {"far0", "far1"}
    assert all(n["rtt_ms"] > 0 for n in after["nodes"])
    table = cli(cluster.address, "allocation", job_id)
    assert table.returncode == 0, table.stderr
    assert "time summed from its" in table.stdout and "total: computing" in table.stdout
