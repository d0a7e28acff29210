"""Optimizers from a spec, and bit-identical continuation from state saved as safetensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epochmesh.optim import (
    build_optimizer,
    build_outer_optimizer,
    build_round_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
)
from epochmesh.spec import parse_spec
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import from_safetensors, to_safetensors

pytestmark = pytest.mark.timeout(60)

BASE = """\
name = "o"
[data]
train = "d.safetensors"
inputs = ["x"]
targets = ["y"]
[train]
"""


def spec(train: str) -> common_pb2.JobSpec:
    return parse_spec(BASE + train, "/nonexistent", check_files=False).spec


SPECS = {
    "sgd": spec("lr = 0.1"),
    "sgd_momentum": spec("lr = 0.1\nmomentum = 0.9\ndampening = 0.1\nweight_decay = 0.01"),
    "sgd_nesterov": spec("lr = 0.05\nmomentum = 0.9\nnesterov = true"),
    "adamw": spec('optimizer = "adamw"\nlr = 0.01\nbetas = [0.8, 0.99]\neps = 1e-6'),
}


def test_sgd_fields_have_torch_meaning() -> None:
    p = [nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(SPECS["sgd_momentum"], p)
    assert isinstance(opt, torch.optim.SGD)
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"]) == (
        0.1,
        0.9,
        0.1,
        0.01,
        False,
    )
    assert build_optimizer(SPECS["sgd_nesterov"], p).param_groups[0]["nesterov"] is True


def test_adamw_fields_have_torch_meaning() -> None:
    opt = build_optimizer(SPECS["adamw"], [nn.Parameter(torch.zeros(3))])
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert g["lr"] == 0.01 and g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6
    assert g["weight_decay"] == 0.01  # AdamW's default when not given


def test_local_sgd_inner_and_outer() -> None:
    s = spec('sync = "local_sgd"\ninner_optimizer = "adamw"\nouter_lr = 0.5\nouter_momentum = 0.8')
    p = [nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(s, p), torch.optim.AdamW)
    outer = build_outer_optimizer(s, p)
    g = outer.param_groups[0]
    assert isinstance(outer, torch.optim.SGD)
    assert (g["lr"], g["momentum"], g["nesterov"]) == (0.5, 0.8, True)


def test_round_optimizer_is_outer_in_local_sgd_else_the_spec_optimizer() -> None:
    local = spec('sync = "local_sgd"\nouter_lr = 0.5\nouter_momentum = 0.8')
    p = [nn.Parameter(torch.zeros(3))]
    outer = build_round_optimizer(local, p)
    assert isinstance(outer, torch.optim.SGD)
    assert outer.param_groups[0]["lr"] == 0.5 and outer.param_groups[0]["nesterov"]
    plain = build_round_optimizer(SPECS["adamw"], p)
    assert isinstance(plain, torch.optim.AdamW) and plain.param_groups[0]["lr"] == 0.01


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, 6, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("kind", list(SPECS))
def test_restored_optimizer_continues_bit_identically(kind: str) -> None:
    s = SPECS[kind]
    a = make_model()
    opt_a = build_optimizer(s, list(a.parameters()))
    names = [n for n, _ in a.named_parameters()]
    for i in range(5):
        step(a, opt_a, i)

    # Checkpoint through safetensors bytes, as the coordinator does.
    state_blob = to_safetensors(optimizer_state_tensors(opt_a, names))
    params_blob = to_safetensors(a.state_dict())
    saved_keys = list(from_safetensors(state_blob))
    if kind == "sgd":
        assert saved_keys == []
    elif kind.startswith("sgd"):
        assert saved_keys[0] == "momentum_buffer/0.weight"
    else:
        assert {"exp_avg/0.weight", "exp_avg_sq/0.weight", "step/0.weight"} <= set(saved_keys)

    b = make_model()
    b.load_state_dict(from_safetensors(params_blob))
    opt_b = build_optimizer(s, list(b.parameters()))
    load_optimizer_state_tensors(opt_b, names, from_safetensors(state_blob))

    for i in range(5, 10):
        step(a, opt_a, i)
        step(b, opt_b, i)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert (
        optimizer_state_tensors(opt_a, names).keys() == optimizer_state_tensors(opt_b, names).keys()
    )


def test_state_before_any_step_is_empty() -> None:
    m = make_model()
    opt = build_optimizer(SPECS["adamw"], list(m.parameters()))
    assert optimizer_state_tensors(opt, [n for n, _ in m.named_parameters()]) == {}


def test_bad_state_is_refused() -> None:
    m = make_model()
    names = [n for n, _ in m.named_parameters()]
    opt = build_optimizer(SPECS["sgd_momentum"], list(m.parameters()))
    with pytest.raises(ValueError, match="does not name a parameter"):
        load_optimizer_state_tensors(opt, names, {"momentum_buffer/nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="does not name a parameter"):
        load_optimizer_state_tensors(opt, names, {"noslash": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        load_optimizer_state_tensors(opt, names, {"momentum_buffer/0.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="4 parameters but 1 names"):
        optimizer_state_tensors(opt, ["a"])
