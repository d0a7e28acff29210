"""Verdicts of the program check, remembered by content: a program submitted again (by anyone
who may name its blob) is not checked again.

The key is (the program's sha256, the initial state's sha256, `check_version()`): the check
loads the program *with* its initial state, so a state that does not fit its program is refused
as well as a program off the allow-list; the version is a digest of the check's own code (the
archive rules, the operator allow-list, the inspection child, its confinement) and of torch's
version, so a coordinator running another check never takes an old verdict.

Only verdicts of the program itself are kept: accepted and refused. A crash, a timeout, running
out of memory or a child that did not start depend on the machine and the limits of that moment
and are checked again next time.

The cache lives in memory, bounded (`DEFAULT_MAX_ENTRIES` verdicts, least recently used first
out; a few hundred bytes each), and, given a `directory`, in files there too
(``DIRECTORY/VERSION[:32]/PROGRAM-STATE.json``, written atomically), so that a restarted
coordinator, or another one given the same directory, takes the verdict instead of checking
again. The version of a persisted verdict also digests the check's limits (`check_version`'s
``limits``): a program accepted within a minute and 2 GiB is not taken as accepted by a
coordinator that allows it less. A file that cannot be read or written is logged and ignored:
the cache never fails a submission. Nothing in it is state the design requires to survive a
crash (a lost verdict is one check to run again).

Concurrent checks of one key are one check (`VerdictCache.verdict`): the first caller runs it,
the others wait for its result, holding nothing of the program.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from epochmesh.program.inspection import Inspection, Verdict

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 4096
CACHED_VERDICTS = frozenset({Verdict.ACCEPTED, Verdict.REFUSED})
# The modules whose code decides a verdict.
_CHECK_MODULES = (
    "epochmesh.program.archive",
    "epochmesh.program.op_allowlist",
    "epochmesh.program.inspection",
    "epochmesh.program.confine",
    "epochmesh.program.flops",
)


def check_version(limits: str = "") -> str:
    """A digest of what decides a verdict: the check's modules' source, torch's version and
    ``limits`` (the time and memory the check's child may take, as text)."""
    h = hashlib.sha256(sys.implementation.cache_tag.encode())
    h.update(b"limits " + limits.encode() + b"\0")
    try:
        h.update(b"torch " + importlib.metadata.version("torch").encode())
    except importlib.metadata.PackageNotFoundError:
        h.update(b"no torch")
    for name in _CHECK_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        h.update(name.encode() + b"\0")
        if origin:
            h.update(hashlib.sha256(Path(origin).read_bytes()).digest())
    return h.hexdigest()


@dataclass(frozen=True)
class CheckKey:
    program_sha256: str
    state_sha256: str
    version: str


@dataclass(frozen=True)
class CheckVerdict:
    """What a submission needs of an inspection."""

    verdict: Verdict
    reason: str
    flops_per_sample: float = 0.0  # counted by the check (0.0: not countable)

    @classmethod
    def of(cls, inspection: Inspection) -> CheckVerdict:
        return cls(inspection.verdict, inspection.reason, inspection.flops_per_sample)

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.ACCEPTED


@dataclass(frozen=True)
class Outcome:
    """A verdict and whether this caller's submission ran the check for it."""

    verdict: CheckVerdict
    checked: bool


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_VERDICT_FILE_BYTES = 4096


class VerdictCache:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        version: str | None = None,
        directory: Path | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError("the program check cache needs room for at least one verdict")
        self.max_entries = max_entries
        self.version = version if version is not None else check_version()
        self.directory = directory
        self._entries: OrderedDict[CheckKey, CheckVerdict] = OrderedDict()
        self._flights: dict[CheckKey, asyncio.Future[CheckVerdict]] = {}
        self.checks = 0  # checks run (a check of a key counts once, however many waited on it)
        self.hits = 0  # verdicts answered without a check of their own

    def key(self, program_sha256: str, state_sha256: str) -> CheckKey:
        return CheckKey(program_sha256, state_sha256, self.version)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CheckKey) -> CheckVerdict | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            return found
        found = self._read(key)
        if found is not None:
            self._remember(key, found)
        return found

    def put(self, key: CheckKey, verdict: CheckVerdict) -> None:
        if verdict.verdict not in CACHED_VERDICTS:
            return
        self._remember(key, verdict)
        self._write(key, verdict)

    def _remember(self, key: CheckKey, verdict: CheckVerdict) -> None:
        self._entries[key] = verdict
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _path(self, key: CheckKey) -> Path | None:
        if self.directory is None:
            return None
        if not (_SHA256.fullmatch(key.program_sha256) and _SHA256.fullmatch(key.state_sha256)):
            return None  # never a path from anything but two digests
        name = f"{key.program_sha256}-{key.state_sha256}.json"
        return self.directory / hashlib.sha256(key.version.encode()).hexdigest()[:32] / name

    def _read(self, key: CheckKey) -> CheckVerdict | None:
        path = self._path(key)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read(MAX_VERDICT_FILE_BYTES + 1)[:MAX_VERDICT_FILE_BYTES])
            verdict = Verdict(doc["verdict"])
            if verdict not in CACHED_VERDICTS or doc.get("version") != key.version:
                raise ValueError(f"not a verdict of this check: {verdict}")
            return CheckVerdict(verdict, str(doc["reason"]), float(doc["flops_per_sample"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("program check verdict %s ignored: %s", path, e)
            return None

    def _write(self, key: CheckKey, verdict: CheckVerdict) -> None:
        path = self._path(key)
        if path is None:
            return
        doc = {
            "version": key.version,
            "verdict": verdict.verdict.value,
            "reason": verdict.reason,
            "flops_per_sample": verdict.flops_per_sample,
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verdict-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("program check verdict not kept in %s: %s", path.parent, e)

    async def verdict(self, key: CheckKey, check: Callable[[], Awaitable[Inspection]]) -> Outcome:
        """The verdict for ``key``: remembered, or that of a check of it in progress, or of
        ``check()`` run now. A check that fails (an exception, the caller cancelled) leaves
        its waiters to try again."""
        while True:
            found = self.get(key)
            if found is not None:
                self.hits += 1
                return Outcome(found, checked=False)
            flight = self._flights.get(key)
            if flight is None:
                break
            await asyncio.wait({flight})
            if not flight.cancelled():
                self.hits += 1
                return Outcome(flight.result(), checked=False)
        flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            inspection = await check()
        except BaseException:
            flight.cancel()  # its waiters try again
            raise
        finally:
            del self._flights[key]
        self.checks += 1
        result = CheckVerdict.of(inspection)
        self.put(key, result)
        flight.set_result(result)
        return Outcome(result, checked=True)
