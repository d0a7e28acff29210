"""Inspection children's working dirs carry their maker's pid; the directories of processes
that are gone (a coordinator killed with -9) are removed by the next maker, nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epochmesh.program.workdirs import PREFIX, inspection_workdir, owner_pid, sweep_stale

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_only_the_dirs_of_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_dir = tmp_path / f"{PREFIX}{_dead_pid()}-abc"
        (dead_dir / "sub").mkdir(parents=True)
        (dead_dir / "sub" / "f").write_bytes(b"x")
        live_dir = tmp_path / f"{PREFIX}{live.pid}-def"
        live_dir.mkdir()
        mine = tmp_path / f"{PREFIX}{os.getpid()}-ghi"
        mine.mkdir()
        old_style = tmp_path / f"{PREFIX}q1w2e3"  # made before names carried a pid
        old_style.mkdir()
        other = tmp_path / "something-else-1"
        other.mkdir()

        assert sweep_stale(tmp_path) == 1
        assert not dead_dir.exists()
        assert live_dir.exists() and mine.exists() and old_style.exists() and other.exists()
    finally:
        live.kill()
        live.wait(timeout=30)


def test_names_carry_the_makers_pid() -> None:
    with inspection_workdir() as name:
        assert owner_pid(Path(name).name) == os.getpid()
    assert owner_pid("epochmesh-inspect-abc") is None
    assert owner_pid("other-123-x") is None
