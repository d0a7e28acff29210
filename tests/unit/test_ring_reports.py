"""What a ring member's successful report must hold to be taken
(coordinator.rounds.ring_verdicts.report_problem): the version the round makes, sha256
checksums, finite figures, and in a time-boxed (weighted) attempt a sample count that is its
weight: whole steps of its part, or all of it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.rounds.ring_verdicts import report_problem
from coordinator.rounds.round_state import Part, RoundState
from epochmesh.v1 import agent_pb2

pytestmark = pytest.mark.timeout(10)

GOOD = "ab" * 32


def _round(budget_s: float) -> RoundState:
    part = Part(
        node_id="m",
        task_id="t",
        ranges=np.array([[0, 40], [100, 120]], dtype=np.int64),
        local_batch=10,
        samples=60,
        inner_steps=6,
        budget_s=budget_s,
        assigned=60,
    )
    return RoundState(round=3, epoch=0, version=7, deadline_s=5.0, parts={"m": part})


def _report(**fields: object) -> agent_pb2.ReportProgressRequest:
    base: dict[str, object] = {
        "node_id": "m",
        "task_id": "t",
        "params_version": 8,
        "params_checksum": GOOD,
        "samples_done": 60,
        "mean_loss": 0.5,
        "compute_seconds": 0.1,
        "communicate_seconds": 0.1,
    }
    return agent_pb2.ReportProgressRequest(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "weighted", "budget_s", "problem"),
    [
        ({}, False, 0.0, ""),
        ({}, True, 1.0, ""),
        # A time-boxed member that got through 2 of its 6 steps.
        ({"samples_done": 20}, True, 1.0, ""),
        # Not whole steps, none, or more than its part: refused in a weighted attempt.
        ({"samples_done": 25}, True, 1.0, "whole steps of 10 samples"),
        ({"samples_done": 0}, True, 1.0, "num_samples is 0"),
        ({"samples_done": 70}, True, 1.0, "num_samples is 70"),
        # A part without a box trains all of it.
        ({"samples_done": 20}, True, 0.0, "the task assigned 60"),
        # Unweighted attempts do not weigh by the count (b_i / B): not checked here.
        ({"samples_done": 20}, False, 1.0, ""),
        ({"params_version": 7}, False, 0.0, "reported version 7, the round makes 8"),
        ({"params_checksum": "x"}, False, 0.0, "params_checksum is not a sha256"),
        ({"optim_checksum": "y"}, False, 0.0, "optim_checksum is not a sha256"),
        ({"mean_loss": math.nan}, False, 0.0, "non-finite"),
        ({"compute_seconds": -1.0}, False, 0.0, "non-finite"),
    ],
)
def test_report_problem(
    fields: dict[str, object], weighted: bool, budget_s: float, problem: str
) -> None:
    got = report_problem(_report(**fields), _round(budget_s), weighted)
    if problem:
        assert problem in got
    else:
        assert got == ""
