"""The parameter server's arithmetic: sample-weighted aggregation and the optimizer step.

Each node sends the gradient of the *mean* loss over its ``b_i`` samples. The aggregate
``sum_i (b_i / sum_j b_j) * g_i`` is then exactly the gradient of the mean loss over the union
of the round's samples, so N heterogeneous nodes train like one process on the same batches.
In local SGD each node sends its pseudo-gradient (parameters before minus after its inner
steps) over ``n_i`` samples; the same weighting (``n_i / sum n``) feeds the outer optimizer.
No networking here: the engine feeds decoded tensors in and streams the parameters out.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from coordinator.aggregation.robust import aggregate
from epochmesh.optim import (
    build_round_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
)
from epochmesh.v1 import common_pb2


class ParameterServer:
    """Holds a job's trainable parameters and the round optimizer; applies aggregated rounds
    (gradients in sync mode, pseudo-gradients in local SGD: same weighting, same call)."""

    def __init__(
        self,
        spec: common_pb2.JobSpec,
        params: Mapping[str, torch.Tensor],
        version: int = 0,
    ) -> None:
        self.names: list[str] = list(params)
        self.params: dict[str, torch.nn.Parameter] = {
            name: torch.nn.Parameter(t.detach().clone(), requires_grad=True)
            for name, t in params.items()
        }
        # Sync mode: the spec's optimizer over averaged gradients. Local SGD: the outer
        # optimizer (Nesterov SGD) over averaged pseudo-gradients (start - end of the inner
        # steps); the inner optimizer lives on the agents.
        self.optimizer = build_round_optimizer(spec, [self.params[n] for n in self.names])
        self.version = version
        # [train] aggregation_rule: "" / "mean" is the sample-weighted mean below (equal to a
        # plain replay); the robust rules come from coordinator/aggregation/robust.py.
        self.rule = spec.aggregation_rule or "mean"
        self.last_note = ""

    def expected(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and shape every gradient tensor must have, by name, in order."""
        return {n: (p.dtype, tuple(p.shape)) for n, p in self.params.items()}

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The current parameters as plain tensors (a copy, safe to encode later)."""
        return {n: p.detach().clone() for n, p in self.params.items()}

    def apply(self, parts: list[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        """Apply one round: ``parts`` holds (samples, mean-loss gradients or pseudo-gradients)
        per node; the aggregate is their sample-weighted mean.

        The caller orders ``parts`` deterministically (by node id) so that a replay sums in
        the same order.
        """
        total = sum(n for n, _ in parts)
        if total <= 0:
            raise ValueError("a round needs at least one sample")
        with torch.no_grad():
            if self.rule != "mean":
                robust = aggregate(self.rule, [(float(n), g) for n, g in parts])
                self.last_note = robust.note
                for name in self.names:
                    self.params[name].grad = robust.tensors[name].to(self.params[name].dtype)
            else:
                for name in self.names:
                    acc = torch.zeros_like(self.params[name])
                    for samples, grads in parts:
                        acc.add_(grads[name].to(acc.dtype), alpha=samples / total)
                    self.params[name].grad = acc
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def apply_delta(self, parts: list[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        """Apply one round of pseudo-gradients (local SGD): same weighting, same optimizer."""
        self.apply(parts)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state as named tensors, for a safetensors checkpoint."""
        out: dict[str, torch.Tensor] = {
            f"param/{n}": p.detach().clone() for n, p in self.params.items()
        }
        for key, t in optimizer_state_tensors(self.optimizer, self.names).items():
            out[f"optim/{key}"] = t
        return out

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[f"param/{n}"])
        optim = {k.removeprefix("optim/"): v for k, v in tensors.items() if k.startswith("optim/")}
        load_optimizer_state_tensors(self.optimizer, self.names, optim)
        self.version = version
