"""Weights of mismatched shapes and dtypes fed to the allowed operators (a fixed, bounded table).

Every weight (parameter or buffer) of the catalogue's models (tests/unit/test_op_allowlist.py:
normalization, recurrent, convolution, embedding, attention, pooling and tensor layers) is
replaced, as a hand-edited archive would replace it together with its declaration, by tensors
whose shapes are one short, one long, of another rank, or of another dtype. For each, the shape
check (epochmesh.program.shape_check, given the batch's inputs) must either refuse with a
one-line ProgramError, or the program must be valid as edited: the kernels then run without
error, twice with identical results (a kernel reading past a weight's end gives different
results for identical calls). A kernel refusing what the check accepted counts as a failure:
the check must refuse before any kernel runs.

The table runs in a child process, so that a kernel crashing (a write past the end) fails the
test instead of ending the test run, and reports each case as it goes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("batch_norm", "recurrent", "conv", "more_layers", "attention", "tied", "zen")
MUTATIONS = ("short", "long", "rank", "dtype")
MAX_WEIGHTS_PER_MODEL = 24


def _mutate(t: object, how: str) -> object:
    import torch

    assert isinstance(t, torch.Tensor)
    if how == "dtype":
        return torch.zeros(t.shape, dtype=torch.float64 if t.is_floating_point() else torch.float32)
    if t.dim() == 0:
        return torch.zeros(2, dtype=t.dtype)
    shape = list(t.shape)
    if how == "short":
        shape[-1] = max(shape[-1] - 1, 0) if shape[-1] > 1 else 2
    elif how == "long":
        shape[0] += 1
    else:  # rank
        shape = shape[:-1] if len(shape) > 1 else [*shape, 1]
    return torch.zeros(shape, dtype=t.dtype)


def _run_table() -> None:
    """Child: one JSON line per case on stdout."""
    import torch

    from epochmesh.errors import ProgramError
    from epochmesh.program.archive import TrainableProgram
    from epochmesh.program.shape_check import ShapeCheck
    from tests.unit.test_op_allowlist import exported, initial_state

    torch.set_num_threads(1)
    for name in MODELS:
        case, program = exported(name)
        inputs = [t[:3] for t in case.example]
        prog = TrainableProgram.from_bytes(program, initial_state(case.model))
        module = prog._module
        for weight in list(case.model.state_dict())[:MAX_WEIGHTS_PER_MODEL]:
            for how in MUTATIONS:
                parent, _, leaf = ("model." + weight).rpartition(".")
                owner = module.get_submodule(parent)
                slots = owner._parameters if leaf in owner._parameters else owner._buffers
                old = slots[leaf]
                assert old is not None
                new = _mutate(old, how)
                assert isinstance(new, torch.Tensor)
                slots[leaf] = torch.nn.Parameter(new, new.is_floating_point()) if isinstance(
                    old, torch.nn.Parameter
                ) else new  # fmt: skip
                record = {"model": name, "weight": weight, "how": how}
                try:
                    ShapeCheck(module).check_inputs(inputs)
                except ProgramError as e:
                    record.update(verdict="refused", message=str(e))
                else:
                    losses = []
                    try:
                        for _ in range(2):
                            torch.manual_seed(0)
                            losses.append(module(*inputs).detach())
                        same = torch.equal(losses[0], losses[1]) or bool(
                            torch.isnan(losses[0]).all() and torch.isnan(losses[1]).all()
                        )
                        record.update(verdict="ran" if same else "nondeterministic")
                    except Exception as e:
                        record.update(verdict="kernel_refused", message=str(e)[:200])
                slots[leaf] = old
                sys.stdout.write(json.dumps(record) + "\n")
                sys.stdout.flush()


@pytest.mark.timeout(900)
def test_mismatched_weights_are_refused_or_valid() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.unit.test_shape_fuzz import _run_table; _run_table()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (proc.returncode, records[-1:], proc.stderr[-2000:])
    bad = [r for r in records if r["verdict"] not in ("refused", "ran")]
    assert not bad, bad
    refused = [r for r in records if r["verdict"] == "refused"]
    assert all("\n" not in r["message"] for r in refused)
    assert len(records) > 100 and len(refused) > len(records) // 2, len(refused)
