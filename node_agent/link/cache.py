"""Content-addressed blob cache under DATA_DIR/cache, shared by every job.

- An entry is DATA_DIR/cache/<sha256>, its name the lowercase hex sha256 of its bytes.
- A download goes to <sha256>.part and resumes from that file's length (FetchBlob offset); the
  whole file is hashed before it is renamed into place, so a finished entry is always complete.
- Every use checks the entry. Hashing is skipped only while the file is provably the one
  hashed before: the in-memory "verified" set is keyed by (size, mtime_ns, ctime_ns, inode),
  and any write to the file changes ctime, which no user can set back. A corrupted entry is
  therefore detected the next time a task opens it, deleted and fetched again.
- Hashing runs in a worker thread, so heartbeats keep flowing while a large blob is checked.
- A size cap (``max_bytes``, the agent's --cache-max-bytes): after each download, entries are
  evicted least recently used first (and partial downloads nobody resumes, oldest first) until
  the cache fits. An entry used in the last ``protect_s`` seconds or being fetched is never
  evicted (a task may be about to read it), so the cache can exceed the cap by what tasks use
  at once. Recency lives in memory; at start the entries are ranked by their download time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from epochmesh.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)

# fetch(sha256, offset) -> stream of FetchBlobResponse starting at `offset`.
FetchFn = Callable[[str, int], AsyncIterator[agent_pb2.FetchBlobResponse]]

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_HASH_BLOCK = 4 << 20
PART_SUFFIX = ".part"
DEFAULT_PROTECT_S = 60.0

_FileKey = tuple[int, int, int, int]


class CacheError(Exception):
    """A blob could not be obtained intact (bad reference, or the bytes served do not match)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _file_key(path: Path) -> _FileKey | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def validate_ref(ref: common_pb2.BlobRef) -> str:
    sha = ref.sha256.lower()
    if not _SHA256_RE.match(sha):
        raise CacheError(f"invalid blob reference {ref.sha256!r}: expected 64 hex digits")
    if ref.size < 0:
        raise CacheError(f"invalid blob reference {sha}: negative size {ref.size}")
    return sha


class BlobCache:
    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int | None = None,
        protect_s: float = DEFAULT_PROTECT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_bytes`` None: no cap. ``clock``: wall-clock seconds (compared with mtimes)."""
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError("the cache's size cap must be positive")
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.protect_s = protect_s
        self._clock = clock
        self._verified: dict[str, _FileKey] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Complete entries, least recently used first: sha256 -> (size, last use).
        self._lru: OrderedDict[str, tuple[int, float]] = OrderedDict()
        # Counters, for logs and tests.
        self.hits = 0
        self.downloads = 0
        self.corrupt_entries = 0
        self.bytes_fetched = 0
        self.evictions = 0
        self._scan()
        self.evict()  # the cap may have been lowered since the last start

    # -- size cap -------------------------------------------------------------------------------

    def _scan(self) -> None:
        found = []
        for path in self.root.iterdir():
            if not _SHA256_RE.match(path.name):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, path.name, st.st_size))
        for mtime, sha, size in sorted(found):
            self._lru[sha] = (size, mtime)

    def _touch(self, sha: str, size: int) -> None:
        self._lru[sha] = (size, self._clock())
        self._lru.move_to_end(sha)

    def entries(self) -> list[str]:
        """The complete entries, least recently used first."""
        return list(self._lru)

    def _parts(self) -> list[tuple[float, Path, int]]:
        out = []
        for path in self.root.glob("*" + PART_SUFFIX):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, path, st.st_size))
        return sorted(out)

    def total_bytes(self) -> int:
        """Bytes held: complete entries and partial downloads."""
        return sum(size for size, _ in self._lru.values()) + sum(n for _, _, n in self._parts())

    def _busy(self, sha: str) -> bool:
        lock = self._locks.get(sha)
        return lock is not None and lock.locked()

    def evict(self) -> int:
        """Evict until the cache fits its cap (see the module's docstring); bytes freed."""
        if self.max_bytes is None:
            return 0
        parts = self._parts()
        total = sum(size for size, _ in self._lru.values()) + sum(n for _, _, n in parts)
        freed = 0
        recent = self._clock() - self.protect_s
        for mtime, path, size in parts:
            if total <= self.max_bytes:
                return freed
            if mtime >= recent or self._busy(path.name.removesuffix(PART_SUFFIX)):
                continue
            path.unlink(missing_ok=True)
            total, freed = total - size, freed + size
            log.info("cache: dropped the partial download %s (%d bytes)", path.name, size)
        for sha, (size, used) in list(self._lru.items()):
            if total <= self.max_bytes:
                break
            if used >= recent or self._busy(sha):
                continue
            self.path_for(sha).unlink(missing_ok=True)
            del self._lru[sha]
            self._verified.pop(sha, None)
            self.evictions += 1
            total, freed = total - size, freed + size
            log.info("cache: evicted blob %s (%d bytes, least recently used)", sha, size)
        if total > self.max_bytes:
            log.warning(
                "cache holds %d bytes, over its cap of %d: the rest is in use",
                total,
                self.max_bytes,
            )
        return freed

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256

    def part_path_for(self, sha256: str) -> Path:
        return self.root / f"{sha256}{PART_SUFFIX}"

    async def lookup(self, ref: common_pb2.BlobRef) -> Path | None:
        """The path of an intact entry, or None. A corrupt entry is deleted (and None returned)."""
        sha = validate_ref(ref)
        path = self.path_for(sha)
        key = _file_key(path)
        if key is None:
            return None
        if self._verified.get(sha) == key:
            self._touch(sha, key[0])
            return path
        ok = ref.size in (0, key[0]) and await asyncio.to_thread(sha256_file, path) == sha
        if ok and _file_key(path) == key:
            self._verified[sha] = key
            self._touch(sha, key[0])
            return path
        if ok:
            return await self.lookup(ref)  # changed while hashing: look again
        self.corrupt_entries += 1
        log.warning("cache entry %s is corrupt (size or sha256 mismatch): fetching it again", sha)
        self._verified.pop(sha, None)
        self._lru.pop(sha, None)
        path.unlink(missing_ok=True)
        return None

    async def get(self, ref: common_pb2.BlobRef, fetch: FetchFn) -> Path:
        """The path of an intact copy of the blob, downloading (or resuming) it when needed.

        Network errors from `fetch` propagate with the partial download kept, so that a retry
        resumes it. A download whose bytes do not hash to the reference raises CacheError.
        """
        sha = validate_ref(ref)
        lock = self._locks.setdefault(sha, asyncio.Lock())
        async with lock:
            path = await self.lookup(ref)
            if path is not None:
                self.hits += 1
                return path
            path = await self._download(sha, ref.size, fetch)
            self.evict()  # under the lock: never the entry just fetched
            return path

    async def _download(self, sha: str, expected_size: int, fetch: FetchFn) -> Path:
        part = self.part_path_for(sha)
        offset = part.stat().st_size if part.exists() else 0
        if expected_size and offset > expected_size:
            log.warning("partial download %s is longer than the blob: starting over", part)
            part.unlink()
            offset = 0
        if offset:
            log.info("resuming download of blob %s at byte %d", sha, offset)
        total = expected_size if expected_size else -1
        with open(part, "ab") as f:
            async for response in fetch(sha, offset):
                if response.total_size:
                    if expected_size and response.total_size != expected_size:
                        raise CacheError(
                            f"blob {sha}: coordinator serves {response.total_size} bytes, "
                            f"the reference says {expected_size}"
                        )
                    total = response.total_size
                chunk = response.chunk
                if not chunk.data:
                    continue
                if chunk.offset != offset:
                    raise CacheError(
                        f"blob {sha}: chunk at offset {chunk.offset}, expected {offset}"
                    )
                f.write(chunk.data)
                offset += len(chunk.data)
                self.bytes_fetched += len(chunk.data)
                if total >= 0 and offset > total:
                    break
            f.flush()
            os.fsync(f.fileno())
        if total >= 0 and offset < total:
            raise ConnectionError(f"blob {sha}: stream ended at byte {offset} of {total}")
        digest = await asyncio.to_thread(sha256_file, part)
        if digest != sha or (total >= 0 and offset != total):
            part.unlink(missing_ok=True)
            raise CacheError(
                f"blob {sha}: downloaded {offset} bytes hash to {digest}; discarded the download"
            )
        path = self.path_for(sha)
        os.replace(part, path)
        key = _file_key(path)
        if key is not None:
            self._verified[sha] = key
            self._touch(sha, key[0])
        self.downloads += 1
        log.info("cached blob %s (%d bytes)", sha, offset)
        return path
