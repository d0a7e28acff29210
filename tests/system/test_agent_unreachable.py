"""An agent whose coordinator is not there: it retries at growing intervals (1 s, 2 s, 4 s ...
up to 60 s, with jitter), says so once as a warning (what it tries, when it retries), and
logs each later attempt at debug level only."""

from __future__ import annotations

import re
import signal
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from tests.procs import console_script, create_token, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _attempt_times(text: str) -> list[float]:
    """When each enrollment attempt failed: the warning's line, then the debug lines."""
    times = []
    for line in text.splitlines():
        if "unreachable (Enroll" in line or "Enroll attempt" in line:
            match = STAMP.match(line)
            assert match, line
            times.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return times


def test_retries_at_growing_intervals_and_warns_once(tmp_path: Path) -> None:
    token = create_token(tmp_path / "coord", "node")  # a CA, but no coordinator ever runs
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                str(console_script("epochmesh-agent")),
                "--coordinator",
                address,
                "--data-dir",
                str(tmp_path / "agent"),
                "--token",
                token,
                "--device",
                "cpu",
                "--log-level",
                "DEBUG",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_until(
            lambda: len(_attempt_times(log_path.read_text())) >= 4 or proc.poll() is not None,
            timeout=60,
            interval=0.2,
            message="fewer than 4 enrollment attempts",
        )
        assert proc.poll() is None, log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = log_path.read_text()
    times = _attempt_times(text)[:4]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Waits of 1, 2 and 4 s, each shortened by at most a quarter (the attempts themselves
    # add a little): every one longer than the one before.
    assert gaps[0] >= 0.7, gaps
    assert gaps[1] >= 1.45 and gaps[1] > gaps[0], gaps
    assert gaps[2] >= 2.95 and gaps[2] > gaps[1], gaps
    warnings = [line for line in text.splitlines() if " WARNING " in line and "unreachable" in line]
    assert len(warnings) == 1, warnings
    assert "retrying in" in warnings[0] and "up to 60 s" in warnings[0], warnings[0]
    assert re.search(r"Enroll attempt 3 failed .*; next attempt in \d", text), text[-2000:]
