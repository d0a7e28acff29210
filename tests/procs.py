"""Launch and control coordinators for tests: real subprocesses through the console script,
or an in-process `Coordinator` for fast integration tests.

Public helpers:
- ``free_port()``: a TCP port free on 127.0.0.1 right now.
- ``wait_until(pred, timeout, interval)`` / ``async_wait_until(...)``: poll with a deadline.
- ``start_coordinator(data_dir, *extra_args, env=None)`` -> ``CoordinatorProc``: runs
  ``epochmesh-coordinator --data-dir DATA_DIR --listen 127.0.0.1:0 EXTRA_ARGS`` and waits for
  ``DATA_DIR/coordinator.addr`` and a SERVING health check (``--listen HOST:PORT`` in
  EXTRA_ARGS wins, for a fixed port).
- ``in_process_coordinator(data_dir, **config_overrides)``: async context manager yielding a
  started in-process ``coordinator.app.Coordinator``.

TLS is on in every test, transparently: each coordinator the helpers start has its own CA
(made on its first start in its data dir) and is remembered by address, so that
- ``identity_for(address, role)`` gives a certificate of that role (subprocess coordinators:
  through the coordinator's ``token create`` (in this process) + enrollment; in-process ones:
  issued by the coordinator's CA), cached per coordinator and role;
- ``sync_channel_for(address, role="operator")`` / ``aio_channel_for(...)`` open channels
  with it (plaintext when the coordinator runs ``--insecure``);
- ``token_for(address, role)`` creates a join token (AgentProc uses it for ``--token``);
- ``health_status`` speaks TLS to a known TLS coordinator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epochmesh.export_cache import ENV_CACHE_DIR
from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.identity import (
    ROLE_OPERATOR,
    Identity,
    channel_credentials,
    coordinator_channel_options,
    enroll_with_token,
    identity_credentials,
)

if TYPE_CHECKING:
    from coordinator.app import Coordinator

ADDR_FILE = "coordinator.addr"
STDERR_LOG = "coordinator-stderr.log"
# Coordinator arguments for tests in which no agent dies, hangs or is cut off: the default
# heartbeat (2 s; tasks come through NextTask, not heartbeats), so that a loaded host delaying
# an agent's heartbeat by a second or two neither makes its part of a round "silent" (1.5
# intervals) nor lapses its lease (6 s), which would fail the part or cancel its benchmark
# and make it register again: work redone, or a job failed by the race of a node going
# OFFLINE while it is being given the job.
STEADY_LEASES = ("--heartbeat-interval", "2", "--lease-ttl", "6")


def shared_check_cache() -> Path | None:
    """The program checks' verdicts shared by every coordinator of this test run (in the run's
    export cache, tests/conftest.py), or None outside a pytest run. Each distinct program is
    checked once per run instead of once per coordinator (2-3 CPU-seconds each): a test that
    counts checks, or makes the check's child misbehave, gives its coordinator its own."""
    root = os.environ.get(ENV_CACHE_DIR)
    return Path(root) / "program-checks" if root else None


def shared_check_args(extra_args: Sequence[str]) -> list[str]:
    """The arguments that give a coordinator process the run's shared verdicts (unless
    ``extra_args`` names its own) and no spare check child (started after a first check and
    kept for the next one: a second torch import per coordinator that most tests never use)."""
    args: list[str] = []
    shared = shared_check_cache()
    if shared is not None and "--program-check-cache" not in extra_args:
        args += ["--program-check-cache", str(shared)]
    if "--no-program-check-spare" not in extra_args:
        args.append("--no-program-check-spare")
    return args


def free_port() -> int:
    """A port that is free on 127.0.0.1 at the time of the call (racy by nature: prefer
    ``--listen 127.0.0.1:0`` and reading the bound address where a program supports it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    pred: Callable[[], object],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "",
) -> object:
    """Call ``pred`` until it returns something truthy (returned) or ``timeout`` seconds pass
    (raises TimeoutError). Exceptions raised by ``pred`` propagate."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(message or f"condition not met within {timeout:.1f}s")
        time.sleep(interval)


async def async_wait_until(
    pred: Callable[[], object | Awaitable[object]],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "",
) -> object:
    """Async ``wait_until``; ``pred`` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(message or f"condition not met within {timeout:.1f}s")
        await asyncio.sleep(interval)


def console_script(name: str) -> Path:
    """Path of a console script installed in the running interpreter's venv."""
    return Path(sys.executable).parent / name


# -- trust plumbing -----------------------------------------------------------------------------


class _Trust:
    """What the helpers know about one coordinator they started: how to get credentials."""

    def __init__(
        self,
        data_dir: Path,
        insecure: bool,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.insecure = insecure
        self.coordinator = coordinator
        self.identities: dict[str, Identity] = {}

    def ca_pem(self) -> bytes | None:
        if self.insecure:
            return None
        try:
            return (self.data_dir / "ca.pem").read_bytes()
        except FileNotFoundError:
            return None

    def token(self, role: str, *extra: str) -> str:
        return create_token(self.data_dir, role, *extra)

    def identity(self, address: str, role: str) -> Identity | None:
        if self.insecure:
            return None
        if role not in self.identities:
            if self.coordinator is not None:
                self.identities[role] = self.coordinator.issue_identity(role)
            else:
                self.identities[role] = enroll_with_token(address, self.token(role))
        return self.identities[role]


_TRUST: dict[str, _Trust] = {}


def _remember(address: str, trust: _Trust) -> None:
    _TRUST[address] = trust


def trust_of(address: str) -> _Trust | None:
    return _TRUST.get(address)


def create_token(data_dir: Path | str, role: str, *extra: str) -> str:
    """A join token from the coordinator's ``token create`` on ``data_dir`` (``extra``: e.g.
    "--ttl", "1s", "--reusable"): its own parser and code (``EPOCHMESH_STORE`` included), run
    in this process, in a thread of its own (it runs an event loop, also when called from a
    test's). A console-script start per token cost ~0.3 s, some 250 times a suite; the console
    script itself is run by tests/system/test_trust_hardening.py and test_readme_manual.py."""
    from coordinator.main import build_parser, run_token

    argv = ["token", "create", "--data-dir", str(data_dir), "--role", role, *extra]
    args = build_parser().parse_args(argv)
    out = io.StringIO()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="token-create") as pool:
        code = pool.submit(run_token, args, out).result(timeout=60)
    if code != 0:
        raise RuntimeError(f"token create failed ({code}): its error is in the test's log")
    return out.getvalue().strip()


def token_for(address: str, role: str = "node", *extra: str) -> str | None:
    """A join token of the coordinator the helpers started at ``address`` (None: unknown or
    --insecure)."""
    trust = _TRUST.get(address)
    if trust is None or trust.insecure:
        return None
    return trust.token(role, *extra)


def identity_for(address: str, role: str = ROLE_OPERATOR) -> Identity | None:
    """A certificate of ``role`` for the coordinator at ``address`` (None: unknown/insecure)."""
    trust = _TRUST.get(address)
    return None if trust is None else trust.identity(address, role)


def sync_channel_for(
    address: str, role: str = ROLE_OPERATOR, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to a coordinator the helpers started, as ``role``."""
    identity = identity_for(address, role)
    if identity is None:
        return grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, *options])
    return grpc.secure_channel(
        address,
        identity_credentials(identity),
        options=[*coordinator_channel_options(), *options],
    )


def aio_channel_for(
    address: str, role: str = ROLE_OPERATOR, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a coordinator the helpers started, as ``role``."""
    identity = identity_for(address, role)
    if identity is None:
        return grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *options])
    return grpc.aio.secure_channel(
        address,
        identity_credentials(identity),
        options=[*coordinator_channel_options(), *options],
    )


def health_status(address: str, service: str = "", timeout: float = 1.0) -> str | None:
    """The grpc.health.v1 status name of ``service`` at ``address`` ("SERVING", ...), or None if
    the server cannot be reached. TLS (no client certificate) for a known TLS coordinator."""
    trust = _TRUST.get(address)
    ca = trust.ca_pem() if trust is not None else None
    channel = (
        grpc.secure_channel(address, channel_credentials(ca), options=coordinator_channel_options())
        if ca is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


class CoordinatorProc:
    """A coordinator running as a subprocess of the test."""

    def __init__(
        self,
        data_dir: Path,
        extra_args: Sequence[str],
        env: dict[str, str] | None,
        start_timeout: float,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.extra_args = list(extra_args)
        self.env = env
        self.start_timeout = start_timeout
        self.log_path = self.data_dir / STDERR_LOG
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> CoordinatorProc:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"coordinator already running (pid {self.proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        addr_file = self.data_dir / ADDR_FILE
        addr_file.unlink(missing_ok=True)  # a kill -9 leaves a stale one behind
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [
            str(console_script("epochmesh-coordinator")),
            "--data-dir",
            str(self.data_dir),
            "--listen",
            "127.0.0.1:0",
            *shared_check_args(self.extra_args),
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self.address = ""
        try:
            wait_until(
                self._started,
                timeout=self.start_timeout,
                interval=0.05,
                message=f"coordinator did not start within {self.start_timeout}s",
            )
        except BaseException as exc:
            self.kill9()
            raise RuntimeError(f"{exc}\n--- log tail ---\n{self.log_tail()}") from exc
        return self

    def _started(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"coordinator exited with {self.proc.returncode} during start\n"
                f"--- log tail ---\n{self.log_tail()}"
            )
        addr_file = self.data_dir / ADDR_FILE
        if not self.address:
            try:
                text = addr_file.read_text().strip()
            except FileNotFoundError:
                return False
            if not text:
                return False
            self.address = text
            _remember(text, _Trust(self.data_dir, self.insecure))
        return health_status(self.address, timeout=0.5) == "SERVING"

    @property
    def insecure(self) -> bool:
        return "--insecure" in self.extra_args

    def create_token(self, role: str, *extra: str) -> str:
        """A join token through the coordinator's ``token create`` (`create_token`)."""
        return create_token(self.data_dir, role, *extra)

    def identity(self, role: str = ROLE_OPERATOR) -> Identity | None:
        return identity_for(self.address, role)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL the coordinator and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait up to ``timeout`` seconds for exit (SIGKILL after that), and return the
        exit status (negative: killed by that signal)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return int(self.proc.returncode)

    def restart(self) -> CoordinatorProc:
        """Start again on the same data dir (a new port). A running coordinator is first
        terminated gracefully."""
        if self.running():
            self.terminate()
        return self.start()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> CoordinatorProc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running():
            self.kill9()


def start_coordinator(
    data_dir: Path | str,
    *extra_args: str,
    env: dict[str, str] | None = None,
    timeout: float = 90.0,
) -> CoordinatorProc:
    """Launch ``epochmesh-coordinator`` on 127.0.0.1 with an ephemeral port and wait until it
    serves (within ``timeout``: generous, as a start that takes 2 s on an idle machine has been
    seen to take over 30 s on a loaded one; it returns as soon as it serves). Its stdout+stderr
    go to ``DATA_DIR/coordinator-stderr.log``. Use it as a context manager (or call
    ``kill9``/``terminate``) so that it does not outlive the test."""
    return CoordinatorProc(Path(data_dir), extra_args, env, timeout).start()


@contextlib.asynccontextmanager
async def in_process_coordinator(
    data_dir: Path | str, engine_factory: Any = None, **overrides: Any
) -> AsyncIterator[Coordinator]:
    """A started in-process Coordinator on 127.0.0.1:0; ``overrides`` are CoordinatorConfig
    fields (e.g. heartbeat_interval_s=0.2, lease_ttl_s=0.6). Stopped on exit."""
    from coordinator.app import Coordinator
    from coordinator.core.config import CoordinatorConfig

    overrides.setdefault("listen", "127.0.0.1:0")
    overrides.setdefault("shutdown_grace_s", 1.0)
    overrides.setdefault("program_check_spare", False)
    shared = shared_check_cache()
    if shared is not None:
        overrides.setdefault("program_check_cache_root", shared)
    config = CoordinatorConfig(data_dir=Path(data_dir), **overrides)
    coord = Coordinator(config, engine_factory=engine_factory)
    await coord.start()
    _remember(coord.address, _Trust(config.data_dir, config.insecure, coord))
    try:
        yield coord
    finally:
        await coord.stop()
