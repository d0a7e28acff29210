"""The open round's part lifecycle (coordinator/rounds/round_state.py), table-driven, without a network:
updates taken or refused, time-boxed prefixes, failures, and what the round still awaits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from coordinator.rounds.round_state import Part, RoundState

pytestmark = pytest.mark.timeout(30)


def part(node: str, samples: int = 8, local_batch: int = 8, **kw: object) -> Part:
    return Part(
        node_id=node,
        task_id=f"t-{node}",
        ranges=np.array([[0, samples]], dtype=np.int64),
        local_batch=local_batch,
        samples=samples,
        inner_steps=-(-samples // local_batch),
        assigned=samples,
        **kw,  # type: ignore[arg-type]
    )


def round_of(*parts: Part, closed: bool = False) -> RoundState:
    rs = RoundState(
        round=1, epoch=0, version=1, deadline_s=1.0, parts={p.node_id: p for p in parts}
    )
    rs.closed = closed
    return rs


GRADS = {"w": torch.ones(2)}


@dataclass(frozen=True)
class Update:
    name: str
    part: Part
    task: str
    samples: int
    closed: bool
    refusal: str  # "" when taken; else a fragment of the reason
    kept_samples: int  # the part's samples afterwards


UPDATES = [
    Update("whole part", part("a"), "t-a", 8, False, "", 8),
    Update("another task", part("a"), "t-old", 8, False, "not part of the open round", 8),
    Update("closed round", part("a"), "t-a", 8, True, "round is closed", 8),
    Update("already failed", part("a", status="failed"), "t-a", 8, False, "already failed", 8),
    Update("fewer samples, not boxed", part("a"), "t-a", 4, False, "the task assigned 8", 8),
    Update(
        "a boxed prefix of whole steps",
        part("a", samples=32, local_batch=8, budget_s=1.0),
        "t-a",
        16,
        False,
        "",
        16,
    ),
    Update(
        "a boxed prefix of part of a step",
        part("a", samples=32, local_batch=8, budget_s=1.0),
        "t-a",
        12,
        False,
        "whole steps of 8",
        32,
    ),
    Update(
        "more than a boxed part holds",
        part("a", samples=32, local_batch=8, budget_s=1.0),
        "t-a",
        40,
        False,
        "the task assigned 32",
        32,
    ),
]


@pytest.mark.parametrize("case", UPDATES, ids=[u.name for u in UPDATES])
def test_an_update_is_taken_or_refused_with_a_reason(case: Update) -> None:
    rs = round_of(case.part, closed=case.closed)
    status = case.part.status
    reason = rs.take_update("a", case.task, case.samples, 0.5, 0.1, GRADS)
    p = rs.parts["a"]
    if case.refusal:
        assert case.refusal in reason
        assert p.status == status and p.grads is None
    else:
        assert reason == ""
        assert p.status == "received" and p.mean_loss == 0.5 and p.grads is not None
        assert rs.changed.is_set()
    assert p.samples == case.kept_samples
    assert int((p.ranges[:, 1] - p.ranges[:, 0]).sum()) == case.kept_samples
    assert p.inner_steps == -(-case.kept_samples // p.local_batch)


@pytest.mark.parametrize(
    "case",
    [u for u in UPDATES if not u.closed and u.part.status == "pending"],
    ids=lambda u: u.name,
)
def test_samples_problem_says_what_take_update_refuses(case: Update) -> None:
    p = case.part
    rs = round_of(part("a", samples=p.samples, local_batch=p.local_batch, budget_s=p.budget_s))
    problem = rs.samples_problem("a", case.task, case.samples)
    reason = rs.take_update("a", case.task, case.samples, 0.0, 0.0, GRADS)
    assert problem == reason


@pytest.mark.parametrize(
    ("before", "status", "after"),
    [
        ("pending", "failed", "failed"),
        ("pending", "rejected", "rejected"),
        ("received", "failed", "received"),
        ("late", "rejected", "late"),
    ],
)
def test_a_part_ends_without_an_update_only_while_awaited(
    before: str, status: str, after: str
) -> None:
    rs = round_of(part("a", status=before))
    rs.end_part("a", "t-a", status, "x" * 600)
    p = rs.parts["a"]
    assert p.status == after
    if after != before:
        assert len(p.error) == 500
    rs.end_part("a", "t-other", "failed", "stale task")  # another task: nothing changes
    assert rs.parts["a"].status == after


def test_what_the_round_still_awaits() -> None:
    rs = round_of(part("a"), part("b", required=False), part("c"))
    assert [p.node_id for p in rs.outstanding()] == ["a", "b", "c"]
    assert [p.node_id for p in rs.awaited()] == ["a", "c"]  # b is best effort
    assert rs.is_open_part("a", "t-a") and not rs.is_open_part("a", "t-b")
    assert rs.take_update("a", "t-a", 8, 0.0, 0.1, GRADS) == ""
    rs.end_part("c", "t-c", "failed", "node went offline")
    assert rs.awaited() == [] and [p.node_id for p in rs.outstanding()] == ["b"]
    assert not rs.is_open_part("a", "t-a")
    assert rs.part_samples("b", "t-b") == 8 and rs.part_samples("b", "t-a") is None
    rs.closed = True
    assert not rs.is_open_part("b", "t-b")


def test_the_record_weighs_loss_by_applied_samples_and_lists_every_part() -> None:
    a, b, c, d = part("a", samples=8), part("b", samples=24), part("c"), part("d", required=False)
    a.status, a.mean_loss, a.wall_s, a.compute_s = "applied", 1.0, 0.5, 0.2
    b.status, b.mean_loss, b.comm_s = "applied", 2.0, 0.05
    c.status, c.error = "failed", "node went offline"
    d.status = "late"  # best effort: not news
    rs = round_of(a, b, c, d)
    record = rs.record("j-1", version=7, finished_ms=123)
    assert record.loss == pytest.approx((8 * 1.0 + 24 * 2.0) / 32)
    assert record.params_version == 7 and record.finished_ms == 123
    assert [p.node_id for p in record.parts] == ["a", "b", "c", "d"]
    comm = {p.node_id: p.communicate_seconds for p in record.parts}
    assert comm == pytest.approx({"a": 0.3, "b": 0.05, "c": 0.0, "d": 0.0})
    assert [p.node_id for p in rs.dropped()] == ["c"]
    d.required = True  # a late part the round waited for is news
    assert [p.node_id for p in rs.dropped()] == ["c", "d"]


def test_a_round_with_nothing_applied_records_no_loss() -> None:
    rs = round_of(part("a", status="failed"))
    assert math.isnan(rs.record("j-1", version=1, finished_ms=0).loss)
