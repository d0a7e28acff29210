"""Helpers for the CLI system tests: run ``epochmesh`` as a subprocess against real processes.

Every CLI run gets an isolated environment: its own ``XDG_CONFIG_HOME`` (so a developer's
config file never leaks in), no ``EPOCHMESH_COORDINATOR`` unless given, no ``NO_COLOR``.

TLS: a `Cli` for a coordinator started by the test helpers logs in first, as an operator
unless told otherwise, through the real ``epochmesh login --token`` (the token from the real
``epochmesh-coordinator token create``), so its credentials live in its ``XDG_CONFIG_HOME``.
Agents get ``--token`` the same way.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from epochmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.procs import console_script, start_coordinator, sync_channel_for, token_for, wait_until

EPOCHMESH = str(console_script("epochmesh"))


def cli_env(config_home: Path, coordinator: str | None = None, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("EPOCHMESH_COORDINATOR", "NO_COLOR", "COLUMNS", "XDG_CONFIG_HOME")
    }
    env["XDG_CONFIG_HOME"] = str(config_home)
    env["PYTHONUNBUFFERED"] = "1"
    if coordinator:
        env["EPOCHMESH_COORDINATOR"] = coordinator
    env.update(extra)
    return env


_LOGGED_IN_HOMES: dict[str, Path] = {}


@atexit.register
def _remove_logged_in_homes() -> None:
    for home in _LOGGED_IN_HOMES.values():
        shutil.rmtree(home, ignore_errors=True)


def logged_in_env(address: str, role: str = "operator") -> dict[str, str]:
    """An environment for running ``epochmesh`` against a coordinator the test helpers started:
    its own XDG_CONFIG_HOME (one per address and role, made once) where ``epochmesh login``
    stored credentials, and EPOCHMESH_COORDINATOR set."""
    key = f"{address}/{role}"
    home = _LOGGED_IN_HOMES.get(key)
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="epochmesh-cli-"))
        Cli(address, home, role=role)
        _LOGGED_IN_HOMES[key] = home
    return cli_env(home, address)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.stdout)

    def json_lines(self) -> list[Any]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]


class Cli:
    """Runs ``epochmesh`` against one coordinator, with an isolated config dir."""

    def __init__(self, address: str, config_home: Path, role: str | None = "operator") -> None:
        self.address = address
        self.config_home = config_home
        config_home.mkdir(parents=True, exist_ok=True)
        if role is not None and not self.logged_in():
            self.login(role)

    def logged_in(self) -> bool:
        return (self.config_home / "epochmesh" / "credentials" / "cert.pem").exists()

    def login(self, role: str = "operator") -> CliResult | None:
        """``epochmesh login`` with a fresh token of ``role`` (None: the coordinator is not one
        the helpers started, or runs --insecure)."""
        token = token_for(self.address, role)
        if token is None:
            return None
        result = self.run("login", "--token", token)
        if result.code != 0:
            raise RuntimeError(f"epochmesh login failed: {result.stderr}")
        return result

    def env(self, **extra: str) -> dict[str, str]:
        return cli_env(self.config_home, self.address, **extra)

    def run(
        self,
        *args: str,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> CliResult:
        t0 = time.monotonic()
        proc = subprocess.run(
            [EPOCHMESH, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env() if env is None else env,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [EPOCHMESH, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env() if env is None else env,
        )


def assert_clean_error(result: CliResult, code: int, *needles: str) -> None:
    """A failed run: the documented code, an ``error:`` line (+ optional hint), no traceback."""
    assert result.code == code, (result.code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert all(line.startswith(("error: ", "hint: ")) for line in lines), result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert result.stdout == "", result.stdout


class LineReader:
    """Reads a subprocess pipe line by line in a thread, so a test can wait with a deadline."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # end of stream

    def next_line(self, timeout: float) -> str:
        """The next line ("" at end of stream); TimeoutError when none comes in time."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output line within {timeout}s") from None


class AgentProc:
    """One ``epochmesh-agent`` subprocess."""

    def __init__(self, coordinator: str, data_dir: Path, name: str, *extra: str) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        if not (data_dir / "cert.pem").exists() and "--insecure" not in extra:
            token = token_for(coordinator, "node")
            if token:
                extra = (*extra, "--token", token)
        self.name = name
        self.log_path = data_dir / "agent.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                str(console_script("epochmesh-agent")),
                "--coordinator",
                coordinator,
                "--data-dir",
                str(data_dir),
                "--name",
                name,
                "--device",
                "cpu",
                "--benchmark",
                "quick",
                "--threads",
                "1",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")


def list_nodes(address: str) -> list[common_pb2.NodeInfo]:
    with sync_channel_for(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            return list(stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=5).nodes)
        except grpc.RpcError:
            return []


def wait_for_nodes(
    address: str,
    names: Sequence[str],
    timeout: float = 60.0,
    agents: Sequence[AgentProc] = (),
) -> None:
    """Waits until every named node is ONLINE; fails at once when one of ``agents`` died."""

    def ready() -> bool:
        for agent in agents:
            if agent.proc.poll() is not None:
                raise RuntimeError(
                    f"agent {agent.name} exited with {agent.proc.returncode}\n{agent.log_tail()}"
                )
        live = {n.name for n in list_nodes(address) if n.state == common_pb2.NODE_STATE_ONLINE}
        return set(names) <= live

    wait_until(ready, timeout=timeout, interval=0.1, message=f"agents {names} did not register")


@dataclass
class Cluster:
    address: str
    data_dir: Path
    cli: Cli
    agents: list[AgentProc]


@pytest.fixture(name="cluster", scope="module")
def cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A coordinator subprocess with two CPU agents ("alpha", "beta"), shared by a module."""
    root = tmp_path_factory.mktemp("cli-cluster")
    coord = start_coordinator(root / "coordinator", "--heartbeat-interval", "0.5")
    agents: list[AgentProc] = []
    try:
        for name in ("alpha", "beta"):
            agents.append(AgentProc(coord.address, root / name, name))
        try:
            wait_for_nodes(coord.address, ["alpha", "beta"], agents=agents)
        except TimeoutError:
            tails = "\n".join(f"--- {a.name}\n{a.log_tail()}" for a in agents)
            raise RuntimeError(f"agents did not register\n{tails}") from None
        yield Cluster(coord.address, root, Cli(coord.address, root / "config"), agents)
    finally:
        for agent in agents:
            agent.stop()
        coord.kill9()


def engine_available() -> bool:
    """Whether ``epochmesh-coordinator`` runs with the training engine (not NullEngine)."""
    try:
        from coordinator.main import default_engine_factory

        return default_engine_factory() is not None
    except Exception:  # noqa: BLE001 - an engine mid-way through being written counts as absent
        return False
