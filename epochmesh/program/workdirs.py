"""Temporary working directories of program-inspection children, named after the process that
made them, so that the directories a process killed with -9 left behind are found and removed
by the next process that makes one."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "epochmesh-inspect-"

_swept = False
_sweep_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def owner_pid(name: str) -> int | None:
    """The pid a working directory's name carries (``epochmesh-inspect-PID-...``), or None for
    a name of another form."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_stale(root: Path) -> int:
    """Remove the working directories under ``root`` whose owner process is gone; returns how
    many were removed. Directories of live processes and of other names are left alone."""
    removed = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
                removed += 1
        except OSError as e:  # another process swept it first, or it is not ours to remove
            log.debug("could not remove stale inspection dir %s: %s", entry, e)
    if removed:
        log.info("removed %d inspection working dirs left by processes that are gone", removed)
    return removed


def inspection_workdir() -> tempfile.TemporaryDirectory[str]:
    """A fresh working directory for one inspection child; the first call in a process sweeps
    the directories that dead processes left behind."""
    global _swept
    with _sweep_lock:
        if not _swept:
            _swept = True
            sweep_stale(Path(tempfile.gettempdir()))
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-")
