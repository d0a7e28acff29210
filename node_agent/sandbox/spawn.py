"""Starting a program's child process: forked by the agent's zygote, else a fresh interpreter.

Children are forked by the agent's zygote (node_agent.sandbox.zygote; a `Zygote`, owned by the
agent's ProgramHosts, over a `ZygoteClient`): a fresh interpreter with the children's minimal
environment (`child_env`), started for the first child, that has imported torch, so that a
child skips the interpreter's start and torch's import. Forking from it, never from the agent,
keeps the agent's key, certificate and tokens out of every child's memory. When no zygote can
serve (`Zygote.fork_child` returns None), or a program has none, a child starts as a fresh
interpreter (`spawn_child`). Both are started with `python -m` by dotted name
(ZYGOTE_MODULE, "node_agent.sandbox.child"). node_agent.sandbox.host talks to the child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import IO, Any, Protocol

from epochmesh.program.confine import describe_exit
from node_agent.sandbox.wire import (
    WireError,
    read_message,
    send_message,
)

log = logging.getLogger(__name__)

TEST_HOOKS_ENV = "EPOCHMESH_TEST_HOOKS"
# Environment a child gets from the agent (nothing else: no tokens, no credentials).
_PASSED_ENV = ("LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", TEST_HOOKS_ENV)
START_TIMEOUT_S = 120.0  # a fresh interpreter importing torch on a busy machine
MAX_LOG_LINE_CHARS = 500
FORK_TIMEOUT_S = 30.0  # the zygote's answer to a fork
ZYGOTE_MODULE = "node_agent.sandbox.zygote"


def log_lines(stream: IO[bytes] | None, pid: int, what: str = "program child") -> None:
    """Forward a program child's (or the zygote's) stderr to the agent's log, line by line,
    until it closes."""
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError), stream:
        for line in stream:
            text = line.decode(errors="replace").rstrip()
            if text:
                log.warning("%s %d: %s", what, pid, text[:MAX_LOG_LINE_CHARS])


def child_env() -> dict[str, str]:
    """The whole environment of a program child (and of the zygote): nothing of the agent's
    but _PASSED_ENV, so no tokens and no credentials."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env["PATH"] = "/usr/bin:/bin"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # numpy's BLAS pool would start with `import torch`, before confinement: a thread that
    # Landlock (before ABI 8) would not cover (and that a fork would not carry). torch's own
    # pool starts after it.
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def _start_interpreter(
    module: str, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """``python -m MODULE FD`` with `env` as its whole environment, in "/", no descriptor of
    the agent's but its end of a socket pair (FD) and a pipe for its stderr: a pipe, not the
    agent's stderr, since a confined child may not write files (a log file would refuse its
    lines), and its lines reach the agent's log this way. Returns the process and the agent's
    end of the socket pair."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd="/",
            close_fds=True,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, parent


def spawn_child(env: dict[str, str]) -> tuple[ChildProcess, socket.socket, IO[bytes]]:
    """A program child as a fresh interpreter (when no zygote serves): its process, the
    agent's end of its socket pair, its stderr."""
    proc, parent = _start_interpreter("node_agent.sandbox.child", env)
    assert proc.stderr is not None
    return SpawnedChild(proc), parent, proc.stderr


class SpawnedChild:
    """A child started as a fresh interpreter: Popen's waits, its signals through a pidfd
    opened before anything could reap it (never to a process that took its pid later)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self.pid = proc.pid
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # no pidfds: Popen's own kill
            self._pidfd = os.pidfd_open(proc.pid)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError, TypeError):
            if self._pidfd is not None:
                os.close(self._pidfd)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def kill(self) -> None:
        if self._pidfd is None:
            self._proc.kill()
            return
        with contextlib.suppress(ProcessLookupError):  # it has exited
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class Zygote:
    """The program zygote of an owner (the agent's ProgramHosts): started by the first child it
    needs, again after it died, stopped by its owner (`stop`; a later child starts a new one)."""

    def __init__(self) -> None:
        self._client: ZygoteClient | None = None
        self._lock = threading.Lock()

    def fork_child(
        self, env: dict[str, str]
    ) -> tuple[ChildProcess, socket.socket, IO[bytes]] | None:
        """A program child forked by the zygote (started on first use); None, with a warning,
        when no zygote can serve (the caller starts a fresh interpreter instead)."""
        with self._lock:
            zygote = self._client
            if zygote is None or not zygote.serving:
                try:
                    zygote = self._client = ZygoteClient(env)
                except ZygoteError as e:
                    log.warning("no program zygote (%s): children start as fresh interpreters", e)
                    return None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        read_end, write_end = os.pipe()
        try:
            proc = zygote.fork(child.fileno(), write_end, env)
        except ZygoteError as e:
            log.warning(
                "the program zygote failed (%s): this child starts as a fresh interpreter", e
            )
            parent.close()
            os.close(read_end)
            return None
        finally:
            child.close()
            os.close(write_end)
        return proc, parent, os.fdopen(read_end, "rb")

    def stop(self) -> None:
        """Stop the zygote (a later child starts a new one): it forks no more and exits once
        its last child is gone."""
        with self._lock:
            zygote, self._client = self._client, None
        if zygote is not None:
            zygote.stop()

    def pid(self) -> int | None:
        """The pid of the zygote serving now, if any."""
        with self._lock:
            zygote = self._client
        return zygote.pid if zygote is not None and zygote.serving else None


class ChildProcess(Protocol):
    """What ProgramChild uses of its process: a Popen, or a ForkedChild."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class ForkedChild:
    """A child forked by the zygote, with Popen's part that ProgramChild uses: its exit status
    comes from the zygote's report (Popen's convention: -N for signal N), signals go through a
    pidfd (never to a reused pid)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd  # closed when this handle is dropped: no thread can use it then
        self._returncode: int | None = None
        self._orphaned = False  # the zygote died before reporting this child's exit
        self._cond = threading.Condition()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._pidfd)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def exited(self, returncode: int) -> None:
        """The zygote's report."""
        with self._cond:
            if self._returncode is None:
                self._returncode = returncode
            self._cond.notify_all()

    def orphaned(self) -> None:
        """The zygote is gone without reporting this child (which it took with it)."""
        with self._cond:
            self._orphaned = True
            self._cond.notify_all()

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"program child {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has exited
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._returncode is None and not self._orphaned:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._returncode is not None:
                return self._returncode
        # Orphaned: no report will come. A zygote's child dies with it (SIGKILL), and its
        # pidfd turns readable once it has exited.
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        exited, _, _ = select.select([self._pidfd], [], [], remaining)
        if not exited:
            return None
        with self._cond:
            if self._returncode is None:
                self._returncode = -signal.SIGKILL
            return self._returncode


class ZygoteError(Exception):
    """The zygote could not be started, or failed to fork a child."""


class ZygoteClient:
    """The agent's end of its program zygote (node_agent.sandbox.zygote): a fresh interpreter
    with the children's minimal environment that forks them. A thread started here starts it
    (it dies with that thread: PR_SET_PDEATHSIG) and reads its answers and exit reports."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Future[ForkedChild]] = {}
        self._children: dict[int, ForkedChild] = {}
        self._next_id = 0
        self._stopping = False
        self._gone = False
        self._handle: SpawnedChild | None = None  # the zygote, signalled through a pidfd
        self._sock: socket.socket | None = None
        ready: Future[int] = Future()
        threading.Thread(
            target=self._run, args=(env, ready), daemon=True, name="program-zygote"
        ).start()
        try:
            self.pid = ready.result(timeout=START_TIMEOUT_S)
        except FutureTimeout:
            self.kill()
            raise ZygoteError(f"it did not start within {START_TIMEOUT_S:.0f} s") from None
        log.info("program zygote %d started", self.pid)

    @property
    def serving(self) -> bool:
        return not (self._gone or self._stopping)

    def fork(self, sock_fd: int, stderr_fd: int, env: dict[str, str]) -> ForkedChild:
        """A child on `sock_fd` (the child's end of its socket pair) with `stderr_fd` as its
        stderr and `env` as its environment; the caller keeps and closes both descriptors."""
        fut: Future[ForkedChild] = Future()
        with self._lock:
            if not self.serving or self._sock is None:
                raise ZygoteError("it has stopped")
            request_id = self._next_id
            self._next_id += 1
            self._pending[request_id] = fut
            try:
                message = {"op": "fork", "id": request_id, "env": env}
                send_message(self._sock, message, [sock_fd, stderr_fd])
            except OSError as e:
                self._pending.pop(request_id, None)
                raise ZygoteError(f"it cannot be reached: {e}") from None
        try:
            return fut.result(timeout=FORK_TIMEOUT_S)
        except FutureTimeout:
            with self._lock:
                mine = self._pending.pop(request_id, None) is not None
            if not mine:  # answered meanwhile: the answer is being delivered
                return fut.result()
            self.kill()  # a zygote that does not fork is broken
            raise ZygoteError(f"it did not fork within {FORK_TIMEOUT_S:.0f} s") from None

    def stop(self) -> None:
        """Fork no more; the zygote exits once its last child is gone."""
        with self._lock:
            self._stopping = True
            if self._sock is not None and not self._gone:
                with contextlib.suppress(OSError):
                    send_message(self._sock, {"op": "stop"})

    def kill(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.kill()

    def _run(self, env: dict[str, str], ready: Future[int]) -> None:
        try:
            proc, parent = _start_interpreter(ZYGOTE_MODULE, env)
        except OSError as e:
            ready.set_exception(ZygoteError(str(e)))
            return
        self._handle, self._sock = SpawnedChild(proc), parent
        threading.Thread(
            target=log_lines,
            args=(proc.stderr, proc.pid, "program zygote"),
            daemon=True,
            name="zygote-log",
        ).start()
        try:
            hello, fds = read_message(parent)
            _close_fds(fds)
            if hello.get("op") != "ready":
                raise WireError(f"it answered {hello.get('op')!r}, not 'ready'")
            ready.set_result(proc.pid)
            while True:
                self._dispatch(*read_message(parent))
        except (WireError, OSError) as e:
            reason = str(e)
        except Exception as e:  # a bug here: waiters must not hang on a zygote nobody reads
            log.exception("reading the program zygote's answers failed")
            reason = str(e)
            proc.kill()
        self._lost()
        parent.close()
        code = proc.wait()
        if not ready.done():
            ready.set_exception(ZygoteError(f"it {describe_exit(code)} ({reason})"))
        elif not self._stopping:
            log.warning("the program zygote %d %s; a new one starts", proc.pid, describe_exit(code))

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        pid = message.get("pid")
        pid = pid if type(pid) is int and pid > 0 else None
        if op == "forked":
            request_id = message.get("id")
            with self._lock:
                fut = self._pending.pop(request_id, None) if type(request_id) is int else None
            if pid is not None and len(fds) == 1:
                child = ForkedChild(pid, fds[0])
                with self._lock:
                    self._children[pid] = child
                if fut is not None:
                    fut.set_result(child)
                else:  # its requester gave up
                    child.kill()
                return
            _close_fds(fds)
            if fut is not None:
                fut.set_exception(ZygoteError(str(message.get("error", "no child"))[:200]))
            return
        _close_fds(fds)
        code = message.get("status")
        if op == "exited" and pid is not None and type(code) is int:
            with self._lock:
                exited = self._children.pop(pid, None)
            if exited is not None:
                exited.exited(code)

    def _lost(self) -> None:
        """The zygote has gone: fail what waits on it; its children died with it."""
        with self._lock:
            self._gone = True
            pending, self._pending = self._pending, {}
            children, self._children = self._children, {}
        for fut in pending.values():
            fut.set_exception(ZygoteError("it exited"))
        for child in children.values():
            child.orphaned()


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
