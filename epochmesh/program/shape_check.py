"""Argument shapes of a loaded program, re-derived and checked before any kernel runs.

An archive describes every tensor of its graph (`meta['val']`), but an edited archive describes
what its author wants: a batch norm whose running mean is shorter than its channels, an LSTM
whose hidden weights are short. Some CPU kernels trust their arguments' shapes (they read and
write as many elements as the other arguments imply), so a donor must not either.

`ShapeCheck(module)` holds the module `torch.export` built (the graph that runs, its parameters,
buffers and constants as they are after the initial state is loaded) and propagates shapes
through it with fake tensors (`FakeTensorMode`, no fallback to real kernels): the inputs are
fake tensors of the given shapes, the weights fake copies of the module's real tensors, and each
node's value is what its operator's meta/fake implementation computes from the values already
propagated. The archive's own `meta['val']` is never an input of the propagation. Each ATen node
must be on the allow-list, pass its operator's contract (`CONTRACTS`: the checks the CPU kernels
of some operators leave out) and be computed by its fake implementation without error.

- `check_declared(batch_sizes)` (load time): the inputs take the shapes the archive declares for
  them, its batch symbol set to each of a few sizes within the declared range; every node's
  propagated value must also equal the value the archive declares for it (shape and dtype), so
  an archive whose description disagrees with its weights or its graph is refused.
- `check_inputs(args)` (before each run): the actual inputs' shapes, once per distinct
  signature (a program's shapes depend on the batch size only through the graph's arithmetic,
  so each new size is checked before it runs).

Failures raise ProgramError naming the node, the operator and what does not fit.

The contracts: where an operator's fake implementation computes a shape without checking what
its CPU kernel relies on, a contract below checks it (tests/unit/test_shape_fuzz.py feeds every
weight of the catalogue's models with wrong shapes and dtypes; operators no weight reaches are
fuzzed by tests/unit/test_shape_fuzz_ops.py):
- matrix products, convolutions, norms, embedding bags, recurrent layers and attention
  (SAME_FLOAT_DTYPE): one floating dtype across input and weights outside autocast regions;
- batch_norm, instance_norm: weight, bias, running mean and variance are vectors of the
  input's channel count (the CPU kernels of the native batch norms index them by channel);
- native_group_norm: N, C and HxW agree with the input, groups divide C, weight and bias have
  C elements; group_norm, layer_norm and native_layer_norm likewise against their shapes;
- lstm, gru, rnn_tanh: the flat weight list has the layer/direction count the flags imply and
  each weight and bias the shape the input size, hidden size (and projection) imply; the
  initial states match (the CPU kernels, mkldnn's included, read the weights by those sizes);
- embedding, embedding_bag, _embedding_bag: a 2-D weight, integer indices (and offsets of the
  same dtype), per-sample weights shaped like the indices, a known mode, no sparse gradients;
- convolution and conv1d/2d/3d/conv_transpose2d: weight rank and channels against the input's
  and the groups, bias length, one stride/padding/dilation per spatial dimension, positive
  strides and dilations, groups > 0;
- grid_sampler_2d, _fft_r2c, _fft_c2r: enum-valued integers in range; _fft_c2r's last
  dimension size agrees with its input (the kernel reads last_dim_size // 2 + 1 elements).
- every allowed operator: `epochmesh.program.op_contracts` (index/scatter/gather family,
  pads, adaptive pools, dims within the rank, FFT dims, the dtypes an operator's meaning
  requires, and the dtypes its kernels for the tensors' device type implement: no complex
  tensors outside the operators with complex kernels, no CPU float16/bfloat16 gaps on CPU),
  checked before the contracts above (tests/unit/test_shape_fuzz_ops.py fuzzes every allowed
  operator and requires that no kernel refuses a case the check accepted).
Index values (gather, scatter, index, index_put, index_select, embedding) are data: the CPU
kernels check their ranges as they run.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from epochmesh.errors import ProgramError
from epochmesh.program import op_contracts
from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS

# Distinct input signatures remembered as checked (beyond it, each run is checked again).
MAX_CHECKED_SIGNATURES = 64
# Batch sizes the load-time check propagates (clamped into the declared range).
LOAD_BATCH_SIZES = (2, 3)

# The Python functions on sizes the archive check accepts as graph targets.
_SIZE_FUNCTIONS: set[Any] = {
    getattr(operator, n)
    for n in (
        "getitem add sub mul truediv floordiv mod neg pos abs eq ne lt le gt ge "
        "and_ or_ xor not_ invert"
    ).split()
}
_SIZE_FUNCTIONS |= {math.floor, math.ceil, math.trunc, math.sqrt}
_SIZE_FUNCTIONS |= {
    f
    for n in (
        "sym_not sym_max sym_min sym_float sym_int sym_ite sym_sqrt sym_sum _sym_sqrt".split()
    )
    if (f := getattr(torch, n, None)) is not None
}
_INTEGER_DTYPES = (torch.int32, torch.int64)
# Operators whose result has the shape and dtype of their first argument.
_SHAPE_OF_INPUT = {"aten.batch_norm.default", "aten.instance_norm.default"}


Contract = Callable[[Sequence[Any], Mapping[str, Any]], None]


class ShapeCheck:
    """Shape propagation over `module` (the GraphModule of ExportedProgram.module()), see the
    module docstring. Not thread-safe; one per loaded program."""

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, fx.GraphModule):
            raise ProgramError("the exported module is not a graph")
        self._module = module
        self._inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
        self._checked: set[tuple[Any, ...]] = set()
        self._ranges: dict[Any, tuple[int, int]] = {}  # the declared symbols' (lo, hi)

    # -- entry points -----------------------------------------------------------------------

    def check_declared(
        self, ranges: Mapping[Any, tuple[int, int]], batch_sizes: Iterable[int] = LOAD_BATCH_SIZES
    ) -> None:
        """Propagate from the declared input shapes, each symbol of `ranges` ({symbol: (lo,
        hi)}, the archive's range constraints) set to each of `batch_sizes` clamped into its
        range; the declared value of every node must equal the propagated one."""
        self._ranges = dict(ranges)
        for size in sorted(set(batch_sizes)):
            values = {s: min(max(size, lo), hi) for s, (lo, hi) in ranges.items()}
            args = [_declared_input(n, values) for n in self._inputs]
            self._propagate(args, declared=values)

    def zero_inputs(self, size: int, device: torch.device) -> list[torch.Tensor]:
        """Zero tensors of the declared input shapes, each symbol of the ranges `check_declared`
        was given (the batch size) set to `size` clamped into its range (ProgramError if a size
        depends on an unknown symbol)."""
        values = {s: min(max(size, lo), hi) for s, (lo, hi) in self._ranges.items()}
        specs = [_declared_input(n, values) for n in self._inputs]
        return [torch.zeros(a.shape, dtype=a.dtype, device=device) for a in specs]

    def check_inputs(self, args: Sequence[torch.Tensor]) -> None:
        """Propagate from these inputs (once per distinct signature); ProgramError if a node
        does not check."""
        sig = tuple((tuple(a.shape), a.dtype, a.device.type) for a in args)
        if sig in self._checked:
            return
        if len(args) != len(self._inputs):
            raise ProgramError(f"the program takes {len(self._inputs)} inputs, got {len(args)}")
        for node, a in zip(self._inputs, args, strict=True):
            _conforms(node, a)
        self._propagate([_Spec(tuple(a.shape), a.dtype, a.device) for a in args], declared=None)
        if len(self._checked) < MAX_CHECKED_SIGNATURES:
            self._checked.add(sig)

    # -- propagation -------------------------------------------------------------------------

    def _propagate(self, args: Sequence[_Spec], declared: Mapping[Any, int] | None) -> None:
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        mode.allow_fallback_kernels = False
        fakes: dict[int, torch.Tensor] = {}

        def fake(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in fakes:  # tied weights stay one tensor
                fakes[id(t)] = torch.empty_strided(
                    tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device
                )
            return fakes[id(t)]

        with mode, torch.no_grad():
            inputs = [
                torch.empty_strided(
                    a.shape, _contiguous_strides(a.shape), dtype=a.dtype, device=a.device
                )
                for a in args
            ]
            _run_graph(self._module, self._module.graph, inputs, fake, declared)


def batch_ranges(ep: torch.export.ExportedProgram) -> dict[Any, tuple[int, int]]:
    """{symbol: (lo, hi)} of the archive's range constraints (the batch size), hi bounded."""
    out: dict[Any, tuple[int, int]] = {}
    for sym, vr in ep.range_constraints.items():
        lo = int(vr.lower) if _finite_int(vr.lower) else 0
        hi = int(vr.upper) if _finite_int(vr.upper) else 1 << 31  # unbounded: int_oo
        out[sym] = (max(lo, 0), max(lo, hi, 0))
    return out


def _finite_int(value: Any) -> bool:
    """A sympy bound that is an integer (not int_oo)."""
    return type(value) is int or bool(getattr(value, "is_Integer", False))


class _Spec:
    """An input's shape, dtype and device."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _declared_input(node: fx.Node, values: Mapping[Any, int]) -> _Spec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ProgramError(f"program input {node.name!r} is not declared as a tensor")
    shape = tuple(_concrete(d, values, f"the size of input {node.name!r}") for d in val.shape)
    return _Spec(shape, val.dtype, val.device)


def _conforms(node: fx.Node, arg: torch.Tensor) -> None:
    """`arg` has the declared rank, dtype and fixed sizes of input `node`."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ProgramError(f"program input {node.name!r} is not declared as a tensor")
    fixed = [d if type(d) is int else None for d in val.shape]
    if (
        arg.dim() != len(fixed)
        or arg.dtype != val.dtype
        or any(f is not None and f != s for f, s in zip(fixed, arg.shape, strict=True))
    ):
        declared = ["*" if f is None else f for f in fixed]
        raise ProgramError(
            f"input {node.name!r} is {arg.dtype} {list(arg.shape)}; the program takes "
            f"{val.dtype} {declared}"
        )


def _concrete(value: Any, values: Mapping[Any, int], what: str) -> int:
    """An int or a declared SymInt evaluated with the symbols' `values`."""
    if type(value) is int:
        return value
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        known = {s: v for s, v in values.items() if s in expr.free_symbols}
        if set(known) != expr.free_symbols:
            raise ProgramError(f"{what} depends on an unknown symbol ({expr})")
        result = expr.xreplace({s: sympy.Integer(v) for s, v in known.items()})
        if getattr(result, "is_Integer", False):
            return int(result)
        raise ProgramError(f"{what} is not an integer ({expr})")
    raise ProgramError(f"{what} is not a size")


def _run_graph(
    module: torch.nn.Module,
    graph: fx.Graph,
    inputs: Sequence[Any],
    fake: Callable[[torch.Tensor], torch.Tensor],
    declared: Mapping[Any, int] | None,
) -> Any:
    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            try:
                env[node] = next(it)
            except StopIteration:
                raise ProgramError("the program's graph takes more inputs than given") from None
        elif node.op == "get_attr":
            obj = _attribute(module, str(node.target))
            env[node] = fake(obj) if isinstance(obj, torch.Tensor) else obj
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = _call(node, args, kwargs, fake, declared)
        elif node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        else:
            raise ProgramError(f"graph node {node.name!r} is a {node.op} (not accepted)")
        if declared is not None and "val" in node.meta:
            _compare(node, node.meta["val"], env[node], declared)
    raise ProgramError("the program's graph has no output")


def _attribute(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        if not hasattr(obj, part):
            raise ProgramError(f"the graph reads {target!r}, which the program lacks")
        obj = getattr(obj, part)
    return obj


def _call(
    node: fx.Node,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    fake: Callable[[torch.Tensor], torch.Tensor],
    declared: Mapping[Any, int] | None,
) -> Any:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = f"aten.{target._schema.name.split('::', 1)[-1]}.{target._overloadname}"
        if target.namespace != "aten" or name not in ALLOWED_ATEN_OPS:
            raise ProgramError(f"graph node {node.name!r} calls {name}, not on the allow-list")
        where = f"node {node.name!r} ({name})"
        contract = CONTRACTS.get(name)
        try:
            op_contracts.check(target, name, args, kwargs)
            if name in SAME_FLOAT_DTYPE:
                _same_float_dtype(args, kwargs)
            if contract is not None:
                contract(args, kwargs)
            return target(*args, **kwargs)
        except ProgramError as e:
            raise ProgramError(f"{where}: {e}") from None
        except ZeroDivisionError:
            # The decomposition of batch norm divides by (values per channel - 1) in Python:
            # one value per channel, which the kernel accepts (its contract is checked above).
            if name not in _SHAPE_OF_INPUT:
                raise ProgramError(f"{where} does not check: division by zero") from None
            return torch.empty_like(args[0])
        except Exception as e:  # what the fake implementation refuses
            raise ProgramError(f"{where} does not check: {_first_line(e)}") from None
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _call_hop(node, target, args, fake, declared)
    if target in _SIZE_FUNCTIONS:
        try:
            return target(*args, **kwargs)  # type: ignore[operator]
        except Exception as e:
            raise ProgramError(f"node {node.name!r}: {_first_line(e)}") from None
    raise ProgramError(f"graph node {node.name!r} calls {target!r} (not accepted)")


def _call_hop(
    node: fx.Node,
    hop: torch._ops.HigherOrderOperator,
    args: Sequence[Any],
    fake: Callable[[torch.Tensor], torch.Tensor],
    declared: Mapping[Any, int] | None,
) -> Any:
    name = str(hop._name)
    if name == "wrap_with_set_grad_enabled" and len(args) >= 2:
        sub, rest = args[1], args[2:]
        return _run_sub(node, sub, rest, fake, declared)
    if name == "wrap_with_autocast" and len(args) >= 5:
        device_type, dtype, enabled, cache_enabled, sub = args[:5]
        if not isinstance(device_type, str) or device_type not in ("cpu", "cuda"):
            raise ProgramError(f"node {node.name!r}: autocast on {device_type!r}")
        with torch.autocast(device_type, dtype=dtype, enabled=bool(enabled)):
            return _run_sub(node, sub, args[5:], fake, declared)
    raise ProgramError(f"graph node {node.name!r} calls {name} (not accepted)")


def _run_sub(
    node: fx.Node,
    sub: Any,
    args: Sequence[Any],
    fake: Callable[[torch.Tensor], torch.Tensor],
    declared: Mapping[Any, int] | None,
) -> Any:
    if not isinstance(sub, fx.GraphModule):
        raise ProgramError(f"node {node.name!r}: its subgraph is not a graph")
    return _run_graph(sub, sub.graph, args, fake, declared)


def _compare(node: fx.Node, want: Any, got: Any, values: Mapping[Any, int]) -> None:
    """The archive's declared value of `node` against the propagated one."""
    what = f"node {node.name!r}"
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise ProgramError(f"{what}: declared a tensor, computes {type(got).__name__}")
        shape = tuple(_concrete(d, values, f"the declared size of {what}") for d in want.shape)
        if shape != tuple(got.shape) or want.dtype != got.dtype:
            raise ProgramError(
                f"{what}: the archive declares {want.dtype} {list(shape)}, its inputs and "
                f"weights give {got.dtype} {list(got.shape)}"
            )
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise ProgramError(f"{what}: declared {len(want)} results, computes another count")
        for w, g in zip(want, got, strict=True):
            _compare(node, w, g, values)
    elif isinstance(want, torch.SymInt) or type(want) is int:
        if isinstance(got, (int, torch.SymInt)):
            value = _concrete(want, values, f"the declared value of {what}")
            if value != int(got):
                raise ProgramError(f"{what}: the archive declares {value}, it computes {got}")


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            text = line.strip()
            return f"{type(e).__name__}: {text[:300]}"
    return type(e).__name__


# ---------------------------------------------------------------------------------------------
# Contracts: the argument checks some CPU kernels leave out (see the module docstring)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    if i < len(args):
        return args[i]
    return kwargs.get(name, default)


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ProgramError(f"{what} is not a tensor")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ProgramError(f"{what} is not an integer")
    return int(value)


def _shape(t: torch.Tensor) -> list[int]:
    return [int(d) for d in t.shape]


def _expect(t: Any, shape: Sequence[int], what: str) -> None:
    tensor = _tensor(t, what)
    if _shape(tensor) != list(shape):
        raise ProgramError(f"{what} has shape {_shape(tensor)}, expected {list(shape)}")


def _same_float(t: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if not t.dtype.is_floating_point or t.dtype != ref.dtype:
        raise ProgramError(f"{what} is {t.dtype}, expected {ref.dtype} like the input")


def _channel_vectors(x: Any, named: Mapping[str, Any], op: str) -> None:
    """weight/bias/running statistics: None or vectors of x's channel count."""
    x = _tensor(x, "the input")
    if x.dim() < 2:
        raise ProgramError(f"{op} needs an input with a channel dimension, got {_shape(x)}")
    channels = int(x.shape[1])
    for what, t in named.items():
        if t is not None:
            _expect(t, [channels], f"{what} (for {channels} channels)")


def _batch_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    names = ("weight", "bias", "running_mean", "running_var")
    named = {n: _arg(args, kwargs, i + 1, n, None) for i, n in enumerate(names)}
    _channel_vectors(args[0], named, "batch norm")


def _instance_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    _batch_norm(args, kwargs)


def _native_group_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _tensor(args[0], "the input")
    n, c, hxw, group = (_int(_arg(args, kwargs, i, k, None), k) for i, k in
                        ((3, "N"), (4, "C"), (5, "HxW"), (6, "group")))  # fmt: skip
    if x.dim() < 2 or [int(x.shape[0]), int(x.shape[1])] != [n, c] or n * c * hxw != x.numel():
        raise ProgramError(f"N={n}, C={c}, HxW={hxw} do not describe an input of {_shape(x)}")
    if group <= 0 or c % group:
        raise ProgramError(f"{group} groups do not divide {c} channels")
    for i, what in ((1, "weight"), (2, "bias")):
        t = _arg(args, kwargs, i, what, None)
        if t is not None:
            _expect(t, [c], f"{what} (for {c} channels)")


def _group_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _tensor(args[0], "the input")
    groups = _int(_arg(args, kwargs, 1, "num_groups", None), "num_groups")
    if x.dim() < 2:
        raise ProgramError(f"group norm needs a channel dimension, got {_shape(x)}")
    c = int(x.shape[1])
    if groups <= 0 or c % groups:
        raise ProgramError(f"{groups} groups do not divide {c} channels")
    for i, what in ((2, "weight"), (3, "bias")):
        t = _arg(args, kwargs, i, what, None)
        if t is not None:
            _expect(t, [c], f"{what} (for {c} channels)")


def _layer_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    x = _tensor(args[0], "the input")
    shape = [_int(d, "normalized_shape") for d in _arg(args, kwargs, 1, "normalized_shape", [])]
    if not shape or x.dim() < len(shape) or _shape(x)[x.dim() - len(shape) :] != shape:
        raise ProgramError(f"normalized shape {shape} does not end the input's {_shape(x)}")
    for i, what in ((2, "weight"), (3, "bias")):
        t = _arg(args, kwargs, i, what, None)
        if t is not None:
            _expect(t, shape, what)


def _recurrent(gates: int) -> Contract:
    """lstm.input (gates 4, hx a pair, optional projections), gru.input (3), rnn_tanh.input
    (1): input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first."""

    def check(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        x = _tensor(args[0], "the input")
        hx_arg, params = args[1], list(args[2])
        has_biases, num_layers, _dropout, _train, bidirectional, batch_first = args[3:9]
        num_layers = _int(num_layers, "num_layers")
        dirs = 2 if bidirectional else 1
        if x.dim() not in (2, 3):
            raise ProgramError(f"the input must be 2-D or 3-D, got {_shape(x)}")
        if not x.dtype.is_floating_point:
            raise ProgramError(f"the input is {x.dtype}, not a floating-point tensor")
        if num_layers < 1:
            raise ProgramError(f"num_layers is {num_layers}")
        batched = x.dim() == 3
        batch = int(x.shape[0 if batch_first else 1]) if batched else None
        hxs = list(hx_arg) if gates == 4 else [hx_arg]
        if len(hxs) != (2 if gates == 4 else 1):
            raise ProgramError("the initial state does not match the layer kind")
        hidden = int(_tensor(hxs[-1], "the initial state").shape[-1])  # the cell state for LSTM
        out = int(_tensor(hxs[0], "the initial state").shape[-1])  # projection size for LSTM
        proj = gates == 4 and out != hidden
        for i, h in enumerate(hxs):
            size = hidden if i == len(hxs) - 1 else out
            want = [num_layers * dirs] + ([batch] if batch is not None else []) + [size]
            _expect(h, want, "the initial state")
            _same_float(h, x, "the initial state")
        per = 2 + (2 if has_biases else 0) + (1 if proj else 0)
        if len(params) != num_layers * dirs * per:
            raise ProgramError(
                f"{len(params)} weights given; {num_layers} layer(s) x {dirs} direction(s) "
                f"need {num_layers * dirs * per}"
            )
        in_size = int(x.shape[-1])
        for layer in range(num_layers):
            layer_in = in_size if layer == 0 else out * dirs
            for d in range(dirs):
                base = (layer * dirs + d) * per
                w = params[base : base + per]
                tag = f"layer {layer}{' reverse' if d else ''}"
                _expect(w[0], [gates * hidden, layer_in], f"the input weight of {tag}")
                _expect(w[1], [gates * hidden, out], f"the hidden weight of {tag}")
                if has_biases:
                    _expect(w[2], [gates * hidden], f"the input bias of {tag}")
                    _expect(w[3], [gates * hidden], f"the hidden bias of {tag}")
                if proj:
                    _expect(w[-1], [out, hidden], f"the projection weight of {tag}")
                for t in w:
                    _same_float(t, x, f"a weight of {tag}")

    return check


def _indices(value: Any, what: str) -> torch.Tensor:
    t = _tensor(value, what)
    if t.dtype not in _INTEGER_DTYPES:
        raise ProgramError(f"{what} are {t.dtype}, not int32 or int64")
    return t


def _embedding(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    weight = _tensor(args[0], "the weight")
    if weight.dim() != 2:
        raise ProgramError(f"the weight must be 2-D, got {_shape(weight)}")
    _indices(args[1], "the indices")
    padding = _int(_arg(args, kwargs, 2, "padding_idx", -1), "padding_idx")
    rows = int(weight.shape[0])
    if padding != -1 and not -rows <= padding < rows:
        raise ProgramError(f"padding_idx {padding} is outside the weight's {rows} rows")
    if _arg(args, kwargs, 4, "sparse", False):
        raise ProgramError("sparse gradients are not accepted")


def _embedding_bag(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """embedding_bag.padding_idx and _embedding_bag: weight, indices, offsets,
    scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset, padding_idx."""
    weight = _tensor(args[0], "the weight")
    if weight.dim() != 2:
        raise ProgramError(f"the weight must be 2-D, got {_shape(weight)}")
    indices = _indices(args[1], "the indices")
    offsets = _indices(args[2], "the offsets")
    if indices.dim() not in (1, 2) or offsets.dim() != 1 or offsets.dtype != indices.dtype:
        raise ProgramError(
            f"indices {_shape(indices)} ({indices.dtype}) and offsets {_shape(offsets)} "
            f"({offsets.dtype}) do not fit (1-D or 2-D indices, 1-D offsets of their dtype)"
        )
    mode = _int(_arg(args, kwargs, 4, "mode", 0), "mode")
    if mode not in (0, 1, 2):
        raise ProgramError(f"mode {mode} is not sum, mean or max")
    if _arg(args, kwargs, 5, "sparse", False):
        raise ProgramError("sparse gradients are not accepted")
    psw = _arg(args, kwargs, 6, "per_sample_weights", None)
    if psw is not None:
        _expect(psw, _shape(indices), "the per-sample weights (like the indices)")
        _same_float(_tensor(psw, "the per-sample weights"), weight, "the per-sample weights")
    padding = _arg(args, kwargs, 8, "padding_idx", None)
    if padding is not None:
        rows, p = int(weight.shape[0]), _int(padding, "padding_idx")
        if p != -1 and not -rows <= p < rows:
            raise ProgramError(f"padding_idx {p} is outside the weight's {rows} rows")


def _conv_check(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: Any,
) -> None:
    x, weight = _tensor(x, "the input"), _tensor(weight, "the weight")
    groups = _int(groups, "groups")
    if weight.dim() < 3 or x.dim() not in (weight.dim(), weight.dim() - 1):
        raise ProgramError(f"a weight of {_shape(weight)} does not fit an input of {_shape(x)}")
    spatial = weight.dim() - 2
    channels = int(x.shape[-spatial - 1])
    if groups <= 0:
        raise ProgramError(f"groups is {groups}")
    w0, w1 = int(weight.shape[0]), int(weight.shape[1])
    if transposed:
        ok, out = channels == w0 and w0 % groups == 0, w1 * groups
    else:
        ok, out = channels == w1 * groups and w0 % groups == 0, w0
    if not ok:
        raise ProgramError(
            f"a weight of {_shape(weight)} with {groups} group(s) does not fit an input of "
            f"{channels} channels"
        )
    if bias is not None:
        _expect(bias, [out], f"the bias (for {out} output channels)")
    for name, values, positive in (
        ("stride", stride, True),
        ("padding", padding, False),
        ("dilation", dilation, True),
        ("output_padding", output_padding, False),
    ):
        if values is None:
            continue
        ints = [_int(v, name) for v in (values if isinstance(values, (list, tuple)) else [values])]
        if len(ints) not in (1, spatial) or any(v < (1 if positive else 0) for v in ints):
            raise ProgramError(f"{name} {ints} does not fit {spatial} spatial dimension(s)")


def _convolution(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    _conv_check(*args[:9])


def _conv_nd(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """conv1d/2d/3d.default: input, weight, bias, stride, padding, dilation, groups."""
    a = [_arg(args, kwargs, i, k, d) for i, (k, d) in enumerate(
        (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
         ("dilation", 1), ("groups", 1)))]  # fmt: skip
    _conv_check(a[0], a[1], a[2], a[3], a[4], a[5], False, None, a[6])


def _conv_transpose(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """conv_transpose2d.input: input, weight, bias, stride, padding, output_padding, groups,
    dilation."""
    a = [_arg(args, kwargs, i, k, d) for i, (k, d) in enumerate(
        (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
         ("output_padding", 0), ("groups", 1), ("dilation", 1)))]  # fmt: skip
    _conv_check(a[0], a[1], a[2], a[3], a[4], a[7], True, a[5], a[6])


def _grid_sampler(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for i, name in ((2, "interpolation_mode"), (3, "padding_mode")):
        if _int(_arg(args, kwargs, i, name, 0), name) not in (0, 1, 2):
            raise ProgramError(f"{name} is out of range")


def _fft_norm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int]:
    x = _tensor(args[0], "the input")
    dims = [_int(d, "dim") for d in _arg(args, kwargs, 1, "dim", [])]
    if not dims or any(not -x.dim() <= d < x.dim() for d in dims):
        raise ProgramError(f"dims {dims} do not fit an input of {x.dim()} dimensions")
    wrapped = [d % x.dim() for d in dims]
    if len(set(wrapped)) != len(wrapped):
        raise ProgramError(f"dims {dims} repeat")
    if _int(_arg(args, kwargs, 2, "normalization", 0), "normalization") not in (0, 1, 2):
        raise ProgramError("normalization is out of range")
    return wrapped


def _fft_r2c(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    _fft_norm(args, kwargs)


def _fft_c2r(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    dims = _fft_norm(args, kwargs)
    x = _tensor(args[0], "the input")
    last = _int(_arg(args, kwargs, 3, "last_dim_size", 0), "last_dim_size")
    if last < 1 or int(x.shape[dims[-1]]) != last // 2 + 1:
        raise ProgramError(
            f"last_dim_size {last} does not fit an input of {int(x.shape[dims[-1]])} along the "
            "last transformed dimension"
        )


def _same_float_dtype(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """The floating-point tensors of a call share one dtype (autocast regions excepted: there
    the kernel's arguments are cast first)."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return
    dtypes: set[torch.dtype] = set()
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.dtype.is_floating_point:
                dtypes.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    if len(dtypes) > 1:
        raise ProgramError(f"mixes floating-point dtypes {sorted(str(d) for d in dtypes)}")


# Operators whose CPU kernels require one floating dtype across input and weights (the fake
# implementations of several of them promote instead).
SAME_FLOAT_DTYPE = frozenset(
    {
        "aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default",
        "aten.baddbmm.default", "aten.matmul.default", "aten.bilinear.default",
        "aten.convolution.default", "aten.conv1d.default", "aten.conv2d.default",
        "aten.conv3d.default", "aten.conv_transpose2d.input", "aten.batch_norm.default",
        "aten.instance_norm.default", "aten.layer_norm.default", "aten.native_layer_norm.default",
        "aten.group_norm.default", "aten.native_group_norm.default", "aten.prelu.default",
        "aten.embedding_bag.padding_idx", "aten._embedding_bag.default",
        "aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input",
        "aten.scaled_dot_product_attention.default",
    }
)  # fmt: skip

CONTRACTS: dict[str, Contract] = {
    "aten.batch_norm.default": _batch_norm,
    "aten.instance_norm.default": _instance_norm,
    "aten.native_group_norm.default": _native_group_norm,
    "aten.group_norm.default": _group_norm,
    "aten.layer_norm.default": _layer_norm,
    "aten.native_layer_norm.default": _layer_norm,
    "aten.lstm.input": _recurrent(4),
    "aten.gru.input": _recurrent(3),
    "aten.rnn_tanh.input": _recurrent(1),
    "aten.embedding.default": _embedding,
    "aten.embedding_bag.padding_idx": _embedding_bag,
    "aten._embedding_bag.default": _embedding_bag,
    "aten.convolution.default": _convolution,
    "aten.conv1d.default": _conv_nd,
    "aten.conv2d.default": _conv_nd,
    "aten.conv3d.default": _conv_nd,
    "aten.conv_transpose2d.input": _conv_transpose,
    "aten.grid_sampler_2d.default": _grid_sampler,
    "aten._fft_r2c.default": _fft_r2c,
    "aten._fft_c2r.default": _fft_c2r,
}
