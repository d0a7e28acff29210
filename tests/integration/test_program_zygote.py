"""Program children forked by the agent's zygote (node_agent.sandbox.zygote), with real processes.

- Children are the zygote's (not the agent's), and the zygote is the agent's; a later child
  skips the interpreter's start and torch's import (the figures are logged, not asserted).
- A child killed with SIGKILL is reported so, and the next call works in a new child.
- Killing the zygote with SIGKILL takes its children with it; the next load starts a new
  zygote; a zygote that cannot start leaves children to start as fresh interpreters.
- The zygote exits when the agent stops it, and dies with the agent (kill -9 included), taking
  its children with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from node_agent.sandbox import spawn
from node_agent.sandbox.host import CRASHED, ProgramFault, ProgramHosts
from tests.fixtures import write_mlp_job
from tests.procs import wait_until

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"))
    return build_job(load_spec(job), cache=ExportCache.default())


@pytest.fixture
def hosts() -> Iterator[ProgramHosts]:
    hosts = ProgramHosts("cpu", threads=1, memory_budget=1 << 30)
    yield hosts
    hosts.close_all()


def batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=g)], [torch.randint(0, 4, (8,), generator=g)]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_children_are_forked_from_the_zygote_which_the_agent_started(
    job: PackedJob, hosts: ProgramHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_TOKEN", "emt1.secret")  # the agent's, never the zygote's
    hosts.zygote.stop()  # a new zygote, timed
    t0 = time.monotonic()
    first = hosts.load(job.program, job.initial_state)
    t1 = time.monotonic()
    second = hosts.load(job.program, job.initial_state)
    t2 = time.monotonic()
    zygote = hosts.zygote.pid()
    assert zygote is not None and parent_of(zygote) == os.getpid()
    environ = Path(f"/proc/{zygote}/environ").read_bytes().split(b"\0")
    names = {e.split(b"=", 1)[0].decode() for e in environ if e}
    passed = {"LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "EPOCHMESH_TEST_HOOKS"}
    assert names <= passed | {"PATH", "PYTHONPATH", "OPENBLAS_NUM_THREADS"}, names
    assert first.pid is not None and second.pid is not None
    assert parent_of(first.pid) == zygote and parent_of(second.pid) == zygote
    assert first.loss(*batch()) == second.loss(*batch())
    assert "Landlock ABI" in second.confinement and "earlier thread" not in second.confinement
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t3 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, cwd="/")
    t4 = time.monotonic()
    log.info(
        "load with the zygote's start %.2f s, a later load %.2f s; "
        "a fresh interpreter importing torch alone %.2f s",
        t1 - t0,
        t2 - t1,
        t4 - t3,
    )


def test_a_child_killed_with_sigkill_is_reported_so_and_the_next_call_works(
    job: PackedJob, hosts: ProgramHosts
) -> None:
    prog = hosts.load(job.program, job.initial_state)
    first = prog.loss(*batch())
    pid = prog.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ProgramFault, match="killed by SIGKILL") as e:
        prog.loss(*batch())
    assert e.value.kind == CRASHED
    assert prog.loss(*batch()) == first
    assert prog.restarts == 1 and prog.pid is not None and prog.pid != pid
    assert parent_of(prog.pid) == hosts.zygote.pid()


def test_a_killed_zygote_takes_its_children_and_a_new_one_starts(
    job: PackedJob, hosts: ProgramHosts
) -> None:
    prog = hosts.load(job.program, job.initial_state)
    first = prog.loss(*batch())
    zygote, child = hosts.zygote.pid(), prog.pid
    assert zygote is not None and child is not None
    os.kill(zygote, signal.SIGKILL)
    wait_until(lambda: not alive(child), timeout=30, message="the child outlived its zygote")
    assert prog.pid is None  # seen dead between calls: the next one starts a fresh child
    assert prog.loss(*batch()) == first
    assert prog.restarts == 1
    again = hosts.load(job.program, job.initial_state)
    assert again.loss(*batch()) == first
    wait_until(lambda: hosts.zygote.pid() not in (None, zygote), timeout=30)
    assert again.pid is not None and parent_of(again.pid) == hosts.zygote.pid()


def test_without_a_zygote_children_start_as_fresh_interpreters(
    job: PackedJob,
    hosts: ProgramHosts,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hosts.zygote.stop()
    monkeypatch.setattr(spawn, "ZYGOTE_MODULE", "node_agent.no_such_module")
    with caplog.at_level(logging.WARNING, logger=spawn.__name__):
        prog = hosts.load(job.program, job.initial_state)
    assert "no program zygote" in caplog.text
    assert prog.pid is not None and parent_of(prog.pid) == os.getpid()
    assert "Landlock ABI" in prog.confinement
    assert prog.loss(*batch()) > 0
    assert hosts.zygote.pid() is None


def test_the_zygote_exits_when_the_agent_stops_it(job: PackedJob, hosts: ProgramHosts) -> None:
    prog = hosts.load(job.program, job.initial_state)
    zygote, child = hosts.zygote.pid(), prog.pid
    assert zygote is not None and child is not None
    hosts.close_all()  # the agent's shutdown: its programs, then the zygote
    wait_until(lambda: not alive(child) and not alive(zygote), timeout=30)
    assert hosts.zygote.pid() is None


AGENT = """
import sys, time
from pathlib import Path
from node_agent.sandbox.host import ProgramHosts
hosts = ProgramHosts("cpu", threads=1, memory_budget=1 << 30)
prog = hosts.load(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes())
Path(sys.argv[3]).write_text(f"{hosts.zygote.pid()} {prog.pid}")
sys.stdin.read()
"""


def test_the_zygote_and_its_children_die_with_the_agent(job: PackedJob, tmp_path: Path) -> None:
    (tmp_path / "program").write_bytes(job.program)
    (tmp_path / "state").write_bytes(job.initial_state)
    pids = tmp_path / "pids"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, *(str(tmp_path / n) for n in ("program", "state", "pids"))],
        stdin=subprocess.PIPE,
    )
    try:
        wait_until(lambda: pids.exists() and pids.read_text(), timeout=120)
        zygote, child = (int(p) for p in pids.read_text().split())
        assert parent_of(zygote) == agent.pid and parent_of(child) == zygote
        agent.kill()
        agent.wait(timeout=30)
        wait_until(lambda: not alive(zygote) and not alive(child), timeout=30)
    finally:
        agent.kill()
        agent.wait(timeout=30)
