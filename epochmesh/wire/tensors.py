"""Named tensors on the wire (streamed bundles) and at rest (safetensors), never pickled.

A *bundle* is an ordered set of named tensors encoded back to back into one payload, described
by a `TensorBundle` header (epochmesh.v1.common_pb2): per tensor its name, logical dtype and
shape, codec (see `epochmesh.wire.compression`) and encoded size; the total size; and the sha256 of
the payload. The payload streams as `DataChunk`s of at most 1 MiB.

Sender::

    header, payload = encode_bundle(grads, codec="int8")
    for chunk in iter_chunks(payload):
        ...  # send header first, then the chunks

Receiver (validates as bytes arrive, and everything again at the end)::

    asm = BundleAssembler(header, expected={"fc.weight": (torch.float32, (10, 64)), ...})
    for chunk in chunks:
        asm.add(chunk)
    tensors = asm.finish()   # sha256, names/order, dtypes, shapes, sizes, NaN/Inf checked

Every inconsistency raises `CodecError` with a precise message (map it to INVALID_ARGUMENT).
Tensors decoded by `BundleAssembler.finish` (or from any writable buffer passed to
`decode_bundle`) are views into that buffer (no copy); tensors decoded from read-only `bytes`
are copied once. Lossy codecs decode to float32 and are cast to the header's dtype.

At rest: `to_safetensors` / `from_safetensors` store a state dict (parameters, buffers,
optimizer state) as safetensors bytes keeping the key order (safetensors itself sorts keys).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import safetensors.torch
import torch

from epochmesh.errors import CodecError
from epochmesh.limits import DEFAULT_MAX_BLOB_BYTES, MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2
from epochmesh.wire import compression
from epochmesh.wire.compression import CODECS, LOSSY_CODECS, ErrorFeedback
from epochmesh.wire.safetensors_file import safetensors_header

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_NAME_CHARS = 1024
MAX_DIMS = 16
ORDER_METADATA_KEY = "epochmesh.order"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Expected = Mapping[str, tuple[torch.dtype | str, Sequence[int]]]


@dataclass(frozen=True)
class BundleLimits:
    """Bounds a receiver enforces before allocating anything."""

    max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES  # encoded payload
    max_decoded_bytes: int = 4 * DEFAULT_MAX_BLOB_BYTES  # tensors after decoding
    max_tensors: int = 100_000
    max_chunk_bytes: int = MAX_CHUNK_BYTES


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str
    offset: int
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype ("float32", ...); ValueError for unsupported dtypes."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported on the wire; use one of {', '.join(DTYPES)}"
        ) from None


def encode_bundle(
    tensors: Mapping[str, torch.Tensor],
    codec: str = "none",
    *,
    topk_ratio: float = 0.01,
    codecs: Mapping[str, str] | None = None,
    error_feedback: ErrorFeedback | None = None,
) -> tuple[common_pb2.TensorBundle, bytes]:
    """Encode tensors, in the mapping's order, into (header, payload).

    `codec` applies to every floating tensor (others always travel raw, e.g. a BatchNorm's
    num_batches_tracked); `codecs` overrides it per name. With `error_feedback` (whose codec
    must be `codec`), lossy tensors go through `error_feedback.compress`.
    """
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    if error_feedback is not None and error_feedback.codec != codec:
        raise ValueError(
            f"error feedback uses codec {error_feedback.codec!r}, bundle codec is {codec!r}"
        )
    header = common_pb2.TensorBundle()
    pieces: list[bytes | memoryview] = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        c = codecs.get(name, codec) if codecs else codec
        if c not in CODECS:
            raise CodecError(f"unknown codec {c!r} for tensor {name!r}")
        if c in LOSSY_CODECS and not t.is_floating_point():
            c = "none"
        if c == "none":
            data: bytes | memoryview = compression.raw_bytes(t)
        elif error_feedback is not None and c == codec:
            data = error_feedback.compress(name, t)
        else:
            data = compression.encode(t, c, topk_ratio)
        header.tensors.append(
            common_pb2.TensorSpec(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                codec=c,
                nbytes=memoryview(data).nbytes,
            )
        )
        pieces.append(data)
    payload = b"".join(pieces)
    header.total_bytes = len(payload)
    header.sha256 = hashlib.sha256(payload).hexdigest()
    return header, payload


def params_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) over the names, dtypes, shapes and raw bytes of `tensors`, in the mapping's
    order: equal on two replicas exactly when their parameters are bit-identical."""
    h = hashlib.sha256()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}\n".encode())
        h.update(compression.raw_bytes(t))
    return h.hexdigest()


def iter_chunks(
    data: bytes | bytearray | memoryview, chunk: int = MAX_CHUNK_BYTES, *, start: int = 0
) -> Iterator[common_pb2.DataChunk]:
    """DataChunks of at most `chunk` bytes covering data[start:] (none for empty data)."""
    if not 0 < chunk <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in [1, {MAX_CHUNK_BYTES}] (got {chunk})")
    mv = memoryview(data).cast("B")
    if not 0 <= start <= mv.nbytes:
        raise ValueError(f"start offset {start} is outside the payload of {mv.nbytes} bytes")
    for off in range(start, mv.nbytes, chunk):
        yield common_pb2.DataChunk(offset=off, data=bytes(mv[off : off + chunk]))


def validate_header(
    header: common_pb2.TensorBundle,
    expected: Expected | None = None,
    limits: BundleLimits | None = None,
) -> list[_Entry]:
    """Check a header on its own (and against `expected`); returns the layout."""
    lim = limits or BundleLimits()
    n = len(header.tensors)
    if n > lim.max_tensors:
        raise CodecError(f"bundle has {n} tensors; at most {lim.max_tensors} are accepted")
    if header.total_bytes < 0 or header.total_bytes > lim.max_total_bytes:
        raise CodecError(
            f"bundle of {header.total_bytes} bytes exceeds the limit of {lim.max_total_bytes}"
        )
    if not _SHA256.match(header.sha256):
        raise CodecError("bundle sha256 must be 64 lowercase hex digits")
    if expected is not None:
        _check_names(header, expected)
    entries: list[_Entry] = []
    seen: set[str] = set()
    offset = 0
    decoded = 0
    for i, ts in enumerate(header.tensors):
        name = ts.name
        where = f"tensor {name!r}" if name else f"tensor #{i}"
        if not name or len(name) > MAX_NAME_CHARS:
            raise CodecError(f"{where}: name must have 1..{MAX_NAME_CHARS} characters")
        if name in seen:
            raise CodecError(f"{where} appears twice in the bundle")
        seen.add(name)
        dtype = DTYPES.get(ts.dtype)
        if dtype is None:
            raise CodecError(
                f"{where}: unknown dtype {ts.dtype!r}; expected one of {', '.join(DTYPES)}"
            )
        if ts.codec not in CODECS:
            raise CodecError(
                f"{where}: unknown codec {ts.codec!r}; expected one of {', '.join(CODECS)}"
            )
        if len(ts.shape) > MAX_DIMS or any(d < 0 for d in ts.shape):
            raise CodecError(
                f"{where}: shape {list(ts.shape)} must have at most {MAX_DIMS} "
                "non-negative dimensions"
            )
        shape = tuple(int(d) for d in ts.shape)
        numel = math.prod(shape)
        decoded += numel * max(4, _itemsize(dtype))
        if decoded > lim.max_decoded_bytes:
            raise CodecError(f"{where}: decoded tensors would exceed {lim.max_decoded_bytes} bytes")
        if expected is not None:
            want_dtype, want_shape = expected[name]
            if isinstance(want_dtype, str):
                want_dtype = DTYPES[want_dtype]
            if dtype != want_dtype:
                raise CodecError(
                    f"{where}: dtype {ts.dtype}, expected {DTYPE_NAMES.get(want_dtype, want_dtype)}"
                )
            if shape != tuple(int(d) for d in want_shape):
                raise CodecError(
                    f"{where}: shape {list(shape)}, expected {[int(d) for d in want_shape]}"
                )
        try:
            compression.check_encoded_size(ts.codec, numel, dtype, ts.nbytes)
        except CodecError as e:
            raise CodecError(f"{where}: {e}") from None
        entries.append(_Entry(name, dtype, shape, ts.codec, offset, ts.nbytes))
        offset += ts.nbytes
    if offset != header.total_bytes:
        raise CodecError(
            f"tensor sizes add up to {offset} bytes but the bundle says total_bytes = "
            f"{header.total_bytes}"
        )
    return entries


def _check_names(header: common_pb2.TensorBundle, expected: Expected) -> None:
    got = [ts.name for ts in header.tensors]
    want = list(expected)
    if got == want:
        return
    missing = [n for n in want if n not in set(got)]
    extra = [n for n in got if n not in set(want)]
    if missing:
        raise CodecError(
            f"bundle is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    if extra:
        raise CodecError(
            f"bundle has unexpected tensor {extra[0]!r}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    if len(got) != len(want):
        raise CodecError(
            f"bundle names some tensors twice ({len(got)} entries, {len(want)} expected)"
        )
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            raise CodecError(f"bundle order differs at position {i}: expected {w!r}, got {g!r}")


def decode_bundle(
    header: common_pb2.TensorBundle,
    data: bytes | bytearray | memoryview,
    expected: Expected | None = None,
    *,
    allow_nonfinite: bool = False,
    limits: BundleLimits | None = None,
    verify_sha: bool = True,
) -> dict[str, torch.Tensor]:
    """Validate a whole bundle and decode it into CPU tensors, in header order."""
    entries = validate_header(header, expected, limits)
    mv = memoryview(data).cast("B")
    if mv.nbytes != header.total_bytes:
        raise CodecError(
            f"bundle payload has {mv.nbytes} bytes, header says total_bytes = {header.total_bytes}"
        )
    if verify_sha:
        digest = hashlib.sha256(mv).hexdigest()
        if digest != header.sha256:
            raise CodecError(
                f"bundle sha256 mismatch: payload hashes to {digest}, header says {header.sha256}"
            )
    return _decode_entries(entries, mv, allow_nonfinite)


def _decode_entries(
    entries: list[_Entry], mv: memoryview, allow_nonfinite: bool
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        piece = mv[e.offset : e.offset + e.nbytes]
        try:
            t = compression.decode(piece, e.codec, e.shape, e.dtype)
        except CodecError as err:
            raise CodecError(f"tensor {e.name!r}: {err}") from None
        if t.dtype != e.dtype:
            t = t.to(e.dtype)
        check_tensor_values(e.name, t, allow_nonfinite=allow_nonfinite)
        out[e.name] = t
    return out


def check_tensor_values(name: str, t: torch.Tensor, *, allow_nonfinite: bool = False) -> None:
    """CodecError if a floating tensor holds NaN/Inf (unless allowed)."""
    if t.numel() == 0:
        return
    if t.is_floating_point() and not allow_nonfinite:
        # Fast path: a NaN or Inf anywhere makes the sum non-finite, so a finite sum proves
        # every element finite (an overflowing sum just falls through to the exact check).
        if bool(torch.isfinite(t.sum())):
            return
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = int(finite.numel() - int(finite.sum()))
            raise CodecError(f"tensor {name!r} has {bad} NaN/Inf value(s)")


class BundleAssembler:
    """Receives a bundle's chunks in order into one preallocated buffer.

    The header is validated on construction, before any allocation; `add` checks each chunk's
    offset and size; `finish` checks completeness and sha256, then decodes. Decoded tensors of
    codec "none" are views into this assembler's buffer.
    """

    def __init__(
        self,
        header: common_pb2.TensorBundle,
        limits: BundleLimits | None = None,
        *,
        expected: Expected | None = None,
        allow_nonfinite: bool = False,
    ) -> None:
        self.header = header
        self.limits = limits or BundleLimits()
        self._entries = validate_header(header, expected, self.limits)
        self._allow_nonfinite = allow_nonfinite
        self._buf = bytearray(header.total_bytes)
        self._received = 0
        self._verified = False

    @property
    def total(self) -> int:
        return self.header.total_bytes

    @property
    def received(self) -> int:
        return self._received

    @property
    def complete(self) -> bool:
        return self._received == self.header.total_bytes

    def add(self, chunk: common_pb2.DataChunk) -> None:
        self.add_bytes(chunk.offset, chunk.data)

    def add_bytes(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if offset != self._received:
            raise CodecError(
                f"chunk at offset {offset}, expected offset {self._received} (chunks must "
                "arrive in order)"
            )
        if n > self.limits.max_chunk_bytes:
            raise CodecError(
                f"chunk of {n} bytes exceeds the limit of {self.limits.max_chunk_bytes}"
            )
        if n == 0:
            raise CodecError(f"empty chunk at offset {offset}")
        if offset + n > self.header.total_bytes:
            raise CodecError(
                f"chunk [{offset}, {offset + n}) runs past the end of the bundle "
                f"({self.header.total_bytes} bytes)"
            )
        self._buf[offset : offset + n] = data
        self._received += n

    def payload(self) -> memoryview:
        """The complete, sha256-verified payload (e.g. to store as a blob)."""
        if not self.complete:
            raise CodecError(
                f"bundle incomplete: received {self._received} of {self.header.total_bytes} bytes"
            )
        if not self._verified:
            digest = hashlib.sha256(self._buf).hexdigest()
            if digest != self.header.sha256:
                raise CodecError(
                    f"bundle sha256 mismatch: payload hashes to {digest}, header says "
                    f"{self.header.sha256}"
                )
            self._verified = True
        return memoryview(self._buf)

    def finish(self) -> dict[str, torch.Tensor]:
        """Verify and decode; the tensors alias this assembler's buffer."""
        mv = self.payload()
        return _decode_entries(self._entries, mv, self._allow_nonfinite)


def expected_from(
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """`expected` argument describing `tensors` (names in order, dtypes, shapes)."""
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------
# safetensors at rest


def to_safetensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> bytes:
    """safetensors bytes of `tensors` (moved to CPU), remembering their order in metadata."""
    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        flat[name] = t
    meta = dict(metadata or {})
    meta[ORDER_METADATA_KEY] = json.dumps(list(flat))
    return safetensors.torch.save(flat, metadata=meta)


def safetensors_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes ({} when absent); CodecError if malformed."""
    header = safetensors_header(data)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CodecError("safetensors __metadata__ must map strings to strings")
    return meta


_safetensors_header = safetensors_header  # older name, still imported elsewhere


def from_safetensors(
    data: bytes | bytearray | memoryview, *, allow_nonfinite: bool = True
) -> dict[str, torch.Tensor]:
    """Load safetensors bytes (CPU tensors), in the order `to_safetensors` recorded."""
    meta = safetensors_metadata(data)
    try:
        loaded = safetensors.torch.load(bytes(data))
    except Exception as e:  # safetensors raises its own SafetensorError and others
        raise CodecError(f"not a valid safetensors file: {e}") from None
    order = list(loaded)
    if ORDER_METADATA_KEY in meta:
        try:
            recorded = json.loads(meta[ORDER_METADATA_KEY])
        except json.JSONDecodeError:
            recorded = None
        if isinstance(recorded, list) and sorted(recorded) == sorted(order):
            order = recorded
    out = {k: loaded[k] for k in order}
    for k, t in out.items():
        check_tensor_values(k, t, allow_nonfinite=allow_nonfinite)
    return out
