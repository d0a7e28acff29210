"""gRPC's own C-core log lines stay out of the coordinator's stderr unless --debug: a
plaintext client knocking on the TLS port makes the C core log a handshake failure
(``ssl_transport_security.cc ... WRONG_VERSION_NUMBER``), which the coordinator keeps only
with --debug or an explicit GRPC_VERBOSITY."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.procs import start_coordinator, wait_until

pytestmark = pytest.mark.timeout(120)

CORE_LINE = "ssl_transport_security"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    return {**env, **extra}


def _knock_in_plaintext(address: str) -> None:
    """A plaintext health check on the TLS port: the handshake fails on the server."""
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_handshake_failures_are_silent_without_debug(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "quiet", env=_env()) as coord:
        for _ in range(3):
            _knock_in_plaintext(coord.address)
        assert coord.terminate() == 0
    log = (tmp_path / "quiet" / "coordinator-stderr.log").read_text()
    assert CORE_LINE not in log, log[-3000:]


def test_debug_keeps_them(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "debug", "--debug", env=_env()) as coord:
        log = tmp_path / "debug" / "coordinator-stderr.log"

        def logged() -> bool:
            _knock_in_plaintext(coord.address)
            return CORE_LINE in log.read_text()

        wait_until(logged, timeout=30, interval=0.2, message="no gRPC handshake line with --debug")


def test_an_explicit_grpc_verbosity_is_honoured(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "explicit", env=_env(GRPC_VERBOSITY="INFO")) as coord:
        log = tmp_path / "explicit" / "coordinator-stderr.log"

        def logged() -> bool:
            _knock_in_plaintext(coord.address)
            return CORE_LINE in log.read_text()

        wait_until(logged, timeout=30, interval=0.2, message="GRPC_VERBOSITY=INFO was overridden")
