"""The seeds of a program's random draws: every draw is a function of (job, round, node, samples).

A job's program may draw random numbers (`nn.Dropout`, `torch.rand`-based noise, `randperm`).
A checker must draw the same numbers as the worker whose chunk it recomputes, else an honest
worker's chunk looks cheated. So nothing random comes from a process's own state: before each
forward pass (a chunk, a micro-batch of one, an inner step of local SGD) the program child seeds
torch's generators (`seed_generators`) from a seed the agent passes in the compute request:

- `compute_seed(job_id, round, node_id, indices)`: the seed of a forward unit, from the job,
  the round, the id of the node whose work it is (a checker recomputing node X's chunk uses X's
  id, never its own) and the exact dataset indices of the unit's samples, in order;
- `micro_seed(seed, k)`: the seed of the unit's k-th micro-batch (the job's micro_batch cuts a
  unit the same way on the worker and on the checker);
- `SeedScope`: (job, round, node) of a task, whose `seed(indices)` is `compute_seed`.

Pure (hashing only) but `seed_generators`, which sets torch's default CPU generator and, on a
CUDA device, that device's generator.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Seeds are unsigned 63-bit integers (torch.manual_seed takes up to 2**64 - 1; JSON and
# protobuf carry 63 bits without surprises).
SEED_BITS = 63
MAX_SEED = (1 << SEED_BITS) - 1
_DOMAIN = b"epochmesh.compute-seed.v1"


def _to_seed(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def compute_seed(job_id: str, round_id: int, node_id: str, indices: Sequence[int]) -> int:
    """The seed of one forward unit of ``node_id``'s work in round ``round_id`` of ``job_id``:
    the unit's samples are the dataset ``indices`` (in the order the unit sees them)."""
    h = hashlib.sha256(_DOMAIN)
    for text in (job_id, node_id):
        raw = text.encode()
        h.update(struct.pack(">I", len(raw)))
        h.update(raw)
    h.update(struct.pack(">qQ", int(round_id), len(indices)))
    h.update(b"".join(struct.pack(">q", int(i)) for i in indices))
    return _to_seed(h.digest())


def micro_seed(seed: int, k: int) -> int:
    """The seed of the ``k``-th micro-batch (from 0) of a unit seeded ``seed``."""
    h = hashlib.sha256(_DOMAIN + b".micro")
    h.update(struct.pack(">QQ", int(seed) & MAX_SEED, int(k)))
    return _to_seed(h.digest())


def valid_seed(value: object) -> bool:
    """Whether ``value`` is a seed a compute request may carry."""
    return type(value) is int and 0 <= value <= MAX_SEED


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed torch's default CPU generator and, on a CUDA ``device``, that device's generator
    (what dropout, rand, randn, randperm and bernoulli draw from)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


@dataclass(frozen=True)
class SeedScope:
    """Whose work a computation is: the job, the round and the node whose part it is (on a
    checker: the checked node's id). `seed` names a forward unit within it by its samples."""

    job_id: str
    round: int
    node_id: str

    def seed(self, indices: Sequence[int]) -> int:
        return compute_seed(self.job_id, self.round, self.node_id, indices)
