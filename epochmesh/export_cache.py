"""A content-addressed cache of exported programs, on the submitter's machine.

`epochmesh submit` spends most of its seconds in torch.export and in the checks around it (the
eager trial of model.py and the load-back check, each in a fresh Python process). Submitting
the same model again (another dataset of the same shapes, other hyperparameters, another
coordinator) gives the same program, so `epochmesh.packaging.build_job` looks it up here first.

The key is the sha256 of a canonical JSON document (`cache_key`) of everything that decides the
program's bytes and the verdict of the checks `build_job` ran before storing it: the Python and
torch versions, the installed distributions, torch's environment variables, epochmesh's own
source, the model's sources (`model_sources`: every file under model.py's folder but the
dataset and job.toml, and every module model.py pulled in from outside the installed
packages), the loss, the initial parameters (which pin make_model() and the seed), and the
example batch the export traced and the checks ran (dtypes, shapes and values). A changed model
file, loss, seed, shape or trial batch is another key: a miss.

Layout: ROOT/exports/KEY[:2]/KEY, one file per program: a header line
``epochmesh-export-cache 1 SHA256 SIZE`` and the program's bytes. An entry that does not match
its header (truncated, corrupted) is ignored and removed. Writers write a temporary file next
to the entry and `os.replace` it into place, so concurrent submits never see half an entry.
Past `max_bytes` (default 2 GiB) the least recently used entries go.
Every cache failure (a read-only disk, a full one) is logged and the export runs as without a
cache: the cache never fails a submit.

ROOT: $EPOCHMESH_CACHE_DIR, else $XDG_CACHE_HOME/epochmesh, else ~/.cache/epochmesh.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import site
import struct
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from epochmesh.wire.safetensors_file import safetensors_header

log = logging.getLogger(__name__)

ENV_CACHE_DIR = "EPOCHMESH_CACHE_DIR"
FORMAT = 1
MAGIC = b"epochmesh-export-cache"
DEFAULT_MAX_BYTES = 2 << 30
MAX_HEADER_BYTES = 256
# The walk of model.py's folder: past this many entries it is not a job folder (a home
# directory, say) and the cache stays off for that build.
MAX_SOURCE_ENTRIES = 2000
HASHED_FILE_BYTES = 1 << 20  # files up to this size are keyed by content, larger by size+mtime
STALE_TEMP_S = 3600.0
_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})


def default_root(env: Mapping[str, str] | None = None) -> Path:
    """$EPOCHMESH_CACHE_DIR, else $XDG_CACHE_HOME/epochmesh, else ~/.cache/epochmesh."""
    env = os.environ if env is None else env
    explicit = env.get(ENV_CACHE_DIR, "")
    if explicit:
        return Path(explicit).expanduser()
    base = env.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "epochmesh"


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_digest(blob: bytes) -> str:
    """sha256 of safetensors bytes that does not depend on the order of the header's keys
    (safetensors writes `__metadata__` in an order that changes from call to call)."""
    header = safetensors_header(blob)
    (n,) = struct.unpack("<Q", blob[:8])
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    h.update(memoryview(blob)[8 + n :])
    return h.hexdigest()


def cache_key(parts: Mapping[str, Any]) -> str:
    """sha256 of `parts` as canonical JSON, with this format's version and the environment."""
    document = {"format": FORMAT, "environment": environment(), **parts}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return _sha256(text.encode())


def environment() -> dict[str, Any]:
    """What of this interpreter can change an exported program: Python, the machine, the
    installed distributions (torch's version among them), torch's environment variables and
    epochmesh's own source."""
    return {
        "python": sys.version,
        "implementation": sys.implementation.cache_tag,
        "machine": f"{sys.platform}/{platform.machine()}",
        "distributions": _distributions(),
        "torch_env": _torch_environment(),
        "epochmesh": _epochmesh_source(),
    }


def _torch_environment() -> dict[str, str]:
    """TORCH*/PYTORCH* variables, but where caches live (torch sets TORCHINDUCTOR_CACHE_DIR
    itself on its first compile)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("TORCH", "PYTORCH")) and "CACHE" not in k
    }


def _distributions() -> list[str]:
    """Names (with their versions) of the *.dist-info and *.egg-info on sys.path: cheaper than
    importlib.metadata, and just as telling of an upgrade."""
    found: set[str] = set()
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as it:
                found.update(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
    return sorted(found)


_SOURCE_DIGEST: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    """sha256 of a file's content, remembered per (path, size, mtime) in this process."""
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns)
    digest = _SOURCE_DIGEST.get(memo)
    if digest is None:
        digest = _SOURCE_DIGEST[memo] = _sha256(path.read_bytes())
    return digest


def _epochmesh_source() -> str:
    """One digest of every Python file of the epochmesh package (LossWrapper, the checks, the
    archive rules, the confinement: a change to any of them is another key)."""
    package = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(_file_digest(path).encode() + b"\n")
    return h.hexdigest()


def installed_roots() -> tuple[str, ...]:
    """Folders of the standard library and installed packages (their versions are keyed through
    `environment`, not their files)."""
    roots = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(AttributeError):
        roots.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        roots.add(site.getusersitepackages())
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


def model_sources(
    folder: Path, exclude: Iterable[Path] = (), modules: Iterable[ModuleType] = ()
) -> dict[str, str] | None:
    """Digests of what model.py may read: every file under `folder` (hidden ones and
    __pycache__ aside; files up to 1 MiB by content, larger ones by size and modification time)
    but those in `exclude` (the dataset, job.toml: their relevant parts are keyed on their own),
    and the source of each module in `modules` (those model.py imported) from outside `folder`
    and the installed packages. None when the folder holds too many entries to be a job's."""
    folder = folder.resolve()
    skipped = {os.path.realpath(p) for p in exclude}
    out: dict[str, str] = {}
    seen = 0
    for top, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        seen += len(dirs) + len(files)
        if seen > MAX_SOURCE_ENTRIES:
            log.info("export cache off: more than %d entries under %s", MAX_SOURCE_ENTRIES, folder)
            return None
        for name in sorted(files):
            path = Path(top) / name
            if name.startswith(".") or os.path.realpath(path) in skipped:
                continue
            rel = path.relative_to(folder).as_posix()
            try:
                st = path.stat()
                if name.endswith(".py") or st.st_size <= HASHED_FILE_BYTES:
                    out[rel] = _file_digest(path)
                else:
                    out[rel] = f"size={st.st_size},mtime={st.st_mtime_ns}"
            except OSError as e:
                out[rel] = f"unreadable:{type(e).__name__}"
    roots = installed_roots()
    inside = str(folder) + os.sep
    for module in modules:
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file:
            continue
        real = os.path.realpath(file)
        if real.startswith(inside) or real.startswith(roots):
            continue
        try:
            out[f"module:{module.__name__}:{real}"] = _file_digest(Path(real))
        except OSError as e:
            out[f"module:{module.__name__}:{real}"] = f"unreadable:{type(e).__name__}"
    return out


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int


class ExportCache:
    """Exported programs by key under `root`/exports (see the module's docstring)."""

    def __init__(
        self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES, *, reuse: bool = True
    ) -> None:
        self.root = Path(root)
        self.dir = self.root / "exports"
        self.max_bytes = max_bytes
        self.reuse = reuse  # False: `get` finds nothing, `put` still stores (a refresh)

    @classmethod
    def default(cls, env: Mapping[str, str] | None = None, *, reuse: bool = True) -> ExportCache:
        return cls(default_root(env), reuse=reuse)

    def path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a sha256 hex key: {key!r}")
        return self.dir / key[:2] / key

    def get(self, key: str) -> bytes | None:
        """The program stored under `key`, or None (absent, or not matching its header: then
        removed)."""
        path = self.path(key)
        if not self.reuse:
            return None
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("export cache: cannot read %s: %s", path, e)
            return None
        program = _parse_entry(blob)
        if program is None:
            log.warning("export cache: ignoring the corrupt entry %s", path)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: pruned last
        return program

    def put(self, key: str, program: bytes) -> bool:
        """Store `program` under `key` (atomically); False when it could not be stored."""
        if len(program) > self.max_bytes:
            log.info("export cache: a program of %d bytes is over its limit", len(program))
            return False
        path = self.path(key)
        header = b"%s %d %s %d\n" % (MAGIC, FORMAT, _sha256(program).encode(), len(program))
        tmp = ""
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(program)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("export cache: cannot store %s: %s", path, e)
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False
        self.prune()
        return True

    def prune(self) -> None:
        """Remove the least recently used entries past `max_bytes`, and temporary files that a
        killed writer left behind."""
        entries: list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            for path in self.dir.glob("*/*"):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    if path.name.startswith(".tmp-"):
                        if now - st.st_mtime > STALE_TEMP_S:
                            path.unlink()
                        continue
                    entries.append((st.st_mtime, st.st_size, path))
        except OSError as e:
            log.warning("export cache: cannot list %s: %s", self.dir, e)
            return
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size

    def stats(self) -> CacheStats:
        sizes = [p.stat().st_size for p in self.dir.glob("*/*") if not p.name.startswith(".")]
        return CacheStats(entries=len(sizes), bytes=sum(sizes))


def _parse_entry(blob: bytes) -> bytes | None:
    """The program of an entry's bytes, or None when they do not match the header."""
    end = blob.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        return None
    fields = blob[:end].split(b" ")
    if len(fields) != 4 or fields[0] != MAGIC or fields[1] != b"%d" % FORMAT:
        return None
    digest, size = fields[2].decode(errors="replace"), fields[3]
    program = blob[end + 1 :]
    if not size.isdigit() or int(size) != len(program) or _sha256(program) != digest:
        return None
    return program
