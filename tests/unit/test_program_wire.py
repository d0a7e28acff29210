"""Shared regions between the agent and a program child (node_agent.sandbox.wire)."""

from __future__ import annotations

import os

import pytest
import torch

from node_agent.sandbox.wire import Layout, Region

pytestmark = pytest.mark.timeout(10)


def test_a_region_cannot_be_resized_by_whoever_holds_its_descriptor() -> None:
    layout = Layout.of([("w", torch.float32, (4, 4))])
    region = Region.create("test", layout.size)
    views = region.views(layout)
    views["w"].fill_(1.5)
    other = Region.attach(os.dup(region.fd))  # what the child maps
    for size in (0, region.size // 2, region.size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(other.fd, size)  # shrinking would SIGBUS the agent
    assert torch.equal(other.views(layout)["w"], torch.full((4, 4), 1.5))
    other.close_fd()
    region.close_fd()
