"""What a program child must not do to the agent, tried inside the real child (the `syscall`
probe, a test hook) as a program that broke out of torch would:

- System V shared memory, message queues and semaphores, POSIX message queues: EPERM;
- renicing, rescheduling or pinning the agent: EPERM;
- undoing its parent-death signal, leaving the agent's session or process group: EPERM, and
  after trying, a kill -9 of the agent leaves no child alive (forked by the zygote, or started
  as a fresh interpreter);
- a CPU child's address space is capped: a shared anonymous mapping (which RLIMIT_DATA does
  not count) beyond its budget is refused, and the program still runs;
- the agent's shutdown kills a child that does not exit when asked (through its pidfd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from node_agent.sandbox.host import ChildLimits, ConfinedProgram, ProgramHosts
from node_agent.sandbox.spawn import Zygote
from node_agent.sandbox.wire import send_message
from tests.fixtures import write_mlp_job
from tests.procs import wait_until

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux confinement"),
]

PR_SET_PDEATHSIG = 1
MAP_SHARED_ANONYMOUS = 0x21
PROT_READ_WRITE = 3
MMAP = {"x86_64": 9, "aarch64": 222}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"))
    return build_job(load_spec(job), cache=ExportCache.default())


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("EPOCHMESH_TEST_HOOKS", "1")
    yield monkeypatch


def batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=g)], [torch.randint(0, 4, (8,), generator=g)]


def alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def syscall(prog: ConfinedProgram, name: str, *args: int) -> str:
    return prog.probe(what="syscall", name=name, args=list(args))


def test_ipc_scheduling_and_escapes_are_refused_inside_the_child(
    job: PackedJob, hooks: pytest.MonkeyPatch
) -> None:
    zygote = Zygote()
    prog = ConfinedProgram(
        job.program, job.initial_state, ChildLimits(256 << 20, threads=1), zygote
    )
    try:
        if "seccomp filter" not in prog.confinement:
            pytest.skip(f"no seccomp filter here ({prog.confinement})")
        first = prog.loss(*batch())
        agent = os.getpid()
        nice, affinity = os.getpriority(os.PRIO_PROCESS, agent), os.sched_getaffinity(agent)
        refused = {
            "shmget": (0, 1 << 20, 0o1600),
            "shmat": (0, 0, 0),
            "msgget": (0, 0o1600),
            "msgsnd": (0, 0, 0, 0),
            "semget": (0, 1, 0o1600),
            "mq_open": (0, 0o102, 0o600, 0),
            "setpriority": (0, agent, 19),  # PRIO_PROCESS
            "sched_setscheduler": (agent, 5, 0),  # SCHED_IDLE
            "sched_setaffinity": (agent, 8, 0),
            "sched_setattr": (agent, 0, 0),
            "prctl": (PR_SET_PDEATHSIG, 0),
            "setsid": (),
            "setpgid": (0, 0),
        }
        for name, args in refused.items():
            assert syscall(prog, name, *args) == "refused: EPERM", name
        assert os.getpriority(os.PRIO_PROCESS, agent) == nice
        assert os.sched_getaffinity(agent) == affinity
        assert "address space capped" in prog.confinement
        mmap = MMAP[os.uname().machine]
        shared = (PROT_READ_WRITE, MAP_SHARED_ANONYMOUS, -1, 0)
        big = prog.probe(what="syscall", nr=mmap, args=[0, 8 << 30, *shared])
        assert big == "refused: ENOMEM"
        assert prog.probe(what="syscall", nr=mmap, args=[0, 1 << 20, *shared]) == "allowed"
        assert prog.loss(*batch()) == first  # still serving, the same child
        assert prog.restarts == 0
    finally:
        prog.close()
        zygote.stop()


AGENT = """
import json, sys
from pathlib import Path
from node_agent.sandbox import spawn
from node_agent.sandbox.host import ProgramHosts
if sys.argv[4] == "fresh":
    spawn.ZYGOTE_MODULE = "node_agent.no_such_module"
hosts = ProgramHosts("cpu", threads=1, memory_budget=1 << 30)
prog = hosts.load(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes())
tried = [prog.probe(what="syscall", name=n, args=a)
         for n, a in (("prctl", [1, 0]), ("setsid", []), ("setpgid", [0, 0]))]
Path(sys.argv[3]).write_text(json.dumps([hosts.zygote.pid(), prog.pid, tried]))
sys.stdin.read()
"""


@pytest.mark.parametrize("start", ["zygote", "fresh"])
def test_a_child_that_tried_to_stay_dies_with_the_agent_killed_by_sigkill(
    job: PackedJob, tmp_path: Path, start: str
) -> None:
    (tmp_path / "program").write_bytes(job.program)
    (tmp_path / "state").write_bytes(job.initial_state)
    out = tmp_path / "out"
    env = {**os.environ, "EPOCHMESH_TEST_HOOKS": "1"}
    args = [str(tmp_path / n) for n in ("program", "state", "out")]
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, *args, start], stdin=subprocess.PIPE, env=env
    )
    try:
        wait_until(lambda: out.exists() and out.read_text(), timeout=150)
        zygote, child, tried = json.loads(out.read_text())
        assert (zygote is None) == (start == "fresh")
        assert tried == ["refused: EPERM"] * 3
        assert alive(child)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        wait_until(lambda: not alive(child), timeout=30, message="the child outlived the agent")
        if zygote is not None:
            wait_until(lambda: not alive(zygote), timeout=30)
    finally:
        agent.kill()
        agent.wait(timeout=30)


def test_the_agents_shutdown_kills_a_child_that_does_not_exit(
    job: PackedJob, hooks: pytest.MonkeyPatch
) -> None:
    hosts = ProgramHosts("cpu", threads=1, memory_budget=1 << 30)
    prog = hosts.load(job.program, job.initial_state)
    prog.loss(*batch())  # its arena is set
    pid, child = prog.pid, prog._child
    assert pid is not None and child is not None
    # Busy in a step that never ends, it never reads the agent's "exit".
    send_message(child.sock, {"op": "step", "fault": "hang"})
    hosts.close_all(grace_s=1.0)
    # Gone well before the reaper thread's own 10 s: killed through its pidfd.
    wait_until(lambda: not alive(pid), timeout=5, message="the child outlived the shutdown")
