"""Clients given several coordinator addresses find the serving one and follow it.

Real processes: coordinators (``epochmesh-coordinator``), an agent (``epochmesh-agent``), the
``epochmesh`` CLI; and a standby stand-in: a real gRPC server on a loopback port that keeps the
standby's contract (grpc.health.v1 NOT_SERVING, every other call UNAVAILABLE with the active
coordinator's address in the ``epochmesh-active`` trailing metadata), so the clients' side is
tested apart from the coordinators' takeover.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epochmesh.coordinators import ACTIVE_METADATA_KEY
from tests.procs import free_port, start_coordinator, token_for, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli, CliResult, assert_clean_error, cli_env

pytestmark = pytest.mark.timeout(240)


class _Unavailable(grpc.GenericRpcHandler):
    def __init__(self, active: str) -> None:
        self.active = active

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.set_trailing_metadata(((ACTIVE_METADATA_KEY, self.active),))
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"standby coordinator; the active coordinator is at {self.active}",
            )
            return b""

        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture
def standby() -> Iterator[str]:
    """A standby stand-in (plaintext) naming 127.0.0.1:1 as the active coordinator."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_Unavailable("127.0.0.1:1"),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def _run(home: Path, *args: str, coordinator: str | None = None) -> CliResult:
    cli = Cli("unused", home, role=None)
    return cli.run(*args, env=cli_env(home, coordinator))


def test_the_cli_talks_to_the_serving_coordinator_among_several(
    tmp_path: Path, standby: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with start_coordinator(tmp_path / "coord", "--insecure") as coord:
        home = tmp_path / "cli"
        listed = f"{dead},{standby},{coord.address}"
        # --coordinator, then the environment variable: a dead address and a standby first.
        ok = _run(home, "--insecure", "--coordinator", listed, "--output", "json", "stats")
        assert ok.code == 0, ok.stderr
        assert ok.json() is not None
        ok = _run(home, "--insecure", "--output", "json", "stats", coordinator=listed)
        assert ok.code == 0, ok.stderr
        # The config file may hold the list too.
        (home / "epochmesh").mkdir(parents=True, exist_ok=True)
        (home / "epochmesh" / "config.toml").write_text(f'coordinator = "{listed}"\n')
        ok = _run(home, "--insecure", "nodes")
        assert ok.code == 0, ok.stderr
        # No serving coordinator: one error naming every address's answer, exit 4.
        none = _run(home, "--insecure", "--coordinator", f"{dead},{standby}", "nodes")
        assert_clean_error(none, 4, "no active coordinator among", f"{standby} standby", dead)
        # A malformed list is a usage error naming the bad address.
        bad = _run(home, "--insecure", "--coordinator", f"{coord.address},nope", "nodes")
        assert_clean_error(bad, 2, "bad coordinator address 'nope'")


def test_login_with_several_addresses_enrolls_with_the_reachable_one_and_keeps_them_all(
    tmp_path: Path,
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with start_coordinator(tmp_path / "coord") as coord:
        token = token_for(coord.address, "operator")
        assert token is not None
        home = tmp_path / "cli"
        listed = f"{dead},{coord.address}"
        login = _run(home, "--coordinator", listed, "--output", "json", "login", "--token", token)
        assert login.code == 0, login.stderr
        assert json.loads(login.stdout)["coordinator"] == coord.address
        config = (home / "epochmesh" / "config.toml").read_text()
        assert listed in config
        # Later commands read the list from the config file and find the live one.
        ok = _run(home, "nodes")
        assert ok.code == 0, ok.stderr


def test_an_agent_skips_a_standby_and_follows_the_serving_coordinator_after_a_kill9(
    tmp_path: Path, standby: str
) -> None:
    with (
        start_coordinator(tmp_path / "a", "--insecure") as first,
        start_coordinator(tmp_path / "b", "--insecure") as second,
    ):
        listed = f"{standby},{first.address},{second.address}"
        with AgentProc(listed, tmp_path / "agent", "--insecure") as agent:
            agent.wait_node_id(timeout=120)
            # Both serve (two independent coordinators): the agent takes the first to answer.
            coordinators = (first, second)

            def serving_one() -> int | None:
                counts = [len(list_nodes(c.address)) for c in coordinators]
                return counts.index(1) if sorted(counts) == [0, 1] else None

            chosen = wait_until(
                lambda: serving_one() is not None,
                timeout=120,
                message=f"the agent never registered with a serving coordinator\n{agent}",
            )
            assert chosen
            on = coordinators[serving_one() or 0]
            other = second if on is first else first
            on.kill9()
            wait_until(
                lambda: len(list_nodes(other.address)) == 1,
                timeout=120,
                message=f"the agent did not move to the other coordinator\n{agent}",
            )
            assert agent.running()
            log = agent.log_text()
            assert f"coordinator moved: {other.address} serves now" in log, log[-3000:]
