"""`epochmesh-coordinator dev --agents N`: a coordinator and N agents on this machine, a
logged-in CLI, the next commands printed on stdout; SIGINT stops every process and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.procs import console_script, wait_until

pytestmark = pytest.mark.timeout(300)


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_dev_starts_a_cluster_prints_how_to_use_it_and_stops_on_sigint(tmp_path: Path) -> None:
    out_path, err_path = tmp_path / "dev.out", tmp_path / "dev.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [
                str(console_script("epochmesh-coordinator")),
                "dev",
                "--agents",
                "2",
                "--data-dir",
                str(tmp_path / "dev"),
            ],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:

        def printed() -> str:
            if proc.poll() is not None:
                raise AssertionError(f"dev exited with {proc.returncode}: {err_path.read_text()}")
            text = out_path.read_text()
            return text if "Ctrl-C" in text else ""

        text = str(wait_until(printed, timeout=180, interval=0.2, message="no instructions"))
        config = next(
            line.split("=", 1)[1]
            for line in text.splitlines()
            if line.strip().startswith("export XDG_CONFIG_HOME=")
        )
        assert "nodes" in text and "submit examples/zen/job.toml" in text, text
        env = dict(os.environ, XDG_CONFIG_HOME=config)
        env.pop("EPOCHMESH_COORDINATOR", None)

        def two_nodes() -> bool:
            listed = subprocess.run(
                [str(console_script("epochmesh")), "nodes", "--output", "json"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            assert listed.returncode == 0, listed.stderr
            return len(json.loads(listed.stdout)["nodes"]) == 2

        wait_until(two_nodes, timeout=120, interval=0.5, message="the CLI never listed 2 nodes")
        children = _descendants(proc.pid)
        assert len(children) >= 3, children  # the coordinator and two agents at least
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, err_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(
        lambda: not any(_alive(pid) for pid in children),
        timeout=30,
        message=f"processes left behind: {[p for p in children if _alive(p)]}",
    )
    assert (tmp_path / "dev" / "coordinator.log").exists()
