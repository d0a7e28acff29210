"""The ``epochmesh`` CLI as a subprocess against a real coordinator and real agents:
control-plane commands, address resolution, and bad input answered cleanly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fixtures import write_mlp_job
from tests.procs import wait_until
from tests.system.test_cli_support import (
    EPOCHMESH,
    AgentProc,
    Cli,
    Cluster,
    LineReader,
    assert_clean_error,
    cli_env,
    cluster_fixture,  # noqa: F401 - the `cluster` fixture
    wait_for_nodes,
)

pytestmark = pytest.mark.timeout(120)


def _node_ids(cluster: Cluster) -> dict[str, str]:
    nodes = cluster.cli.run("nodes", "--output", "json").json()["nodes"]
    return {n["name"]: n["node_id"] for n in nodes}


def test_help_documents_exit_codes(tmp_path: Path) -> None:
    result = Cli("127.0.0.1:1", tmp_path).run("--help")
    assert result.code == 0
    assert "exit codes:" in result.stdout
    for line in ("  3    not found", "  4    coordinator unreachable", "  6    precondition"):
        assert line in result.stdout
    assert "XDG_CONFIG_HOME" in result.stdout and "EPOCHMESH_COORDINATOR" in result.stdout


def test_no_command_and_bad_command_are_usage_errors(tmp_path: Path) -> None:
    cli = Cli("127.0.0.1:1", tmp_path)
    assert cli.run().code == 2
    result = cli.run("stauts")
    assert result.code == 2
    assert "did you mean 'status'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_nodes_table_and_json(cluster: Cluster) -> None:
    # With a width (COLUMNS, as on a terminal) the table fits it; piped without one it is whole.
    result = cluster.cli.run("nodes", env=cluster.cli.env(COLUMNS="80"))
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "NODE",
        "NAME",
        "STATE",
        "DEVICE",
        "SAMPLES/S*",
        "PRICE",
        "CHECKS",
        "JOB",
        "SEEN",
    ]
    assert all(len(line) <= 80 for line in lines)
    names = {line.split()[1] for line in lines[1:]}
    assert {"alpha", "beta"} <= names
    # Aligned: the STATE column starts at the same offset on every line.
    col = lines[0].index("STATE")
    assert all(line[col:].split()[0] in ("online", "busy", "cordoned") for line in lines[1:])
    assert "\x1b[" not in result.stdout  # not a TTY: no colors

    data = cluster.cli.run("nodes", "--output", "json").json()
    by_name = {n["name"]: n for n in data["nodes"]}
    assert {"alpha", "beta"} <= set(by_name)
    alpha = by_name["alpha"]
    assert alpha["node_id"].startswith("n-") and alpha["state"] in ("online", "busy")
    assert alpha["devices"][0]["kind"] == "cpu"
    assert isinstance(alpha["registered_at_ms"], int)
    assert alpha["price_micro_per_hour"] == 0  # donated
    col = lines[0].index("PRICE")
    assert all(line[col : col + 5].strip() == "free" for line in lines[1:]), lines

    offline = cluster.cli.run("nodes", "--state", "offline", "--output", "json").json()
    assert all(n["state"] == "offline" for n in offline["nodes"])
    assert {n["name"] for n in offline["nodes"]}.isdisjoint({"alpha", "beta"})


def test_cordon_uncordon_by_name_and_id(cluster: Cluster) -> None:
    cli = cluster.cli
    result = cli.run("cordon", "alpha")
    assert result.code == 0, result.stderr
    assert "cordoned" in result.stdout
    listed = cli.run("nodes", "--state", "cordoned", "--output", "json").json()["nodes"]
    assert [n["name"] for n in listed] == ["alpha"]
    node_id = listed[0]["node_id"]
    result = cli.run("uncordon", node_id, "--output", "json")
    assert result.code == 0, result.stderr
    assert result.json()["state"] == "online"


def test_events_lists_and_follows(cluster: Cluster) -> None:
    cli = cluster.cli
    result = cli.run("events")
    assert result.code == 0, result.stderr
    assert "node.registered" in result.stdout
    events = cli.run("events", "--output", "json").json_lines()
    assert events and all(isinstance(e["id"], int) for e in events)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    last_id = events[-1]["id"]

    follower = cli.popen("events", "--follow", "--since", str(last_id), "--output", "json")
    lines = LineReader(follower.stdout)
    try:
        assert cli.run("cordon", "beta").code == 0
        event = json.loads(lines.next_line(timeout=20))
        assert event["id"] > last_id and event["node_id"] == _node_ids(cluster)["beta"]
        follower.send_signal(signal.SIGINT)
        assert follower.wait(timeout=10) == 130
        assert "Traceback" not in (follower.stderr.read() if follower.stderr else "")
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        cli.run("uncordon", "beta")


def test_stats_and_status_without_jobs(cluster: Cluster) -> None:
    cli = cluster.cli
    result = cli.run("stats")
    assert result.code == 0, result.stderr
    assert "nodes" in result.stdout and "online" in result.stdout
    stats = cli.run("stats", "--output", "json").json()
    assert sum(stats["nodes_by_state"].values()) >= 2
    assert isinstance(stats["uptime_ms"], int)

    listing = cli.run("status", "--output", "json")
    assert listing.code == 0, listing.stderr
    assert isinstance(listing.json()["jobs"], list)


def test_address_resolution_order(cluster: Cluster, tmp_path: Path) -> None:
    home = tmp_path / "cfg"
    (home / "epochmesh").mkdir(parents=True)
    cli = Cli(cluster.address, home)
    # Config file only.
    (home / "epochmesh" / "config.toml").write_text(f'coordinator = "{cluster.address}"\n')
    env = cli_env(home)
    assert cli.run("stats", env=env).code == 0
    # The environment variable beats the config file.
    env_bad = cli_env(home, "127.0.0.1:1")
    assert cli.run("stats", env=env_bad).code == 4
    # The flag beats both.
    result = cli.run("--coordinator", cluster.address, "stats", env=env_bad)
    assert result.code == 0, result.stderr
    # The flag also works after the command name.
    assert cli.run("stats", "--coordinator", cluster.address, env=env_bad).code == 0
    # Nothing set: the default 127.0.0.1:7070 is named in the error.
    (home / "epochmesh" / "config.toml").unlink()
    result = cli.run("stats", env=cli_env(home), timeout=10)
    if result.code == 4:
        assert "127.0.0.1:7070" in result.stderr and "default" in result.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_coordinator_answers_fast(tmp_path: Path) -> None:
    # No login: the closed port may be one a coordinator of an earlier test listened on, which
    # the helpers still know (a fresh-clone run of the suite once tried to log in there).
    cli = Cli(f"127.0.0.1:{_closed_port()}", tmp_path, role=None)
    for args in (("nodes",), ("status",), ("events", "--follow"), ("watch", "j-x")):
        result = cli.run(*args, timeout=10)
        assert_clean_error(result, 4, "cannot reach the coordinator", "hint: ")
        assert result.seconds < 5, result.seconds


def test_silent_coordinator_answers_within_5s(tmp_path: Path) -> None:
    # A port that accepts TCP but never speaks HTTP/2: the connect deadline must fire.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        result = Cli(f"127.0.0.1:{port}", tmp_path).run("nodes", timeout=15)
    assert_clean_error(result, 4)
    assert result.seconds < 5, result.seconds


def test_unknown_job_and_node(cluster: Cluster) -> None:
    cli = cluster.cli
    for args in (
        ("status", "j-doesnotexist"),
        ("watch", "j-doesnotexist"),
        ("rounds", "j-doesnotexist"),
        ("download", "j-doesnotexist", "-o", "/tmp/never-written"),
        ("cancel", "j-doesnotexist"),
        ("allocation", "j-doesnotexist"),
        ("logs", "j-doesnotexist"),
    ):
        assert_clean_error(cli.run(*args), 3, "unknown job 'j-doesnotexist'", "epochmesh status")
    assert not Path("/tmp/never-written").exists()
    for verb in ("cordon", "drain", "uncordon"):
        assert_clean_error(cli.run(verb, "n-nope"), 3, "unknown node 'n-nope'", "epochmesh nodes")
    # A near miss of a real name gets a suggestion.
    result = cli.run("cordon", "alpah")
    assert_clean_error(result, 3, "did you mean alpha?")


def test_bad_arguments(cluster: Cluster) -> None:
    cli = cluster.cli
    result = cli.run("nodes", "--state", "onlin")
    assert_clean_error(result, 2, "unknown node state 'onlin'", "did you mean online?")
    result = cli.run("nodes", "--output", "yaml")
    assert result.code == 2 and "Traceback" not in result.stderr
    result = cli.run("--coordinator", "nonsense", "nodes")
    assert_clean_error(result, 2, "bad coordinator address", "HOST:PORT")


def test_submit_bad_specs(tmp_path: Path) -> None:
    # The spec is checked before the coordinator is contacted: no coordinator needed.
    cli = Cli(f"127.0.0.1:{_closed_port()}", tmp_path / "cfg")

    not_toml = write_mlp_job(tmp_path / "a", 16)
    not_toml.write_text("name = \n[[[")
    assert_clean_error(cli.run("submit", str(not_toml)), 2, "not valid TOML", "line 1")

    overrides = {"train": {"global_batch": None, "global_bach": 8}}
    typo = write_mlp_job(tmp_path / "b", 16, overrides=overrides)
    assert_clean_error(
        cli.run("submit", str(typo)),
        2,
        "unknown key [train].global_bach",
        "did you mean global_batch?",
    )

    no_data = write_mlp_job(tmp_path / "c", 16)
    (no_data.parent / "train.safetensors").unlink()
    assert_clean_error(
        cli.run("submit", str(no_data)), 2, "dataset file not found", "train.safetensors"
    )

    no_model = write_mlp_job(tmp_path / "d", 16)
    (no_model.parent / "model.py").unlink()
    assert_clean_error(cli.run("submit", str(no_model)), 2, "model file not found", "model.py")

    assert_clean_error(cli.run("submit", str(tmp_path / "missing.toml")), 2, "does not exist")


def test_submit_to_unreachable_coordinator_fails_fast(tmp_path: Path) -> None:
    spec = write_mlp_job(tmp_path / "job", 16)
    result = Cli(f"127.0.0.1:{_closed_port()}", tmp_path / "cfg").run("submit", str(spec))
    assert_clean_error(result, 4, "cannot reach the coordinator")
    assert result.seconds < 5


def test_ctrl_c_exits_130(cluster: Cluster) -> None:
    proc = cluster.cli.popen("events", "--follow")
    lines = LineReader(proc.stdout)
    try:
        # Wait until it is connected and streaming (it prints the stored events first).
        assert lines.next_line(timeout=20)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain(cluster: Cluster, tmp_path: Path) -> None:
    # Its own agent: a drained agent stays up and idle (drain --stop would make it leave).
    agent = AgentProc(cluster.address, tmp_path / "gamma", "gamma")
    try:
        wait_for_nodes(cluster.address, ["gamma"], agents=[agent])
        result = cluster.cli.run("drain", "gamma", "--output", "json")
        assert result.code == 0, result.stderr
        assert result.json()["state"] in ("draining", "offline")

        def left_or_draining() -> bool:
            nodes = cluster.cli.run("nodes", "--output", "json").json()["nodes"]
            return any(
                n["name"] == "gamma" and n["state"] in ("draining", "offline") for n in nodes
            )

        wait_until(left_or_draining, timeout=20)
    finally:
        agent.stop()


def test_broken_pipe_is_quiet(cluster: Cluster) -> None:
    proc = subprocess.run(
        f"'{EPOCHMESH}' events | head -c 1 >/dev/null",
        shell=True,
        capture_output=True,
        text=True,
        timeout=30,
        env=cluster.cli.env(),
    )
    assert "Traceback" not in proc.stderr
