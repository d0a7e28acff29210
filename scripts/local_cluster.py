"""A coordinator and agents as real processes on this machine, for the demo and benchmarks.

TLS is on, as in production: the coordinator makes its CA on first start, every agent enrolls
with its own single-use node token from `epochmesh-coordinator token create`, and the CLI is
logged in (`epochmesh login --token`, an operator token) under a private XDG_CONFIG_HOME.

    with LocalCluster(work_dir) as cluster:
        cluster.start_coordinator("--split", "equal")
        cluster.start_agent("fast", "--slowdown", "1")
        cluster.start_agent("far", coordinator=relay_address)  # e.g. through a WanLink
        cluster.login()
        print(cluster.cli("nodes"))

Every process started is stopped (SIGTERM, then SIGKILL) when the block ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from epochmesh.identity import coordinator_channel_options, enroll_with_token, identity_credentials

BIN = Path(sys.executable).parent
if not (BIN / "epochmesh-coordinator").exists():  # console scripts elsewhere (a system python)
    _found = shutil.which("epochmesh-coordinator")
    if _found:
        BIN = Path(_found).parent
T = TypeVar("T")


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


class LocalCluster:
    def __init__(self, work: Path) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.coord_dir = self.work / "coordinator"
        self.address = ""
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, XDG_CONFIG_HOME=str(self.work / "cli-config"))

    def _start(
        self,
        cmd: list[str],
        log: Path,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` in its own session, output to `log`; `cpus`: the CPUs it may run on
        (every thread it will have inherits them); `env`: variables added to this process's."""
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
                env=None if env is None else dict(os.environ, **env),
            )
        self.procs.append(proc)
        return proc

    def start_coordinator(self, *args: str, cpus: set[int] | None = None) -> str:
        self.coord_dir.mkdir(parents=True, exist_ok=True)
        addr_file = self.coord_dir / "coordinator.addr"
        addr_file.unlink(missing_ok=True)
        proc = self._start(
            [
                str(BIN / "epochmesh-coordinator"),
                "--data-dir",
                str(self.coord_dir),
                "--listen",
                "127.0.0.1:0",
                *args,
            ],
            self.work / "coordinator.log",
            cpus,
        )

        def started() -> str:
            if proc.poll() is not None:
                raise ClusterError(f"the coordinator exited with {proc.returncode}")
            return addr_file.exists() and addr_file.read_text().strip()

        self.address = wait_for(started, 60, "the coordinator's start")
        return self.address

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
            self.work / f"agent-{name}.log",
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
        )
        if out.returncode != 0:
            raise ClusterError(f"epochmesh {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def run_cli(self, *args: str) -> int:
        """The CLI with its output on this terminal (e.g. `submit --watch`); its exit code."""
        cmd = [str(BIN / "epochmesh"), "--coordinator", self.address, *args]
        return subprocess.run(cmd, env=self.env, check=False).returncode

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
