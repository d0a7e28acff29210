"""``epochmesh quote JOB.toml`` predicts a job's own program: the real console scripts against
a real coordinator and two priced agents. A job submitted without a quote calibrates the
quotes of other programs (the coordinator counts its FLOPs in its program check). The quote's node set is the one
the job then trains on, its time and cost are positive and finite, its rates come from the
program's FLOPs; once the job ran, the next quote of the same program is calibrated by it
(rate source, recorded overheads). No speed is asserted (scripts/bench_quote.py compares
quotes with actual runs)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochmesh.v1 import common_pb2
from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_agent import AgentProc, coordinator_args, list_nodes
from tests.system.test_cli_queue import whoami
from tests.system.test_cli_support import Cli

pytestmark = pytest.mark.timeout(300)

NS = common_pb2.NodeState
PRICE = "1000"  # credits per node-hour, each agent (a tiny job still costs something)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cli, Cli, Path]]:
    tmp = tmp_path_factory.mktemp("quote")
    with start_coordinator(tmp / "coordinator", *coordinator_args(0.5, 10.0)) as coord:
        agents = [
            AgentProc(coord.address, tmp / name, "--name", name, "--price", PRICE)
            for name in ("a", "b")
        ]
        try:
            for a in agents:
                a.wait_node_id()
            wait_until(
                lambda: (
                    sum(
                        1
                        for n in list_nodes(coord.address)
                        if n.state == NS.NODE_STATE_ONLINE and n.benchmark.samples_per_second > 0
                    )
                    == 2
                ),
                timeout=120,
                interval=0.2,
                message="agents never benchmarked",
            )
            op = Cli(coord.address, tmp / "op")
            alice = Cli(coord.address, tmp / "alice", role="submitter")
            granted = op.run("credits", "grant", whoami(alice), "100")
            assert granted.code == 0, granted.stderr
            yield op, alice, tmp
        finally:
            for a in agents:
                a.kill9()


def quote(cli: Cli, path: Path) -> dict[str, object]:
    result = cli.run("quote", str(path), "--output", "json", timeout=120)
    assert result.code == 0, result.stderr
    return dict(result.json())


def run_to_end(cli: Cli, path: Path) -> tuple[str, dict[str, object]]:
    submitted = cli.run("submit", str(path), "--output", "json", timeout=120)
    assert submitted.code == 0, submitted.stderr
    job_id = str(submitted.json()["job_id"])

    def ended() -> dict[str, object] | None:
        result = cli.run("status", job_id, "--output", "json")
        assert result.code == 0, result.stderr
        job = dict(result.json())
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None

    job = wait_until(ended, timeout=200, interval=0.5, message=f"job {job_id} never ended")
    assert isinstance(job, dict) and job["state"] == "succeeded"
    return job_id, job


def test_the_quoted_nodes_are_the_jobs_and_the_quote_is_sane(
    cluster: tuple[Cli, Cli, Path],
) -> None:
    op, alice, tmp = cluster
    # Another program, submitted without a quote: its steps calibrate the quote below.
    other = write_mlp_job(tmp / "other", num_samples=128)
    model = other.parent / "model.py"
    model.write_text(model.read_text().replace("32", "48"))
    with other.open("a") as f:
        f.write("\n[market]\nbudget = 10\n")
    run_to_end(alice, other)

    path = write_mlp_job(tmp / "job", num_samples=256)
    with path.open("a") as f:
        f.write("\n[market]\nbudget = 10\n")
    q = quote(alice, path)
    assert q["rates"] == "predicted_for_the_program"
    nodes = q["nodes"]
    assert isinstance(nodes, list) and len(nodes) == 2
    assert all(n["rate_source"] == "calibrated" for n in nodes)
    assert all(n["samples_per_second"] > 0 and n["reference_samples_per_second"] > 0 for n in nodes)
    assert isinstance(q["flops_per_sample"], float) and q["flops_per_sample"] > 0
    assert q["rounds"] == 2 * math.ceil(256 / 32)  # the tiny MLP: 2 epochs of batch 32
    for key in ("total_seconds", "epoch_seconds", "start_seconds", "round_overhead_seconds"):
        value = q[key]
        assert isinstance(value, float) and 0 < value < math.inf, key
    # The CLI's own part of a submit (measured on this machine) comes on top of the job's.
    assert isinstance(q["submit_seconds"], float) and q["submit_seconds"] > 0
    assert q["total_seconds"] == q["job_seconds"] + q["submit_seconds"]
    assert isinstance(q["total_cost_micro"], int) and q["total_cost_micro"] > 0
    assert q["overhead_source"] == "recorded" and q["budget_covers"] is True

    table = alice.run("quote", str(path), env=alice.env(NO_COLOR="1", COLUMNS="200"))
    assert table.code == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:5] == ["NODE", "NAME", "DEVICE", "PRICE", "JOB"]
    assert "JOB SAMPLES/S is predicted for this program" in table.stderr

    job_id, job = run_to_end(alice, path)
    rounds = alice.run("rounds", job_id, "--output", "json")
    assert rounds.code == 0, rounds.stderr
    used = {p["node_id"] for r in rounds.json_lines() for p in r.get("parts", [])}
    assert used == {n["node_id"] for n in nodes}
    assert int(job["spent_micro"]) > 0

    # The same program again: rated by the job that ran it, with its recorded overheads.
    again = quote(alice, path)
    assert {n["rate_source"] for n in again["nodes"]} == {"same_program"}  # type: ignore[union-attr]
    assert again["overhead_source"] == "recorded" and again["recorded_jobs"] == 2
