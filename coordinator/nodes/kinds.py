"""A node's device model, the key its speeds are compared and calibrated by."""

from __future__ import annotations

from epochmesh.v1 import common_pb2


def node_kind(info: common_pb2.NodeInfo) -> str:
    """The device model a node computes on ("cuda:NVIDIA H100 80GB HBM3", "cpu:2")."""
    if not info.devices:
        return ""
    d = info.devices[0]
    return f"{d.kind}:{d.name or d.cores}"
