"""The CLI's rough edges a new user meets, through the real ``epochmesh`` console script against
real coordinators (TLS and --insecure):

- accounts and tenants are resolved from a unique prefix; unknown ones are refused (exit 3),
  by the CLI and by the coordinator itself (NOT_FOUND naming the account), unless --create;
- a piped table cuts nothing; on a terminal (a real pty) the REASON column wraps, whole;
- the shared options (--output, --coordinator, --debug, ...) go before or after the command;
- gRPC's own log lines stay off stderr unless --debug, and a TLS/plaintext mismatch gets a
  hint that says so (both directions);
- refusals by role are in the user's words;
- a revoked node shows as revoked, not cordoned.
"""

from __future__ import annotations

import os
import pty
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from epochmesh.v1 import market_pb2, market_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.procs import CoordinatorProc, start_coordinator, sync_channel_for
from tests.system.test_cli_queue import whoami
from tests.system.test_cli_support import (
    EPOCHMESH,
    AgentProc,
    Cli,
    assert_clean_error,
    cli_env,
    wait_for_nodes,
)

pytestmark = pytest.mark.timeout(180)


@dataclass
class Site:
    coord: CoordinatorProc
    op: Cli
    alice: Cli
    alice_id: str
    tmp: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("rough")
    with start_coordinator(tmp / "coordinator") as coord:
        op = Cli(coord.address, tmp / "op")
        alice = Cli(coord.address, tmp / "alice", role="submitter")
        yield Site(coord, op, alice, whoami(alice), tmp)


# -- accounts and tenants -------------------------------------------------------------------------


def test_a_truncated_id_resolves_and_unknown_accounts_are_refused(site: Site) -> None:
    s = site
    prefix = s.alice_id[:-2]  # u-62b3dc18 of u-62b3dc18ab
    granted = s.op.run("credits", "grant", prefix, "1")
    assert granted.code == 0, granted.stderr
    assert f"to tenant:{s.alice_id}:" in granted.stdout
    granted = s.op.run("credits", "grant", f"tenant:{prefix}", "1", "--output", "json")
    assert granted.code == 0 and granted.json()["to"] == f"tenant:{s.alice_id}"

    for ref in ("foo", "u-nobody", "tenant:u-0000000000", "donor:nobody"):
        result = s.op.run("credits", "grant", ref, "1")
        assert_clean_error(result, 3, f"unknown account {ref!r}", "--create")
    near = s.op.run("credits", "grant", s.alice_id[:-1] + "x", "1")
    assert_clean_error(near, 3, f"did you mean tenant:{s.alice_id}?")

    assert_clean_error(
        s.op.run("tenant", "set", "u-nobody", "--weight", "3"), 3, "unknown tenant 'u-nobody'"
    )
    weighted = s.op.run("tenant", "set", prefix, "--weight", "3")
    assert weighted.code == 0, weighted.stderr
    assert weighted.stdout.strip() == f"tenant {s.alice_id} weight 3"

    # Nothing was opened by the refusals.
    known = s.op.run("balance", "--all", "--known", "--output", "json")
    assert known.code == 0, known.stderr
    accounts = {b["account"] for b in known.json()["balances"]}
    assert f"tenant:{s.alice_id}" in accounts
    assert not {"tenant:foo", "tenant:u-nobody", "donor:nobody"} & accounts


def test_create_opens_an_account_on_purpose(site: Site) -> None:
    s = site
    made = s.op.run("credits", "grant", "tenant:u-future0001", "2", "--create")
    assert made.code == 0, made.stderr
    assert "to tenant:u-future0001:" in made.stdout
    # Now it exists: a prefix finds it, no --create needed.
    again = s.op.run("credits", "grant", "u-future", "1")
    assert again.code == 0 and "balance 3" in again.stdout, again.stderr
    weighted = s.op.run("tenant", "set", "u-later", "--weight", "2", "--create")
    assert weighted.code == 0 and "tenant u-later weight 2" in weighted.stdout, weighted.stderr


def test_the_coordinator_refuses_unknown_accounts_from_any_client(site: Site) -> None:
    with sync_channel_for(site.coord.address) as channel:
        market = market_pb2_grpc.MarketServiceStub(channel)
        sched = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            market.GrantCredits(
                market_pb2.GrantCreditsRequest(account="u-62b3dc18", amount_micro=1), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "tenant:u-62b3dc18" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            sched.SetTenantWeight(
                scheduler_pb2.SetTenantWeightRequest(tenant="u-nobody", weight=3), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "u-nobody" in (caught.value.details() or "")
        # Asked to create: it does, and the service kept serving.
        reply = market.GrantCredits(
            market_pb2.GrantCreditsRequest(account="u-62b3dc18", amount_micro=1, create=True),
            timeout=10,
        )
        assert reply.entry.to_account == "tenant:u-62b3dc18"


# -- tables -------------------------------------------------------------------------------------


def _reasons(site: Site) -> list[str]:
    result = site.op.run("statement", f"tenant:{site.alice_id}", "--output", "json")
    assert result.code == 0, result.stderr
    return [e["reason"] for e in result.json()["entries"]]


def test_a_piped_table_is_whole(site: Site) -> None:
    s = site
    assert s.op.run("credits", "grant", s.alice_id, "1").code == 0
    reasons = _reasons(s)
    piped = s.op.run("statement", f"tenant:{s.alice_id}", env=s.op.env(NO_COLOR="1"))
    assert piped.code == 0, piped.stderr
    assert "..." not in piped.stdout
    lines = piped.stdout.splitlines()
    assert max(len(line) for line in lines) > 80  # wider than a terminal: nothing was cut
    for line, reason in zip(lines[1:], reasons, strict=True):
        assert line.endswith(reason), (line, reason)


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """stdout of ``epochmesh ARGS`` run on a real pseudo-terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [EPOCHMESH, *args], stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    )
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_on_a_terminal_the_reason_wraps_whole(site: Site) -> None:
    s = site
    assert s.op.run("credits", "grant", s.alice_id, "1").code == 0
    reasons = _reasons(s)
    out = _on_a_terminal(
        ["statement", f"tenant:{s.alice_id}"], s.op.env(NO_COLOR="1", COLUMNS="100")
    )
    lines = out.splitlines()
    assert lines and all(len(line) <= 100 for line in lines), out
    assert "..." not in out
    start = lines[0].index("REASON")
    column = " ".join(line[start:].strip() for line in lines[1:])
    assert column.split() == " ".join(reasons).split(), out
    assert len(lines) > len(reasons) + 1  # some reason took a continuation line


# -- shared options -------------------------------------------------------------------------------


def test_shared_options_go_before_or_after_the_command(site: Site) -> None:
    s = site
    env = cli_env(s.op.config_home)  # no EPOCHMESH_COORDINATOR: --coordinator must work
    for args in (
        ("--output", "json", "status"),
        ("status", "--output", "json"),
        ("--coordinator", s.coord.address, "--output", "json", "balance", "--all"),
        ("--debug", "--output", "json", "credits", "grant", s.alice_id, "1"),
        ("credits", "--output", "json", "grant", s.alice_id, "1", "--debug"),
    ):
        full = args if "--coordinator" in args else ("--coordinator", s.coord.address, *args)
        result = s.op.run(*full, env=env)
        assert result.code == 0, (args, result.stderr)
        assert isinstance(result.json(), dict), args


# -- gRPC's logs and TLS mismatches ---------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProc]:
    with start_coordinator(tmp_path_factory.mktemp("plain"), "--insecure") as coord:
        yield coord


def test_a_tls_cli_against_a_plaintext_coordinator(site: Site, plain: CoordinatorProc) -> None:
    # Logged in (TLS, with credentials): gRPC would log its handshake failure.
    result = site.op.run("status", env=cli_env(site.op.config_home, plain.address))
    assert_clean_error(result, 4, f"the coordinator at {plain.address} speaks plaintext")
    assert "pass --insecure" in result.stderr
    assert "start it with" not in result.stderr
    assert "ssl_transport_security" not in result.stderr
    # Not logged in at all: the same diagnosis.
    nobody = Cli(plain.address, site.tmp / "nobody", role=None)
    assert_clean_error(nobody.run("nodes"), 4, "speaks plaintext", "pass --insecure")
    # With --debug the traceback is shown and gRPC's own logging is left at its default (whether
    # C-core logs the failed handshake before the CLI exits is up to its timing; a user's
    # GRPC_VERBOSITY, below, makes it log for sure).
    debug = site.op.run("status", "--debug", env=cli_env(site.op.config_home, plain.address))
    assert debug.code == 4 and "Traceback" in debug.stderr, debug.stderr


def test_an_insecure_cli_against_a_tls_coordinator(site: Site, plain: CoordinatorProc) -> None:
    result = site.op.run("--insecure", "status")
    assert_clean_error(
        result,
        4,
        f"the coordinator at {site.coord.address} speaks TLS",
        "epochmesh login --token",
        "drop --insecure",
    )
    assert "start it with" not in result.stderr
    # The plaintext coordinator itself answers an --insecure CLI.
    ok = site.op.run("--insecure", "status", env=cli_env(site.op.config_home, plain.address))
    assert ok.code == 0, ok.stderr


def test_a_users_grpc_verbosity_is_kept(site: Site, plain: CoordinatorProc) -> None:
    env = cli_env(site.op.config_home, plain.address, GRPC_VERBOSITY="DEBUG")
    result = site.op.run("status", env=env)
    assert result.code == 4 and "ssl_transport_security" in result.stderr, result.stderr


# -- refusals in the user's words ----------------------------------------------------------------


def test_refusals_by_role_say_what_and_who(site: Site) -> None:
    a = site.alice
    for args, phrase in (
        (("tenant", "list"), "only operators can see the whole queue"),
        (("credits", "grant", site.alice_id, "1"), "only operators can grant credits"),
        (("events",), "only operators can see the cluster's events"),
        (("tenant", "set", site.alice_id, "--weight", "2"), "only operators can set a tenant's"),
    ):
        result = a.run(*args)
        assert_clean_error(result, 7, phrase, "(you are logged in as a submitter")
        assert "not allowed for role" not in result.stderr


# -- states ---------------------------------------------------------------------------------------


def test_a_revoked_node_shows_as_revoked(site: Site) -> None:
    agent = AgentProc(site.coord.address, site.tmp / "gamma", "gamma")
    try:
        wait_for_nodes(site.coord.address, ["gamma"], agents=[agent])
        revoked = site.op.run("revoke", "gamma")
        assert revoked.code == 0, revoked.stderr
        # At once (the coordinator also cordons it; later its lease lapses: still revoked).
        table = site.op.run("nodes", env=site.op.env(NO_COLOR="1"))
        row = next(line for line in table.stdout.splitlines() if " gamma " in line)
        assert row.split()[2] == "revoked", table.stdout
        nodes = site.op.run("nodes", "--output", "json")
        (gamma,) = [n for n in nodes.json()["nodes"] if n["name"] == "gamma"]
        assert gamma["revoked"] is True
    finally:
        agent.stop()
