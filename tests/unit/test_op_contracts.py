"""The operator contracts of the shape check (epochmesh.program.op_contracts): each refusal names
the operator and the argument in one line, and the legitimate forms next to them are accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx

from epochmesh.errors import ProgramError
from epochmesh.program.shape_check import ShapeCheck

pytestmark = pytest.mark.timeout(60)
aten = torch.ops.aten


def _check(op: Any, *args: Any, **kwargs: Any) -> None:
    """`op(*args, **kwargs)` as a one-node graph (tensors as inputs) through the shape check."""
    graph = fx.Graph()
    tensors: list[torch.Tensor] = []

    def to_node(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            node = graph.placeholder(f"arg{len(tensors)}")
            node.meta["val"] = v
            tensors.append(v)
            return node
        if isinstance(v, list):
            return [to_node(x) for x in v]
        return v

    node = graph.call_function(
        op, tuple(to_node(a) for a in args), {k: to_node(v) for k, v in kwargs.items()}
    )
    graph.output(node)
    ShapeCheck(fx.GraphModule(torch.nn.Module(), graph)).check_inputs(tensors)


def _refused(match: str, op: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ProgramError, match=match) as info:
        _check(op, *args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and f"aten.{op._schema.name.split('::')[1]}" in message
    return message


F = torch.randn
I64 = torch.tensor


def test_index_family_arguments_are_refused_before_the_kernel() -> None:
    x = F(3, 4)
    _refused("index is torch.float32", aten.gather.default, x, 1, F(2, 2))
    _refused("index has 1 dimension", aten.gather.default, x, 1, I64([0, 1]))
    _refused("larger than self", aten.gather.default, x, 1, torch.zeros(4, 2, dtype=torch.long))
    _refused("dim 2 is out of range", aten.gather.default, x, 2, torch.zeros(2, 2).long())
    idx = torch.zeros(2, 2, dtype=torch.long)
    _refused("larger than src", aten.scatter.src, x, 1, idx, F(1, 2))
    _refused("index must be a vector", aten.index_select.default, x, 0, idx)
    _refused("source has shape", aten.index_add.default, x, 0, I64([0, 1]), F(2, 5))
    _refused("values of shape", aten.index_put.default, x, [I64([0, 1])], F(2, 5))
    _refused("share one dtype", aten.index_put.default, x, [I64([0, 1])], F(2, 4).double())
    _refused(
        "2 dimension\\(s\\) indexed|3 dimension", aten.index.Tensor, F(3), [I64([0]), I64([0])]
    )
    _refused("a mask of shape", aten.index.Tensor, x, [torch.ones(2, dtype=torch.bool)])
    _refused("a bool mask", aten.masked_fill.Scalar, x, torch.ones(3, 4), 1.0)
    _refused("source has 2 elements", aten.masked_scatter.default, x, x > 0, F(2))
    _refused("src has shape", aten.select_scatter.default, x, F(3), 0, 1)
    _refused("src has shape", aten.slice_scatter.default, x, F(2, 4), 0, 0, 3)


def test_pads_pools_dims_and_fft_are_refused() -> None:
    x = F(1, 2, 4)
    _refused("pad has 3 values", aten.constant_pad_nd.default, x, [1, 1, 1])
    _refused("at most 6", aten.constant_pad_nd.default, x, [1] * 8)
    _refused("-1 long", aten.constant_pad_nd.default, x, [-3, -2])
    _refused("reflects past", aten.reflection_pad1d.default, x, [4, 0])
    _refused("takes a 2-D or 3-D input", aten.reflection_pad1d.default, F(1, 2, 4, 2), [1, 1])
    _refused("output_size \\[3\\] is not 2", aten._adaptive_avg_pool2d.default, F(1, 2, 6, 6), [3])
    _refused("non-negative", aten.adaptive_avg_pool2d.default, F(1, 2, 6, 6), [-1, 3])
    _refused("dim 99 is out of range", aten.softmax.int, x, 99)
    _refused("dim 2 is out of range", aten._log_softmax.default, F(2, 3), 2, False)
    _refused("dim is empty", aten.logsumexp.default, x, [])
    _refused("normalised", aten._fft_r2c.default, F(4, 6), [-1], 0, True)
    _refused("self must be 2-D", aten._pdist_forward.default, F(4), 2.0)


def test_dtype_contracts() -> None:
    x = F(2, 3)
    _refused("floating-point", aten.softmax.int, torch.ones(2, 3, dtype=torch.long), 1)
    _refused("weight is torch.int64", aten.layer_norm.default, x, [3], torch.ones(3).long())
    _refused("numbers, not bool", aten.sub.Tensor, x > 0, x > 0)
    _refused("integer or bool", aten.bitwise_and.Tensor, x, x)
    _refused("int64 class indices", aten.nll_loss_nd.default, x, I64([0, 1]).int())
    _refused("share one dtype", aten.mm.default, x, torch.ones(3, 2, dtype=torch.long))
    _refused("cannot hold in place", aten.mul_.Tensor, torch.ones(2, 3).long(), x)


def test_legitimate_forms_are_accepted() -> None:
    x = F(2, 3)
    _check(aten.gather.default, x, 1, torch.zeros(2, 2, dtype=torch.int32))
    _check(aten.softmax.int, torch.ones(2, 3, dtype=torch.long), 1, torch.float32)
    _check(aten.cross_entropy_loss.default, x, torch.rand(2, 3))  # probabilities
    _check(aten.upsample_nearest2d.vec, torch.zeros(1, 1, 2, 2, dtype=torch.uint8), [4, 4], None)
    _check(aten.constant_pad_nd.default, x, [-1, -1], 0.0)  # cropping
    _check(aten.index_put.default, F(3, 4), [None, I64([0, 2])], F(1))  # broadcast value
    _check(aten.index_put.default, F(3, 4), [F(3, 4) > 0], F(1))  # a mask: count is data
    _check(aten.adaptive_avg_pool2d.default, F(1, 2, 6, 6), [0, 3])
    _check(aten.select_scatter.default, x, F(3).double(), 0, -1)  # src is cast
    _check(aten.rand_like.default, torch.ones(2, dtype=torch.long), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _check(aten.mm.default, x, F(3, 2).bfloat16())
