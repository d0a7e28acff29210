"""Weighted ring contributions (pure): the all-reduce of a time-boxed local SGD round.

In a ring round whose members step for a time box (a task with ``ring_weighted``), a member's
weight in the round's mean is the number of samples it trained, known only once it has
stepped. Every member therefore puts into the all-reduce its pseudo-gradient times its weight
``w_i = n_i / T`` (``n_i``: samples it trained, ``T``: the samples the round handed out, so that
every weight is at most 1) and the weight itself as one more element; after the all-reduce it
divides the summed pseudo-gradients by the summed weight: sum_i n_i delta_i / sum_i n_i, the
sample-weighted mean the parameter server takes of time-boxed parts.

Layout. The flat buffer is the parameters (program order), then a *tail* of `tail_length`
elements: zeros, and the weight last. The tail's length puts the weight alone at the start of
an int8 block of the ring's last segment (every chunk of a segment starts on a block boundary,
`epochmesh.ring.schedule`): the block's scale is the weight's own, so the int8 codec carries it
to float32 rounding, and no parameter shares its scale with it. fp16 and bf16 round it as they
round every element (bf16: 2^-9 relative per hop), the same for every member: all of them divide
by the same bits, so the result stays bit-identical across the ring.

Sketches. A member's evidence of the all-reduce (epochmesh.ring.evidence) covers the tail as one
more tensor named `WEIGHT_NAME`, which sorts after every parameter name, so that the
parameters' buckets and signs are those of `epochmesh.sketch.sketch` over the parameters alone
and the tail's come last: a checked member's contribution sketches to ``w_i`` times (its update's
sketch plus `tail_sketch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from epochmesh.sketch import coordinate_draws
from epochmesh.wire.compression import INT8_BLOCK

# What an agent declares in RegisterRequest.ring_features when its members take
# Task.ring_weighted (this module's contributions); the coordinator time-boxes a ring of local SGD
# only when every member declared it.
RING_FEATURE_WEIGHTED = "weighted"
RING_FEATURES = (RING_FEATURE_WEIGHTED,)

# The tail's tensor name in sketches: after every parameter name (which are ASCII) in sorted
# order.
WEIGHT_NAME = "\uffffring-weight"


def tail_length(numel: int, n: int) -> int:
    """Elements after ``numel`` parameters in a weighted buffer of an ``n``-member ring: the
    fewest (at least 1) that put the last element at the start of an int8 block of the last
    segment (whose size is total // n, its chunks starting at block boundaries)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0 (got {numel})")
    if n < 1:
        raise ValueError(f"a ring needs at least one member (got {n})")
    length = 1
    while ((numel + length) // n - 1) % INT8_BLOCK != 0:
        length += 1
    return length


def weight_of(samples: int, total: int) -> float:
    """``w_i = samples / total``, rounded to float32: the member's weight (0 < samples <=
    total), exactly the value its buffer's tail holds, so that the coordinator, which computes
    the same from the member's report, takes exactly the tail's share off the member's sketch
    (even when its update is zero)."""
    if not 0 < samples <= total:
        raise ValueError(
            f"a weighted contribution needs 0 < samples <= the round's total ({samples} of {total})"
        )
    return float(torch.tensor(samples / total, dtype=torch.float32))


def weighted_contribution(flat: torch.Tensor, weight: float, n: int) -> torch.Tensor:
    """What a member puts into the all-reduce: ``flat * weight``, then the tail (zeros, the
    weight last)."""
    numel = flat.numel()
    out = torch.zeros(numel + tail_length(numel, n), dtype=torch.float32)
    torch.mul(flat.reshape(-1), weight, out=out[:numel])
    out[-1] = weight
    return out


def weighted_mean(summed: torch.Tensor, numel: int) -> torch.Tensor:
    """After the all-reduce: the summed parameters' part divided by the summed weight (the
    last element). ValueError when that weight is not a positive finite number (every honest
    member's is)."""
    total = float(summed[-1])
    if not (total > 0 and total != float("inf")):
        raise ValueError(f"the round's summed weight is {total}: not a positive number")
    return summed[:numel] / summed[-1]


def weighted_shapes(shapes: Mapping[str, Sequence[int]], n: int) -> dict[str, tuple[int, ...]]:
    """``shapes`` (the parameters, program order) and the tail, as the flat buffer holds them."""
    for name in shapes:
        if not name < WEIGHT_NAME:
            raise ValueError(f"parameter name {name!r} sorts after the ring weight's")
    numel = sum(math.prod(int(d) for d in s) for s in shapes.values())
    out = {name: tuple(int(d) for d in s) for name, s in shapes.items()}
    out[WEIGHT_NAME] = (tail_length(numel, n),)
    return out


def tail_sketch(sizes: Mapping[str, int], n: int, seed: int, buckets: int) -> torch.Tensor:
    """The float64 sketch, under ``seed``, of the tail of weight 1 (zeros, then 1) in a buffer
    of parameters of ``sizes`` elements each: what a weight of w adds to a contribution's sketch,
    divided by w."""
    numel = sum(int(v) for v in sizes.values())
    all_sizes = {**{k: int(v) for k, v in sizes.items()}, WEIGHT_NAME: tail_length(numel, n)}
    out = torch.zeros(buckets, dtype=torch.float64)
    for name, where, sign in coordinate_draws(all_sizes, seed, buckets):
        if name == WEIGHT_NAME:
            out[int(where[-1])] += float(sign[-1])
    return out


__all__ = [
    "RING_FEATURES",
    "RING_FEATURE_WEIGHTED",
    "WEIGHT_NAME",
    "tail_length",
    "tail_sketch",
    "weight_of",
    "weighted_contribution",
    "weighted_mean",
    "weighted_shapes",
]
