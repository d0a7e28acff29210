"""The safetensors header, read without torch: the tensors' names, dtypes and shapes.

`safetensors_header(data)` parses the header at the start of safetensors bytes;
`dataset_samples(path, names)` reads only the header of a dataset file and says how many
samples it holds (the CLI's `quote` needs no tensor data)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epochmesh.errors import CodecError, SpecError

MAX_HEADER_BYTES = 100 << 20


def safetensors_header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The JSON header of safetensors bytes: {name: {"dtype", "shape", "data_offsets"}, ...}
    plus "__metadata__"; CodecError if malformed. Reads no tensor data."""
    mv = memoryview(data).cast("B")
    if mv.nbytes < 8:
        raise CodecError("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > mv.nbytes - 8 or n > MAX_HEADER_BYTES:
        raise CodecError("not a safetensors file: header length out of range")
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"not a safetensors file: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CodecError("not a safetensors file: header is not a JSON object")
    return header


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The header of the safetensors file at ``path``, reading only its first bytes;
    CodecError if malformed, OSError if unreadable."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CodecError("not a safetensors file: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise CodecError("not a safetensors file: header length out of range")
        return safetensors_header(prefix + f.read(n))


def dataset_samples(path: str | Path, names: Sequence[str]) -> int:
    """The number of samples of the dataset at ``path``: the first dimension its tensors
    ``names`` share. SpecError, saying what is wrong, if the file is missing or not
    safetensors, lacks one of the tensors, or their first dimensions differ or are 0."""
    p = Path(path)
    try:
        header = read_safetensors_header(p)
    except FileNotFoundError:
        raise SpecError(f"dataset file not found: {p}") from None
    except IsADirectoryError:
        raise SpecError(f"dataset {p} is a directory, not a .safetensors file") from None
    except OSError as e:
        raise SpecError(f"cannot read dataset {p}: {e.strerror or e}") from None
    except CodecError as e:
        raise SpecError(f"{p} is {e}") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    sizes: dict[str, int | None] = {}
    for name in dict.fromkeys(names):
        if name not in tensors:
            raise SpecError(
                f"{p.name} has no tensor {name!r} named in [data]; it has: "
                f"{', '.join(sorted(tensors)) or 'no tensors'}"
            )
        shape = tensors[name].get("shape") if isinstance(tensors[name], dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise SpecError(f"{p.name}: tensor {name!r} has no valid shape in its header")
        sizes[name] = shape[0] if shape else None
    if any(s is None for s in sizes.values()) or len(set(sizes.values())) != 1:
        listing = ", ".join(f"{n}: {tensors[n]['shape']}" for n in sizes)
        raise SpecError(
            f"the tensors of {p.name} must share their first dimension (the samples); got {listing}"
        )
    count = next(iter(sizes.values()))
    if not count:
        raise SpecError(f"{p.name} holds no samples (first dimension is 0)")
    return int(count)
