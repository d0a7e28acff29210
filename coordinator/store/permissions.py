"""The coordinator's data dir is private to its user: the directory 0700, what is in it 0600
(directories 0700).

`tighten_data_dir` runs at every start (and before ``token create``): a data dir that others
may read or enter (made by hand, by a package, or by an older version; say 0755 with a database
and blobs 0644 in it) is made private, with everything in it. When that is impossible (the
directory belongs to another user) it raises `DataDirPermissionError` and the coordinator does
not start. `create_private_file` makes the database 0600 before SQLite first opens it: SQLite
gives its WAL and shared-memory files the database's mode.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


class DataDirPermissionError(RuntimeError):
    """The data dir is open to other users and cannot be made private."""


def _tighten(path: Path, mode: int) -> None:
    current = stat.S_IMODE(path.lstat().st_mode)
    if current & 0o077:
        os.chmod(path, current & ~0o077 | (mode & 0o700))


def tighten_data_dir(data_dir: Path) -> bool:
    """Make ``data_dir`` 0700 and, if it was open to others, every directory in it 0700 and
    every file 0600 (symbolic links are left alone). True if anything was open.
    DataDirPermissionError when it cannot be changed."""
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if not mode & 0o077:
        return False
    try:
        os.chmod(data_dir, DIR_MODE)
        for root, dirs, files in os.walk(data_dir):
            for name in dirs:
                path = Path(root, name)
                if not path.is_symlink():
                    _tighten(path, DIR_MODE)
            for name in files:
                path = Path(root, name)
                if not path.is_symlink():
                    _tighten(path, FILE_MODE)
    except OSError as exc:
        raise DataDirPermissionError(
            f"the data dir {data_dir} is open to other users (mode {mode:o}) and cannot be made "
            f"private ({exc}): it holds the coordinator's keys, database and blobs; "
            f"`chmod -R go-rwx {data_dir}` as its owner, or use another --data-dir"
        ) from None
    log.warning(
        "data dir %s was open to other users (mode %o): made it and everything in it private "
        "(directories 0700, files 0600)",
        data_dir,
        mode,
    )
    return True


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist; make an existing one (and
    SQLite's ``-wal`` / ``-shm`` beside it) 0600 if others may read it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        pass
    else:
        os.close(fd)
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            _tighten(each, FILE_MODE)
        except FileNotFoundError:
            continue
