"""A coordinator and agents as real processes on this machine: `epochmesh-coordinator dev`,
the demo and the benchmark scripts.

TLS is on, as in production: the coordinator makes its CA on first start, every agent enrolls
with its own single-use node token from `epochmesh-coordinator token create`, and the CLI is
logged in (`epochmesh login --token`, an operator token) under a private XDG_CONFIG_HOME.

    with LocalCluster(work_dir) as cluster:
        cluster.start_coordinator("--split", "equal")
        cluster.start_agent("fast", "--slowdown", "1")
        cluster.start_agent("far", coordinator=relay_address)  # e.g. through a WanLink
        cluster.login()
        print(cluster.cli("nodes"))

Every process started is stopped when the block ends: the agents first (SIGTERM: they finish
their task and leave), then the coordinator, each SIGKILLed if it has not exited 15 s later.

Processes are started through the console scripts only (never imported): this module is the
coordinator's, but the agents and the CLI it runs are separate programs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

BIN = Path(sys.executable).parent
if not (BIN / "epochmesh-coordinator").exists():  # console scripts elsewhere (a system python)
    _found = shutil.which("epochmesh-coordinator")
    if _found:
        BIN = Path(_found).parent
T = TypeVar("T")

# How long a stopped process gets to exit before SIGKILL.
STOP_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    pass


def wait_for(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise ClusterError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(interval)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the process that started it dies (Linux), so that
    a cluster killed with SIGKILL leaves no agent behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class LocalCluster:
    def __init__(self, work: Path, *, die_with_parent: bool = False) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.coord_dir = self.work / "coordinator"
        self.cli_config = self.work / "cli-config"
        self.address = ""
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.env = dict(os.environ, XDG_CONFIG_HOME=str(self.cli_config))
        self._die_with_parent = die_with_parent

    def _start(
        self,
        cmd: list[str],
        log_path: Path,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` in its own session, output to `log_path`; `cpus`: the CPUs it may run on
        (every thread it will have inherits them); `env`: variables added to this process's."""
        die_with_parent = self._die_with_parent

        def prepare() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if die_with_parent:
                _die_with_parent()

        with open(log_path, "ab") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=prepare if cpus is not None or die_with_parent else None,
                env=None if env is None else dict(os.environ, **env),
            )
        self.procs.append(proc)
        return proc

    def start_coordinator(
        self, *args: str, cpus: set[int] | None = None, listen: str = "127.0.0.1:0"
    ) -> str:
        self.coord_dir.mkdir(parents=True, exist_ok=True)
        addr_file = self.coord_dir / "coordinator.addr"
        addr_file.unlink(missing_ok=True)
        self.logs["coordinator"] = self.work / "coordinator.log"
        proc = self._start(
            [
                str(BIN / "epochmesh-coordinator"),
                "--data-dir",
                str(self.coord_dir),
                "--listen",
                listen,
                *args,
            ],
            self.logs["coordinator"],
            cpus,
        )
        self.coordinator = proc

        def started() -> str:
            if proc.poll() is not None:
                raise ClusterError(
                    f"the coordinator exited with {proc.returncode} (log: {self.logs['coordinator']})"
                )
            return addr_file.read_text().strip() if addr_file.exists() else ""

        self.address = wait_for(started, 60, "the coordinator's start")
        return self.address

    def http_address(self, timeout: float = 10.0) -> str:
        """The dashboard's HOST:PORT (the coordinator writes it once it serves HTTP)."""
        path = self.coord_dir / "http.addr"
        return wait_for(
            lambda: path.read_text().strip() if path.exists() else "",
            timeout,
            "the dashboard's start",
        )

    def token(self, role: str) -> str:
        out = subprocess.run(
            [
                str(BIN / "epochmesh-coordinator"),
                "token",
                "create",
                "--data-dir",
                str(self.coord_dir),
                "--role",
                role,
                "--ttl",
                "2h",
                "--log-level",
                "WARNING",
            ],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            raise ClusterError(f"token create failed: {out.stderr.strip()}")
        return out.stdout.strip()

    def start_agent(
        self,
        name: str,
        *args: str,
        coordinator: str | None = None,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """An enrolled agent named `name`; it dials `coordinator` (default: the coordinator's
        own address; give a relay's address to put the agent behind an emulated link); `cpus`:
        the CPUs it may run on (None: any)."""
        self.logs[name] = self.work / f"agent-{name}.log"
        proc = self._start(
            [
                str(BIN / "epochmesh-agent"),
                "--coordinator",
                coordinator or self.address,
                "--data-dir",
                str(self.work / f"agent-{name}"),
                "--name",
                name,
                "--threads",
                "1",
                "--benchmark",
                "quick",
                "--token",
                self.token("node"),
                *args,
            ],
            self.logs[name],
            cpus,
            env,
        )
        self.agents[name] = proc
        return proc

    def login(self) -> str:
        return self.cli("login", "--token", self.token("operator"))

    def operator_channel(self) -> grpc.Channel:
        """A blocking TLS channel to the coordinator as a freshly enrolled operator, for
        scripts that poll the coordinator often (a CLI process per poll costs CPU)."""
        import grpc

        from epochmesh.identity import (
            coordinator_channel_options,
            enroll_with_token,
            identity_credentials,
        )

        identity = enroll_with_token(self.address, self.token("operator"))
        return grpc.secure_channel(
            self.address, identity_credentials(identity), options=coordinator_channel_options()
        )

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [str(BIN / "epochmesh"), "--coordinator", self.address, *args],
            capture_output=True,
            text=True,
            check=False,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            raise ClusterError(f"epochmesh {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def run_cli(self, *args: str) -> int:
        """The CLI with its output on this terminal (e.g. `submit --watch`); its exit code."""
        cmd = [str(BIN / "epochmesh"), "--coordinator", self.address, *args]
        return subprocess.run(cmd, env=self.env, check=False).returncode

    def exited(self) -> list[str]:
        """Names of the processes ("coordinator" or an agent's name) that have exited."""
        gone = [name for name, p in self.agents.items() if p.poll() is not None]
        if self.coordinator is not None and self.coordinator.poll() is not None:
            gone.insert(0, "coordinator")
        return gone

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the agents, then the rest (the coordinator); SIGKILL what is left after
        `grace` seconds at each step."""
        agents = [p for p in self.procs if p in self.agents.values()]
        others = [p for p in self.procs if p not in agents]
        for group in (agents, others):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()

    def kill(self) -> None:
        """SIGKILL every process still running (a second Ctrl-C)."""
        for p in list(self.procs):
            if p.poll() is None:
                p.kill()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- epochmesh-coordinator dev ------------------------------------------------------------------


def _command_name(name: str) -> str:
    """`name` when the shell finds this installation's console script under it, else its
    full path."""
    found = shutil.which(name)
    own = BIN / name
    return name if found and Path(found).resolve() == own.resolve() else str(own)


def next_steps(cluster: LocalCluster, agents: int, dashboard: str) -> str:
    """What `dev` prints on stdout once the cluster is up: where things are and what to type."""
    cli = _command_name("epochmesh")
    logs = ", ".join(str(p) for p in cluster.logs.values())
    lines = [
        f"epochmesh dev cluster: coordinator {cluster.address} (TLS) and {agents} agent"
        f"{'s' if agents != 1 else ''}, data in {cluster.work}",
    ]
    if dashboard:
        lines.append(f"dashboard: http://{dashboard}/")
    lines += [
        f"logs: {logs}",
        "",
        "The CLI is logged in as an operator. In another shell:",
        "",
        f"  export XDG_CONFIG_HOME={cluster.cli_config}",
        f"  {cli} nodes",
        f"  {sys.executable} examples/zen/make_data.py examples/zen/train.safetensors",
        f"  {cli} submit examples/zen/job.toml --watch",
        "",
        "Ctrl-C (or SIGTERM) stops the coordinator and every agent.",
    ]
    return "\n".join(lines) + "\n"


class _Stop:
    """SIGINT/SIGTERM: the first asks to stop, a later one kills what is still running."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.cluster: LocalCluster | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            log.warning("%s again: killing what is still running", signal.Signals(signum).name)
            if self.cluster is not None:
                self.cluster.kill()
            return
        log.info("%s: stopping the agents and the coordinator", signal.Signals(signum).name)
        self.requested.set()


def run_dev(
    data_dir: Path,
    agents: int,
    *,
    listen: str = "127.0.0.1:0",
    http_listen: str = "127.0.0.1:0",
    debug: bool = False,
    agent_args: tuple[str, ...] = (),
) -> int:
    """Start a coordinator and `agents` agents under `data_dir`, log the CLI in, print the next
    steps on stdout and run until SIGINT/SIGTERM; then stop everything and return 0 (1 when the
    cluster could not start or the coordinator died)."""
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(data_dir.expanduser().resolve(), die_with_parent=True)
    stop.cluster = cluster
    debug_args = ("--debug",) if debug else ()
    code = 0
    try:
        log.info("starting a coordinator in %s", cluster.coord_dir)
        cluster.start_coordinator("--http-listen", http_listen, *debug_args, listen=listen)
        for i in range(1, agents + 1):
            if stop.requested.is_set():
                break
            log.info("starting agent %d of %d", i, agents)
            cluster.start_agent(f"agent-{i}", *debug_args, *agent_args)
        if not stop.requested.is_set():
            log.info("logging the CLI in with an operator token")
            cluster.login()
            dashboard = cluster.http_address() if http_listen else ""
            sys.stdout.write(next_steps(cluster, agents, dashboard))
            sys.stdout.flush()
        reported: set[str] = set()
        while not stop.requested.wait(0.5):
            for name in cluster.exited():
                if name in reported:
                    continue
                reported.add(name)
                path = cluster.logs.get(name)
                log.warning("%s exited (see %s)", name, path)
                if name == "coordinator":
                    code = 1
                    stop.requested.set()
    except ClusterError as exc:
        log.error("%s", exc)
        code = 1
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped; data and logs kept in %s", cluster.work)
    return code
