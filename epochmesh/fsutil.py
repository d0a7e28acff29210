"""Private files: a 0700 directory, an atomic write with its permissions from the start,
and the directory fsync that makes a new entry durable."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents) with mode 0700; an existing one is kept as
    it is."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a new file, a rename) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write atomically (a temporary file, fsync, rename, fsync of the directory) with
    permissions ``mode`` from the start (never world-readable). A missing directory is made
    0700."""
    make_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
