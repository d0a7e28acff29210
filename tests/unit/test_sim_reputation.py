"""scripts/sim_reputation.py on a small fleet: one JSON line, overheads within the issue's
budgets, every cheat from a new node caught within the issue's round limits, none uncaught."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sim_reputation.py"


def load_sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_reputation", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_reputation"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_the_simulation_prints_one_json_line_within_budgets_and_limits(
    seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = load_sim()
    args = ["--seed", str(seed), "--nodes", "12", "--rounds", "400", "--cheaters-per-kind", "4"]
    returned = sim.main(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    figures = json.loads(lines[0])
    assert figures == returned
    for key in (
        "overhead_new",
        "overhead_trusted",
        "max_rounds_to_catch",
        "mean_rounds_to_catch",
        "max_rounds_to_catch_trusted",
        "false_accusations",
    ):
        assert key in figures
    assert 0 < figures["overhead_new"] <= 0.10
    assert 0 < figures["overhead_trusted"] <= 0.02
    limits = figures["round_limits"]
    for kind, worst in figures["max_rounds_to_catch"].items():
        assert worst is not None and worst <= limits[kind], kind
        assert 1 <= figures["mean_rounds_to_catch"][kind] <= worst
    assert figures["within_limits"] and figures["uncaught"] == []
    assert all(v is not None for v in figures["max_rounds_to_catch_trusted"].values())
    assert figures["false_accusations"] == 0
