"""Linear sketches of gradients (pure): k numbers that stand for a whole gradient.

Verification (issue 20) compares a node's gradient with a recomputation of it without shipping
either whole: each coordinate j of the flattened gradient goes to bucket h(j) in [0, k) with a
sign s(j) in {-1, +1}, both drawn from a seed (CountSketch), and the sketch is
sketch[b] = sum over h(j) = b of s(j) g[j].

- Linear: sketch(a + b) = sketch(a) + sketch(b), so a round's update, a weighted sum of its
  micro-batches' gradients, must sketch to the same weighted sum of theirs (checked at no
  compute, in float64).
- Norm-preserving on average: E |sketch(g)|^2 = |g|^2, within a few 1/sqrt(k) for k buckets,
  so the relative distance of two sketches estimates that of the gradients. A recomputation on
  another device differs by 3e-7 to 1e-4 relative (docs/device-tolerance.md, measured on an
  H100), a scaled, sign-flipped, random, partial or stale gradient by O(1).
- The seed must be unknown to the node until its gradients are fixed: a node that knows h and s
  can add to its update a vector the sketch does not see (the null space of k buckets among
  millions of coordinates is everything but k directions).

Buckets and signs are drawn per tensor, in order, from a torch.Generator seeded with the seed,
so that a sketch needs O(size of the largest tensor) memory, not O(model x k).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

DEFAULT_BUCKETS = 256


def coordinate_draws(
    sizes: Mapping[str, int], seed: int, buckets: int
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per tensor (sorted by name; empty ones skipped) of ``sizes`` elements: the bucket
    (int64) and the sign (float64, +1 / -1) of each of its coordinates under ``seed``."""
    if buckets < 1:
        raise ValueError("a sketch needs at least one bucket")
    gen = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    for name in sorted(sizes):
        n = int(sizes[name])
        if n == 0:
            continue
        where = torch.randint(0, buckets, (n,), generator=gen)
        sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int8).to(torch.float64)
        yield name, where, 2.0 * sign - 1.0


def sketch(
    tensors: Mapping[str, torch.Tensor], seed: int, buckets: int = DEFAULT_BUCKETS
) -> torch.Tensor:
    """The float64 sketch of ``tensors`` (taken in sorted name order) under ``seed``."""
    return sketch_many([tensors], seed, buckets)[0]


def sketch_many(
    parts: Sequence[Mapping[str, torch.Tensor]], seed: int, buckets: int = DEFAULT_BUCKETS
) -> list[torch.Tensor]:
    """``[sketch(p, seed, buckets) for p in parts]``, bit for bit, for parts of the same names
    and sizes (a part's chunks): each tensor's buckets and signs are drawn once for all of
    them (drawing them is most of a sketch's work), one tensor at a time (memory of the
    largest tensor, as `sketch`). ValueError for parts of other names or sizes."""
    if buckets < 1:
        raise ValueError("a sketch needs at least one bucket")
    if not parts:
        return []
    sizes = {name: t.numel() for name, t in parts[0].items()}
    for i, part in enumerate(parts[1:], start=1):
        other = {name: t.numel() for name, t in part.items()}
        if other != sizes:
            raise ValueError(f"part {i} has other tensors or sizes than part 0")
    outs = [torch.zeros(buckets, dtype=torch.float64) for _ in parts]
    for name, where, sign in coordinate_draws(sizes, seed, buckets):
        for out, part in zip(outs, parts, strict=True):
            flat = part[name].detach().reshape(-1).to("cpu", torch.float64)
            out.index_add_(0, where, flat * sign)
    return outs


def combine(parts: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """The weighted sum of sketches (the sketch of the weighted sum of their gradients)."""
    if not parts:
        raise ValueError("nothing to combine")
    total = torch.zeros_like(parts[0][1], dtype=torch.float64)
    for weight, s in parts:
        total += float(weight) * s.to(torch.float64)
    return total


def relative_distance(reference: torch.Tensor, other: torch.Tensor) -> float:
    """|other - reference| / |reference| (inf for a zero reference and a non-zero other)."""
    norm = float(reference.norm())
    diff = float((other.to(torch.float64) - reference.to(torch.float64)).norm())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm
