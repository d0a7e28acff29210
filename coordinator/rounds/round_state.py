"""The state of one training round on the coordinator: its parts (one per node), the round
itself while it is open, and each node's running figures for the job."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from coordinator.rounds.sample_ranges import (
    ROUND_PART_RANGES_FIELD,
    encode_ranges_field,
    head_of_runs,
)
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

# A round whose deadline passes before any node delivered waits at most this many times longer.
MAX_DEADLINE_EXTENSIONS = 2


@dataclass
class Part:
    node_id: str
    task_id: str
    ranges: np.ndarray  # dataset index runs, training order: (k, 2) [start, stop) rows
    local_batch: int  # b_i: samples per (inner) step
    # Samples in ``ranges``: local_batch in sync mode, H*b_i in local SGD (fewer at an epoch's
    # end). Aggregation weights, the ledger, the estimator and deadlines all work in these.
    samples: int = 0
    inner_steps: int = 1  # steps the node runs on them: ceil(samples / local_batch)
    # Time-boxed local SGD: the seconds of stepping the node has (0: none, every step), and the
    # samples handed out; an update for a prefix of them narrows ranges/samples/inner_steps to
    # what was trained, and the ledger commits only that.
    budget_s: float = 0.0
    assigned: int = 0
    handed_out: float = 0.0
    # What the coordinator saw of the node's work (monotonic seconds, 0: not seen): when the
    # node took the task, finished pulling the round's parameters, and its update (or ring
    # progress report) arrived; see coordinator/rounds/claims.py.
    delivered: float = 0.0
    pulled: float = 0.0
    arrived: float = 0.0
    grads: dict[str, torch.Tensor] | None = None
    mean_loss: float = float("nan")
    compute_s: float = 0.0
    wall_s: float = 0.0
    status: str = "pending"  # pending | applied | failed | late | rejected
    error: str = ""
    # False for a best-effort part (see _plan_batches): the round does not wait for it.
    required: bool = True
    # Ring mode (coordinator/engine/strategies/ring.py): a ring member (else an external node that pushes
    # its update to the coordinator), what its ReportProgress said, its own figure of the time
    # it spent communicating (None: wall time minus compute time).
    member: bool = False
    checksum: str = ""
    optim_checksum: str = ""  # ring mode: of the optimizer state after the step
    failed_peer: str = ""
    ring_fault: int = 0  # agent_pb2.RingFault this member found in its left neighbour's data
    comm_s: float | None = None
    # A member of a weighted ring attempt (time-boxed): the samples it reported trained, a
    # prefix of the part; the part is narrowed to them when the round commits.
    trained: int = 0
    # The market, fixed at hand-out (coordinator/market/job_billing.py): the node's price in
    # micro-credits per hour and its measured samples/s for the job.
    price: int = 0
    rate: float = 0.0

    def window_s(self) -> float:
        """Seconds between the node having the task and its parameters and its update
        arriving (0: not observed): the most it can have spent computing."""
        if self.arrived <= 0:
            return 0.0
        return max(0.0, self.arrived - max(self.delivered or self.handed_out, self.pulled))

    def communicate_s(self) -> float:
        """Seconds the node spent outside compute for this part (its own figure, else wall
        time minus compute time)."""
        return self.comm_s if self.comm_s is not None else max(0.0, self.wall_s - self.compute_s)


def part_record(p: Part) -> common_pb2.RoundPart:
    """The round record's entry of a part."""
    out = common_pb2.RoundPart(
        node_id=p.node_id,
        local_batch=p.local_batch,
        mean_loss=p.mean_loss,
        seconds=p.compute_s,
        status=p.status,
        inner_steps=p.inner_steps,
        communicate_seconds=p.communicate_s() if p.status == "applied" else 0.0,
        price_micro_per_hour=p.price,
        billed_rate=p.rate,
    )
    out.MergeFromString(encode_ranges_field(ROUND_PART_RANGES_FIELD, p.ranges))
    return out


@dataclass
class RoundState:
    round: int
    epoch: int
    version: int
    deadline_s: float
    parts: dict[str, Part]
    started: float = field(default_factory=time.monotonic)
    started_ms: int = field(default_factory=now_ms)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set with `changed`, for waiters other than the round loop (which clears `changed`).
    touched: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    waited_s: float = 0.0
    attempts: int = 0  # ring mode: how many times the ring was formed

    def touch(self) -> None:
        self.changed.set()
        self.touched.set()

    def outstanding(self) -> list[Part]:
        return [p for p in self.parts.values() if p.status == "pending"]

    def awaited(self) -> list[Part]:
        """Outstanding parts the round waits for (not the best-effort ones)."""
        return [p for p in self.outstanding() if p.required]

    def dropped(self) -> list[Part]:
        """Parts the round waited for and closed without (failed, rejected, or late while
        required; a late best-effort part is expected), by node."""
        return sorted(
            (
                p
                for p in self.parts.values()
                if p.status in ("failed", "rejected") or (p.status == "late" and p.required)
            ),
            key=lambda p: p.node_id,
        )

    def record(self, job_id: str, version: int, finished_ms: int) -> common_pb2.RoundRecord:
        """The round's record once closed: its applied parts' sample-weighted loss, the
        parameter version it ends with, every part by node."""
        applied = [p for p in self.parts.values() if p.status == "applied"]
        samples = sum(p.samples for p in applied)
        loss = sum(p.mean_loss * p.samples for p in applied) / samples if samples else math.nan
        return common_pb2.RoundRecord(
            job_id=job_id,
            epoch=self.epoch,
            round=self.round,
            started_ms=self.started_ms,
            finished_ms=finished_ms,
            loss=loss,
            params_version=version,
            parts=[part_record(p) for p in sorted(self.parts.values(), key=lambda p: p.node_id)],
            attempts=self.attempts,
        )

    def _part(self, node_id: str, task_id: str) -> Part | None:
        part = self.parts.get(node_id)
        return part if part is not None and part.task_id == task_id else None

    def is_open_part(self, node_id: str, task_id: str) -> bool:
        """Whether the task is the node's part of this round and still awaited."""
        part = self._part(node_id, task_id)
        return not self.closed and part is not None and part.status == "pending"

    def part_samples(self, node_id: str, task_id: str) -> int | None:
        """The samples the task's part holds now (None: not a part of this round)."""
        part = self._part(node_id, task_id)
        return part.samples if part is not None else None

    def samples_problem(self, node_id: str, task_id: str, num_samples: int) -> str:
        """Why an update of ``num_samples`` does not fit the task's part ("" if it does): all
        of the part's samples, or (a time-boxed part) a whole number of its inner steps."""
        part = self._part(node_id, task_id)
        if part is None:
            return "the task is not part of the open round"
        if num_samples == part.samples:
            return ""
        if part.budget_s > 0 and 0 < num_samples < part.samples:
            if num_samples % part.local_batch == 0:
                return ""
            return (
                f"num_samples is {num_samples}: a time-boxed part trains whole steps of "
                f"{part.local_batch} samples or all {part.samples}"
            )
        return f"num_samples is {num_samples}, the task assigned {part.samples}"

    def take_update(
        self,
        node_id: str,
        task_id: str,
        num_samples: int,
        mean_loss: float,
        compute_s: float,
        grads: Mapping[str, torch.Tensor],
        arrived: float = 0.0,
    ) -> str:
        """A decoded update of the task's part: the part is "received" (a time-boxed part
        narrowed to the prefix of its ranges the node trained). ``arrived``: when its header
        came (monotonic). Returns "" or why the update was not taken (the part is unchanged
        then)."""
        part = self._part(node_id, task_id)
        if self.closed:
            return "the round is closed (the update came after its deadline)"
        if part is None:
            return "the task is not part of the open round"
        if part.status != "pending":
            return f"the task is already {part.status}"
        if num_samples != part.samples:
            problem = self.samples_problem(node_id, task_id, num_samples)
            if problem:
                return problem
            part.ranges = head_of_runs(part.ranges, num_samples)
            part.samples = num_samples
            part.inner_steps = -(-num_samples // part.local_batch)
        part.grads = dict(grads)
        part.mean_loss = mean_loss
        part.compute_s = compute_s
        part.wall_s = time.monotonic() - part.handed_out
        part.arrived = arrived or time.monotonic()
        part.status = "received"
        self.touch()
        return ""

    def seen(self, node_id: str, task_id: str, what: str) -> None:
        """The node took the task (``what`` "delivered") or finished pulling the round's
        parameters ("pulled"), now."""
        part = self._part(node_id, task_id) if task_id else self.parts.get(node_id)
        if part is not None and part.status == "pending":
            setattr(part, what, time.monotonic())

    def end_part(self, node_id: str, task_id: str, status: str, error: str) -> None:
        """The task's part ends without an update (``status`` "failed" or "rejected"), if it
        is still awaited."""
        part = self._part(node_id, task_id)
        if part is not None and part.status == "pending":
            part.status = status
            part.error = error[:500]
            self.touch()


@dataclass
class NodeStats:
    compute_s: float = 0.0
    communicate_s: float = 0.0
    failures_in_a_row: int = 0
    excluded: bool = False
