"""The program zygote: a fork server for program children (node_agent.sandbox.child).

Started once by node_agent.sandbox.host as ``python -m node_agent.sandbox.zygote FD``: a fresh
interpreter with the children's minimal environment, so it never holds the agent's key,
certificate or tokens. It imports torch and what a child needs (running no torch op, touching
no GPU: it stays single-threaded, and so do the children it forks), answers "ready" on FD (its
control socket to the agent), then serves, one message at a time (node_agent.sandbox.wire):

- ``fork`` (id, env; the child's end of its socket pair to the agent and the write end of its
  stderr pipe ride along): forks a child, which makes the pipe its stderr, closes every other
  descriptor, takes env as its environment and runs program_child.run on its socket (it
  confines itself there); answered ``forked`` (id, pid; a pidfd of the child rides along), or
  ``forked`` with an error;
- ``stop``: forks no more, and exits once its last child is gone.

It reaps its children and reports each: ``exited`` (pid, status: Popen.returncode's sign
convention). It exits when the agent closes its end, killing its children through their
pidfds, and is killed when the agent (the thread that started it) dies; its children are
killed when it dies (a parent-death signal that a confined child cannot undo).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from node_agent.sandbox import child as program_child
from node_agent.sandbox.wire import WireError, read_message, send_message

log = logging.getLogger("epochmesh.program_zygote")


class Zygote:
    """The zygote's state: its control socket and its living children (pidfd -> pid)."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.children: dict[int, int] = {}
        self.stopping = False
        self.poller = select.poll()
        self.poller.register(control.fileno(), select.POLLIN)

    def serve(self) -> None:
        while not (self.stopping and not self.children):
            for fd, _ in self.poller.poll():
                if fd == self.control.fileno():
                    if not self._command():
                        self.kill_children()
                        return
                elif fd in self.children:
                    self._reap(fd)

    def kill_children(self) -> None:
        """The agent has gone: SIGKILL every child through its pidfd (their parent-death
        signal would take them when this process exits; this does not wait for that)."""
        for pidfd in self.children:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)

    def _command(self) -> bool:
        """One message from the agent; False when it has gone."""
        try:
            msg, fds = read_message(self.control)
        except (WireError, OSError):
            return False
        op = msg.get("op")
        if op == "fork" and len(fds) == 2 and not self.stopping:
            self._fork(msg, fds[0], fds[1])
            return True
        for fd in fds:
            os.close(fd)
        if op == "stop":
            self.stopping = True
        elif op == "fork":
            self._send({"op": "forked", "id": msg.get("id"), "error": "not forking"})
        else:
            log.warning("unknown request %r", op)
        return True

    def _fork(self, msg: dict[str, Any], sock_fd: int, err_fd: int) -> None:
        env = msg.get("env")
        env = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
        sys.stderr.flush()
        zygote = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            os.close(sock_fd)
            os.close(err_fd)
            self._send({"op": "forked", "id": msg.get("id"), "error": str(e)})
            return
        if pid == 0:
            _child(self.control, sock_fd, err_fd, env, zygote)
        os.close(sock_fd)
        os.close(err_fd)
        pidfd = os.pidfd_open(pid)  # before it is reaped: always this child
        self.children[pidfd] = pid
        self.poller.register(pidfd, select.POLLIN)
        self._send({"op": "forked", "id": msg.get("id"), "pid": pid}, [pidfd])

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self._send({"op": "exited", "pid": pid, "status": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        with contextlib.suppress(OSError):  # the agent has gone: the next read says so
            send_message(self.control, message, fds)


def _child(
    control: socket.socket, sock_fd: int, err_fd: int, env: dict[str, str], zygote: int
) -> NoReturn:
    """In a forked child: take its descriptors and environment, run program_child.run, exit
    (never back into the zygote's loop)."""
    code = 1
    try:
        os.dup2(err_fd, 2)
        control.detach()  # closed below with the rest: nothing may close its number later
        _close_fds_except({0, 1, 2, sock_fd})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        logging.basicConfig(level=logging.WARNING, format="program child: %(message)s", force=True)
        code = program_child.run(sock_fd, parent=zygote)
    except BaseException:  # a child never returns into the zygote's loop
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):  # listdir's own descriptor, gone by now
                os.close(fd)


def preload() -> None:
    """Import what a child needs before it confines itself (program_child.preload), and check
    that nothing started a thread: forking a threaded process is unsafe, and a child's threads
    must start under its Landlock rules."""
    program_child.preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        log.warning("%d threads after the imports: its children start with them", threads)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="program zygote: %(message)s")
    parent = os.getppid()
    program_child.die_with_parent()
    if os.getppid() != parent:  # the agent died before the line above
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    control = socket.socket(fileno=int(args[0]))
    preload()
    send_message(control, {"op": "ready", "pid": os.getpid()})
    Zygote(control).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
