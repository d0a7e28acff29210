"""Trust end to end with real processes: `epochmesh-coordinator token create`, agents enrolling
with --token (key made and kept in their data dir), `epochmesh login`, roles seen from the CLI,
`epochmesh revoke`, single-use tokens, and the explicit --insecure mode of all three programs.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from epochmesh.identity import principal_from_pem
from epochmesh.v1 import common_pb2
from tests.procs import console_script, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, get_node
from tests.system.test_cli_support import Cli, assert_clean_error, cli_env

NS = common_pb2.NodeState


@pytest.mark.timeout(120)
def test_enroll_login_roles_and_revoke(tmp_path: Path) -> None:
    with start_coordinator(
        tmp_path / "coord", "--heartbeat-interval", "0.3", "--lease-ttl", "1.5"
    ) as coord:
        assert (tmp_path / "coord" / "ca.pem").exists()
        assert stat.S_IMODE((tmp_path / "coord" / "ca.key").stat().st_mode) == 0o600
        token = coord.create_token("node")
        with AgentProc(
            coord.address, tmp_path / "agent", "--name", "alpha", "--token", token
        ) as agent:
            node_id = agent.wait_node_id()
            # The key was made in the agent's data dir and stays there (0600); the
            # certificate names the node.
            key = tmp_path / "agent" / "key.pem"
            assert stat.S_IMODE(key.stat().st_mode) == 0o600
            assert key.read_bytes() not in (tmp_path / "coord" / "coordinator.db").read_bytes()
            cert = principal_from_pem((tmp_path / "agent" / "cert.pem").read_bytes())
            assert (cert.id, cert.role) == (node_id, "node")
            wait_until(
                lambda: (
                    (n := get_node(coord.address, node_id)) is not None
                    and n.state == NS.NODE_STATE_ONLINE
                ),
                timeout=30,
                message="agent never came online",
            )

            # The same single-use token cannot enroll a second agent.
            second = subprocess.run(
                [
                    str(console_script("epochmesh-agent")),
                    "--coordinator",
                    coord.address,
                    "--data-dir",
                    str(tmp_path / "second"),
                    "--token",
                    token,
                    "--device",
                    "cpu",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode == 2, second.stderr
            assert "enrollment refused" in second.stderr
            assert not (tmp_path / "second" / "key.pem").exists()

            # A submitter sees nodes but may not cordon or revoke; not logged in: exit 7.
            submitter = Cli(coord.address, tmp_path / "submitter", role="submitter")
            assert submitter.run("whoami").stdout.startswith("submitter u-")
            assert submitter.run("nodes").code == 0
            assert_clean_error(
                submitter.run("cordon", "alpha"), 7, "only operators can cordon a node"
            )
            nobody = Cli(coord.address, tmp_path / "nobody", role=None)
            assert_clean_error(nobody.run("nodes"), 7, "not logged in", "epochmesh login")

            operator = Cli(coord.address, tmp_path / "operator")
            result = operator.run("revoke", "alpha", "--reason", "test")
            assert result.code == 0, result.stderr
            assert node_id in result.stdout
            # From now on the agent's certificate is refused: its lease lapses.
            wait_until(
                lambda: (
                    (n := get_node(coord.address, node_id)) is not None
                    and n.state == NS.NODE_STATE_OFFLINE
                ),
                timeout=30,
                message=f"revoked node still leased\n{agent}",
            )
            wait_until(
                lambda: "has been revoked" in agent.log_text(),
                timeout=30,
                message=f"agent never saw the refusal\n{agent}",
            )
            # Retrying cannot help: the agent says what to do and exits 7 (not authorized).
            wait_until(lambda: not agent.running(), timeout=30, message=f"still running\n{agent}")
            assert agent.proc.returncode == 7, agent.log_text()
            assert "enroll it again with a new node token" in agent.log_text()
            events = operator.run("events", "--output", "json").json_lines()
            assert any(e["kind"] == "principal.revoked" for e in events)


@pytest.mark.timeout(90)
def test_reusable_and_expiring_tokens(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        reusable = coord.create_token("submitter", "--reusable", "--ttl", "10m")
        for i in range(2):
            cli = Cli(coord.address, tmp_path / f"user{i}", role=None)
            result = cli.run("login", "--token", reusable)
            assert result.code == 0, result.stderr
            assert result.stdout.startswith(f"logged in to {coord.address} as submitter u-")
        once = coord.create_token("submitter")
        cli = Cli(coord.address, tmp_path / "once", role=None)
        assert cli.run("login", "--token", once).code == 0
        assert_clean_error(cli.run("login", "--token", once), 7, "already used")

        # Reusable, so that logins before the expiry (a slow machine) do not use it up.
        short = coord.create_token("operator", "--ttl", "1s", "--reusable")
        late = Cli(coord.address, tmp_path / "late", role=None)
        refused = wait_until(
            lambda: (r := late.run("login", "--token", short)).code == 7 and r,
            timeout=20,
            interval=0.2,
            message="a token with --ttl 1s never expired",
        )
        assert_clean_error(refused, 7, "expired")  # type: ignore[arg-type]
        # A token for another coordinator's CA is refused before anything is sent.
        with start_coordinator(tmp_path / "other") as other:
            foreign = other.create_token("operator")
        assert_clean_error(late.run("login", "--token", foreign), 7, "fingerprint")


@pytest.mark.timeout(120)
def test_insecure_is_explicit_everywhere(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord", "--insecure") as coord:
        assert not (tmp_path / "coord" / "ca.pem").exists()
        assert "PLAINTEXT" in coord.log_tail()
        with AgentProc(coord.address, tmp_path / "agent", "--name", "plain", "--insecure") as agent:
            agent.wait_node_id()
            assert "--insecure" in agent.log_text()
            cli = Cli(coord.address, tmp_path / "cfg", role=None)
            result = cli.run("--insecure", "nodes", "--output", "json")
            assert result.code == 0, result.stderr
            assert [n["name"] for n in result.json()["nodes"]] == ["plain"]
            # Without --insecure the CLI will not talk plaintext.
            result = cli.run("nodes")
            assert result.code in (4, 7) and "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_an_agent_without_a_token_says_what_to_do(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        result = subprocess.run(
            [
                str(console_script("epochmesh-agent")),
                "--coordinator",
                coord.address,
                "--data-dir",
                str(tmp_path / "agent"),
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=50,
            env=cli_env(tmp_path),
        )
    assert result.returncode == 2
    assert "--token" in result.stderr and "--insecure" in result.stderr
