"""Caps on concurrent streams (uploads, watchers): per identity and in all.

`StreamCaps.hold(identity)` counts a stream while it is open and refuses one past either cap
with RESOURCE_EXHAUSTED naming the limit and the flag that sets it. No I/O, no clock.
`fetch_caps()`: the cap shared by FetchBlob (nodes) and DownloadResult (submitters), streams
that each hold a stored file open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from coordinator.core.errors import ResourceExhaustedError


class StreamCaps:
    def __init__(self, what: str, per_identity: int, total: int, flag: str) -> None:
        if per_identity < 1 or total < 1:
            raise ValueError(f"caps of {what} streams must be at least 1")
        self.what = what
        self.per_identity = per_identity
        self.total = total
        self.flag = flag
        self._open: dict[str, int] = {}
        self._all = 0

    def open_streams(self, identity: str | None = None) -> int:
        """Streams open now: of ``identity``, or in all (None)."""
        return self._all if identity is None else self._open.get(identity, 0)

    def acquire(self, identity: str) -> None:
        held = self._open.get(identity, 0)
        if held >= self.per_identity:
            raise ResourceExhaustedError(
                f"too many concurrent {self.what} streams: at most {self.per_identity} per "
                f"identity ({self.flag}); close one first"
            )
        if self._all >= self.total:
            raise ResourceExhaustedError(
                f"the coordinator serves at most {self.total} concurrent {self.what} streams in "
                f"all ({self.flag}-total); retry later"
            )
        self._open[identity] = held + 1
        self._all += 1

    def release(self, identity: str) -> None:
        held = self._open.get(identity, 0)
        if held <= 0:
            return
        if held == 1:
            del self._open[identity]
        else:
            self._open[identity] = held - 1
        self._all -= 1

    @contextlib.contextmanager
    def hold(self, identity: str) -> Iterator[None]:
        """Count one stream of ``identity`` for the ``with`` block (ResourceExhaustedError
        past a cap, before anything is counted)."""
        self.acquire(identity)
        try:
            yield
        finally:
            self.release(identity)


def fetch_caps(per_identity: int = 8, total: int = 256) -> StreamCaps:
    """Caps of the streams that read stored bytes out: FetchBlob and DownloadResult."""
    return StreamCaps("FetchBlob/DownloadResult", per_identity, total, "--max-fetch-streams")
