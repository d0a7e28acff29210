"""Argument shapes re-derived before a program runs (epochmesh.program.shape_check).

A hand-edited archive whose weights have shapes its operators do not accept (a batch norm's
short running mean, an LSTM's short hidden weight) passes the archive check but is refused when
loaded, before any kernel runs, whether the archive's description of the weight was edited with
it or not; the operator the red team used (aten._native_batch_norm_legit) is off the list.
The examples' programs pass, and the check's cost on them is small.
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest
import torch

from epochmesh.errors import ProgramError
from epochmesh.program.archive import TrainableProgram, validate_program_archive
from epochmesh.program.shape_check import CONTRACTS, ShapeCheck, batch_ranges
from tests.fixtures.shape_programs import cell_program, legit_batch_norm_program, with_weight

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)

# (weight, replacement, what the refusal says)
RED_TEAM = {
    "short_running_mean": ("bn.running_mean", torch.zeros(2), r"running_mean .* has shape \[2\]"),
    "short_hidden_weight": (
        "lstm.weight_hh_l0",
        torch.randn(64, 2),
        r"hidden weight of layer 0 has shape \[64, 2\], expected \[64, 16\]",
    ),
}


@pytest.fixture(scope="module")
def cell() -> tuple[bytes, bytes]:
    return cell_program()


def batch(n: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.randn(n, 16)], [torch.randint(0, 4, (n,))]


def test_the_unedited_cell_loads_and_trains(cell: tuple[bytes, bytes]) -> None:
    prog = TrainableProgram.from_bytes(*cell)
    loss, grads = prog.loss_and_grads(*batch())
    assert loss == loss and set(grads) == set(prog.param_names)


@pytest.mark.parametrize("case", list(RED_TEAM))
def test_red_team_weights_pass_the_archive_check_but_are_refused_at_load(
    cell: tuple[bytes, bytes], case: str
) -> None:
    fqn, tensor, message = RED_TEAM[case]
    program, state = with_weight(*cell, fqn, tensor)
    validate_program_archive(program)  # the archive itself is well-formed
    with pytest.raises(ProgramError, match=message) as e:
        TrainableProgram.from_bytes(program, state)
    assert "\n" not in str(e.value)


def test_a_weight_whose_declaration_was_left_alone_is_refused_as_a_mismatch(
    cell: tuple[bytes, bytes],
) -> None:
    program, state = with_weight(*cell, "fc.bias", torch.zeros(1))  # broadcasts: kernel-valid
    TrainableProgram.from_bytes(program, state)  # consistently edited: shapes check
    # The archive's declaration of a node disagreeing with what its inputs give is refused.
    prog = TrainableProgram.from_bytes(*cell)
    module = prog._module
    module.get_submodule("model.fc")._parameters["bias"] = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ProgramError, match=r"the archive declares torch.float32 \[32\]"):
        ShapeCheck(module).check_declared({s: (1, 1 << 31) for s in _symbols(module)})


def _symbols(module: torch.nn.Module) -> set[object]:
    out: set[object] = set()
    for node in module.graph.nodes:  # type: ignore[union-attr]
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            for d in val.shape:
                if isinstance(d, torch.SymInt):
                    out |= d.node.expr.free_symbols
    return out


def test_the_red_team_operator_is_off_the_allow_list() -> None:
    program, _ = legit_batch_norm_program()
    with pytest.raises(ProgramError, match=r"aten\._native_batch_norm_legit\.default is not al"):
        validate_program_archive(program)


def test_each_new_batch_size_is_checked_before_it_runs(cell: tuple[bytes, bytes]) -> None:
    prog = TrainableProgram.from_bytes(*cell)
    prog.loss_and_grads(*batch(5))
    prog.loss(*batch(7))
    assert len(prog._shapes._checked) >= 2
    with pytest.raises(ValueError, match=r"input 'args_0' is torch.float64"):
        prog.loss([torch.randn(3, 16, dtype=torch.float64)], batch()[1])


def test_contracts_name_allowed_operators_only() -> None:
    from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS

    assert set(CONTRACTS) <= ALLOWED_ATEN_OPS


def example_program(example: str) -> tuple[bytes, bytes]:
    """examples/<example>'s model and loss exported as packaging exports them."""
    import torch.nn.functional as F

    from tests.unit.test_op_allowlist import Case, export, initial_state, load_model_file

    module = load_model_file(ROOT / "examples" / example / "model.py")
    torch.manual_seed(0)
    if example == "zen":
        example_batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
        case = Case(module.make_model(), module.loss_fn, 1, example_batch)
    else:
        case = Case(
            module.make_model(), F.cross_entropy, 1, (torch.randn(4, 2), torch.zeros(4).long())
        )
    return export(case), initial_state(case.model)


@pytest.mark.parametrize("example", ["zen", "spirals"])
def test_the_examples_pass_and_the_check_costs_little(example: str) -> None:
    program, state = example_program(example)
    t0 = time.perf_counter()
    prog = TrainableProgram.from_bytes(program, state)
    loaded = time.perf_counter() - t0
    ep = torch.export.load(io.BytesIO(program))
    t1 = time.perf_counter()
    ShapeCheck(prog._module).check_declared(batch_ranges(ep))
    declared = time.perf_counter() - t1
    t2 = time.perf_counter()
    ShapeCheck(prog._module).check_inputs([t[:64] for t in _inputs(ep, example)])
    one = time.perf_counter() - t2
    log.warning(
        "%s: from_bytes %.2f s, of which the load-time shape check (2 batch sizes) %.2f s; "
        "one new batch size %.2f s", example, loaded, declared, one,
    )  # fmt: skip
    assert declared < 30  # generous for a loaded machine; measured figures go in the report


def _inputs(ep: torch.export.ExportedProgram, example: str) -> list[torch.Tensor]:
    if example == "zen":
        return [torch.randint(0, 128, (64, 32)), torch.randint(0, 128, (64, 32))]
    return [torch.randn(64, 2), torch.zeros(64).long()]
