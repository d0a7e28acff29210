"""``epochmesh queue``, ``priority`` and ``tenant``: the real console script against a real
coordinator with the training engine, an operator and two submitters (two tenants), no agents
(the submitted jobs wait, and the queue says why). Exit codes: 0, 2 (bad input), 7 (not
allowed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator
from tests.system.test_cli_support import Cli, assert_clean_error, engine_available

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not engine_available(), reason="needs the training engine"),
]


@dataclass
class Parties:
    op: Cli
    alice: Cli
    bob: Cli
    alice_id: str
    bob_id: str
    job_a: str  # alice's
    job_b: str  # bob's


def whoami(cli: Cli) -> str:
    result = cli.run("whoami", "--output", "json")
    assert result.code == 0, result.stderr
    return str(result.json()["principal"])


def submit_both(alice: Cli, bob: Cli, tmp: Path) -> tuple[str, str]:
    """Each submitter's ``epochmesh submit`` of a small job, both at once; their job ids."""
    procs = [
        cli.popen("submit", str(write_mlp_job(tmp / name, 64, overrides={"name": name})))
        for cli, name in ((alice, "alice-job"), (bob, "bob-job"))
    ]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err
        ids.append(out.strip())
    return ids[0], ids[1]


@pytest.fixture(scope="module")
def parties(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parties]:
    tmp = tmp_path_factory.mktemp("queue")
    with start_coordinator(tmp / "coordinator") as coord:
        op = Cli(coord.address, tmp / "op")
        alice = Cli(coord.address, tmp / "alice", role="submitter")
        bob = Cli(coord.address, tmp / "bob", role="submitter")
        job_a, job_b = submit_both(alice, bob, tmp)
        yield Parties(op, alice, bob, whoami(alice), whoami(bob), job_a, job_b)


def test_queue_table_and_json(parties: Parties) -> None:
    p = parties
    table = p.alice.run("queue", env=p.alice.env(NO_COLOR="1", COLUMNS="200"))
    assert table.code == 0, table.stderr
    assert "\x1b[" not in table.stdout
    header, *rows = table.stdout.splitlines()
    assert header.split() == [
        "JOB", "NAME", "TENANT", "PRIORITY", "STATE", "FAIR", "SHARE", "NODES", "REASON",
    ]  # fmt: skip
    assert len(rows) == 1, table.stdout  # her own job only
    # no node anywhere: the job waits (queued, or paused once it had started)
    assert rows[0].split()[:4] == [p.job_a, "alice-job", p.alice_id, "normal"]
    assert rows[0].split()[4] in ("queued", "paused"), rows[0]
    assert "0/" in rows[0] and "waits:" in rows[0], rows[0]
    assert "1 live job(s) of other tenants not shown" in table.stderr

    mine = p.alice.run("queue", "--output", "json")
    assert mine.code == 0, mine.stderr
    doc = mine.json()
    assert doc["other_jobs"] == 1
    (entry,) = doc["jobs"]
    assert entry["job_id"] == p.job_a and entry["tenant"] == p.alice_id
    assert entry["state"] in ("queued", "paused") and entry["waiting"] is True
    assert entry["nodes_held"] == 0 and entry["node_ids"] == []
    assert entry["reason"].startswith("waits:")

    everything = p.op.run("queue", "--output", "json").json()
    assert sorted(j["job_id"] for j in everything["jobs"]) == sorted([p.job_a, p.job_b])
    assert everything["other_jobs"] == 0


def test_priority_exit_codes(parties: Parties) -> None:
    p = parties
    # An owner may not raise its job: 7.
    assert_clean_error(p.alice.run("priority", p.job_a, "high"), 7, "only an operator")
    # Nor touch another tenant's: 7.
    assert_clean_error(p.bob.run("priority", p.job_a, "low"), 7, "another submitter")
    # An unknown priority: 2, with a suggestion.
    assert_clean_error(p.alice.run("priority", p.job_a, "hihg"), 2, "did you mean high?")
    # An unknown job: 3.
    assert_clean_error(p.op.run("priority", "j-0000000000", "low"), 3, "unknown job")

    lowered = p.alice.run("priority", "alice-job", "LOW")
    assert lowered.code == 0, lowered.stderr
    assert lowered.stdout.strip() == f"job {p.job_a} priority normal -> low"
    raised = p.op.run("priority", p.job_a, "high", "--output", "json")
    assert raised.code == 0, raised.stderr
    assert raised.json()["spec"]["priority"] == "high"
    queue = p.op.run("queue", "--output", "json").json()
    assert {j["job_id"]: j["priority"] for j in queue["jobs"]}[p.job_a] == "high"
    back = p.alice.run("priority", p.job_a, "normal")
    assert back.code == 0, back.stderr
    assert back.stdout.strip() == f"job {p.job_a} priority high -> normal"


def test_tenant_set_and_list(parties: Parties) -> None:
    p = parties
    assert_clean_error(
        p.alice.run("tenant", "set", p.alice_id, "--weight", "2"), 7, "SetTenantWeight"
    )
    assert_clean_error(p.alice.run("tenant", "list"), 7)
    for bad in ("0", "-1", "nan", "inf"):
        assert_clean_error(
            p.op.run("tenant", "set", p.alice_id, "--weight", bad), 2, "positive number"
        )
    not_a_number = p.op.run("tenant", "set", p.alice_id, "--weight", "lots")
    assert not_a_number.code == 2 and "invalid float value" in not_a_number.stderr

    done = p.op.run("tenant", "set", p.alice_id, "--weight", "3")
    assert done.code == 0, done.stderr
    assert done.stdout.strip() == f"tenant {p.alice_id} weight 3"
    as_json = p.op.run("tenant", "set", p.bob_id, "--weight", "0.5", "--output", "json")
    assert as_json.code == 0 and as_json.json() == {"tenant": p.bob_id, "weight": 0.5}

    listing = p.op.run("tenant", "list", "--output", "json")
    assert listing.code == 0, listing.stderr
    tenants = {t["tenant"]: t for t in listing.json()["tenants"]}
    assert tenants[p.alice_id] == {
        "tenant": p.alice_id,
        "weight": 3.0,
        "weight_set": True,
        "jobs": 1,
        "nodes": 0,
        "fair_share": 0.0,
    }
    assert tenants[p.bob_id]["weight"] == 0.5
    table = p.op.run("tenant", "list", env=p.op.env(COLUMNS="200"))
    assert table.code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["TENANT", "WEIGHT", "JOBS", "NODES", "FAIR", "SHARE"]
    assert any(line.split()[:3] == [p.alice_id, "3", "1"] for line in lines[1:]), lines

    # A submitter sees its own weight in the queue, not the others'.
    mine = p.alice.run("queue", "--output", "json")
    assert json.loads(mine.stdout)["tenant_weights"] == {p.alice_id: 3.0}
