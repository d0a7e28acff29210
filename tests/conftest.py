"""Session-wide test setup."""

from __future__ import annotations

import compileall
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochmesh.export_cache import ENV_CACHE_DIR

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("epochmesh", "client", "coordinator", "node_agent")
_CACHE_DIR: str | None = None
# Where the suite's time goes: with this set to a file, every test appends one JSON line with
# its wall time and the CPU time the whole machine was busy meanwhile (from /proc/stat: the
# test's processes and anything else running; run alone, that is the test's own). A test whose
# CPU is a small share of its wall time waits (leases, deadlines, polling), and two workers
# overlap it; one whose CPU is near its wall time needs less work to be faster.
ENV_CPU_LOG = "EPOCHMESH_TEST_CPU_LOG"
# A folder for the run's export cache and program-check verdicts given by the caller (the test
# command's two pytest runs share one, which it removes): models exported and programs checked
# by the first run are not exported and checked again by the second.
ENV_SHARED_CACHE = "EPOCHMESH_TEST_SHARED_CACHE"


def _precompile() -> None:
    """The suite starts hundreds of Python processes (CLI calls, coordinators, agents, token
    creation) that import the project from source. Where PYTHONDONTWRITEBYTECODE is set none of
    them writes bytecode, so every one compiles the same modules again (0.1-0.2 s each): compile
    them once here (py_compile writes atomically; up-to-date files are skipped, and Python
    ignores a .pyc whose source changed since)."""
    if not (sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return  # the processes write their bytecode themselves
    for package in PACKAGES:
        compileall.compile_dir(ROOT / package, quiet=2, workers=1)


def _busy_cpu_s() -> float:
    """CPU seconds the machine has been busy since boot (all cores; not idle, not iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    path = os.environ.get(ENV_CPU_LOG)
    if not path:
        yield
        return
    wall0, cpu0 = time.monotonic(), _busy_cpu_s()
    yield
    line = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall0, 2),
        "busy_cpu_s": round(_busy_cpu_s() - cpu0, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
    }
    with open(path, "a") as log:  # one short line per write: appends do not interleave
        log.write(json.dumps(line) + "\n")


def pytest_configure() -> None:
    # The suite sends SIGINT (Ctrl-C) to the CLI processes it starts. A run launched as a
    # background job of a non-interactive shell starts with SIGINT ignored, an ignored signal
    # stays ignored across exec, and Python then installs no KeyboardInterrupt handler: those
    # tests would see Ctrl-C do nothing. A handler here is reset to the default on exec, so
    # every process the suite starts gets SIGINT as a user's terminal would deliver it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _precompile()
    # Every `epochmesh submit` the suite runs shares one export cache of this session (never
    # the developer's ~/.cache): the same example models are exported once, not per test.
    # pytest-xdist's workers inherit the controller's folder (its writers replace entries
    # atomically), so a model is exported once per run, not once per worker; the controller
    # removes it.
    global _CACHE_DIR
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    given = os.environ.get(ENV_SHARED_CACHE)
    if given:
        os.environ[ENV_CACHE_DIR] = given  # the caller's, left for the caller to remove
    elif worker and os.environ.get(ENV_CACHE_DIR, "").startswith(_shared_cache_prefix()):
        pass  # the controller's folder
    elif _CACHE_DIR is None:
        _CACHE_DIR = tempfile.mkdtemp(prefix="epochmesh-test-cache-")
        os.environ[ENV_CACHE_DIR] = _CACHE_DIR
    if worker:
        # Each worker has a core's share: torch's intra-op threads (one per core by default)
        # would only contend with the other worker's.
        import torch

        torch.set_num_threads(1)


def _shared_cache_prefix() -> str:
    return os.path.join(tempfile.gettempdir(), "epochmesh-test-cache-")


def pytest_unconfigure() -> None:
    global _CACHE_DIR
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
        os.environ.pop(ENV_CACHE_DIR, None)
        _CACHE_DIR = None


# Under pytest-xdist, the whole clusters first: a worker that is handed a many-minute system test
# near the end of the run leaves the other worker idle meanwhile; with these first, what is left
# at the end are tests of a second or less, which `--dist worksteal` (scripts/test.sh) spreads.
_RUN_FIRST = ("tests/system/", "tests/integration/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the collection's order

    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, p in enumerate(_RUN_FIRST) if path.startswith(p)), len(_RUN_FIRST))

    items.sort(key=rank)  # stable: a file's tests keep their order, as every worker sees it
