"""Argument contracts of the allowed operators: dtypes and arguments checked before a kernel runs.

`epochmesh.program.shape_check` propagates fake tensors through a program's graph; an
operator's fake (meta) implementation computes its result's shape but does not always check what
its kernels check: an index's dtype, a dimension within the rank, a pad list's length, a value
that must broadcast to an indexing result. Those kernels refuse such arguments today with their
own errors, but a kernel that happens to check is not a contract. `check(op, name, args,
kwargs)` checks them here first, on the fake tensors, and raises a one-line ProgramError naming
the argument (the shape check prefixes the node and the operator).

What is checked:
- dtypes the kernels implement, for every operator (`DTYPES`, `COMPLEX_OPS`,
  `DEVICE_DTYPE_GAPS`): no tensor of a dtype outside the standard set (float8, complex32,
  uint16/32/64, quantized); complex tensors only for the operators whose kernels implement them
  (FFT, elementwise arithmetic, sums, matrix products, indexing, movement), on every device; the
  float16/bfloat16 gaps of the kernels of the tensors' device type (the fake tensors carry the
  real device: CPU float16/bfloat16 FFT, avg_pool3d and margin losses; cuFFT's bfloat16, and
  float16 of other than power-of-two sizes, on CUDA). A device type without a table of its own
  is held to the CPU's;
- dtypes that the operator's meaning or its kernels on every device require (`DTYPE_RULES`):
  indices are integer tensors (int64 where the operator takes only int64), masks are bool, class
  targets int64, bitwise operators take integer or bool tensors, operators whose math is
  floating point (softmax, the smooth activations, pools, im2col/col2im, interpolation, norms,
  std/var, distances, most losses, _fft_r2c) take floating-point tensors (distances float32 or
  float64 only: no device implements half-precision distances), _fft_c2r complex ones, and
  arithmetic that bool does not have (subtraction, relu, rounding, reflection pads, argmax,
  topk) refuses bool;
- arguments that must share one dtype (`SAME_DTYPE`: matrix products, scatter sources, index_put
  values, grid sampling), outside autocast regions (there the kernels' arguments are cast first),
  in-place results that the operator's own dtype must hold, and operators that produce one
  argument's dtype from others (`RESULT_OF`: the result type of them must cast to it);
- arguments (`ARG_CONTRACTS`): dims within the rank (softmax family, sort, logsumexp, the
  index/scatter/gather family), gather/scatter index ranks and sizes against self's and src's,
  index_add sources, index/index_put index counts and mask shapes and index_put values that
  broadcast to the indexing result, select/slice_scatter sources of the slice's shape, pad
  lists (even, at most two per dimension, results non-negative; reflection pads shorter than
  the dimension), adaptive pools' output sizes, _pdist_forward's 2-D input, _fft_r2c/_fft_c2r
  dims normalised (0 <= dim < rank, distinct), masked_scatter sources that can fill the mask.

Where the CUDA kernels were not measured, the rules refuse on every device what the CPU kernels
do not implement (complex, integer and bool gaps), so a program the check accepts on one device
type does not meet a kernel's own dtype refusal on another. Left to the kernels: values that are
data (an index's values, a mask's count of true elements): the kernels check those as they run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from epochmesh.errors import ProgramError

Bound = dict[str, Any]

_INDEX = (torch.int32, torch.int64)
_INDEX_OR_MASK = (torch.int32, torch.int64, torch.uint8, torch.bool)
_MASKS = (torch.bool, torch.uint8)


def check(op: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """The dtype rules, dtype groups and argument contract of operator `name` (ProgramError)."""
    a = _bind(op, args, kwargs)
    _implemented_dtypes(name, a)
    rules = DTYPE_RULES.get(name)
    group = SAME_DTYPE.get(name)
    contract = ARG_CONTRACTS.get(name)
    for arg, kind in rules or ():
        value = a.get(arg)
        if value is not None:
            _KINDS[kind](value, arg)
    if group is not None and not _autocast():
        _same_dtype(a, group)
    result = RESULT_OF.get(name)
    if result is not None:
        _result_type(a, result)
    if contract is not None:
        contract(a)


def _bind(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Bound:
    """{argument name: value} by the operator's schema (defaults filled in)."""
    out: Bound = {}
    for i, spec in enumerate(op._schema.arguments):
        if i < len(args):
            out[spec.name] = args[i]
        elif spec.name in kwargs:
            out[spec.name] = kwargs[spec.name]
        elif spec.has_default_value():
            out[spec.name] = spec.default_value
    return out


def _autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


# -- helpers ---------------------------------------------------------------------------------


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ProgramError(f"{what} is not a tensor")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ProgramError(f"{what} is not an integer")
    return int(value)


def _ints(value: Any, what: str) -> list[int]:
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return [int(value)]
    if not isinstance(value, (list, tuple)):
        raise ProgramError(f"{what} is not a list of integers")
    return [_int(v, what) for v in value]


def _shape(t: torch.Tensor) -> list[int]:
    return [int(d) for d in t.shape]


def _dim(value: Any, rank: int, what: str = "dim") -> int:
    """A dimension index wrapped into [0, rank) (a 0-d tensor has one dimension to name)."""
    d, n = _int(value, what), max(rank, 1)
    if not -n <= d < n:
        raise ProgramError(f"{what} {d} is out of range for a tensor of {rank} dimension(s)")
    return d % n


def _sizes(t: torch.Tensor) -> list[int]:
    """Sizes, a 0-d tensor counting as one element of one dimension."""
    return _shape(t) or [1]


# -- dtype kinds -----------------------------------------------------------------------------


def _kind(test: Callable[[torch.dtype], bool], wants: str) -> Callable[[Any, str], None]:
    def check_kind(value: Any, what: str) -> None:
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor) and not test(t.dtype):  # scalars are not checked
                raise ProgramError(f"{what} is {t.dtype}; the operator takes {wants}")

    return check_kind


def _floating(d: torch.dtype) -> bool:
    return d.is_floating_point


_KINDS: dict[str, Callable[[Any, str], None]] = {
    "float": _kind(_floating, "floating-point tensors"),
    "float32_or_64": _kind(
        lambda d: d in (torch.float32, torch.float64), "float32 or float64 tensors"
    ),
    "complex": _kind(lambda d: d.is_complex, "complex tensors"),
    "float_or_complex": _kind(
        lambda d: d.is_floating_point or d.is_complex, "floating-point or complex tensors"
    ),
    "float_or_uint8": _kind(
        lambda d: d.is_floating_point or d == torch.uint8, "floating-point or uint8 tensors"
    ),
    "not_bool": _kind(lambda d: d != torch.bool, "numbers, not bool"),
    "integral": _kind(
        lambda d: not d.is_floating_point and not d.is_complex, "integer or bool tensors"
    ),
    "index": _kind(lambda d: d in _INDEX, "int64 or int32 indices"),
    "long": _kind(lambda d: d == torch.int64, "int64 indices"),
    "indices": _kind(lambda d: d in _INDEX_OR_MASK, "int64, int32, uint8 or bool indices"),
    "mask": _kind(lambda d: d == torch.bool, "a bool mask"),
    "class_target": _kind(lambda d: d in (torch.int64, torch.uint8), "int64 class indices"),
    "class_or_probabilities": _kind(
        lambda d: d in (torch.int64, torch.uint8) or d.is_floating_point,
        "int64 class indices or floating-point probabilities",
    ),
}


def _same_dtype(a: Bound, names: Sequence[str]) -> None:
    seen: list[tuple[str, torch.dtype]] = []
    for n in names:
        v = a.get(n)
        if isinstance(v, torch.Tensor):
            seen.append((n, v.dtype))
    if len({d for _, d in seen}) > 1:
        listed = ", ".join(f"{n} {d}" for n, d in seen)
        raise ProgramError(f"the arguments must share one dtype, got {listed}")


# -- dtypes the kernels implement -------------------------------------------------------------


def _tensors(a: Bound) -> list[tuple[str, torch.Tensor]]:
    """(argument name, tensor) for every tensor argument, lists' items named name[i]."""
    out: list[tuple[str, torch.Tensor]] = []
    for n, v in a.items():
        if isinstance(v, torch.Tensor):
            out.append((n, v))
        elif isinstance(v, (list, tuple)):
            out.extend((f"{n}[{i}]", t) for i, t in enumerate(v) if isinstance(t, torch.Tensor))
    return out


def _implemented_dtypes(name: str, a: Bound) -> None:
    """Every tensor argument has a dtype that the operator's kernels implement: one of
    `DTYPES`, complex only where the operator is in `COMPLEX_OPS`, and none of the gaps that
    `DEVICE_DTYPE_GAPS` lists for the device type the tensors are on."""
    tensors = _tensors(a)
    for arg, t in tensors:
        if t.dtype not in DTYPES:
            raise ProgramError(
                f"{arg} is {t.dtype}; programs' tensors are floating-point (16 to 64 bits), "
                "complex64/128, int8 to int64, uint8 or bool"
            )
        if t.dtype.is_complex and name not in COMPLEX_OPS:
            raise ProgramError(f"{arg} is {t.dtype}; the operator has no complex kernels")
    if not tensors:
        return
    # The kernel runs on the device of its non-CPU tensors (CPU ones are 0-d scalars there).
    device = next((t.device.type for _, t in tensors if t.device.type != "cpu"), "cpu")
    gaps = DEVICE_DTYPE_GAPS.get(device, DEVICE_DTYPE_GAPS["cpu"]).get(name, ())
    for arg, t in tensors:
        if t.dtype in gaps:
            raise ProgramError(
                f"{arg} is {t.dtype}; the operator's {device} kernel does not implement it"
            )
    if name in _FFT and device == "cuda":
        _cuda_half_fft(a)


def _cuda_half_fft(a: Bound) -> None:
    """cuFFT computes float16 transforms only of power-of-two sizes."""
    x = _tensor(a["self"], "self")
    if x.dtype != torch.float16:
        return
    for d in _ints(a["dim"], "dim"):
        size = int(x.shape[d]) if 0 <= d < x.dim() else 0
        if size < 1 or size & (size - 1):
            raise ProgramError(
                f"self is torch.float16 with size {size} along dim {d}; the cuda FFT of "
                "float16 takes power-of-two sizes only"
            )


def _result_type(a: Bound, names: Sequence[str]) -> None:
    """The operator produces the dtype of argument names[0]: the result type of all of them
    must cast to it (complex arguments of an operator that produces a real tensor do not)."""
    tensors = [(n, a[n]) for n in names if isinstance(a.get(n), torch.Tensor)]
    if len(tensors) < 2:
        return
    out, result = tensors[0][1].dtype, tensors[0][1].dtype
    for _, t in tensors[1:]:
        result = torch.promote_types(result, t.dtype)
    if not torch.can_cast(result, out):
        worst = next((n for n, t in tensors if not torch.can_cast(t.dtype, out)), names[0])
        raise ProgramError(
            f"{worst} is {a[worst].dtype}; the operator produces {out} ({names[0]}'s dtype), "
            f"which cannot hold the result type {result}"
        )


# -- argument contracts ----------------------------------------------------------------------


def _softmax(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    _dim(a["dim"], x.dim())
    dtype = a.get("dtype") or x.dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ProgramError(f"self is {x.dtype}; the operator computes in a floating-point dtype")


def _dim_of_self(a: Bound) -> None:
    _dim(a["dim"], _tensor(a["self"], "self").dim())


def _logsumexp(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    dims = _ints(a["dim"], "dim")
    if not dims:
        raise ProgramError("dim is empty; logsumexp needs at least one dimension")
    for d in dims:
        _dim(d, x.dim())


def _gather_scatter(a: Bound, src_name: str | None) -> None:
    """gather (src_name None) and the scatters: index rank equals self's, index sizes within
    self's except along dim (and within src's everywhere)."""
    x, index = _tensor(a["self"], "self"), _tensor(a["index"], "index")
    dim = _dim(a["dim"], x.dim())
    src = a.get(src_name) if src_name else None
    if max(index.dim(), 1) != max(x.dim(), 1):
        raise ProgramError(
            f"index has {index.dim()} dimension(s), self {x.dim()}; they must be equal"
        )
    if isinstance(src, torch.Tensor) and max(src.dim(), 1) != max(x.dim(), 1):
        raise ProgramError(f"src has {src.dim()} dimension(s), self {x.dim()}; they must be equal")
    if index.numel() == 0:
        return
    xs, ix = _sizes(x), _sizes(index)
    for d, (i, s) in enumerate(zip(ix, xs, strict=True)):
        if d != dim and i > s:
            raise ProgramError(
                f"index {_shape(index)} is larger than self {_shape(x)} in dimension {d}"
            )
    if isinstance(src, torch.Tensor):
        for d, (i, s) in enumerate(zip(ix, _sizes(src), strict=True)):
            if i > s:
                raise ProgramError(
                    f"index {_shape(index)} is larger than src {_shape(src)} in dimension {d}"
                )


def _scatter_reduce(a: Bound) -> None:
    _gather_scatter(a, "src")
    if a.get("reduce") not in ("sum", "prod", "mean", "amax", "amin"):
        raise ProgramError(f"reduce {a.get('reduce')!r} is not sum, prod, mean, amax or amin")


def _index_vector(index: torch.Tensor) -> None:
    if index.dim() > 1:
        raise ProgramError(f"index must be a vector, got shape {_shape(index)}")


def _index_select(a: Bound) -> None:
    _dim_of_self(a)
    _index_vector(_tensor(a["index"], "index"))


def _index_add(a: Bound) -> None:
    x, source = _tensor(a["self"], "self"), _tensor(a["source"], "source")
    index = _tensor(a["index"], "index")
    dim = _dim(a["dim"], x.dim())
    _index_vector(index)
    want = _sizes(x)
    want[dim] = index.numel()
    if _sizes(source) != want or max(source.dim(), 1) != max(x.dim(), 1):
        raise ProgramError(
            f"source has shape {_shape(source)}; self {_shape(x)} and {index.numel()} "
            f"indices along dim {dim} need {want}"
        )


def _indexing(a: Bound) -> list[Any]:
    """index.Tensor / index_put: at most self's rank indexed, masks shaped like the dimensions
    they index. Returns the indices."""
    x = _tensor(a["self"], "self")
    indices = list(a["indices"])
    pos = 0
    for i, t in enumerate(indices):
        if t is None:
            pos += 1
            continue
        t = _tensor(t, f"indices[{i}]")
        if t.dtype in _MASKS:
            want = _shape(x)[pos : pos + t.dim()]
            if _shape(t) != want or pos + t.dim() > x.dim():
                raise ProgramError(
                    f"indices[{i}] is a mask of shape {_shape(t)}; self {_shape(x)} has "
                    f"{want} there"
                )
            pos += t.dim()
        else:
            pos += 1
    if pos > x.dim():
        raise ProgramError(f"{pos} dimension(s) indexed; self has {x.dim()}")
    return indices


def _index(a: Bound) -> None:
    _indexing(a)


def _index_put(a: Bound) -> None:
    indices = _indexing(a)
    x, values = _tensor(a["self"], "self"), _tensor(a["values"], "values")
    if any(isinstance(t, torch.Tensor) and t.dtype in _MASKS for t in indices):
        return  # the result's length along a mask is the mask's count: data, left to the kernel
    if not any(isinstance(t, torch.Tensor) for t in indices):
        return
    try:
        result = _shape(torch.ops.aten.index.Tensor(x, indices))
    except Exception as e:
        raise ProgramError(f"the indices do not index self {_shape(x)}: {e}") from None
    if not _broadcasts(_shape(values), result):
        raise ProgramError(
            f"values of shape {_shape(values)} do not broadcast to the indexed {result}"
        )


def _broadcasts(shape: Sequence[int], to: Sequence[int]) -> bool:
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to), strict=False))


def _broadcast(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """The broadcast shape of `a` and `b`, None when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return out[::-1]


def _select_scatter(a: Bound) -> None:
    x, src = _tensor(a["self"], "self"), _tensor(a["src"], "src")
    dim = _dim(a["dim"], x.dim())
    if x.dim() == 0:
        raise ProgramError("self is 0-d; there is no dimension to select")
    size, index = int(x.shape[dim]), _int(a["index"], "index")
    if not -size <= index < size:
        raise ProgramError(f"index {index} is out of range for size {size} along dim {dim}")
    want = _shape(x)[:dim] + _shape(x)[dim + 1 :]
    if _shape(src) != want:
        raise ProgramError(f"src has shape {_shape(src)}; the selected slice of self is {want}")


def _slice_scatter(a: Bound) -> None:
    x, src = _tensor(a["self"], "self"), _tensor(a["src"], "src")
    dim = _dim(a["dim"], x.dim())
    if x.dim() == 0:
        raise ProgramError("self is 0-d; there is no dimension to slice")
    size = int(x.shape[dim])
    step = _int(a.get("step", 1), "step")
    if step < 1:
        raise ProgramError(f"step {step} is not positive")

    def bound(value: Any, default: int, what: str) -> int:
        v = default if value is None else _int(value, what)
        v = v + size if v < 0 else v
        return min(max(v, 0), size)

    start, end = bound(a.get("start"), 0, "start"), bound(a.get("end"), size, "end")
    length = max(0, (end - start + step - 1) // step)
    want = _shape(x)
    want[dim] = length
    if _shape(src) != want:
        raise ProgramError(f"src has shape {_shape(src)}; the slice of self is {want}")


def _pad_list(x: torch.Tensor, pad: Any, what: str) -> list[int]:
    pads = _ints(pad, what)
    if len(pads) % 2 or len(pads) // 2 > x.dim():
        raise ProgramError(
            f"{what} has {len(pads)} values; it takes two per padded dimension, at most "
            f"{2 * x.dim()} for self's {x.dim()} dimension(s)"
        )
    return pads


def _padded(x: torch.Tensor, pads: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dimension, size, padded size) for each padded dimension (pads list the last first)."""
    out = []
    for i in range(len(pads) // 2):
        d = x.dim() - 1 - i
        size = int(x.shape[d])
        out.append((d, size, size + pads[2 * i] + pads[2 * i + 1]))
    return out


def _constant_pad(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    for d, size, new in _padded(x, _pad_list(x, a["pad"], "pad")):
        if new < 0:
            raise ProgramError(f"pad makes dimension {d} (size {size}) {new} long")


def _mode_pad(x: torch.Tensor, pads: Sequence[int], mode: str, what: str) -> None:
    n = len(pads) // 2
    if n not in (1, 2, 3) or x.dim() not in (n + 1, n + 2):
        raise ProgramError(
            f"{mode} padding of {n} dimension(s) takes a {n + 1}-D or {n + 2}-D input, "
            f"got {_shape(x)}"
        )
    if 0 in _shape(x)[-n - 1 :] if x.dim() == n + 2 else 0 in _shape(x):
        raise ProgramError(f"{mode} padding needs non-empty dimensions, got {_shape(x)}")
    for i, (d, size, new) in enumerate(_padded(x, pads)):
        if new < 1:
            raise ProgramError(f"{what} makes dimension {d} (size {size}) {new} long")
        if mode == "reflect" and max(pads[2 * i], pads[2 * i + 1]) >= size:
            raise ProgramError(f"{what} {list(pads)} reflects past dimension {d} (size {size})")
        if mode == "circular" and max(pads[2 * i], pads[2 * i + 1]) > size:
            raise ProgramError(f"{what} {list(pads)} wraps past dimension {d} (size {size})")


def _pad(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    mode = a.get("mode", "constant")
    pads = _pad_list(x, a["pad"], "pad")
    if mode == "constant":
        _constant_pad(a)
    elif mode in ("reflect", "replicate", "circular"):
        _mode_pad(x, pads, str(mode), "pad")
    else:
        raise ProgramError(f"mode {mode!r} is not constant, reflect, replicate or circular")


def _padding_nd(n: int, mode: str) -> Callable[[Bound], None]:
    def check_padding(a: Bound) -> None:
        x = _tensor(a["self"], "self")
        pads = _ints(a["padding"], "padding")
        if len(pads) != 2 * n:
            raise ProgramError(f"padding has {len(pads)} values; it takes {2 * n}")
        _mode_pad(x, pads, mode, "padding")

    return check_padding


def _adaptive(n: int) -> Callable[[Bound], None]:
    def check_adaptive(a: Bound) -> None:
        x = _tensor(a["self"], "self")
        size = _ints(a["output_size"], "output_size")
        if len(size) != n or any(s < 0 for s in size):
            raise ProgramError(f"output_size {size} is not {n} non-negative size(s)")
        if x.dim() not in (n + 1, n + 2) or 0 in _shape(x)[-n:]:
            raise ProgramError(
                f"self must be {n + 1}-D or {n + 2}-D with non-empty spatial dimensions, "
                f"got {_shape(x)}"
            )

    return check_adaptive


def _pdist(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    if x.dim() != 2:
        raise ProgramError(f"self must be 2-D, got {_shape(x)}")
    if float(a.get("p", 2.0)) < 0:
        raise ProgramError(f"p {a.get('p')} is negative")


def _fft_dims(a: Bound) -> None:
    x = _tensor(a["self"], "self")
    dims = _ints(a["dim"], "dim")
    if not dims or any(not 0 <= d < x.dim() for d in dims) or len(set(dims)) != len(dims):
        raise ProgramError(
            f"dim {dims} must be distinct dimensions in [0, {x.dim()}) (normalised, as "
            "torch.fft passes them)"
        )


def _masked_scatter(a: Bound) -> None:
    x, mask = _tensor(a["self"], "self"), _tensor(a["mask"], "mask")
    source = _tensor(a["source"], "source")
    shape = _broadcast(_shape(x), _shape(mask))
    if shape is None:
        raise ProgramError(f"mask {_shape(mask)} does not broadcast with self {_shape(x)}")
    n = math.prod(shape)
    if source.numel() < n:
        raise ProgramError(
            f"source has {source.numel()} elements; the mask may select {n} (it must hold "
            "one per element of the mask)"
        )


def _detach_(a: Bound) -> None:
    if _tensor(a["self"], "self")._is_view():
        raise ProgramError("self is a view; a view cannot be detached in place")


def _in_place(a: Bound) -> None:
    x, other = _tensor(a["self"], "self"), a["other"]
    result = torch.result_type(x, other)
    if not torch.can_cast(result, x.dtype):
        raise ProgramError(f"the result is {result}, which self ({x.dtype}) cannot hold in place")


def _rand_like(a: Bound) -> None:
    dtype = a.get("dtype") or _tensor(a["self"], "self").dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ProgramError(f"the result would be {dtype}; uniform draws are floating-point")


# -- the tables ------------------------------------------------------------------------------


def _rules(names: str, *rules: tuple[str, str]) -> dict[str, tuple[tuple[str, str], ...]]:
    return {f"aten.{n}": rules for n in names.split()}


_SELF = ("self", "float")
DTYPE_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    # Floating-point math (the kernels of no device implement integer or bool inputs).
    **_rules(
        "_softmax.default _log_softmax.default gelu.default silu.default silu_.default "
        "mish.default hardsigmoid.default hardswish.default softplus.default celu.default "
        "elu.default elu_.default selu.default glu.default log_sigmoid.default "
        "hardshrink.default adaptive_avg_pool2d.default _adaptive_avg_pool2d.default "
        "_adaptive_avg_pool3d.default adaptive_max_pool1d.default adaptive_max_pool2d.default "
        "avg_pool2d.default avg_pool3d.default max_pool1d.default max_pool2d.default "
        "max_pool2d_with_indices.default max_pool3d.default max_pool3d_with_indices.default "
        "im2col.default col2im.default _fft_r2c.default huber_loss.default "
        "soft_margin_loss.default binary_cross_entropy_with_logits.default",
        _SELF,
    ),
    **_rules(
        "std.dim std_mean.dim var.dim var_mean.dim var.correction", ("self", "float_or_complex")
    ),
    **_rules(
        "upsample_bilinear2d.vec grid_sampler_2d.default", ("input", "float"), ("grid", "float")
    ),
    **_rules("upsample_nearest2d.vec", ("input", "float_or_uint8")),
    # Distances: float32 and float64 kernels only, on every device.
    **_rules("_pdist_forward.default", ("self", "float32_or_64")),
    **_rules(
        "cdist.default _cdist_forward.default", ("x1", "float32_or_64"), ("x2", "float32_or_64")
    ),
    **_rules("_fft_c2r.default", ("self", "complex")),
    **_rules(
        "batch_norm.default instance_norm.default",
        *((n, "float") for n in ("input", "weight", "bias", "running_mean", "running_var")),
    ),
    **_rules(
        "group_norm.default native_group_norm.default layer_norm.default native_layer_norm.default",
        *((n, "float") for n in ("input", "weight", "bias")),
    ),
    **_rules("binary_cross_entropy.default", _SELF, ("target", "float"), ("weight", "float")),
    # Arithmetic that bool does not have.
    **_rules(
        "abs.default ceil.default floor.default round.default trunc.default relu.default "
        "relu_.default argmax.default argmin.default sub.Tensor sub.Scalar rsub.Scalar "
        "topk.default reflection_pad1d.default reflection_pad2d.default reflection_pad3d.default",
        ("self", "not_bool"),
        ("other", "not_bool"),
    ),
    **_rules("l1_loss.default", ("self", "not_bool"), ("target", "not_bool")),
    **_rules("margin_ranking_loss.default", ("input1", "not_bool"), ("input2", "not_bool")),
    **_rules("pairwise_distance.default", ("x1", "not_bool"), ("x2", "not_bool")),
    **_rules(
        "triplet_margin_loss.default",
        *((n, "not_bool") for n in ("anchor", "positive", "negative")),
    ),
    # Bitwise operators: integer or bool.
    **_rules(
        "bitwise_and.Tensor bitwise_or.Tensor bitwise_xor.Tensor bitwise_and.Scalar "
        "bitwise_or.Scalar bitwise_xor.Scalar bitwise_not.default __and__.Tensor __or__.Tensor",
        ("self", "integral"),
        ("other", "integral"),
    ),
    # Indices, masks and class targets.
    **_rules(
        "gather.default scatter.src scatter.value scatter_add.default scatter_reduce.two "
        "index_select.default index_add.default",
        ("index", "index"),
    ),
    **_rules("index.Tensor index_put.default", ("indices", "indices")),
    **_rules("one_hot.default", ("self", "long")),
    **_rules("masked_fill.Scalar masked_fill_.Scalar masked_scatter.default", ("mask", "mask")),
    **_rules("where.self where.ScalarOther", ("condition", "mask")),
    **_rules("nll_loss_nd.default", _SELF, ("target", "class_target"), ("weight", "float")),
    **_rules(
        "cross_entropy_loss.default",
        _SELF,
        ("target", "class_or_probabilities"),
        ("weight", "float"),
    ),
    **_rules("multi_margin_loss.default", _SELF, ("target", "long"), ("weight", "float")),
    **_rules("multilabel_margin_loss.default", _SELF, ("target", "long")),
}

SAME_DTYPE: dict[str, tuple[str, ...]] = {
    f"aten.{k}": v
    for k, v in {
        "addmm.default": ("self", "mat1", "mat2"),
        "mm.default": ("self", "mat2"),
        "bmm.default": ("self", "mat2"),
        "baddbmm.default": ("self", "batch1", "batch2"),
        "matmul.default": ("self", "other"),
        "linear.default": ("input", "weight", "bias"),
        "bilinear.default": ("input1", "input2", "weight", "bias"),
        "cdist.default": ("x1", "x2"),
        "_cdist_forward.default": ("x1", "x2"),
        "grid_sampler_2d.default": ("input", "grid"),
        "binary_cross_entropy.default": ("self", "target", "weight"),
        "index_add.default": ("self", "source"),
        "index_put.default": ("self", "values"),
        "scatter.src": ("self", "src"),
        "scatter_add.default": ("self", "src"),
        "scatter_reduce.two": ("self", "src"),
        "masked_scatter.default": ("self", "source"),
        "cross_entropy_loss.default": ("self", "weight"),
        "nll_loss_nd.default": ("self", "weight"),
    }.items()
}

ARG_CONTRACTS: dict[str, Callable[[Bound], None]] = {
    "aten.softmax.int": _softmax,
    "aten.log_softmax.int": _softmax,
    "aten._softmax.default": _dim_of_self,
    "aten._log_softmax.default": _dim_of_self,
    "aten.sort.default": _dim_of_self,
    "aten.logsumexp.default": _logsumexp,
    "aten.gather.default": lambda a: _gather_scatter(a, None),
    "aten.scatter.src": lambda a: _gather_scatter(a, "src"),
    "aten.scatter.value": lambda a: _gather_scatter(a, None),
    "aten.scatter_add.default": lambda a: _gather_scatter(a, "src"),
    "aten.scatter_reduce.two": _scatter_reduce,
    "aten.index_select.default": _index_select,
    "aten.index_add.default": _index_add,
    "aten.index.Tensor": _index,
    "aten.index_put.default": _index_put,
    "aten.select_scatter.default": _select_scatter,
    "aten.slice_scatter.default": _slice_scatter,
    "aten.constant_pad_nd.default": _constant_pad,
    "aten.pad.default": _pad,
    "aten.reflection_pad1d.default": _padding_nd(1, "reflect"),
    "aten.reflection_pad2d.default": _padding_nd(2, "reflect"),
    "aten.reflection_pad3d.default": _padding_nd(3, "reflect"),
    "aten.replication_pad2d.default": _padding_nd(2, "replicate"),
    "aten.replication_pad3d.default": _padding_nd(3, "replicate"),
    "aten.adaptive_avg_pool2d.default": _adaptive(2),
    "aten._adaptive_avg_pool2d.default": _adaptive(2),
    "aten._adaptive_avg_pool3d.default": _adaptive(3),
    "aten.adaptive_max_pool1d.default": _adaptive(1),
    "aten.adaptive_max_pool2d.default": _adaptive(2),
    "aten._pdist_forward.default": _pdist,
    "aten._fft_r2c.default": _fft_dims,
    "aten._fft_c2r.default": _fft_dims,
    "aten.masked_scatter.default": _masked_scatter,
    "aten.detach_.default": _detach_,
    "aten.add_.Tensor": _in_place,
    "aten.mul_.Tensor": _in_place,
    "aten.rand_like.default": _rand_like,
}


# The dtypes a program's tensors may have (the kernels of most operators implement no others:
# float8, complex32, uint16/32/64, quantized and bit types).
DTYPES = frozenset(
    {
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
        torch.bool,
    }
)  # fmt: skip

# The operators that take complex tensors (their kernels implement complex on CPU and CUDA
# alike: elementwise arithmetic and transcendental functions, sums and products, matrix
# products, equality, selection, indexing and movement). Every other operator refuses a complex
# argument: comparisons, clamps, rounding, activations, pools, norms, convolutions, losses,
# random draws and sorting have no complex kernels.
COMPLEX_OPS = frozenset(
    f"aten.{n}"
    for n in """
    _fft_c2r.default _to_copy.default to.device to.dtype to.dtype_layout type_as.default
    abs.default acos.default acosh.default asin.default asinh.default atan.default atanh.default
    cos.default cosh.default sin.default sinh.default tan.default tanh.default exp.default
    exp_.default expm1.default log.default log10.default log1p.default log2.default
    neg.default reciprocal.default rsqrt.default sigmoid.default sqrt.default sqrt_.default
    add.Scalar add.Tensor add_.Tensor sub.Scalar sub.Tensor rsub.Scalar mul.Scalar mul.Tensor
    mul_.Tensor div.Scalar div.Tensor pow.Scalar pow.Tensor_Scalar pow.Tensor_Tensor
    addcmul.default lerp.Scalar isfinite.default isinf.default isnan.default nan_to_num.default
    eq.Scalar eq.Tensor ne.Scalar ne.Tensor logical_and.default logical_not.default
    logical_or.default logical_xor.default any.default any.dim any.dims all.dim
    sum.default sum.dim_IntList mean.default mean.dim prod.default prod.dim_int cumsum.default
    cumprod.default std.dim std_mean.dim var.dim var_mean.dim var.correction
    linalg_vector_norm.default logsumexp.default
    addmm.default mm.default bmm.default baddbmm.default matmul.default linear.default
    bilinear.default einsum.default outer.default
    where.self where.ScalarOther masked_fill.Scalar masked_fill_.Scalar masked_scatter.default
    gather.default scatter.src scatter.value scatter_add.default index.Tensor
    index_put.default index_select.default index_add.default select_scatter.default
    slice_scatter.default
    alias.default clone.default contiguous.default copy.default detach.default detach_.default
    lift_fresh_copy.default cat.default stack.default broadcast_tensors.default chunk.default
    split.Tensor split_with_sizes.default tensor_split.sections unbind.int diagonal.default
    expand.default expand_as.default flatten.using_ints unflatten.int flip.default
    narrow.default permute.default repeat.default repeat_interleave.self_int reshape.default
    reshape_as.default roll.default select.int slice.Tensor squeeze.default squeeze.dim
    squeeze.dims t.default transpose.int tril.default triu.default unfold.default
    unsqueeze.default view.default view_as.default diff.default pixel_shuffle.default
    pixel_unshuffle.default constant_pad_nd.default pad.default
    empty_like.default full_like.default ones_like.default zeros_like.default new_full.default
    new_ones.default new_zeros.default fill.Scalar fill_.Scalar sym_size.int sym_numel.default
    _assert_tensor_metadata.default
    """.split()
)

_FFT = frozenset({"aten._fft_r2c.default", "aten._fft_c2r.default"})
_HALVES = (torch.float16, torch.bfloat16)
# Dtypes that the kernels of one device type do not implement although the operator admits
# them ({device type: {operator: dtypes}}). A device type not listed is held to the "cpu" gaps.
# CPU: measured (tests/unit/test_shape_fuzz_ops.py). CUDA (not measured here): its avg_pool3d
# and margin-loss kernels implement float16 and bfloat16; cuFFT implements float16 (of
# power-of-two sizes, checked apart) but not bfloat16.
DEVICE_DTYPE_GAPS: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    "cpu": {
        f"aten.{n}": _HALVES
        for n in (
            "_fft_r2c.default avg_pool3d.default multi_margin_loss.default "
            "multilabel_margin_loss.default"
        ).split()
    },
    "cuda": {"aten._fft_r2c.default": (torch.bfloat16,)},
}

# Operators that produce the dtype of their first named argument from the others too: the
# result type of the named arguments must cast to it.
RESULT_OF: dict[str, tuple[str, ...]] = {
    f"aten.{k}": v
    for k, v in {
        "huber_loss.default": ("self", "target"),
        "soft_margin_loss.default": ("self", "target"),
        "conv_transpose2d.input": ("input", "weight", "bias"),
    }.items()
}
