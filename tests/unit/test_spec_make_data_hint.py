"""The missing-dataset error points at make_data.py when one sits beside job.toml."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from epochmesh.errors import SpecError
from epochmesh.spec import load_spec

pytestmark = pytest.mark.timeout(60)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spirals"


def _example_without_data(tmp_path: Path) -> Path:
    job = tmp_path / "spirals"
    job.mkdir()
    for name in ("job.toml", "model.py", "make_data.py"):
        shutil.copy(EXAMPLE / name, job / name)
    return job


def test_missing_dataset_names_make_data(tmp_path: Path) -> None:
    job = _example_without_data(tmp_path)
    with pytest.raises(SpecError) as err:
        load_spec(job / "job.toml")
    message = str(err.value)
    assert "dataset file not found" in message
    assert f"run make_data.py in {job} first" in message


def test_no_hint_without_make_data(tmp_path: Path) -> None:
    job = _example_without_data(tmp_path)
    (job / "make_data.py").unlink()
    with pytest.raises(SpecError) as err:
        load_spec(job / "job.toml")
    assert "dataset file not found" in str(err.value)
    assert "make_data.py" not in str(err.value)
