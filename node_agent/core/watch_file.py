"""Settings an operator may change while the agent runs (the slowdown factor, the price): the
value in force is mirrored in a file in DATA_DIR, written at start; rewriting the file changes
the setting. A cheap stat() on every read notices a rewrite; `reload()` (SIGUSR1) re-reads the
file even when its stat looks unchanged. A file that does not parse is logged and ignored: the
value in force stays."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_StatKey = tuple[int, int, int]


class WatchedValue(Generic[T]):
    """A value backed by a watch file. Thread-safe.

    `parse` reads the file's text (ValueError with a clear message for a bad one), `show`
    writes a value as that text, `what` names the setting and `unit` follows a value in log
    lines."""

    def __init__(
        self,
        value: T,
        path: Path | None,
        *,
        parse: Callable[[str], T],
        show: Callable[[T], str],
        what: str,
        unit: str = "",
    ) -> None:
        self._value = value
        self._path = path
        self._parse = parse
        self._show = show
        self._what = what
        self._unit = f" {unit}" if unit else ""
        self._lock = threading.Lock()
        self._seen: _StatKey | None = None
        if path is not None:
            self._write(value)

    @property
    def path(self) -> Path | None:
        return self._path

    def get(self) -> T:
        """The value in force, after picking up any change of the file."""
        self._check()
        with self._lock:
            return self._value

    def set(self, value: T) -> None:
        """Change the value (and the file, so that both agree)."""
        with self._lock:
            self._value = value
        if self._path is not None:
            self._write(value)

    def reload(self) -> bool:
        """Re-read the file even if its stat did not change (SIGUSR1); True when that changed
        the value."""
        with self._lock:
            self._seen = None
            before = self._value
        return self.get() != before

    def _write(self, value: T) -> None:
        assert self._path is not None
        path = self._path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self._show(value) + "\n")
            os.replace(tmp, path)
            key = _stat_key(path)
        except OSError as exc:
            log.warning("cannot write the %s file %s: %s", self._what, path, exc)
            return
        with self._lock:
            self._seen = key

    def _check(self) -> None:
        path = self._path
        if path is None:
            return
        key = _stat_key(path)
        with self._lock:
            if key == self._seen:
                return
            self._seen = key
        if key is None:
            return  # file removed: keep the value in force
        try:
            value = self._parse(path.read_text().strip())
        except (OSError, ValueError) as exc:
            with self._lock:
                kept = self._value
            log.warning(
                "ignoring %s: %s; keeping %s %s%s",
                path,
                exc,
                self._what,
                self._show(kept),
                self._unit,
            )
            return
        with self._lock:
            changed = value != self._value
            self._value = value
        if changed:
            log.info("%s is now %s%s (from %s)", self._what, self._show(value), self._unit, path)


def _stat_key(path: Path) -> _StatKey | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)
