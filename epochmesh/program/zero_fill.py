"""Uninitialised memory never reaches a program's results: `empty` allocations are zero-filled.

`aten.empty.memory_format` and `aten.empty_like.default` (on the operator allow-list: ordinary
exports emit them) return whatever the allocator's memory held, and a program may read it
before writing all of it (``torch.empty(n, 4) * 0`` is NaN where the garbage was NaN). A worker
and a checker would then compute different results from the same input, and an honest worker
would look like a cheater. So a loaded program's graph calls the zeroing twin of each
(`zero_fill_uninitialised`: ``zeros``, ``zeros_like``, ``new_zeros``), at load, before it runs
anywhere. The overloads without a twin of the same arguments (``empty_strided``) stay off the
allow-list (epochmesh.program.op_allowlist), so a program calling them is refused.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ZEROING", "zero_fill_uninitialised"]

_aten: Any = torch.ops.aten

# Uninitialised allocation -> (its zeroing twin, keyword arguments the twin does not take).
ZEROING: dict[Any, tuple[Any, tuple[str, ...]]] = {
    _aten.empty.memory_format: (_aten.zeros.default, ("memory_format",)),
    _aten.empty_like.default: (_aten.zeros_like.default, ()),
    _aten.new_empty.default: (_aten.new_zeros.default, ()),
}


def zero_fill_uninitialised(module: torch.nn.Module) -> int:
    """Make every graph of ``module`` (an exported program's module and its subgraphs) call
    the zeroing twin of each uninitialised allocation; returns how many calls changed."""
    changed = 0
    for sub in module.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        touched = False
        for node in sub.graph.nodes:
            if node.op != "call_function" or node.target not in ZEROING:
                continue
            twin, dropped = ZEROING[node.target]
            node.target = twin
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in dropped}
            touched = True
            changed += 1
        if touched:
            sub.recompile()
    return changed
