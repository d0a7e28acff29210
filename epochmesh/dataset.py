"""A dataset held as safetensors shards, indexed by global sample index.

A job's dataset is split by packaging into shards: safetensors blobs each holding samples
[start, start + count) of every input and target tensor (first dimension = samples). An agent
loads the shards a task touches and asks for batches by global index::

    ds = ShardedDataset([(0, 500, shard0_bytes), (500, 500, "/cache/shard1.safetensors")],
                        inputs=["x"], targets=["y"])
    xs, ys = ds.get_batch(ranges_to_indices([(10, 20), (600, 610)]))

The order of samples is the caller's (the coordinator's epoch ledger owns it). Shards are
validated when added: every named tensor present, first dimension equal to the shard's count,
the same trailing shape and dtype in every shard, no overlapping ranges (CodecError/ValueError).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from epochmesh.errors import CodecError
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import from_safetensors

ShardData = bytes | bytearray | memoryview | str | Path
ShardSource = tuple[int, int, ShardData]


@dataclass(frozen=True)
class _Shard:
    start: int
    count: int
    tensors: dict[str, torch.Tensor]

    @property
    def stop(self) -> int:
        return self.start + self.count


def ranges_to_indices(
    ranges: Iterable[common_pb2.SampleRange | tuple[int, int]],
) -> list[int]:
    """Concatenate half-open ranges [start, stop) (SampleRange messages or tuples), in order."""
    out: list[int] = []
    for r in ranges:
        start, stop = (r.start, r.stop) if isinstance(r, common_pb2.SampleRange) else r
        if start < 0 or stop < start:
            raise ValueError(f"invalid sample range [{start}, {stop})")
        out.extend(range(start, stop))
    return out


class ShardedDataset:
    """Shards of one dataset; `get_batch` gathers samples by global index, in the given order."""

    def __init__(
        self,
        shards: Iterable[ShardSource] = (),
        inputs: Sequence[str] = (),
        targets: Sequence[str] = (),
    ) -> None:
        if not inputs:
            raise ValueError("a dataset needs at least one input tensor name")
        self.inputs = list(inputs)
        self.targets = list(targets)
        self.names = list(dict.fromkeys([*self.inputs, *self.targets]))
        self._shards: list[_Shard] = []  # sorted by start
        self._starts: list[int] = []
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        for start, count, data in shards:
            self.add_shard(start, count, data)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Loaded sample ranges [start, stop), sorted."""
        return [(s.start, s.stop) for s in self._shards]

    @property
    def num_loaded(self) -> int:
        return sum(s.count for s in self._shards)

    def has_shard(self, start: int, count: int) -> bool:
        i = bisect.bisect_left(self._starts, start)
        return (
            i < len(self._shards)
            and self._shards[i].start == start
            and (self._shards[i].count == count)
        )

    def add_shard(self, start: int, count: int, data: ShardData) -> None:
        """Load one shard (safetensors bytes or a file path); adding a loaded one is a no-op."""
        if start < 0 or count < 1:
            raise ValueError(f"invalid shard [{start}, {start + count})")
        if self.has_shard(start, count):
            return
        tensors = _load(data)
        picked: dict[str, torch.Tensor] = {}
        for name in self.names:
            t = tensors.get(name)
            if t is None:
                raise CodecError(
                    f"shard [{start}, {start + count}) has no tensor {name!r} "
                    f"(it has: {', '.join(sorted(tensors)) or 'nothing'})"
                )
            if t.dim() == 0 or t.shape[0] != count:
                raise CodecError(
                    f"shard [{start}, {start + count}): tensor {name!r} has shape "
                    f"{list(t.shape)}, expected first dimension {count}"
                )
            picked[name] = t
        layout = {n: (t.dtype, tuple(t.shape[1:])) for n, t in picked.items()}
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            for n in self.names:
                if layout[n] != self._layout[n]:
                    raise CodecError(
                        f"shard [{start}, {start + count}): tensor {n!r} is "
                        f"{layout[n][0]} with sample shape {list(layout[n][1])}, other shards "
                        f"have {self._layout[n][0]} with {list(self._layout[n][1])}"
                    )
        i = bisect.bisect_left(self._starts, start)
        stop = start + count
        if (i > 0 and self._shards[i - 1].stop > start) or (
            i < len(self._shards) and self._shards[i].start < stop
        ):
            raise ValueError(f"shard [{start}, {stop}) overlaps a loaded shard {self.ranges}")
        self._shards.insert(i, _Shard(start, count, picked))
        self._starts.insert(i, start)

    def get_batch(self, indices: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, targets) for the samples at global `indices`, in that order (CPU tensors)."""
        if self._layout is None:
            raise IndexError("no shard is loaded")
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise ValueError("a batch needs at least one index")
        starts = np.asarray(self._starts, dtype=np.int64)
        stops = np.asarray([s.stop for s in self._shards], dtype=np.int64)
        which = np.searchsorted(starts, idx, side="right") - 1
        bad = (which < 0) | (idx >= stops[np.maximum(which, 0)])
        if bad.any():
            first = int(idx[np.argmax(bad)])
            raise IndexError(
                f"sample {first} is not in any loaded shard (loaded: {self.ranges}); "
                f"{int(bad.sum())} of {idx.size} indices are missing"
            )
        gathered: dict[str, torch.Tensor] = {}
        shard_ids = np.unique(which)
        for name in self.names:
            if len(shard_ids) == 1:
                s = self._shards[int(shard_ids[0])]
                local = torch.from_numpy(idx - s.start)
                gathered[name] = s.tensors[name].index_select(0, local)
                continue
            dtype, sample_shape = self._layout[name]
            out = torch.empty((idx.size, *sample_shape), dtype=dtype)
            for sid in shard_ids:
                s = self._shards[int(sid)]
                pos = np.nonzero(which == sid)[0]
                out[torch.from_numpy(pos)] = s.tensors[name].index_select(
                    0, torch.from_numpy(idx[pos] - s.start)
                )
            gathered[name] = out
        return [gathered[n] for n in self.inputs], [gathered[n] for n in self.targets]


def _load(data: ShardData) -> dict[str, torch.Tensor]:
    if isinstance(data, str | Path):
        try:
            return safetensors.torch.load_file(str(data))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise CodecError(f"shard file {data} is not valid safetensors: {e}") from None
    return from_safetensors(data)
