"""How a round's work may be done other than as asked: the hooks the training code calls, and `HONEST`.

The training code (node_agent.training.compute, ring_round) depends on this protocol, never on
what implements it, so that imports run one way: node_agent.testing -> node_agent.training. A
`Tamper` reaches a round through its TaskContext (``ctx.tamper``), which the worker fills from
what node_agent.main gave it: an implementation only when the test entry point installs one
(fault injection for the verification tests, node_agent.testing), else `HONEST`, whose hooks
change nothing. Every hook is called on the compute thread of the round it concerns, except
`contribution_factor` and `benchmarked` (on the event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.training.jobs import ComputedUpdate, LoadedJob

Grads = dict[str, torch.Tensor]


class Tamper(Protocol):
    def partial(self, round_: int) -> bool:
        """Called once before a round's update is computed: whether the round computes only a
        share of its part (`share`) and claims the whole of it: its missing chunks made up
        (`filled_chunks`, `filled_local_update`), without chunks its num_samples and steps
        those of the whole part. A partial local SGD round steps without a compute budget."""
        ...

    def share(self, total: int) -> int:
        """How many of ``total`` pieces a partial round computes (at least one when ``total``
        is not 0): its first verification chunks; without chunks, its first samples (sync)
        or inner steps (local SGD)."""
        ...

    def filled_chunks(
        self, losses: Sequence[float], grads: Sequence[Grads], total: int
    ) -> tuple[list[float], list[Grads]]:
        """A partial sync round's chunks, once its share is computed: the computed ones, then
        made-up ones up to ``total``."""
        ...

    def filled_local_update(
        self, update: ComputedUpdate, slices: Sequence[Sequence[int]], verify_chunks: int
    ) -> ComputedUpdate:
        """A partial local SGD round's update, once its share of the grid's pieces is stepped
        (``update.chunks``: those pieces): the pieces it stepped, then made-up ones for the
        rest of its planned steps ``slices``."""
        ...

    def sent(self, job: LoadedJob, task: agent_pb2.Task, update: ComputedUpdate) -> ComputedUpdate:
        """Called once a round's update is computed (and filled, for a partial round), before it
        is checked, grouped into chunks and sent: the update that is sent instead of
        ``update`` (``update`` itself to change nothing). It may keep what it needs for later
        rounds on ``job`` (`LoadedJob.previous`)."""
        ...

    def benchmarked(self, result: common_pb2.BenchmarkResult) -> common_pb2.BenchmarkResult:
        """Called once a job benchmark is measured, before it is reported: the result that is
        reported instead (``result`` itself to change nothing). Called on the event loop."""
        ...

    def contribution_factor(self, round_: int) -> float:
        """Called once per ring attempt, after the contribution's copies for the round's audit
        are taken and before the all-reduce: the factor applied to what this member puts
        into the ring (1.0 to change nothing)."""
        ...


class Honest:
    """The `Tamper` of an agent that does its work as asked: every hook changes nothing."""

    def partial(self, round_: int) -> bool:
        return False

    def share(self, total: int) -> int:
        return total

    def filled_chunks(
        self, losses: Sequence[float], grads: Sequence[Grads], total: int
    ) -> tuple[list[float], list[Grads]]:
        return list(losses), list(grads)

    def filled_local_update(
        self, update: ComputedUpdate, slices: Sequence[Sequence[int]], verify_chunks: int
    ) -> ComputedUpdate:
        return update

    def sent(self, job: LoadedJob, task: agent_pb2.Task, update: ComputedUpdate) -> ComputedUpdate:
        return update

    def benchmarked(self, result: common_pb2.BenchmarkResult) -> common_pb2.BenchmarkResult:
        return result

    def contribution_factor(self, round_: int) -> float:
        return 1.0


HONEST: Tamper = Honest()
