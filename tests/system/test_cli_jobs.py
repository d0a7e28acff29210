"""Job-level CLI commands end to end: a real coordinator with the training engine, real agents,
and ``epochmesh`` subprocesses: submit --watch, status, rounds, download, allocation, logs,
plot, cancel, and ``watch`` on a terminal (tmux, or a pseudo-terminal with a tiny screen
model where tmux is missing)."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import termios
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import MLP_DIR, write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_cli_support import (
    EPOCHMESH,
    AgentProc,
    Cli,
    CliResult,
    assert_clean_error,
    engine_available,
    wait_for_nodes,
)

ENGINE_AVAILABLE = engine_available()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not ENGINE_AVAILABLE,
        reason="epochmesh-coordinator runs without the training engine (coordinator/engine/engine.py)",
    ),
]

SAMPLES = 512


def write_job(root: Path, *, name: str, epochs: int, global_batch: int = 64) -> Path:
    """The fixtures' tiny MLP job with SAMPLES samples under ``root``; returns job.toml."""
    return write_mlp_job(
        root,
        SAMPLES,
        overrides={"name": name, "train": {"epochs": epochs, "global_batch": global_batch}},
    )


def fixture_state_dict() -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("cli_test_mlp", MLP_DIR / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.make_model().state_dict())


@dataclass
class JobCluster:
    address: str
    root: Path
    cli: Cli
    finished: CliResult  # `submit --watch` of the short job
    finished_id: str
    spec: Path


@pytest.fixture(name="jobs", scope="module")
def jobs_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobCluster]:
    root = tmp_path_factory.mktemp("cli-jobs")
    coord = start_coordinator(root / "coordinator", "--heartbeat-interval", "0.5")
    agents: list[AgentProc] = []
    try:
        agents.append(AgentProc(coord.address, root / "fast", "fast"))
        agents.append(AgentProc(coord.address, root / "slow", "slow", "--slowdown", "2"))
        wait_for_nodes(coord.address, ["fast", "slow"], agents=agents)
        cli = Cli(coord.address, root / "config")
        spec = write_job(root / "short", name="short", epochs=2)
        finished = cli.run("submit", str(spec), "--watch", timeout=150)
        assert finished.code == 0, (finished.stdout, finished.stderr)
        job_id = finished.stdout.strip().splitlines()[0]
        yield JobCluster(coord.address, root, cli, finished, job_id, spec)
    finally:
        for agent in agents:
            agent.stop()
        coord.kill9()


def test_submit_watch_plain_progress(jobs: JobCluster) -> None:
    result = jobs.finished
    assert re.fullmatch(r"j-\S+", jobs.finished_id)
    err = result.stderr
    assert "\r" not in err and "\x1b" not in err  # not a TTY: plain lines
    assert "Traceback" not in err
    lines = err.splitlines()
    assert any(line.startswith("uploading ") and "(100%)" in line for line in lines), err
    rounds = [line for line in lines if re.search(r"\bround \d+\b", line) and " loss " in line]
    assert len(rounds) >= 2, err
    assert any("epoch 2/2" in line for line in rounds), err
    assert "nodes: " in rounds[-1] and "b=" in rounds[-1]
    assert "succeeded" in err


def test_status_of_one_job_and_all(jobs: JobCluster) -> None:
    cli = jobs.cli
    one = cli.run("status", jobs.finished_id, "--output", "json")
    assert one.code == 0, one.stderr
    job = one.json()
    assert job["job_id"] == jobs.finished_id and job["state"] == "succeeded"
    assert job["samples_done"] == job["samples_total"] == 2 * SAMPLES
    text = cli.run("status", jobs.finished_id)
    assert "succeeded" in text.stdout and "100.0%" in text.stdout
    listing = cli.run("status")
    assert listing.code == 0 and jobs.finished_id in listing.stdout
    assert all(len(line) <= 80 for line in listing.stdout.splitlines())
    # A unique prefix and the job's name work too.
    assert cli.run("status", jobs.finished_id[:6], "--output", "json").json()["job_id"] == (
        jobs.finished_id
    )


def test_rounds_json_lines_cover_every_sample_once_per_epoch(jobs: JobCluster) -> None:
    result = jobs.cli.run("rounds", jobs.finished_id, "--output", "json")
    assert result.code == 0, result.stderr
    rounds = result.json_lines()
    assert rounds and [r["round"] for r in rounds] == sorted(r["round"] for r in rounds)
    covered: dict[int, list[int]] = {}
    for r in rounds:
        assert {"epoch", "round", "loss", "parts"} <= set(r)
        for part in r["parts"]:
            assert {"node_id", "local_batch", "ranges", "mean_loss", "seconds"} <= set(part)
            if part["status"] not in ("", "applied"):
                continue
            size = sum(stop - start for start, stop in part["ranges"])
            assert size == part["local_batch"]
            for start, stop in part["ranges"]:
                covered.setdefault(r["epoch"], []).extend(range(start, stop))
    assert sorted(covered) == [0, 1]
    for indices in covered.values():
        assert sorted(indices) == list(range(SAMPLES))
    table = jobs.cli.run("rounds", jobs.finished_id)
    assert table.stdout.splitlines()[0].split()[:3] == ["EPOCH", "ROUND", "LOSS"]


def test_download_writes_state_dict_keys(jobs: JobCluster, tmp_path: Path) -> None:
    result = jobs.cli.run("download", jobs.finished_id, "-o", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    path = tmp_path / "out" / "model.safetensors"
    assert result.stdout.strip() == str(path)
    tensors = load_file(str(path))
    expected = fixture_state_dict()
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert tensors[key].shape == value.shape and tensors[key].dtype == value.dtype
        assert torch.isfinite(tensors[key]).all()
    again = jobs.cli.run(
        "download", jobs.finished_id, "-o", str(tmp_path / "out"), "--output", "json"
    )
    assert again.json()["path"] == str(path)


def test_allocation_logs_and_cancel_of_finished_job(jobs: JobCluster) -> None:
    cli = jobs.cli
    alloc = cli.run("allocation", jobs.finished_id, "--output", "json")
    assert alloc.code == 0, alloc.stderr
    assert alloc.json()["job_id"] == jobs.finished_id
    assert cli.run("allocation", jobs.finished_id).code == 0
    logs = cli.run("logs", jobs.finished_id, "--output", "json")
    assert logs.code == 0, logs.stderr
    events = logs.json_lines()
    assert events and all(e["job_id"] == jobs.finished_id for e in events)
    assert_clean_error(
        cli.run("cancel", jobs.finished_id), 6, "already succeeded", "nothing to cancel"
    )


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the plot extra) is not installed")
def test_plot_writes_png(jobs: JobCluster, tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    result = jobs.cli.run("plot", jobs.finished_id, "-o", str(out))
    assert result.code == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(jobs: JobCluster, tmp_path: Path) -> None:
    # A `matplotlib` that fails to import, first on the path: what a missing extra looks like.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = jobs.cli.env(PYTHONPATH=str(tmp_path / "site"))
    result = jobs.cli.run("plot", jobs.finished_id, "-o", str(tmp_path / "x.png"), env=env)
    assert_clean_error(result, 2, "matplotlib", "pip install 'epochmesh[plot]'")


# -- a long job: download too early, watch on a terminal, cancel ------------------------------


class Screen:
    """A tiny terminal model: enough of VT100 for the CLI's live block (CR, LF, cursor up,
    erase line, erase below, SGR colors ignored), with line wrapping at ``cols``."""

    CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")

    def __init__(self, cols: int = 100, rows: int = 40) -> None:
        self.cols, self.rows = cols, rows
        self.lines: list[list[str]] = [[]]
        self.row = self.col = 0

    def feed(self, text: str) -> None:
        pos = 0
        while pos < len(text):
            match = self.CSI.match(text, pos)
            if match:
                self._csi(match.group(1), match.group(2))
                pos = match.end()
                continue
            self._char(text[pos])
            pos += 1

    def _line(self) -> list[str]:
        while len(self.lines) <= self.row:
            self.lines.append([])
        return self.lines[self.row]

    def _char(self, ch: str) -> None:
        if ch == "\r":
            self.col = 0
        elif ch == "\n":
            self.row += 1
            self.col = 0
            self._line()
        elif ch >= " ":
            if self.col >= self.cols:
                self.row += 1
                self.col = 0
            line = self._line()
            line.extend(" " * (self.col + 1 - len(line)))
            line[self.col] = ch
            self.col += 1

    def _csi(self, params: str, op: str) -> None:
        n = int(params) if params.isdigit() else 1
        if op == "A":
            self.row = max(0, self.row - n)
        elif op == "K":
            line = self._line()
            if params in ("2",):
                line.clear()
            else:
                del line[self.col :]
        elif op == "J":
            del self._line()[self.col :]
            del self.lines[self.row + 1 :]

    def text(self) -> str:
        return "\n".join("".join(line).rstrip() for line in self.lines).rstrip()


def _watch_under_pty(cli: Cli, job_id: str, until: re.Pattern[str], timeout: float) -> str:
    """Runs `epochmesh watch` on a pseudo-terminal and returns the screen once ``until``
    matches it (and it has been redrawn at least twice)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(
        [EPOCHMESH, "watch", job_id],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=cli.env(TERM="xterm"),
        close_fds=True,
    )
    os.close(slave)
    screen = Screen(cols=100)
    raw = ""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536).decode(errors="replace")
                except OSError:
                    break
                raw += chunk
                screen.feed(chunk)
                if until.search(screen.text()) and raw.count("\x1b[J") >= 2:
                    return screen.text()
            if proc.poll() is not None:
                break
        raise AssertionError(f"screen never matched {until.pattern!r}:\n{screen.text()}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        os.close(master)


def _watch_under_tmux(cli: Cli, job_id: str, until: re.Pattern[str], timeout: float) -> str:
    """Runs `epochmesh watch` in a detached tmux pane (100x40) and returns the captured screen
    once ``until`` matches it twice in a row with different round numbers (so it redrew)."""
    sock = f"em-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
    command = f"'{EPOCHMESH}' watch {job_id}; sleep 60"
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "w", "-x", "100", "-y", "40", command],
        check=True,
        env=cli.env(TERM="xterm"),
        timeout=20,
    )
    try:
        seen_rounds: set[str] = set()

        def screen_ready() -> str | None:
            out = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "w"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            match = until.search(out)
            if match:
                rnd = re.search(r"round (\d+)", out)
                seen_rounds.add(rnd.group(1) if rnd else "")
                if len(seen_rounds) >= 2:
                    return out
            return None

        return str(wait_until(screen_ready, timeout=timeout, interval=0.2))
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=20, check=False)


SCREEN_READY = re.compile(
    r"round [1-9]\d*.*\n.*loss \d.*eta.*\nloss \S+.*\n.*NODE\s+NAME\s+SAMPLES/S"
)


def _check_screen(screen: str, job_id: str) -> None:
    lines = screen.splitlines()
    headers = [line for line in lines if line.startswith(f"job {job_id}")]
    assert len(headers) == 1, f"the block was not redrawn in place:\n{screen}"
    top = lines.index(headers[0])
    block = lines[top:]
    assert "running" in block[0] and re.search(r"epoch \d+/50", block[0]), screen
    assert re.search(r"\[[#-]{30}\]\s+\d+\.\d%\s+loss \d+\.\d{4}\s+eta \S+", block[1]), screen
    assert block[2].startswith("loss ") and len(block[2].split()[1]) >= 2, screen
    table = block[3:]
    assert table[0].split() == ["NODE", "NAME", "SAMPLES/S", "SHARE", "B_I"], screen
    names = {row.split()[1] for row in table[1:] if row.strip()}
    assert names & {"fast", "slow"}, screen
    assert all("%" in row for row in table[1:] if row.strip()), screen


def test_long_job_download_early_watch_tty_and_cancel(jobs: JobCluster, tmp_path: Path) -> None:
    cli = jobs.cli
    spec = write_job(tmp_path / "long", name="long", epochs=50, global_batch=32)
    submitted = cli.run("submit", str(spec), timeout=120)
    assert submitted.code == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    # The dataset is the short job's: its shard is already on the coordinator, not re-sent.
    assert "blobs already there" in submitted.stderr, submitted.stderr
    # The model is the short job's too: its exported program comes from the export cache.
    assert "the exported program came from the cache" in submitted.stderr, submitted.stderr
    assert f"epochmesh watch {job_id}" in submitted.stderr

    early = cli.run("download", job_id, "-o", str(tmp_path / "early"))
    assert_clean_error(early, 6, "has not finished", f"epochmesh watch {job_id}")
    assert not (tmp_path / "early" / "model.safetensors").exists()

    if shutil.which("tmux"):
        _check_screen(_watch_under_tmux(cli, job_id, SCREEN_READY, 90), job_id)
    _check_screen(_watch_under_pty(cli, job_id, SCREEN_READY, 90), job_id)

    # A plain watcher in the background must end with exit 5 once the job is cancelled.
    watcher = cli.popen("watch", job_id)
    cancelled = cli.run("cancel", job_id)
    assert cancelled.code == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout
    try:
        assert watcher.wait(timeout=60) == 5
        err = watcher.stderr.read() if watcher.stderr else ""
        assert f"error: job {job_id} cancelled" in err and "Traceback" not in err
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert_clean_error(cli.run("cancel", job_id), 6, "already cancelled")
    assert_clean_error(cli.run("download", job_id, "-o", str(tmp_path / "x")), 6, "cancelled")
    # Watching a job that already ended shows its last state and exits 5 at once.
    watch_again = cli.run("watch", job_id, timeout=30)
    assert watch_again.code == 5, watch_again.stderr
    assert f"error: job {job_id} cancelled" in watch_again.stderr
    assert "Traceback" not in watch_again.stderr and watch_again.stdout == ""
    status = cli.run("status", job_id, "--output", "json").json()
    assert status["state"] == "cancelled"
