"""The quorum rule of recomputation checks (coordinator.verification.quorum), table-driven:
checkers that agree or disagree with the node and with each other, checkers of one donor, a
nondeterministic program; and the draw weight of a checker's verified history."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator.verification.quorum import (
    HISTORY_CAP,
    Recomputation,
    Verdict,
    checker_weight,
    decide,
    pair,
)
from coordinator.verification.reputation import ReputationRecord

pytestmark = pytest.mark.timeout(30)

NODE_DONOR = "d-node"


@dataclass(frozen=True)
class Case:
    name: str
    # checker -> (donor, agrees with the node)
    answers: dict[str, tuple[str, bool]]
    agreeing: tuple[tuple[str, str], ...]  # checker pairs whose recomputations agree
    working: int
    more: bool
    verdict: Verdict
    quorum: tuple[str, ...] = ()
    struck: tuple[str, ...] = ()


CASES = [
    Case("no answer yet", {}, (), working=2, more=True, verdict=Verdict.WAIT),
    Case(
        "two donors reproduce the chunk",
        {"a": ("d1", True), "b": ("d2", True)},
        (("a", "b"),),
        working=0,
        more=True,
        verdict=Verdict.PASS,
        quorum=("a", "b"),
    ),
    Case(
        "one agreeing checker is no quorum: wait for the other",
        {"a": ("d1", True)},
        (),
        working=1,
        more=True,
        verdict=Verdict.WAIT,
    ),
    Case(
        "one agreeing checker, no other donor left: undecided",
        {"a": ("d1", True)},
        (),
        working=0,
        more=False,
        verdict=Verdict.UNDECIDED,
    ),
    Case(
        "two donors agree with each other against the node: accused",
        {"a": ("d1", False), "b": ("d2", False)},
        (("a", "b"),),
        working=0,
        more=True,
        verdict=Verdict.ACCUSE,
        quorum=("a", "b"),
    ),
    Case(
        "two checkers against the node that disagree with each other: nobody is accused, "
        "a third donor is asked",
        {"a": ("d1", False), "b": ("d2", False)},
        (),
        working=0,
        more=True,
        verdict=Verdict.MORE,
    ),
    Case(
        "a third donor sides with one of two disagreeing checkers: accused by those two",
        {"a": ("d1", False), "b": ("d2", False), "c": ("d3", False)},
        (("a", "c"),),
        working=0,
        more=True,
        verdict=Verdict.ACCUSE,
        quorum=("a", "c"),
        struck=("b",),
    ),
    Case(
        "one checker with the node, one against: a third donor is asked",
        {"a": ("d1", True), "b": ("d2", False)},
        (),
        working=0,
        more=True,
        verdict=Verdict.MORE,
    ),
    Case(
        "the third sides with the node: passed, the dissenter struck",
        {"a": ("d1", True), "b": ("d2", False), "c": ("d3", True)},
        (("a", "c"),),
        working=0,
        more=True,
        verdict=Verdict.PASS,
        quorum=("a", "c"),
        struck=("b",),
    ),
    Case(
        "one with the node, one against, none left: undecided, nobody struck",
        {"a": ("d1", True), "b": ("d2", False)},
        (),
        working=0,
        more=False,
        verdict=Verdict.UNDECIDED,
    ),
    Case(
        "two checkers of one donor against the node count as one: no accusation",
        {"a": ("d1", False), "b": ("d1", False)},
        (("a", "b"),),
        working=0,
        more=False,
        verdict=Verdict.UNDECIDED,
    ),
    Case(
        "two checkers of one donor with the node count as one: no pass",
        {"a": ("d1", True), "b": ("d1", True)},
        (("a", "b"),),
        working=0,
        more=True,
        verdict=Verdict.MORE,
    ),
    Case(
        "a checker of the node's own donor does not vote",
        {"a": (NODE_DONOR, True), "b": ("d2", True)},
        (("a", "b"),),
        working=0,
        more=False,
        verdict=Verdict.UNDECIDED,
    ),
    Case(
        "a pair of donors against the node and a pair with it: a tie decides nothing",
        {"a": ("d1", False), "b": ("d2", False), "c": ("d3", True), "d": ("d4", True)},
        (("a", "b"), ("c", "d")),
        working=0,
        more=False,
        verdict=Verdict.UNDECIDED,
    ),
    Case(
        "every recomputation differs from every other (three donors): nondeterministic",
        {"a": ("d1", False), "b": ("d2", False), "c": ("d3", False)},
        (),
        working=0,
        more=True,
        verdict=Verdict.NONDETERMINISTIC,
    ),
    Case(
        "two donors differ from the node and each other, none left: nondeterministic",
        {"a": ("d1", False), "b": ("d2", False)},
        (),
        working=0,
        more=False,
        verdict=Verdict.NONDETERMINISTIC,
    ),
    Case(
        "scattered results while a checker still works: wait",
        {"a": ("d1", False), "b": ("d2", False)},
        (),
        working=1,
        more=True,
        verdict=Verdict.WAIT,
    ),
    Case(
        "a quorum decides without waiting for a third checker",
        {"a": ("d1", True), "b": ("d2", True)},
        (("a", "b"),),
        working=1,
        more=True,
        verdict=Verdict.PASS,
        quorum=("a", "b"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_quorum_rule(case: Case) -> None:
    answers = [Recomputation(c, d, agrees) for c, (d, agrees) in case.answers.items()]
    decision = decide(
        NODE_DONOR,
        answers,
        {pair(a, b) for a, b in case.agreeing},
        working=case.working,
        more_possible=case.more,
    )
    assert decision.verdict is case.verdict, decision.reason
    assert decision.quorum == case.quorum, decision
    assert decision.struck == case.struck, decision
    assert decision.reason


def test_nobody_is_struck_without_a_verdict() -> None:
    """Whatever the answers, a decision that blames nobody strikes no checker."""
    for case in CASES:
        answers = [Recomputation(c, d, agrees) for c, (d, agrees) in case.answers.items()]
        decision = decide(
            NODE_DONOR,
            answers,
            {pair(a, b) for a, b in case.agreeing},
            working=case.working,
            more_possible=case.more,
        )
        if decision.verdict not in (Verdict.PASS, Verdict.ACCUSE):
            assert decision.struck == () and decision.quorum == ()


def test_an_undecided_check_says_whether_donors_were_too_few_or_disagreed() -> None:
    """A cluster of two donors: the one checker agrees, nobody contradicts anybody, and the
    reason says that a verdict needed more donors (not that the checkers disagree)."""
    alone = decide(
        NODE_DONOR, [Recomputation("a", "d1", True)], set(), working=0, more_possible=False
    )
    assert alone.verdict is Verdict.UNDECIDED
    assert alone.reason.startswith("only 1 donor(s) besides the node's could check it"), alone
    split = decide(
        NODE_DONOR,
        [Recomputation("a", "d1", True), Recomputation("b", "d2", False)],
        set(),
        working=0,
        more_possible=False,
    )
    assert split.verdict is Verdict.UNDECIDED
    assert split.reason.startswith("the checkers disagree among themselves"), split


def test_a_quorum_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="quorum"):
        decide(NODE_DONOR, [], set(), working=0, more_possible=False, quorum=0)


def test_checkers_are_weighted_by_their_verified_history() -> None:
    fresh = checker_weight(ReputationRecord())
    assert checker_weight(None) == fresh == 1.0
    seasoned = ReputationRecord(verified_in_a_row=30, verified_total=30, last_verified_round=9)
    assert checker_weight(seasoned) == 31.0
    veteran = ReputationRecord(
        verified_in_a_row=10_000, verified_total=10_000, last_verified_round=9
    )
    assert checker_weight(veteran) == 1.0 + HISTORY_CAP
    # A failure resets the run: back to a fresh identity's weight.
    failed = ReputationRecord(
        verified_in_a_row=0,
        verified_total=40,
        failed_total=1,
        last_verified_round=9,
        last_failure_round=10,
        last_failure_evidence="wrong",
    )
    assert checker_weight(failed) == fresh
