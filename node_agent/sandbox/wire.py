"""The wire between the agent and its program child (node_agent.sandbox.child): framing of the
small JSON messages on their socket pair, and the layout of tensors in shared memory.

Messages are length-prefixed JSON objects (4 bytes big-endian, then UTF-8 JSON, at most
MAX_MESSAGE_BYTES); file descriptors (memfd regions) ride on a message's first segment.
Tensors never travel in messages: both sides map the same memfd and view it through a
`Layout` (name, dtype, shape, byte offset of each tensor). The agent never trusts what the
child sends: `read_message` bounds sizes and the caller checks every field it uses.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from epochmesh.wire.tensors import DTYPES  # a program's state and batches: by their wire names

MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 8
ALIGN = 64
_HEADER = struct.Struct(">I")

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(Exception):
    """A malformed message, or the peer closed the socket."""


# -- framing ----------------------------------------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message, separators=(",", ":"), allow_nan=True).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def read_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (the caller owns and closes them)."""
    header, fds = _recv_exactly(sock, _HEADER.size, with_fds=True)
    (length,) = _HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        _close_all(fds)
        raise WireError(f"message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    body, _ = _recv_exactly(sock, length, with_fds=False)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _close_all(fds)
        raise WireError(f"message is not JSON: {e}") from None
    if not isinstance(message, dict):
        _close_all(fds)
        raise WireError("message is not a JSON object")
    return message, fds


def _recv_exactly(sock: socket.socket, n: int, *, with_fds: bool) -> tuple[bytes, list[int]]:
    buf = bytearray()
    fds: list[int] = []
    while len(buf) < n:
        if with_fds and not buf:
            chunk, got, _flags, _addr = socket.recv_fds(sock, n, MAX_FDS)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            _close_all(fds)
            raise WireError("the peer closed the connection")
        buf += chunk
    return bytes(buf), fds


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- shared memory ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset]


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies in a region; `size` bytes in all (at least 1)."""

    slots: tuple[Slot, ...]
    size: int

    @classmethod
    def of(cls, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], start: int = 0) -> Layout:
        """Tensors packed in order from byte `start` (a multiple of ALIGN), each aligned to
        ALIGN bytes; `size` is where the last one ends (rounded up)."""
        slots: list[Slot] = []
        offset = start
        for name, dtype, shape in specs:
            if dtype not in DTYPE_NAMES:
                raise WireError(f"tensor {name!r} has unsupported dtype {dtype}")
            slot = Slot(name, DTYPE_NAMES[dtype], tuple(int(d) for d in shape), offset)
            slots.append(slot)
            offset += -(-slot.nbytes // ALIGN) * ALIGN
        return cls(tuple(slots), max(offset, 1))

    def to_json(self) -> dict[str, Any]:
        return {"slots": [s.to_json() for s in self.slots], "size": self.size}

    @classmethod
    def from_json(cls, obj: Any, region_size: int) -> Layout:
        """A layout read from the other side, checked to fit in a region of `region_size`."""
        if not isinstance(obj, dict) or not isinstance(obj.get("slots"), list):
            raise WireError("malformed layout")
        slots: list[Slot] = []
        for raw in obj["slots"]:
            if not (isinstance(raw, list) and len(raw) == 4):
                raise WireError("malformed layout slot")
            name, dtype, shape, offset = raw
            if (
                not isinstance(name, str)
                or dtype not in DTYPES
                or not isinstance(shape, list)
                or not all(type(d) is int and d >= 0 for d in shape)
                or type(offset) is not int
                or offset < 0
                or offset % ALIGN
            ):
                raise WireError(f"malformed layout slot {raw!r:.200}")
            slot = Slot(name, dtype, tuple(shape), offset)
            if slot.offset + slot.nbytes > region_size:
                raise WireError(f"slot {name!r} lies outside its region")
            slots.append(slot)
        size = obj.get("size")
        if type(size) is not int or size > region_size:
            raise WireError("malformed layout size")
        return cls(tuple(slots), size)


class Region:
    """A memfd-backed shared region and tensor views of it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, name: str, size: int) -> Region:
        fd = os.memfd_create(f"epochmesh-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, max(size, 1))
        # Sealed at its size: a child that shrank it would make the agent's next access to
        # the mapping a SIGBUS (a dead agent).
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
        return cls(fd, max(size, 1))

    @classmethod
    def attach(cls, fd: int) -> Region:
        return cls(fd, os.fstat(fd).st_size)

    def view(self, slot: Slot) -> torch.Tensor:
        dtype = DTYPES[slot.dtype]
        if slot.numel == 0:
            return torch.empty(slot.shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=slot.numel, offset=slot.offset)
        return flat.view(slot.shape)

    def views(self, layout: Layout) -> dict[str, torch.Tensor]:
        return {s.name: self.view(s) for s in layout.slots}

    def view_bytes(self, size: int) -> memoryview:
        return memoryview(self._map)[:size]

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self._map[offset : offset + len(data)] = data

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays, freed when its views are gone)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
