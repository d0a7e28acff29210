"""Per-tensor codecs for tensors on the wire, and error feedback for lossy ones.

Codecs (the `codec` field of a TensorSpec); all byte layouts are little-endian:

======  ===========================================================  =====================
codec   layout                                                       size for n values
======  ===========================================================  =====================
none    the raw elements in the tensor's own dtype                   n * itemsize
fp16    IEEE half; finite values beyond +-65504 saturate             2n
bf16    bfloat16, round to nearest even                              2n
int8    per block of INT8_BLOCK values: fp32 scale = absmax / 127;   4 * ceil(n / 256) + n
        all scales first, then the int8 values round(x / scale)
topk    k = ceil(ratio * n) largest magnitudes: k int32 indices      8k
        (strictly increasing), then their k fp32 values
======  ===========================================================  =====================

Lossy codecs apply to floating tensors; `decode` returns float32 for them (the "none" codec
returns the dtype it is given). Error bounds per element: fp16 relative 2**-11 (absolute
2**-25 below 2**-14), bf16 relative 2**-8, int8 scale / 2 of its block, topk exact on the kept
entries and zero elsewhere.

`ErrorFeedback` keeps, per tensor name, what lossy compression has not delivered yet (the
residual) and adds it to the next gradient of that name, so nothing is dropped for good: the sum
of what was sent tracks the sum of the inputs within one residual.

`decode` validates what it reads (sizes, int8 scales and range, topk indices) and raises
CodecError; finiteness of the result is checked by the caller (`epochmesh.wire.tensors`).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence

import torch

from epochmesh.errors import CodecError

CODECS = ("none", "fp16", "bf16", "int8", "topk")
LOSSY_CODECS = ("fp16", "bf16", "int8", "topk")
INT8_BLOCK = 256
FP16_MAX = 65504.0
TOPK_MAX_NUMEL = 2**31 - 1

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("epochmesh's tensor codecs assume a little-endian machine")


def topk_count(numel: int, ratio: float) -> int:
    """k = ceil(ratio * numel), at least 1 and at most numel (0 for an empty tensor)."""
    if not 0.0 < ratio <= 1.0 or not math.isfinite(ratio):
        raise ValueError(f"topk ratio must be in (0, 1] (got {ratio})")
    if numel <= 0:
        return 0
    # ratio * numel in floats can land just above an integer (0.07 * 100 = 7.000000000000001):
    # forgive a relative error of 1e-12 so that such a product counts as the integer it means.
    return min(numel, max(1, math.ceil(ratio * numel * (1.0 - 1e-12))))


def int8_blocks(numel: int) -> int:
    return (numel + INT8_BLOCK - 1) // INT8_BLOCK


def encoded_size(
    codec: str, numel: int, dtype: torch.dtype = torch.float32, ratio: float = 0.01
) -> int:
    """Bytes `encode` produces for a tensor of `numel` elements of `dtype`."""
    if codec == "none":
        return numel * _itemsize(dtype)
    if codec in ("fp16", "bf16"):
        return 2 * numel
    if codec == "int8":
        return 4 * int8_blocks(numel) + numel
    if codec == "topk":
        return 8 * topk_count(numel, ratio)
    raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")


def check_encoded_size(codec: str, numel: int, dtype: torch.dtype, nbytes: int) -> None:
    """Raise CodecError unless `nbytes` is a possible encoded size (topk: any k <= numel)."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    if codec != "none" and not dtype.is_floating_point:
        raise CodecError(f"codec {codec!r} applies to floating tensors only, not {dtype}")
    if codec == "topk":
        if nbytes < 0 or nbytes % 8 != 0 or nbytes // 8 > numel:
            raise CodecError(
                f"topk payload of {nbytes} bytes is not 8*k bytes with k <= {numel} elements"
            )
        return
    want = encoded_size(codec, numel, dtype)
    if nbytes != want:
        raise CodecError(
            f"codec {codec!r} of {numel} x {_dtype_name(dtype)} takes {want} bytes, "
            f"header says {nbytes}"
        )


def encode(tensor: torch.Tensor, codec: str, ratio: float = 0.01) -> bytes:
    """Encode one tensor (any device; flattened in C order) with `codec`."""
    t = tensor.detach()
    if codec == "none":
        return raw_bytes(t).tobytes()
    if codec not in LOSSY_CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    if not t.is_floating_point():
        raise CodecError(f"codec {codec!r} applies to floating tensors only, not {t.dtype}")
    x = t.reshape(-1).to(device="cpu", dtype=torch.float32)
    if codec == "fp16":
        x = torch.where(torch.isfinite(x), x.clamp(-FP16_MAX, FP16_MAX), x)
        return raw_bytes(x.to(torch.float16)).tobytes()
    if codec == "bf16":
        return raw_bytes(x.to(torch.bfloat16)).tobytes()
    if codec == "int8":
        return _encode_int8(x)
    return _encode_topk(x, ratio)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The C-order bytes of a tensor as a memoryview (no copy for a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data.cast("B")


def _encode_int8(x: torch.Tensor) -> bytes:
    n = x.numel()
    nb = int8_blocks(n)
    out = torch.empty(4 * nb + n, dtype=torch.uint8)
    if n == 0:
        return b""
    padded = torch.zeros(nb * INT8_BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    out[: 4 * nb].view(torch.float32).copy_(scale)
    out[4 * nb :].view(torch.int8).copy_(q.reshape(-1)[:n])
    return out.numpy().tobytes()


def _encode_topk(x: torch.Tensor, ratio: float) -> bytes:
    n = x.numel()
    if n > TOPK_MAX_NUMEL:
        raise CodecError(f"topk codec supports tensors of at most {TOPK_MAX_NUMEL} elements")
    k = topk_count(n, ratio)
    if k == 0:
        return b""
    if k == n:
        idx = torch.arange(n, dtype=torch.int64)
    else:
        idx = torch.topk(x.abs(), k, sorted=False).indices
        idx, _ = torch.sort(idx)
    out = torch.empty(8 * k, dtype=torch.uint8)
    out[: 4 * k].view(torch.int32).copy_(idx)
    out[4 * k :].view(torch.float32).copy_(x[idx])
    return out.numpy().tobytes()


def decode(
    data: bytes | bytearray | memoryview,
    codec: str,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode one tensor; float32 for lossy codecs, `dtype` for "none" (CPU tensors).

    For "none", a writable, aligned buffer (bytearray) is viewed without a copy; read-only
    `bytes` are copied, so the result is always safe to modify.
    """
    mv = memoryview(data).cast("B")
    numel = math.prod(shape)
    shape = tuple(int(d) for d in shape)
    check_encoded_size(codec, numel, dtype, mv.nbytes)
    if codec == "none":
        if (
            dtype == torch.bool
            and numel
            and bool((frombuffer(mv, torch.uint8, numel, copy=False) > 1).any())
        ):
            raise CodecError("bool payload has bytes other than 0 and 1")
        return frombuffer(mv, dtype, numel).view(shape)
    if codec == "fp16":
        return frombuffer(mv, torch.float16, numel).to(torch.float32).view(shape)
    if codec == "bf16":
        return frombuffer(mv, torch.bfloat16, numel).to(torch.float32).view(shape)
    if codec == "int8":
        return _decode_int8(mv, numel).view(shape)
    return _decode_topk(mv, numel).view(shape)


def _decode_int8(mv: memoryview, n: int) -> torch.Tensor:
    nb = int8_blocks(n)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    scale = frombuffer(mv[: 4 * nb], torch.float32, nb, copy=False)
    q = frombuffer(mv[4 * nb :], torch.int8, n, copy=False)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CodecError("int8 payload has a negative or non-finite block scale")
    if bool((q == -128).any()):
        raise CodecError("int8 payload has the value -128 (values are in [-127, 127])")
    padded = torch.zeros(nb * INT8_BLOCK, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(nb, INT8_BLOCK) * scale[:, None]).reshape(-1)[:n].clone()


def _decode_topk(mv: memoryview, n: int) -> torch.Tensor:
    k = mv.nbytes // 8
    out = torch.zeros(n, dtype=torch.float32)
    if k == 0:
        return out
    idx = frombuffer(mv[: 4 * k], torch.int32, k, copy=False).to(torch.int64)
    vals = frombuffer(mv[4 * k :], torch.float32, k, copy=False)
    if int(idx[0]) < 0 or int(idx[-1]) >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all())):
        raise CodecError(f"topk indices must be strictly increasing within [0, {n})")
    out[idx] = vals
    return out


def frombuffer(
    mv: memoryview, dtype: torch.dtype, count: int, *, copy: bool | None = None
) -> torch.Tensor:
    """A 1-D tensor of `count` elements over `mv` (which must hold exactly that many bytes).

    copy=None: view writable, aligned buffers and copy otherwise; copy=False: view whenever
    possible (the caller only reads the result and drops it before the buffer changes).
    """
    if count == 0:
        return torch.empty(0, dtype=dtype)
    itemsize = _itemsize(dtype)
    if mv.nbytes != count * itemsize:
        raise CodecError(f"expected {count * itemsize} bytes, got {mv.nbytes}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        t = torch.frombuffer(mv, dtype=dtype, count=count)
    aligned = t.data_ptr() % itemsize == 0
    if not aligned or (copy is None and mv.readonly) or copy is True:
        t = t.clone()
    return t


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ErrorFeedback:
    """Per-node residuals per tensor name, for a lossy codec.

    `compress(name, grad)` sends grad + residual[name] and keeps as the new residual
    (grad + residual) - decode(sent). Residuals live on the CPU in float32.
    """

    def __init__(self, codec: str, ratio: float = 0.01) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
        if codec == "topk":
            topk_count(1, ratio)  # validates the ratio
        self.codec = codec
        self.ratio = ratio
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, grad: torch.Tensor) -> bytes:
        """Encode grad plus the residual of `name`; remember what was not delivered."""
        if self.codec == "none" or not grad.is_floating_point():
            return encode(grad, "none")
        x = grad.detach().to(device="cpu", dtype=torch.float32)
        prev = self._residuals.get(name)
        if prev is not None:
            if prev.shape != x.shape:
                raise ValueError(
                    f"tensor {name!r} changed shape from {tuple(prev.shape)} to "
                    f"{tuple(x.shape)}; call reset() first"
                )
            x = x + prev
        data = encode(x, self.codec, self.ratio)
        sent = decode(data, self.codec, x.shape)
        self._residuals[name] = x - sent
        return data

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def residual_norm(self) -> float:
        """L2 norm of all residuals together."""
        total = sum(float(r.double().pow(2).sum()) for r in self._residuals.values())
        return math.sqrt(total)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual, or all of them (e.g. when a job restarts from a checkpoint)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The residuals by name (for a checkpoint)."""
        return dict(self._residuals)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._residuals = {
            k: v.detach().to("cpu", torch.float32).clone() for k, v in tensors.items()
        }
