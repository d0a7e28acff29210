"""Unit tests of node_agent.training.compute.prefetched_batches: the inner steps' batches gathered a
chunk of steps at a time (one gather, then views), in the same order and values as one gather
per step."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from node_agent.training.compute import prefetched_batches

pytestmark = pytest.mark.timeout(30)

X = torch.arange(1000 * 3, dtype=torch.float32).reshape(1000, 3)  # 12 bytes per sample
Y = torch.arange(1000, dtype=torch.int64)  # 8 bytes per sample


class Gather:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, idx: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self.calls.append(len(idx))
        i = torch.tensor(list(idx), dtype=torch.int64)
        return [X[i]], [Y[i]]


@pytest.mark.parametrize("chunk_bytes", [1, 20 * 7, 20 * 40, 32 << 20])
def test_same_batches_as_one_gather_per_step(chunk_bytes: int) -> None:
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    head = order[:95]
    slices = [head[i : i + 10] for i in range(0, 95, 10)]  # 10 steps, the last of 5
    gather = Gather()
    got = list(prefetched_batches(slices, gather, chunk_bytes=chunk_bytes))
    assert len(got) == len(slices)
    for (inputs, targets), idx in zip(got, slices, strict=True):
        want_x, want_y = Gather()(idx)
        assert torch.equal(inputs[0], want_x[0]) and torch.equal(targets[0], want_y[0])
        assert inputs[0].is_contiguous()
    assert sum(gather.calls) == 95
    if chunk_bytes == 1:
        assert len(gather.calls) == 10  # never less than a step per gather
    if chunk_bytes == 32 << 20:
        assert gather.calls == [10, 85]  # the first step alone sizes a sample, then the rest


def test_no_slices_no_gather() -> None:
    gather = Gather()
    assert list(prefetched_batches([], gather)) == []
    assert gather.calls == []
