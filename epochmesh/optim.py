"""Optimizers from a JobSpec, and their state as named tensors (for safetensors checkpoints).

`build_optimizer(spec, params)` gives torch.optim.SGD or torch.optim.AdamW with torch.optim's
meaning of every field (in local_sgd mode this is the inner optimizer);
`build_outer_optimizer(spec, params)` gives local SGD's outer optimizer (SGD with Nesterov
momentum over pseudo-gradients).

`optimizer_step(opt, params, names, grads)` runs one step with gradients given by name.

`state_tensors(params, optim)` names a whole state ("param/<name>", "optim/<key>/<name>").

`optimizer_state_tensors(opt, names)` flattens an optimizer's per-parameter state into tensors
named "<state key>/<parameter name>", e.g. "momentum_buffer/fc.weight", "exp_avg/fc.weight",
"exp_avg_sq/fc.weight", "step/fc.weight"; `load_optimizer_state_tensors(opt, names, tensors)`
puts them back so that the restored optimizer continues bit-identically. `names[i]` names the
i-th parameter of the optimizer (all param groups, in order). Hyperparameters are not part of
the state: they come from the spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from epochmesh.v1 import common_pb2


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor],
) -> None:
    """One step of `optimizer` with `grads[names[i]]` as the gradient of `params[i]` (cast to
    the parameter's dtype); the gradients are cleared again afterwards."""
    for name, p in zip(names, params, strict=True):
        g = grads[name]
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
    optimizer.step()
    for p in params:
        p.grad = None


def build_optimizer(
    spec: common_pb2.JobSpec, params: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """torch.optim.SGD (lr, momentum, dampening, weight_decay, nesterov) or AdamW (lr, betas,
    eps, weight_decay) over `params`, one param group."""
    params = list(params)
    name = (
        spec.inner_optimizer
        if spec.sync == "local_sgd" and spec.inner_optimizer
        else spec.optimizer
    )
    if name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            dampening=spec.dampening,
            weight_decay=spec.weight_decay,
            nesterov=spec.nesterov,
        )
    if name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=spec.lr,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
        )
    raise ValueError(f"unknown optimizer {name!r}; expected sgd or adamw")


def build_outer_optimizer(
    spec: common_pb2.JobSpec, params: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """Local SGD's outer optimizer: SGD(outer_lr, momentum=outer_momentum, nesterov=True).

    Its "gradient" is the pseudo-gradient (parameters before the inner steps minus after).
    """
    if spec.outer_optimizer not in ("nesterov", ""):
        raise ValueError(f"unknown outer optimizer {spec.outer_optimizer!r}; expected nesterov")
    return torch.optim.SGD(
        list(params),
        lr=spec.outer_lr,
        momentum=spec.outer_momentum,
        nesterov=spec.outer_momentum > 0,
    )


def build_round_optimizer(
    spec: common_pb2.JobSpec, params: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """The optimizer that applies an aggregated round (on the parameter server, or on every ring
    member): the outer optimizer in local_sgd mode, else the spec's optimizer."""
    if spec.sync == "local_sgd":
        return build_outer_optimizer(spec, params)
    return build_optimizer(spec, params)


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _check_names(opt: torch.optim.Optimizer, names: Sequence[str]) -> list[torch.Tensor]:
    params = _params(opt)
    if len(params) != len(names):
        raise ValueError(f"optimizer has {len(params)} parameters but {len(names)} names given")
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    return params


def optimizer_state_tensors(
    opt: torch.optim.Optimizer, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as {"<key>/<param name>": tensor} (detached views).

    Parameters without state (no step taken yet, or SGD without momentum) contribute nothing;
    None entries (SGD's momentum_buffer before the first step) are skipped. Python numbers in
    the state are stored as 0-dim float64 tensors.
    """
    params = _check_names(opt, names)
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, params, strict=True):
        state = opt.state.get(p)
        if not state:
            continue
        for key in sorted(state):
            value = state[key]
            if "/" in key:
                raise ValueError(f"optimizer state key {key!r} contains '/'")
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                out[f"{key}/{name}"] = value.detach()
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{key}/{name}"] = torch.tensor(float(value), dtype=torch.float64)
            else:
                raise ValueError(
                    f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; only "
                    "tensors and numbers can be stored"
                )
    return out


def load_optimizer_state_tensors(
    opt: torch.optim.Optimizer, names: Sequence[str], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Replace the optimizer's state with `tensors` as made by `optimizer_state_tensors`.

    State tensors shaped like their parameter go to the parameter's device and dtype; others
    (such as AdamW's scalar "step") keep theirs. Raises ValueError on unknown parameter names
    or shape mismatches.
    """
    params = _check_names(opt, names)
    by_name = dict(zip(names, params, strict=True))
    new_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for full, value in tensors.items():
        key, sep, name = full.partition("/")
        if not sep or not key or name not in by_name:
            raise ValueError(
                f"optimizer state tensor {full!r} does not name a parameter of this optimizer"
            )
        p = by_name[name]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"optimizer state {full!r} is not a tensor")
        if value.dim() == 0:
            t = value.detach().clone()
        elif tuple(value.shape) == tuple(p.shape):
            t = value.detach().to(device=p.device, dtype=p.dtype, copy=True)
        else:
            raise ValueError(
                f"optimizer state {full!r} has shape {list(value.shape)}, parameter has "
                f"{list(p.shape)}"
            )
        new_state.setdefault(p, {})[key] = t
    opt.state.clear()
    for p, st in new_state.items():
        opt.state[p] = st


# A whole training state as named tensors (checkpoints, ring state transfers, local SGD
# snapshots): "param/<name>" for the parameters, "optim/<key>/<name>" for the optimizer state.
PARAM_PREFIX = "param/"
OPTIM_PREFIX = "optim/"


def state_tensors(
    params: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state named like ParameterServer.state_tensors:
    "param/<name>" (in the given order), then "optim/<key>/<name>"."""
    out = {f"{PARAM_PREFIX}{n}": t for n, t in params.items()}
    out.update({f"{OPTIM_PREFIX}{k}": t for k, t in optim.items()})
    return out
