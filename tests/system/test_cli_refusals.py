"""``epochmesh submit`` refuses a hostile model on the submitter's machine (issue 17): the real
console script against a real coordinator, one clear error line, nothing uploaded or stored.

The model (tests/fixtures/hostile.py SPARSE_OUT_OF_RANGE) writes out of bounds when it runs: the
CLI's eager trial run happens in a Python process of its own (where it may crash), and the
export's archive check names the sparse operator, which is the message the submitter gets.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import dump_toml, write_mlp_job
from tests.fixtures.hostile import CRASH_WHEN_RUN, SPARSE_OUT_OF_RANGE, write_model
from tests.procs import start_coordinator
from tests.system.test_cli_support import Cli

pytestmark = pytest.mark.timeout(180)

SPARSE_REFUSAL = re.compile(
    r"error: the exported program would be refused by agents: operator "
    r"aten\.(sparse_coo_tensor|_sparse_coo_tensor_with_dims_and_tensors)\.\w+ is not allowed "
    r"\(not on epochmesh's operator allow-list: sparse, nested and quantized tensors, raw "
    r"storage/stride access and file operators are refused\)"
)


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    with start_coordinator(tmp_path / "coordinator") as coord:
        yield Cli(coord.address, tmp_path / "config")


def test_submit_refuses_a_sparse_model_naming_its_operator(cli: Cli, tmp_path: Path) -> None:
    job = write_mlp_job(tmp_path / "job")
    write_model(tmp_path / "job", SPARSE_OUT_OF_RANGE)

    result = cli.run("submit", str(job), timeout=150)

    assert result.code == 2, (result.code, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert SPARSE_REFUSAL.fullmatch(errors[0]), errors[0]
    assert "uploading" not in result.stderr, result.stderr

    status = cli.run("status", "--output", "json")
    assert status.code == 0, status.stderr
    assert status.json()["jobs"] == []
    stats = cli.run("stats", "--output", "json")
    assert stats.code == 0, stats.stderr
    assert json.loads(stats.stdout)["blobs"] == 0


def test_submit_says_in_one_line_that_the_model_crashed_python(cli: Cli, tmp_path: Path) -> None:
    job = write_mlp_job(tmp_path / "job")
    write_model(tmp_path / "job", CRASH_WHEN_RUN)

    result = cli.run("submit", str(job), timeout=150)

    assert result.code == 2, (result.code, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert re.fullmatch(
        r"error: running the model and loss on a batch of \d+ samples crashed the Python "
        r"process \(segmentation fault\)",
        errors[0],
    ), errors[0]
    assert cli.run("status", "--output", "json").json()["jobs"] == []


def test_submit_refuses_an_unknown_priority_and_stores_nothing(cli: Cli, tmp_path: Path) -> None:
    job = write_mlp_job(tmp_path / "job")
    doc = tomllib.loads(job.read_text())
    doc.setdefault("cluster", {})["priority"] = "urgent"
    job.write_text(dump_toml(doc))

    result = cli.run("submit", str(job), timeout=60)

    assert result.code == 2, (result.code, result.stderr)
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert "[cluster].priority must be one of high, normal, low (got 'urgent')" in errors[0]
    status = cli.run("status", "--output", "json")
    assert status.code == 0, status.stderr
    assert status.json()["jobs"] == []
