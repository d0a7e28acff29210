"""scripts/profile_suite_cpu.py's grouping: command lines blurred into kinds, forks apart,
the CPU a process had before the run left out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_suite_cpu.py"
pytestmark = pytest.mark.timeout(30)


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_suite_cpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_kinds_blur_addresses_paths_and_numbers() -> None:
    p = load()
    a = p.kind_of("/w/.venv/bin/python /w/.venv/bin/epochmesh-agent --coordinator 127.0.0.1:4411")
    b = p.kind_of("/x/.venv/bin/python /x/.venv/bin/epochmesh-agent --coordinator 127.0.0.1:5")
    assert a == b == "python epochmesh-agent --coordinator ADDR"
    assert p.kind_of("python -m node_agent.sandbox.zygote 22") == (
        "python -m node_agent.sandbox.zygote N"
    )


def test_forks_are_counted_apart_and_earlier_cpu_is_left_out() -> None:
    p = load()
    seen = [
        p.Seen(10, 1, "python -m zygote 3", cpu_s=2.5, base_s=0.0),
        p.Seen(11, 10, "python -m zygote 3", cpu_s=4.0, base_s=0.0),
        p.Seen(12, 10, "python -m zygote 3", cpu_s=1.0, base_s=0.0),
        p.Seen(13, 1, "python -m zygote 4", cpu_s=2.0, base_s=0.0),
        p.Seen(2, 1, "/sbin/init", cpu_s=50.0, base_s=49.0),  # older than the run
        p.Seen(3, 1, "idle daemon", cpu_s=7.0, base_s=7.0),  # used nothing during it
    ]
    rows = {r["kind"]: (r["processes"], r["cpu_s"]) for r in p.summarise(seen)}
    assert rows == {
        "python -m zygote N": (2, 4.5),
        "fork of python -m zygote N": (2, 5.0),
        "init": (1, 1.0),
    }
