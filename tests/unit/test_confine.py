"""epochmesh.program.confine: real child processes confine themselves and try what confinement must stop
(files, sockets, processes, signals, limits) and what it must leave (reading the runtime,
threads, torch); the parent moves a busy child's CPU limit; the seccomp filter's decisions,
run through a small BPF interpreter, for both architectures' tables."""

from __future__ import annotations

import errno
import json
import os
import pwd
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from epochmesh.program import confine
from epochmesh.program.confine import (
    ARCHES,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    ConfinementReport,
    describe_exit,
    landlock_abi,
    seccomp_program,
    set_cpu_limit,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")
on_linux = pytest.mark.skipif(not LINUX, reason="process confinement is Linux-only")

PRELUDE = """
import json, os, resource, socket, subprocess, sys, threading
from epochmesh.program.confine import Confinement, confine_self, data_bytes, runtime_read_paths
out = {}
def attempt(name, fn):
    try:
        out[name] = ["allowed", repr(fn())[:80]]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)[:200]]
def confined(**kw):
    report = confine_self(Confinement(read_paths=runtime_read_paths() + kw.pop("extra", ()), **kw))
    out["report"] = {k: getattr(report, k) for k in report.__dataclass_fields__}
    out["describe"] = report.describe()
    return report
"""


def run_child(body: str, timeout: float = 45) -> dict[str, Any]:
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refused(outcome: list[str], *errors: str) -> bool:
    return outcome[0] in (errors or ("PermissionError",))


def need_landlock(out: dict[str, Any]) -> None:
    if out["report"]["landlock_abi"] == 0:
        pytest.skip("this kernel has no Landlock")


def need_seccomp(out: dict[str, Any]) -> None:
    if not out["report"]["seccomp"]:
        pytest.skip("no seccomp filter on this system")


# -- one confined child with torch, many probes -----------------------------------------------


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not LINUX:
        pytest.skip("process confinement is Linux-only")
    tmp = tmp_path_factory.mktemp("confine")
    secret = tmp / "secret" / "key.pem"
    secret.parent.mkdir()
    secret.write_text("secret\n")
    shelf = tmp / "shelf"  # a read path: readable, not writable
    shelf.mkdir()
    (shelf / "book.txt").write_text("words\n")
    body = f"""
    import signal, time
    import torch
    status = open("/proc/self/status")  # opened before: re-read after confinement
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    expected = (a @ b).tolist()
    left, right = socket.socketpair()
    report = confined(
        memory_bytes=data_bytes() + (1 << 30),
        extra=({str(shelf)!r}, "/nonexistent/confine-test"),
        device_paths=("/dev/null",),
    )
    status.seek(0)
    out["status"] = dict(l.split(":", 1) for l in status.read().splitlines())
    out["status"] = {{k: v.strip() for k, v in out["status"].items()}}
    attempt("read_secret", lambda: open({str(secret)!r}).read())
    attempt("list_secret_dir", lambda: os.listdir({str(secret.parent)!r}))
    attempt("read_stdlib", lambda: len(open(os.__file__).read()))
    attempt("list_stdlib", lambda: len(os.listdir(os.path.dirname(os.__file__))))
    attempt("read_shelf", lambda: open({str(shelf / "book.txt")!r}).read())
    attempt("write_shelf", lambda: open({str(shelf / "new.txt")!r}, "w"))
    attempt("append_shelf", lambda: open({str(shelf / "book.txt")!r}, "a"))
    attempt("remove_shelf", lambda: os.unlink({str(shelf / "book.txt")!r}))
    attempt("mkdir_shelf", lambda: os.mkdir({str(shelf / "sub")!r}))
    attempt("chmod_shelf", lambda: os.chmod({str(shelf / "book.txt")!r}, 0o777))
    attempt("write_tmp", lambda: open({str(tmp / "new.txt")!r}, "w"))
    attempt("write_device", lambda: open("/dev/null", "w").write("x"))
    attempt("read_other_device", lambda: open("/dev/zero", "rb").read(1))
    attempt("socket_inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    attempt("socket_inet6_udp", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
    attempt("socket_unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    attempt("socketpair", lambda: socket.socketpair())
    attempt("old_socketpair", lambda: (left.send(b"hi"), right.recv(2))[1])
    attempt("fork", lambda: os.fork())
    attempt("subprocess", lambda: subprocess.run(["/bin/true"]))
    attempt("execv", lambda: os.execv("/bin/true", ["true"]))
    attempt("kill_parent", lambda: os.kill(os.getppid(), 0))
    attempt("kill_group", lambda: os.kill(0, 0))
    attempt("kill_self", lambda: os.kill(os.getpid(), 0))
    attempt("raise_self", lambda: (signal.signal(signal.SIGUSR1, lambda *_: None), signal.raise_signal(signal.SIGUSR1)))
    attempt("setrlimit_raise", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)))
    attempt("setrlimit_lower", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32)))
    attempt("prlimit_cpu", lambda: resource.prlimit(0, resource.RLIMIT_CPU, (10**6, resource.RLIM_INFINITY)))
    attempt("prlimit_read_parent", lambda: resource.prlimit(os.getppid(), resource.RLIMIT_CPU))
    out["rlimit_data"] = resource.getrlimit(resource.RLIMIT_DATA)
    out["rlimit_nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    def in_thread():
        t = threading.Thread(target=lambda: out.setdefault("thread_ran", True))
        t.start()
        t.join()
    attempt("thread", in_thread)
    torch.set_num_threads(2)
    out["torch_threads"] = torch.get_num_threads()
    out["matmul_equal"] = torch.allclose(a @ b, torch.tensor(expected), atol=1e-5)
    x = torch.randn(64, 32, requires_grad=True)
    (x @ x.T).relu().sum().backward()
    out["backward"] = bool(torch.isfinite(x.grad).all())
    """
    return run_child(body)


def test_the_report_names_what_is_in_force(probes: dict[str, Any]) -> None:
    report, text = probes["report"], probes["describe"]
    assert report["rlimits"] and report["no_new_privs"] and report["capabilities_dropped"]
    assert text.startswith("resource limits, no new privileges, no capabilities, ")
    assert "\n" not in text
    abi = landlock_abi()
    assert report["landlock_abi"] == abi
    if abi:
        expected = sum(Path(p).exists() for p in confine.runtime_read_paths()) + 1
        assert report["read_rules"] == expected  # the missing path skipped, the shelf added
        assert report["device_rules"] == 1
        assert f"Landlock ABI {abi} (read-only: {expected} paths, 1 device" in text
        assert report["tcp_blocked"] == (abi >= 4)
    else:
        assert "no Landlock" in text
    if ARCHES.get(os.uname().machine):
        assert report["seccomp"] and "seccomp filter (no sockets, exec, fork, ptrace)" in text
    status = probes["status"]
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert int(status["CapInh"], 16) == 0 and int(status.get("CapAmb", "0"), 16) == 0
    if os.geteuid() == 0:  # root holds CAP_SETPCAP, so the bounding set is emptied too
        assert int(status["CapBnd"], 16) == 0
    if report["seccomp"]:
        assert status["Seccomp"] == "2"


def test_files_outside_the_read_paths_are_closed_and_nothing_is_writable(
    probes: dict[str, Any],
) -> None:
    assert probes["read_stdlib"][0] == "allowed" and probes["list_stdlib"][0] == "allowed"
    assert probes["read_shelf"] == ["allowed", repr("words\n")]
    need_landlock(probes)
    for name in ("read_secret", "list_secret_dir", "write_shelf", "append_shelf"):
        assert refused(probes[name]), (name, probes[name])
    for name in ("remove_shelf", "mkdir_shelf", "write_tmp", "read_other_device"):
        assert refused(probes[name]), (name, probes[name])
    assert probes["write_device"][0] == "allowed"
    assert refused(probes["chmod_shelf"])  # seccomp: Landlock leaves modes alone


def test_no_sockets_processes_programs_or_foreign_signals(probes: dict[str, Any]) -> None:
    need_seccomp(probes)
    for name in ("socket_inet", "socket_inet6_udp", "socket_unix", "socketpair"):
        assert refused(probes[name]), (name, probes[name])
    assert probes["old_socketpair"] == ["allowed", repr(b"hi")]
    for name in ("fork", "subprocess", "execv", "kill_parent", "kill_group"):
        assert refused(probes[name]), (name, probes[name])
    assert probes["kill_self"][0] == "allowed" and probes["raise_self"][0] == "allowed"


def test_limits_cannot_be_changed_from_inside(probes: dict[str, Any]) -> None:
    need_seccomp(probes)
    for name in ("setrlimit_raise", "setrlimit_lower", "prlimit_cpu", "prlimit_read_parent"):
        assert refused(probes[name], "PermissionError", "ValueError"), (name, probes[name])
    assert probes["rlimit_nofile"] == [64, 64]
    soft, hard = probes["rlimit_data"]
    assert soft == hard and soft > 1 << 30


def test_threads_and_torch_still_work(probes: dict[str, Any]) -> None:
    assert probes["thread"][0] == "allowed" and probes["thread_ran"]
    assert probes["torch_threads"] == 2
    assert probes["matmul_equal"] and probes["backward"]


# -- shared memory, scheduling, the death signal --------------------------------------------


@pytest.fixture(scope="module")
def escapes() -> dict[str, Any]:
    """A confined child with torch tries what would let it use memory no limit counts, slow or
    pin the agent, or outlive it. The calls aim at the child itself (the filter does not look
    at the target: test_the_seccomp_filter_decides), so a missing filter harms no one here."""
    if not LINUX:
        pytest.skip("process confinement is Linux-only")
    return run_child(
        """
        import ctypes, errno, mmap, signal
        from multiprocessing import shared_memory
        import torch
        from epochmesh.program.confine import ARCHES, address_space_bytes
        libc = ctypes.CDLL(None, use_errno=True)
        nr = ARCHES[os.uname().machine].nr
        def call(name, *args):
            def go():
                if libc.syscall(ctypes.c_long(nr[name]), *(ctypes.c_long(a) for a in args)) < 0:
                    e = ctypes.get_errno()
                    raise OSError(e, os.strerror(e))
            return go
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG, as the agent's child does
        status = open("/proc/self/status")  # opened before: re-read after confinement
        confined(
            memory_bytes=data_bytes() + (256 << 20),
            address_space_bytes=address_space_bytes() + (1 << 30),
        )
        me = os.getpid()
        attempt("shmget", call("shmget", 0, 1 << 20, 0o1600))  # IPC_PRIVATE, IPC_CREAT | 0600
        attempt("shmat", call("shmat", 0, 0, 0))
        attempt("shmctl", call("shmctl", 0, 0, 0))  # IPC_RMID
        attempt("msgget", call("msgget", 0, 0o1600))
        attempt("msgsnd", call("msgsnd", 0, 0, 0, 0))
        attempt("semget", call("semget", 0, 1, 0o1600))
        attempt("semop", call("semop", 0, 0, 0))
        name = ctypes.create_string_buffer(b"epochmesh-test")
        attempt("mq_open", call("mq_open", ctypes.addressof(name), 0o102, 0o600, 0))
        attempt("posix_shm", lambda: shared_memory.SharedMemory(create=True, size=1 << 20))
        attempt("dev_shm", lambda: open(f"/dev/shm/epochmesh-test-{me}", "wb"))
        attempt("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, me, 19))
        attempt("setpriority_group", lambda: os.setpriority(os.PRIO_PGRP, 0, 19))
        attempt("sched_setscheduler", lambda: os.sched_setscheduler(me, os.SCHED_IDLE, os.sched_param(0)))
        attempt("sched_setparam", lambda: os.sched_setparam(me, os.sched_param(0)))
        attempt("sched_setaffinity", lambda: os.sched_setaffinity(me, {min(os.sched_getaffinity(0))}))
        attempt("sched_setattr", call("sched_setattr", me, 0, 0))
        attempt("ioprio_set", call("ioprio_set", 1, me, (3 << 13)))  # this process, idle class
        attempt("sched_getaffinity", lambda: len(os.sched_getaffinity(0)) > 0)
        attempt("getpriority", lambda: os.getpriority(os.PRIO_PROCESS, 0))
        attempt("pdeathsig", lambda: libc.prctl(1, 0, 0, 0, 0) and ctypes.get_errno())
        sig = ctypes.c_int(-1)
        attempt("get_pdeathsig", lambda: (libc.prctl(2, ctypes.byref(sig), 0, 0, 0), sig.value))
        attempt("set_name", lambda: libc.prctl(15, b"pt_test", 0, 0, 0))  # PR_SET_NAME
        attempt("setsid", os.setsid)
        attempt("setpgid", lambda: os.setpgid(0, 0))
        attempt("shared_anon_map", lambda: len(mmap.mmap(-1, 4 << 30)))  # not counted as data
        attempt("private_map", lambda: len(mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE)))
        torch.set_num_threads(4)
        x = torch.randn(64, 32, requires_grad=True)
        (x @ x.T).relu().sum().backward()
        out["torch"] = bool(torch.isfinite(x.grad).all()) and torch.get_num_threads() == 4
        out["big_matmul"] = float((torch.randn(800, 800) @ torch.randn(800, 800)).sum()) != 0
        status.seek(0)
        out["threads"] = int(next(l for l in status if l.startswith("Threads:")).split()[1])
        """
    )


def eperm(outcome: list[str]) -> bool:
    """Refused by the seccomp filter (EPERM), not by something else on the way."""
    return outcome[0] == "PermissionError" and outcome[1].startswith("[Errno 1] ")


def test_no_system_v_or_posix_ipc(escapes: dict[str, Any]) -> None:
    need_seccomp(escapes)
    for name in ("shmget", "shmat", "shmctl", "msgget", "msgsnd", "semget", "semop", "mq_open"):
        assert eperm(escapes[name]), (name, escapes[name])
    need_landlock(escapes)
    for name in ("posix_shm", "dev_shm"):  # a file in /dev/shm: Landlock refuses (EACCES)
        assert refused(escapes[name]), (name, escapes[name])


def test_no_scheduling_changes_but_reads(escapes: dict[str, Any]) -> None:
    need_seccomp(escapes)
    for name in ("setpriority", "setpriority_group", "sched_setscheduler", "sched_setparam"):
        assert eperm(escapes[name]), (name, escapes[name])
    for name in ("sched_setaffinity", "sched_setattr", "ioprio_set"):
        assert eperm(escapes[name]), (name, escapes[name])
    assert escapes["sched_getaffinity"] == ["allowed", "True"]
    assert escapes["getpriority"][0] == "allowed"


def test_the_death_signal_session_and_group_stay(escapes: dict[str, Any]) -> None:
    need_seccomp(escapes)
    assert escapes["pdeathsig"] == ["allowed", repr(errno.EPERM)]  # prctl -1, errno EPERM
    assert escapes["get_pdeathsig"] == ["allowed", repr((0, int(signal.SIGKILL)))]
    assert escapes["set_name"] == ["allowed", "0"]  # torch names its threads
    assert eperm(escapes["setsid"]) and eperm(escapes["setpgid"])


def test_the_address_space_cap_counts_shared_mappings_and_torch_runs_under_it(
    escapes: dict[str, Any],
) -> None:
    assert escapes["shared_anon_map"][0] == "OSError", escapes["shared_anon_map"]
    assert "Cannot allocate memory" in escapes["shared_anon_map"][1]
    assert escapes["private_map"] == ["allowed", repr(64 << 20)]
    assert escapes["torch"] and escapes["big_matmul"]
    assert escapes["threads"] >= 4  # the pool started under the cap


# -- threads started before confinement ---------------------------------------------------------


@on_linux
def test_threads_started_before_are_filtered_and_reported(tmp_path: Path) -> None:
    secret = tmp_path / "key.pem"
    secret.write_text("secret\n")
    out = run_child(
        f"""
        go = threading.Event()
        def early():
            go.wait()
            attempt("early_read", lambda: open({str(secret)!r}).read())
            attempt("early_socket", lambda: socket.socket())
        t = threading.Thread(target=early)
        t.start()
        report = confined()
        go.set()
        t.join()
        """
    )
    need_seccomp(out)
    assert refused(out["early_socket"])  # seccomp filters every thread (TSYNC)
    need_landlock(out)
    outside = out["report"]["threads_outside"]
    # Before Landlock ABI 8, landlock_restrict_self covers only the calling thread and its
    # later threads: an earlier thread can still read, and the report says so.
    assert outside == (0 if out["report"]["landlock_abi"] >= 8 else 1)
    assert refused(out["early_read"]) == (outside == 0)
    assert ("; not on 1 earlier thread)" in out["describe"]) == (outside == 1)


@on_linux
def test_the_user_keeps_a_name_once_the_password_database_is_closed() -> None:
    """A child's environment names no user; getpass.getuser() (torch 2.11's torch.export.load
    calls it) would read /etc/passwd, which Landlock closes: confinement names the user first."""
    # Looked up here, not in the child: a lookup there before confinement would leave the
    # database open and hide the failure.
    try:
        expected = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        expected = str(os.getuid())
    out = run_child(
        """
        import getpass
        for key in ("LOGNAME", "USER", "LNAME", "USERNAME"):
            os.environ.pop(key, None)
        confined()
        attempt("passwd", lambda: open("/etc/passwd").read())
        attempt("getuser", getpass.getuser)
        """
    )
    assert out["getuser"] == ["allowed", repr(expected)]
    if out["report"]["landlock_abi"]:
        assert refused(out["passwd"])


# -- memory and CPU ---------------------------------------------------------------------------


@on_linux
def test_the_memory_limit_refuses_a_big_allocation() -> None:
    out = run_child(
        """
        confined(memory_bytes=data_bytes() + (64 << 20))
        attempt("small", lambda: len(bytearray(8 << 20)))
        attempt("big", lambda: len(bytearray(512 << 20)))
        """
    )
    assert out["small"] == ["allowed", repr(8 << 20)]
    assert out["big"][0] == "MemoryError"


def cpu_limit(pid: int) -> tuple[int, int]:
    return resource.prlimit(pid, resource.RLIMIT_CPU)


@on_linux
def test_the_parent_moves_a_busy_childs_cpu_limit_until_it_stops_it() -> None:
    script = PRELUDE + textwrap.dedent(
        """
        confined(cpu_seconds=1)
        print("ready", flush=True)
        while True:
            pass
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert cpu_limit(proc.pid) == (1, resource.RLIM_INFINITY)  # soft only
        set_cpu_limit(proc.pid, 2)
        first = cpu_limit(proc.pid)
        assert first[0] >= 3 and first[1] == resource.RLIM_INFINITY
        while confine._cpu_seconds(proc.pid) < 1.5:  # past the first limit, still running
            assert proc.poll() is None
            time.sleep(0.05)
        set_cpu_limit(proc.pid, 2)
        second = cpu_limit(proc.pid)
        assert second[0] > first[0] and second[1] == resource.RLIM_INFINITY
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert any(
            line.startswith("Max cpu time") and line.split()[3:5] == [str(second[0]), "unlimited"]
            for line in limits.splitlines()
        ), limits
        set_cpu_limit(proc.pid, 0)  # at least a second more, then SIGXCPU
        assert proc.wait(timeout=20) == -signal.SIGXCPU
        assert describe_exit(proc.returncode) == "hit its CPU-time limit (SIGXCPU)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@on_linux
def test_a_child_over_its_cpu_limit_is_stopped() -> None:
    script = PRELUDE + "confined(cpu_seconds=1)\nwhile True:\n    pass\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=30)
    assert proc.returncode == -signal.SIGXCPU


# -- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (0, "exited with status 0"),
        (3, "exited with status 3"),
        (-signal.SIGXCPU, "hit its CPU-time limit (SIGXCPU)"),
        (-signal.SIGSEGV, "crashed with a segmentation fault (SIGSEGV)"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-200, "was killed by signal 200"),
    ],
)
def test_describe_exit(code: int, text: str) -> None:
    assert describe_exit(code) == text


def test_describe_what_is_missing() -> None:
    bare = ConfinementReport(
        rlimits=True, landlock_abi=0, seccomp=False, capabilities_dropped=False
    )
    assert bare.describe() == (
        "resource limits, new privileges possible, capabilities kept, no Landlock (files open), "
        "no seccomp"
    )
    full = ConfinementReport(True, 7, True, True, True, read_rules=6, tcp_blocked=True)
    assert full.describe() == (
        "resource limits, no new privileges, no capabilities, Landlock ABI 7 (read-only: 6 paths; "
        "no TCP), seccomp filter (no sockets, exec, fork, ptrace)"
    )
    old = ConfinementReport(True, 3, True, True, True, read_rules=1, threads_outside=2)
    assert "Landlock ABI 3 (read-only: 1 path; TCP open; not on 2 earlier threads)" in (
        old.describe()
    )


def bpf(prog: list[tuple[int, int, int, int]], arch: int, nr: int, *args: int) -> int:
    """Run a classic BPF seccomp program on one seccomp_data (little-endian)."""
    padded = [*args, 0, 0, 0, 0, 0, 0][:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *padded)
    a, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == 0x20:
            (a,) = struct.unpack_from("<I", data, k)
        elif code == 0x15:
            pc += jt if a == k else jf
        elif code == 0x35:
            pc += jt if a >= k else jf
        elif code == 0x45:
            pc += jt if a & k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unknown BPF instruction {code:#x}")


EPERM = RET_ERRNO | 1
ENOSYS = RET_ERRNO | 38
CLONE_THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17


@pytest.mark.skipif(sys.byteorder != "little", reason="the interpreter reads little-endian data")
@pytest.mark.parametrize("name", sorted(ARCHES))
def test_the_seccomp_filter_decides(name: str) -> None:
    arch = ARCHES[name]
    nr = arch.nr
    pid = 4242
    prog = seccomp_program(arch, pid)
    assert len(prog) < 4096 and all(jt < 256 and jf < 256 for _, jt, jf, _ in prog)
    other_arch = next(a.audit for a in ARCHES.values() if a is not arch)
    assert bpf(prog, other_arch, 0) == RET_KILL_PROCESS
    assert bpf(prog, 0x40000003, 0) == RET_KILL_PROCESS  # i386
    for call in ("socket", "connect", "execve", "ptrace", "setrlimit", "bpf"):
        assert bpf(prog, arch.audit, nr[call]) == EPERM, call
    for call in ("mount", "unshare", "fchmodat", "io_uring_setup", "pidfd_open", "tkill"):
        assert bpf(prog, arch.audit, nr[call]) == EPERM, call
    assert bpf(prog, arch.audit, nr["clone3"]) == ENOSYS
    assert bpf(prog, arch.audit, nr["clone"], CLONE_THREAD_FLAGS) == RET_ALLOW
    assert bpf(prog, arch.audit, nr["clone"], SIGCHLD) == EPERM  # fork
    assert bpf(prog, arch.audit, nr["clone"], 0x4111) == EPERM  # vfork: VM|VFORK|SIGCHLD
    assert bpf(prog, arch.audit, nr["clone"], CLONE_THREAD_FLAGS | CLONE_NEWUSER) == EPERM
    for call in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        assert bpf(prog, arch.audit, nr[call], pid, 10) == RET_ALLOW, call
        assert bpf(prog, arch.audit, nr[call], pid + 1, 10) == EPERM, call
        assert bpf(prog, arch.audit, nr[call], 0, 10) == EPERM, call  # the process group
        assert bpf(prog, arch.audit, nr[call], 2**32 - 1, 10) == EPERM, call  # -1: everyone
    for who in (0, pid):  # glibc's getrlimit: prlimit64(0, resource, NULL, &old)
        assert bpf(prog, arch.audit, nr["prlimit64"], who, 0, 0, 0x7FFF0000) == RET_ALLOW
        assert bpf(prog, arch.audit, nr["prlimit64"], who, 0, 0x7FFF0000, 0) == EPERM
        assert bpf(prog, arch.audit, nr["prlimit64"], who, 0, 1 << 32, 0) == EPERM
    assert bpf(prog, arch.audit, nr["prlimit64"], pid + 1, 0, 0, 0x7FFF0000) == EPERM
    for call in ("shmget", "shmat", "msgget", "msgsnd", "semget", "mq_open", "setsid"):
        assert bpf(prog, arch.audit, nr[call]) == EPERM, call
    for call in ("setpriority", "sched_setscheduler", "sched_setaffinity", "sched_setattr"):
        for target in (0, pid, pid + 1, 1):  # itself, the agent, anyone
            assert bpf(prog, arch.audit, nr[call], target, target) == EPERM, call
    assert bpf(prog, arch.audit, nr["setpgid"], 0, 0) == EPERM
    assert bpf(prog, arch.audit, nr["prctl"], 1, 0) == EPERM  # PR_SET_PDEATHSIG
    assert bpf(prog, arch.audit, nr["prctl"], 1, 9) == EPERM
    for option in (2, 15, 16, 38):  # GET_PDEATHSIG, SET_NAME, GET_NAME, SET_NO_NEW_PRIVS
        assert bpf(prog, arch.audit, nr["prctl"], option, 0) == RET_ALLOW, option
    assert bpf(prog, arch.audit, nr["prctl"], 1 + (1 << 32), 0) == EPERM  # an int: low half
    assert bpf(prog, arch.audit, nr["ioctl"], 0, 0x5412) == EPERM  # TIOCSTI
    assert bpf(prog, arch.audit, nr["ioctl"], 0, 0x541B) == RET_ALLOW  # FIONREAD
    for allowed in ("seccomp", "landlock_restrict_self"):
        assert bpf(prog, arch.audit, nr[allowed]) == RET_ALLOW
    refused_nrs = [n for k, n in nr.items() if bpf(prog, arch.audit, n) != RET_ALLOW]
    assert len(set(nr.values())) == len(nr)  # no number written twice
    assert len(refused_nrs) > 80
    if name == "x86_64":
        assert bpf(prog, arch.audit, 0x40000000 + 41) == EPERM  # x32 socket
        assert bpf(prog, arch.audit, 0x40000000) == EPERM  # x32 read: no x32 at all
        assert bpf(prog, arch.audit, 0) == RET_ALLOW  # read
        assert bpf(prog, arch.audit, 204) == RET_ALLOW  # sched_getaffinity
        assert bpf(prog, arch.audit, nr["fork"]) == EPERM
        assert bpf(prog, arch.audit, nr["modify_ldt"]) == EPERM
    else:
        assert "fork" not in nr and "modify_ldt" not in nr
        assert bpf(prog, arch.audit, 63) == RET_ALLOW  # read
        assert bpf(prog, arch.audit, 123) == RET_ALLOW  # sched_getaffinity
