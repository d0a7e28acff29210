"""Every allowed operator called with mismatched argument shapes, dtypes and integers.

tests/unit/test_shape_fuzz.py reaches the operators that the catalogue's weights feed; this
table reaches every operator of `ALLOWED_ATEN_OPS`, including those that take only activations
or literal integers. Each operator has one valid call of its own below (`VALID`: tensor shapes,
dtypes and literals); the cases are that call and its mutations:

- each tensor argument (tensors inside lists too): one dimension more, one fewer, each dimension
  one longer, and other dtypes (`OTHER_DTYPES`: for a float32 argument float64, float16,
  bfloat16, the integer types, bool, complex64 and uint16; for an integer one float32, float16,
  the other integer types, bool and complex64; likewise for bool and complex arguments);
- each integer literal: -1 and 99 (out of range); each integer list: one element more, one
  fewer, its first element -1 and 99.

Each case is a one-node graph (placeholders for the tensors, the literals in the node) given to
the shape check (`ShapeCheck.check_inputs`, which propagates fake tensors from the inputs and
checks the operators' contracts). The check either refuses it with a one-line ProgramError, or
the case is valid: the real kernel then runs twice on identical fresh inputs, without error and
with identical results (uninitialised results, of empty and empty_like, compare by shape and
dtype). The check must refuse every argument the operator's contract forbids (shapes, dims,
index and mask dtypes, pad lists, dtypes the operator's math does not admit) and every dtype the
operator's kernel for the tensors' device type (CPU here) does not implement (complex arguments
of operators without complex kernels, integer pooling, float16 and bfloat16 where the CPU
kernels lack them, result types the operator's output cannot hold), so no kernel is left to
refuse a case the check accepted: a "kernel_refused" case fails the test, as do a check failing
with another error than ProgramError, a kernel failing otherwise, results that differ between
the two runs and a crash of the child process. The valid call itself must be accepted and run.

All cases run in one child process (a crashing kernel fails the test instead of ending the test
run), one JSON line per case.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)
pytestmark = pytest.mark.timeout(60)

# Operators without a valid call here, each with its reason. Keep it short.
NO_SAMPLE: dict[str, str] = {}

# How a kernel refuses arguments it checks itself (an argument error, before it computes).
KERNEL_ERRORS = (RuntimeError, IndexError, NotImplementedError, ValueError, TypeError)

# Operators whose results are uninitialised memory: compared by shape and dtype only.
UNINITIALISED = {"aten.empty.memory_format", "aten.empty_like.default"}


@dataclass(frozen=True)
class T:
    """A tensor argument: its shape, dtype name, and value kind (randn, uniform [0, 1), or
    arange modulo `hi` for integers)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    hi: int = 2
    uniform: bool = False


def F(*shape: int) -> T:
    return T(shape)


def U(*shape: int) -> T:
    return T(shape, uniform=True)


def I(*shape: int, hi: int = 2) -> T:  # noqa: E743
    return T(shape, "int64", hi)


def B(*shape: int) -> T:
    return T(shape, "bool")


def C(*shape: int) -> T:
    return T(shape, "complex64")


X = F(2, 3)
Call = tuple[tuple[Any, ...], dict[str, Any]]


def _c(*args: Any, **kwargs: Any) -> Call:
    return args, kwargs


def _valid_calls() -> dict[str, Call]:
    v: dict[str, Call] = {}
    unary = (
        "abs acos acosh asin asinh atan atanh ceil cos cosh erf exp expm1 floor log log10 log1p "
        "log2 neg reciprocal relu round rsqrt sigmoid sign sin sinh sqrt tan tanh trunc isinf "
        "isnan isfinite alias clone contiguous detach detach_ lift_fresh_copy exp_ relu_ sqrt_ "
        "silu silu_ selu mish hardsigmoid hardswish relu6 log_sigmoid gelu elu elu_ celu "
        "hardtanh hardtanh_ leaky_relu leaky_relu_ hardshrink softplus squeeze t any max min "
        "mean sum prod ones_like zeros_like empty_like rand_like sym_numel logical_not nan_to_num "
        "_to_copy to.dtype_layout"
    )
    for name in unary.split():
        v[name if "." in name else f"{name}.default"] = _c(X)
    v["bitwise_not.default"] = _c(I(2, 3, hi=8))
    binary = (
        "add.Tensor add_.Tensor atan2.default div.Tensor eq.Tensor fmod.Tensor ge.Tensor "
        "gt.Tensor le.Tensor lt.Tensor ne.Tensor maximum.default minimum.default mul.Tensor "
        "mul_.Tensor pow.Tensor_Tensor remainder.Tensor sub.Tensor logical_and.default "
        "logical_or.default logical_xor.default copy.default expand_as.default view_as.default "
        "type_as.default mse_loss.default l1_loss.default soft_margin_loss.default "
        "smooth_l1_loss.default huber_loss.default kl_div.default hinge_embedding_loss.default "
        "binary_cross_entropy_with_logits.default pairwise_distance.default "
        "cosine_similarity.default"
    )
    for name in binary.split():
        v[name] = _c(X, X)
    v["binary_cross_entropy.default"] = _c(U(2, 3), U(2, 3))
    v["reshape_as.default"] = _c(F(3, 2), X)
    v["outer.default"] = _c(F(3), F(4))
    v["lerp.Scalar"] = _c(X, X, 0.5)
    for name in ("__and__.Tensor", "__or__.Tensor"):
        v[name] = _c(B(2, 3), B(2, 3))
    for op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        v[f"{op}.Tensor"] = _c(I(2, 3, hi=8), I(2, 3, hi=8))
        v[f"{op}.Scalar"] = _c(I(2, 3, hi=8), 3)
    scalar = (
        "add.Scalar div.Scalar eq.Scalar ge.Scalar gt.Scalar le.Scalar lt.Scalar ne.Scalar "
        "mul.Scalar sub.Scalar fmod.Scalar remainder.Scalar pow.Tensor_Scalar rsub.Scalar "
        "clamp_max.default clamp_min.default fill.Scalar fill_.Scalar full_like.default"
    )
    for name in scalar.split():
        v[name] = _c(X, 1.5)
    v["div.Scalar_mode"] = _c(X, 1.5, rounding_mode="floor")
    v["div.Tensor_mode"] = _c(X, X, rounding_mode="trunc")
    v["pow.Scalar"] = _c(2.0, X)
    v["clamp.default"] = _c(X, -0.5, 0.5)
    v["clip.default"] = _c(X, -0.5, 0.5)
    v["clamp.Tensor"] = _c(X, X, X)
    v["addcmul.default"] = _c(X, X, X)
    v["where.self"] = _c(B(2, 3), X, X)
    v["where.ScalarOther"] = _c(B(2, 3), X, 1.0)
    v["masked_fill.Scalar"] = _c(X, B(2, 3), 1.0)
    v["masked_fill_.Scalar"] = _c(X, B(2, 3), 1.0)
    v["masked_scatter.default"] = _c(X, B(2, 3), X)
    # Reductions and dimension arguments.
    for name in ("amax", "amin", "logsumexp", "flip"):
        v[f"{name}.default"] = _c(X, [1])
    for name in ("any.dims", "mean.dim", "sum.dim_IntList", "std.dim", "std_mean.dim"):
        v[name] = _c(X, [1])
    for name in ("var.dim", "var_mean.dim", "var.correction", "linalg_vector_norm.default"):
        v[name] = _c(X, [1]) if name != "linalg_vector_norm.default" else _c(X, 2, [1])
    for name in (
        "any.dim all.dim argmax.default argmin.default cumsum.default cumprod.default max.dim "
        "min.dim prod.dim_int softmax.int log_softmax.int sort.default unsqueeze.default "
        "unbind.int sym_size.int"
    ).split():
        v[name] = _c(X, 1)
    v["_softmax.default"] = _c(X, 1, False)
    v["_log_softmax.default"] = _c(X, 1, False)
    v["topk.default"] = _c(X, 2, 1)
    v["glu.default"] = _c(F(2, 4), 1)
    v["squeeze.dim"] = _c(F(2, 1, 3), 1)
    v["squeeze.dims"] = _c(F(2, 1, 3), [1])
    v["select.int"] = _c(X, 1, 2)
    v["narrow.default"] = _c(X, 1, 0, 2)
    v["slice.Tensor"] = _c(X, 1, 0, 2)
    v["transpose.int"] = _c(X, 0, 1)
    v["permute.default"] = _c(X, [1, 0])
    v["flatten.using_ints"] = _c(F(2, 3, 4), 1, 2)
    v["unflatten.int"] = _c(F(2, 6), 1, [2, 3])
    v["split.Tensor"] = _c(X, 2, 1)
    v["split_with_sizes.default"] = _c(X, [1, 2], 1)
    v["chunk.default"] = _c(X, 2, 1)
    v["tensor_split.sections"] = _c(X, 2, 1)
    v["diagonal.default"] = _c(F(3, 3), 0, 0, 1)
    v["tril.default"] = _c(F(3, 3), 0)
    v["triu.default"] = _c(F(3, 3), 0)
    v["roll.default"] = _c(X, [1], [1])
    v["repeat.default"] = _c(X, [2, 2])
    v["repeat_interleave.self_int"] = _c(X, 2, 1)
    v["expand.default"] = _c(F(1, 3), [2, 3])
    v["view.default"] = _c(X, [3, 2])
    v["reshape.default"] = _c(X, [3, 2])
    v["unfold.default"] = _c(F(2, 6), 1, 2, 2)
    v["diff.default"] = _c(X, 1, 1)
    v["pixel_shuffle.default"] = _c(F(1, 4, 2, 2), 2)
    v["pixel_unshuffle.default"] = _c(F(1, 1, 4, 4), 2)
    v["one_hot.default"] = _c(I(4, hi=3), 3)
    # Creation.
    v["arange.default"] = _c(5)
    v["arange.start_step"] = _c(0, 6, 2)
    for name in ("zeros", "ones", "rand", "randn"):
        v[f"{name}.default"] = _c([2, 3])
    v["empty.memory_format"] = _c([2, 3])
    v["full.default"] = _c([2, 3], 1.5)
    v["eye.default"] = _c(3)
    v["linspace.default"] = _c(0.0, 1.0, 5)
    v["randperm.default"] = _c(5)
    v["scalar_tensor.default"] = _c(2.0)
    v["new_full.default"] = _c(X, [2, 3], 1.0)
    v["new_ones.default"] = _c(X, [2, 3])
    v["new_zeros.default"] = _c(X, [2, 3])
    # Indexing.
    idx = I(2, 2, hi=3)
    v["gather.default"] = _c(X, 1, idx)
    v["scatter.src"] = _c(X, 1, idx, F(2, 2))
    v["scatter.value"] = _c(X, 1, idx, 2.0)
    v["scatter_add.default"] = _c(X, 1, idx, F(2, 2))
    v["scatter_reduce.two"] = _c(X, 1, idx, F(2, 2), "sum")
    v["index.Tensor"] = _c(F(3, 4), [I(2, hi=3)])
    v["index_put.default"] = _c(F(3, 4), [I(2, hi=3)], F(2, 4))
    v["index_select.default"] = _c(F(3, 4), 0, I(2, hi=3))
    v["index_add.default"] = _c(F(3, 4), 0, I(2, hi=3), F(2, 4))
    v["select_scatter.default"] = _c(X, F(3), 0, 1)
    v["slice_scatter.default"] = _c(F(4, 3), X, 0, 0, 2)
    # Products.
    v["addmm.default"] = _c(X, F(2, 4), F(4, 3))
    v["mm.default"] = _c(F(2, 4), F(4, 3))
    v["bmm.default"] = _c(F(2, 2, 4), F(2, 4, 3))
    v["baddbmm.default"] = _c(F(2, 2, 3), F(2, 2, 4), F(2, 4, 3))
    v["matmul.default"] = _c(F(2, 4), F(4, 3))
    v["linear.default"] = _c(F(2, 4), F(3, 4), F(3))
    v["bilinear.default"] = _c(X, F(2, 4), F(5, 3, 4), F(5))
    v["einsum.default"] = _c("ij,jk->ik", [X, F(3, 4)])
    v["cat.default"] = _c([X, X], 1)
    v["stack.default"] = _c([X, X], 0)
    v["broadcast_tensors.default"] = _c([X, X])
    v["cdist.default"] = _c(X, F(4, 3))
    v["_cdist_forward.default"] = _c(X, F(4, 3), 2.0, None)
    v["_pdist_forward.default"] = _c(F(4, 3), 2.0)
    v["scaled_dot_product_attention.default"] = _c(F(2, 4, 3), F(2, 5, 3), F(2, 5, 3))
    v["prelu.default"] = _c(F(2, 3, 4), F(3))
    # Convolutions, pooling, padding, resampling.
    x2, x3 = F(1, 2, 6, 6), F(1, 2, 4, 4, 4)
    v["convolution.default"] = _c(
        F(1, 2, 5, 5), F(4, 2, 3, 3), F(4), [1, 1], [0, 0], [1, 1], False, [0, 0], 1
    )
    v["conv1d.default"] = _c(F(1, 2, 5), F(4, 2, 3), F(4))
    v["conv2d.default"] = _c(F(1, 2, 5, 5), F(4, 2, 3, 3), F(4))
    v["conv3d.default"] = _c(x3, F(4, 2, 3, 3, 3), F(4))
    v["conv_transpose2d.input"] = _c(F(1, 2, 5, 5), F(2, 4, 3, 3), F(4))
    v["avg_pool2d.default"] = _c(x2, [2, 2])
    v["avg_pool3d.default"] = _c(x3, [2, 2, 2])
    v["max_pool1d.default"] = _c(F(1, 2, 6), [2])
    v["max_pool2d.default"] = _c(x2, [2, 2])
    v["max_pool2d_with_indices.default"] = _c(x2, [2, 2])
    v["max_pool3d.default"] = _c(x3, [2, 2, 2])
    v["max_pool3d_with_indices.default"] = _c(x3, [2, 2, 2])
    v["adaptive_avg_pool2d.default"] = _c(x2, [3, 3])
    v["_adaptive_avg_pool2d.default"] = _c(x2, [3, 3])
    v["_adaptive_avg_pool3d.default"] = _c(x3, [2, 2, 2])
    v["adaptive_max_pool1d.default"] = _c(F(1, 2, 6), [3])
    v["adaptive_max_pool2d.default"] = _c(x2, [3, 3])
    v["col2im.default"] = _c(F(1, 8, 4), [3, 3], [2, 2], [1, 1], [0, 0], [1, 1])
    v["im2col.default"] = _c(F(1, 2, 3, 3), [2, 2], [1, 1], [0, 0], [1, 1])
    v["constant_pad_nd.default"] = _c(X, [1, 1], 0.0)
    v["pad.default"] = _c(F(1, 2, 4), [1, 1], "constant", 0.0)
    v["reflection_pad1d.default"] = _c(F(1, 2, 4), [1, 1])
    v["reflection_pad2d.default"] = _c(F(1, 2, 4, 4), [1, 1, 1, 1])
    v["reflection_pad3d.default"] = _c(x3, [1] * 6)
    v["replication_pad2d.default"] = _c(F(1, 2, 4, 4), [1, 1, 1, 1])
    v["replication_pad3d.default"] = _c(x3, [1] * 6)
    v["upsample_bilinear2d.vec"] = _c(F(1, 2, 3, 3), [6, 6], False, None)
    v["upsample_nearest2d.vec"] = _c(F(1, 2, 3, 3), [6, 6], None)
    v["grid_sampler_2d.default"] = _c(F(1, 2, 4, 4), F(1, 3, 3, 2), 0, 0, False)
    v["_fft_r2c.default"] = _c(F(4, 6), [1], 0, True)
    v["_fft_c2r.default"] = _c(C(4, 4), [1], 0, 6)
    # Norms.
    c3 = F(3)
    v["batch_norm.default"] = _c(F(2, 3, 4), c3, c3, c3, U(3), False, 0.1, 1e-5, False)
    v["instance_norm.default"] = _c(F(2, 3, 4), c3, c3, None, None, True, 0.1, 1e-5, False)
    v["group_norm.default"] = _c(F(2, 4, 3), 2, F(4), F(4))
    v["native_group_norm.default"] = _c(F(2, 4, 3), F(4), F(4), 2, 4, 3, 2, 1e-5)
    v["layer_norm.default"] = _c(X, [3], c3, c3)
    v["native_layer_norm.default"] = _c(X, [3], c3, c3, 1e-5)
    # Recurrent layers: input (seq 5, batch 2, features 3), hidden size 4, one layer.
    flags = (True, 1, 0.0, False, False, False)
    h = F(1, 2, 4)
    v["lstm.input"] = _c(F(5, 2, 3), [h, h], [F(16, 3), F(16, 4), F(16), F(16)], *flags)
    v["gru.input"] = _c(F(5, 2, 3), h, [F(12, 3), F(12, 4), F(12), F(12)], *flags)
    v["rnn_tanh.input"] = _c(F(5, 2, 3), h, [F(4, 3), F(4, 4), F(4), F(4)], *flags)
    # Embeddings.
    v["embedding.default"] = _c(F(5, 3), I(2, 4, hi=5))
    v["embedding_bag.padding_idx"] = _c(
        F(5, 3), I(6, hi=5), I(3, hi=6), False, 0, False, None, False, None
    )
    v["_embedding_bag.default"] = _c(F(5, 3), I(6, hi=5), I(3, hi=6))
    # Losses.
    target = I(4, hi=3)
    v["cross_entropy_loss.default"] = _c(F(4, 3), target)
    v["nll_loss_nd.default"] = _c(F(4, 3), target)
    v["multi_margin_loss.default"] = _c(F(4, 3), target)
    v["multilabel_margin_loss.default"] = _c(F(4, 3), I(4, 3, hi=3))
    v["cosine_embedding_loss.default"] = _c(F(4, 3), F(4, 3), F(4))
    v["margin_ranking_loss.default"] = _c(F(4), F(4), F(4))
    v["triplet_margin_loss.default"] = _c(F(4, 3), F(4, 3), F(4, 3))
    v["poisson_nll_loss.default"] = _c(X, X, True, False, 1e-8, 1)
    # Randomness, conversion, metadata.
    v["native_dropout.default"] = _c(X, 0.5, True)
    for name in ("dropout", "dropout_", "alpha_dropout"):
        v[f"{name}.default"] = _c(X, 0.5, True)
    v["feature_dropout.default"] = _c(F(2, 3, 4), 0.5, True)
    v["to.dtype"] = _c(X, "float64")
    v["to.device"] = _c(X, "cpu", "float64")
    v["_assert_tensor_metadata.default"] = _c(X, None, None, "float32")
    return {f"aten.{k}": c for k, c in v.items()}


VALID = _valid_calls()
_INTS = ("int32", "int16", "int8", "uint8")
OTHER_DTYPES = {
    "float32": ("float64", "float16", "bfloat16", "int64", *_INTS, "bool", "complex64", "uint16"),
    "int64": ("float32", "float16", *_INTS, "bool", "complex64"),
    "bool": ("float32", "int64", "uint8", "complex64"),
    "complex64": ("float32", "float16", "complex128", "int64"),
}
# Literal strings that name a dtype or a device (converted to torch objects in the child).
DTYPE_NAMES = ("float32", "float64")


def _tensor_mutations(t: T) -> Iterator[tuple[str, T]]:
    yield "rank+1", replace(t, shape=(*t.shape, 2))
    if t.shape:
        yield "rank-1", replace(t, shape=t.shape[:-1])
    for d in range(len(t.shape)):
        shape = list(t.shape)
        shape[d] += 1
        yield f"size[{d}]+1", replace(t, shape=tuple(shape))
    for dtype in OTHER_DTYPES[t.dtype]:
        yield dtype, replace(t, dtype=dtype, hi=max(t.hi, 2))


def _int_list_mutations(xs: list[int]) -> Iterator[tuple[str, list[int]]]:
    yield "longer", [*xs, xs[-1] if xs else 1]
    if xs:
        yield "shorter", xs[:-1]
        yield "first=-1", [-1, *xs[1:]]
        yield "first=99", [99, *xs[1:]]


def _mutations(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(description, mutated value) for one argument (recursing into lists of tensors)."""
    if isinstance(value, T):
        for how, t in _tensor_mutations(value):
            yield f"{path} {how}", t
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        yield f"{path}=-1", -1
        yield f"{path}=99", 99
    elif isinstance(value, list) and all(type(x) is int for x in value):
        for how, xs in _int_list_mutations(value):
            yield f"{path} {how}", xs
    elif isinstance(value, list):
        for i, item in enumerate(value):
            for how, m in _mutations(item, f"{path}[{i}]"):
                yield how, [*value[:i], m, *value[i + 1 :]]


def cases(name: str) -> Iterator[tuple[str, Call]]:
    """The valid call of `name` ("valid") and its mutations."""
    args, kwargs = VALID[name]
    yield "valid", (args, kwargs)
    for i, a in enumerate(args):
        for how, m in _mutations(a, f"arg{i}"):
            yield how, ((*args[:i], m, *args[i + 1 :]), kwargs)
    for k, a in kwargs.items():
        for how, m in _mutations(a, k):
            yield how, (args, {**kwargs, k: m})


def _run_table() -> None:
    """Child: one JSON line per case on stdout."""
    import torch
    from torch import fx

    from epochmesh.errors import ProgramError
    from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS
    from epochmesh.program.shape_check import ShapeCheck

    torch.set_num_threads(1)

    def real(spec: T, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, spec.dtype)
        n = 1
        for d in spec.shape:
            n *= d
        if dtype.is_floating_point or dtype.is_complex:
            draw = torch.rand if spec.uniform else torch.randn
            return draw(spec.shape, generator=g).to(dtype)
        values = torch.arange(n) % spec.hi
        values = values % 2 == 0 if dtype == torch.bool else values.to(dtype)
        return values.reshape(spec.shape).clone()  # not a view: the check models fresh inputs

    def build(name: str, call: Call, seed: int) -> tuple[Any, ...]:
        """(args, kwargs, tensors in order) with fresh real tensors."""
        tensors: list[torch.Tensor] = []

        def conv(v: Any) -> Any:
            if isinstance(v, T):
                tensors.append(real(v, seed + len(tensors)))
                return tensors[-1]
            if isinstance(v, list):
                return [conv(x) for x in v]
            if v == "cpu":
                return torch.device(v)
            if isinstance(v, str) and v in DTYPE_NAMES:
                return getattr(torch, v)
            return v

        args = tuple(conv(a) for a in call[0])
        kwargs = {k: conv(a) for k, a in call[1].items()}
        if name in ("aten._to_copy.default", "aten.to.dtype_layout") and not kwargs:
            kwargs = {"dtype": torch.float64}
        return args, kwargs, tensors

    def overload(name: str) -> Any:
        _, op, ov = name.split(".")
        return getattr(getattr(torch.ops.aten, op), ov)

    def check(name: str, call: Call) -> None:
        args, kwargs, tensors = build(name, call, 0)
        graph = fx.Graph()
        placeholders = {}
        for i, t in enumerate(tensors):
            node = graph.placeholder(f"arg{i}")
            node.meta["val"] = t
            placeholders[id(t)] = node

        def to_node(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return placeholders[id(v)]
            if isinstance(v, list):
                return [to_node(x) for x in v]
            return v

        node = graph.call_function(
            overload(name),
            tuple(to_node(a) for a in args),
            {k: to_node(a) for k, a in kwargs.items()},
        )
        graph.output(node)
        ShapeCheck(fx.GraphModule(torch.nn.Module(), graph)).check_inputs(tensors)

    def leaves(v: Any) -> list[Any]:
        if isinstance(v, (list, tuple)):
            return [x for item in v for x in leaves(item)]
        return [v]

    def same(a: Any, b: Any, shapes_only: bool) -> bool:
        la, lb = leaves(a), leaves(b)
        if len(la) != len(lb):
            return False
        for x, y in zip(la, lb, strict=True):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.shape != y.shape or x.dtype != y.dtype:
                    return False
                if shapes_only:
                    continue
                if x.is_complex():
                    x, y = torch.view_as_real(x), torch.view_as_real(y)
                if x.is_floating_point():
                    if not torch.equal(x.isnan(), y.isnan()):
                        return False
                    x, y = x.nan_to_num(0.0), y.nan_to_num(0.0)
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
        return True

    for name in sorted(ALLOWED_ATEN_OPS):
        if name not in VALID:
            continue
        for how, call in cases(name):
            record: dict[str, Any] = {"op": name, "case": how}
            try:
                check(name, call)
            except ProgramError as e:
                record.update(verdict="refused", message=str(e))
            except Exception as e:
                record.update(verdict="check_failed", message=f"{type(e).__name__}: {e}"[:300])
            else:
                results = []
                try:
                    for _ in range(2):
                        args, kwargs, _tensors = build(name, call, 0)
                        torch.manual_seed(0)
                        out = overload(name)(*args, **kwargs)
                        results.append(leaves(out))
                    ok = same(results[0], results[1], name in UNINITIALISED)
                    record.update(verdict="ran" if ok else "nondeterministic")
                except KERNEL_ERRORS as e:
                    record.update(
                        verdict="kernel_refused", message=f"{type(e).__name__}: {e}"[:300]
                    )
                except Exception as e:
                    record.update(verdict="kernel_failed", message=f"{type(e).__name__}: {e}"[:300])
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()


def test_every_allowed_operator_has_a_valid_call() -> None:
    from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS

    missing = sorted(ALLOWED_ATEN_OPS - set(VALID) - set(NO_SAMPLE))
    assert not missing, f"allowed operators without a valid call in VALID: {missing}"
    assert not set(VALID) - ALLOWED_ATEN_OPS, sorted(set(VALID) - ALLOWED_ATEN_OPS)
    assert not set(NO_SAMPLE) & set(VALID), sorted(set(NO_SAMPLE) & set(VALID))


@pytest.mark.timeout(150)
def test_mismatched_arguments_are_refused_or_valid() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.unit.test_shape_fuzz_ops import _run_table; _run_table()",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (proc.returncode, records[-1:], proc.stderr[-2000:])
    invalid = [r for r in records if r["case"] == "valid" and r["verdict"] != "ran"]
    assert not invalid, invalid
    bad = [r for r in records if r["verdict"] not in ("refused", "ran", "kernel_refused")]
    assert not bad, bad
    refused = [r for r in records if r["verdict"] == "refused"]
    assert all("\n" not in r["message"] and r["message"] for r in refused)
    assert {r["op"] for r in records} == set(VALID)
    counts = {
        v: sum(r["verdict"] == v for r in records) for v in ("refused", "ran", "kernel_refused")
    }
    log.info("%d operators, %d cases: %s", len(VALID), len(records), counts)
    # Every argument error and every dtype a kernel does not implement is the check's to refuse.
    kernel_refused = [r for r in records if r["verdict"] == "kernel_refused"]
    assert not kernel_refused, kernel_refused


def test_device_dtype_gaps_follow_the_tensors_device_type() -> None:
    """The CPU's float16/bfloat16 gaps refuse on CPU tensors only; CUDA tensors (fake ones: no GPU
    is needed) are held to cuFFT's: no bfloat16, float16 of power-of-two sizes only."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from epochmesh.errors import ProgramError
    from epochmesh.program import op_contracts

    aten = torch.ops.aten

    def verdict(op: Any, *args: Any) -> str:
        name = f"aten.{op._schema.name.split('::')[1]}.{op._overloadname}"
        try:
            op_contracts.check(op, name, args, {})
        except ProgramError as e:
            return str(e)
        return "accepted"

    with FakeTensorMode():
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.empty(1, 2, 4, 4, 4, dtype=dtype)
            assert "cpu kernel does not implement" in verdict(aten.avg_pool3d.default, x, [2] * 3)
            x = torch.empty(1, 2, 4, 4, 4, dtype=dtype, device="cuda")
            assert verdict(aten.avg_pool3d.default, x, [2] * 3) == "accepted"
            x = torch.empty(4, 8, dtype=dtype)
            assert "cpu kernel" in verdict(aten._fft_r2c.default, x, [1], 0, True)
        fft = aten._fft_r2c.default
        x = torch.empty(4, 8, dtype=torch.bfloat16, device="cuda")
        assert "cuda kernel does not implement" in verdict(fft, x, [1], 0, True)
        x = torch.empty(4, 6, dtype=torch.float16, device="cuda")
        assert "power-of-two" in verdict(fft, x, [1], 0, True)
        x = torch.empty(4, 8, dtype=torch.float16, device="cuda")
        assert verdict(fft, x, [1], 0, True) == "accepted"
        # Device-independent: no half-precision distances, no complex pools, no integer pools.
        for device in ("cpu", "cuda"):
            x = torch.empty(4, 3, dtype=torch.float16, device=device)
            assert "float32 or float64" in verdict(aten._pdist_forward.default, x, 2.0)
            x = torch.empty(1, 2, 6, 6, dtype=torch.complex64, device=device)
            assert "no complex kernels" in verdict(aten.max_pool2d.default, x, [2, 2])
            x = torch.empty(1, 2, 6, 6, dtype=torch.int64, device=device)
            assert "floating-point" in verdict(aten.max_pool2d.default, x, [2, 2])
