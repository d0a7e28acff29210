"""scripts/bench_market.py runs and prints its one JSON line with the issue's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_market.py"


def test_the_bench_prints_one_json_line_and_meets_its_goal() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--instances", "40", "--offers", "10"],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    figures = json.loads(lines[0])
    for key in ("cost_over_optimal", "cheapest_first_over_optimal", "fastest_first_over_optimal"):
        assert figures[key] >= 1.0
    assert figures["cost_over_optimal"] <= 1.10 and figures["goal_met"]
