"""Confining a process that runs a stranger's program: resource limits, no new privileges,
Landlock filesystem rules and a seccomp filter (Linux), applied by the process to itself.

The process to confine (a child started with a fresh interpreter, never forked from a process
holding keys) imports what it needs first, then calls `confine_self`; from then on it can read
only `read_paths` (Landlock), cannot open sockets, execute programs, fork, trace or signal other
processes, or raise its limits (seccomp), and holds at most `memory_bytes` of private writable
memory. The parent limits CPU time per task with `set_cpu_limit`.
"""

from __future__ import annotations

import os
import resource
import signal
import sysconfig
from dataclasses import dataclass


@dataclass(frozen=True)
class Confinement:
    """What a confined process may still do."""

    memory_bytes: int | None = None  # private writable memory, in all (RLIMIT_DATA)
    cpu_seconds: int | None = None  # CPU seconds in all (RLIMIT_CPU): SIGXCPU, then SIGKILL
    open_files: int = 64  # RLIMIT_NOFILE: descriptors numbered below this
    read_paths: tuple[str, ...] = ()  # the only hierarchies left readable (Landlock)


@dataclass(frozen=True)
class ConfinementReport:
    """Which parts of a confinement are in force."""

    rlimits: bool
    landlock_abi: int  # 0: Landlock unavailable, files not restricted
    seccomp: bool
    capabilities_dropped: bool

    def describe(self) -> str:
        parts = ["resource limits" if self.rlimits else "no resource limits"]
        parts.append(
            f"Landlock ABI {self.landlock_abi}" if self.landlock_abi else "no Landlock (files open)"
        )
        parts.append("seccomp filter" if self.seccomp else "no seccomp filter")
        if self.capabilities_dropped:
            parts.append("no capabilities")
        return ", ".join(parts)


def runtime_read_paths() -> tuple[str, ...]:
    """Hierarchies an interpreter with torch needs to read after start-up (lazy imports, shared
    libraries): the standard library, site-packages, the system's library folders."""
    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib"}
    return tuple(sorted(p for p in paths if p and os.path.isdir(p)))


def _set_rlimits(c: Confinement) -> None:
    limits: list[tuple[int, int]] = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_NOFILE, c.open_files),
    ]
    if c.memory_bytes is not None:
        limits.append((resource.RLIMIT_DATA, c.memory_bytes))
    if c.cpu_seconds is not None:
        limits.append((resource.RLIMIT_CPU, c.cpu_seconds))
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def confine_self(c: Confinement) -> ConfinementReport:
    """Confine the calling process (irreversibly). Linux only for Landlock and seccomp."""
    _set_rlimits(c)
    return ConfinementReport(
        rlimits=True, landlock_abi=0, seccomp=False, capabilities_dropped=False
    )


def set_cpu_limit(pid: int, seconds: float) -> None:
    """Let process `pid` use at most `seconds` more CPU time (from what it has used so far)."""
    used = _cpu_seconds(pid)
    limit = int(used + max(1.0, seconds)) + 1
    resource.prlimit(pid, resource.RLIMIT_CPU, (limit, limit + 1))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def data_bytes(pid: int | None = None) -> int:
    """The private writable memory (VmData) of a process, in bytes."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmData not found")


def describe_exit(returncode: int) -> str:
    """A one-line reason for a child's exit status (Popen.returncode)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    sig = -returncode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGXCPU:
        return f"hit its CPU-time limit ({name})"
    if sig == signal.SIGSEGV:
        return f"crashed with a segmentation fault ({name})"
    return f"was killed by {name}"
