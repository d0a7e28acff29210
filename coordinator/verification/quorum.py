"""What checkers' recomputations of a checked chunk decide, and which nodes are drawn to check
(pure: no clock, no I/O, no randomness of its own).

A checked chunk of a node's part is recomputed by checkers of other donors
(coordinator/engine/verifier.py). Each recomputation is compared with the node's committed
chunk and with the other checkers' recomputations, within the tolerance measured for the pair
of devices. `decide` turns those comparisons into a verdict with its reason:

- Only checkers of donors other than the node's vote, and a donor votes once: two checkers of
  one donor count as one (as one Sybil identity with two nodes would), and a donor whose own
  checkers contradict each other does not vote.
- PASS needs a quorum (`QUORUM`, two) of voting donors whose recomputations agree with the
  node's chunk and with each other; ACCUSE needs a quorum whose recomputations agree with each
  other and not with the node. A quorum of one camp wins only when it outnumbers the other
  camp; checkers of the losing camp contradicted the quorum (they are struck, never
  quarantined). So one donor alone, colluding or broken, can neither pass a cheater nor frame
  an honest node; checkers are drawn by their verified history (`checker_weight`) so that
  fresh identities seldom form a quorum.
- When the recomputations disagree among themselves without a quorum, nobody is struck: WAIT
  for checkers still working, MORE for one more checker of a new donor where one can be drawn,
  else UNDECIDED.
- NONDETERMINISTIC when no two of the recomputations agree (the node's and those of at least
  two voting donors, pairwise): the same input computed several times gives different
  results, which honest donors running a deterministic program never do. The program is at
  fault, not a donor: nobody is struck, no pay is forfeited, and its submitter is told. With
  more checkers available the verdict waits for a third voting donor first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import combinations

from coordinator.verification.reputation import N0, P_FLOOR, ReputationRecord

__all__ = [
    "NONDETERMINISM_VOTERS",
    "QUORUM",
    "Decision",
    "Recomputation",
    "Verdict",
    "checker_weight",
    "decide",
    "pair",
]

# Voting donors (besides the node) that must agree with each other for any verdict.
QUORUM = 2
# Voting donors whose recomputations, all disagreeing, declare the program nondeterministic
# while more checkers could still be drawn (with none left, QUORUM of them do).
NONDETERMINISM_VOTERS = 3
# A checker's weight in the draw grows with its verified rounds in a row up to this many (the
# rounds after which its own check probability reaches the floor).
HISTORY_CAP = round(N0 / P_FLOOR)


class Verdict(Enum):
    PASS = "pass"  # a quorum of donors reproduces the node's chunk
    ACCUSE = "accuse"  # a quorum of donors agrees on another result than the node's
    WAIT = "wait"  # no verdict yet; a checker sent is still working
    MORE = "more"  # no verdict yet; one more checker of a new donor is needed
    UNDECIDED = "undecided"  # no verdict can be reached: nobody is struck
    NONDETERMINISTIC = "nondeterministic"  # the program's results scatter: the job's fault


@dataclass(frozen=True)
class Recomputation:
    """One checker's answer: who it is, its donor, and whether its recomputation agrees with
    the node's committed chunk (sketch and loss within the tolerance)."""

    checker: str
    donor: str
    agrees_with_node: bool


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    quorum: tuple[str, ...] = ()  # the checkers whose agreement decided (PASS, ACCUSE)
    struck: tuple[str, ...] = ()  # checkers that contradicted the deciding quorum


def pair(a: str, b: str) -> frozenset[str]:
    """The key of two checkers in ``agreeing`` (`decide`)."""
    return frozenset((a, b))


def _clique(members: Sequence[str], agreeing: Collection[frozenset[str]]) -> tuple[str, ...]:
    """The largest subset of ``members`` whose every two agree (members are few: at most a
    handful of donors)."""
    for size in range(len(members), 0, -1):
        for combo in combinations(members, size):
            if all(pair(a, b) in agreeing for a, b in combinations(combo, 2)):
                return combo
    return ()


def decide(
    node_donor: str,
    answers: Sequence[Recomputation],
    agreeing: Collection[frozenset[str]],
    *,
    working: int,
    more_possible: bool,
    quorum: int = QUORUM,
) -> Decision:
    """The verdict on a checked chunk (see the module docstring).

    ``answers``: the checkers' recomputations so far; ``agreeing``: the pairs of checkers
    (`pair`) whose recomputations agree with each other; ``working``: checkers sent that have
    not answered; ``more_possible``: whether a checker of a donor not yet asked can still be
    drawn."""
    if quorum < 1:
        raise ValueError(f"quorum must be at least 1, got {quorum}")
    by_donor: dict[str, list[Recomputation]] = {}
    for a in answers:
        if a.donor != node_donor:
            by_donor.setdefault(a.donor, []).append(a)
    voters: list[Recomputation] = []
    split: list[str] = []
    for donor, rs in sorted(by_donor.items()):
        first = rs[0]
        if all(
            r.agrees_with_node == first.agrees_with_node
            and pair(first.checker, r.checker) in agreeing
            for r in rs[1:]
        ):
            voters.append(first)  # several checkers of one donor: one vote
        else:
            split.append(donor)
    ignored = len(answers) - sum(len(rs) for rs in by_donor.values())
    support = [v.checker for v in voters if v.agrees_with_node]
    oppose = [v.checker for v in voters if not v.agrees_with_node]
    pro = _clique(support, agreeing)
    con = _clique(oppose, agreeing)
    notes = []
    if ignored:
        notes.append(f"{ignored} checker(s) of the node's own donor ignored")
    if split:
        notes.append(f"donor(s) {', '.join(split)} contradicted themselves and do not vote")
    note = f" ({'; '.join(notes)})" if notes else ""
    tally = f"{len(support)} donor(s) reproduce the node's chunk, {len(oppose)} do not{note}"

    def outliers(
        deciding: Sequence[str], camp: Sequence[str], losing: Sequence[str]
    ) -> tuple[str, ...]:
        # The losing camp, and of the winning camp those that agree with no quorum member.
        alone = [
            c
            for c in camp
            if c not in deciding and not any(pair(c, q) in agreeing for q in deciding)
        ]
        return tuple(sorted([*losing, *alone]))

    if len(pro) >= quorum and len(support) > len(oppose):
        return Decision(
            Verdict.PASS,
            f"{len(pro)} checkers of distinct donors ({', '.join(pro)}) agree with the node "
            f"and with each other; {tally}",
            quorum=pro,
            struck=outliers(pro, support, oppose),
        )
    if len(con) >= quorum and len(oppose) > len(support):
        return Decision(
            Verdict.ACCUSE,
            f"{len(con)} checkers of distinct donors ({', '.join(con)}) agree with each other "
            f"and not with the node; {tally}",
            quorum=con,
            struck=outliers(con, oppose, support),
        )
    scattered = len(voters) >= quorum and not support and len(con) <= 1
    if working > 0:
        return Decision(Verdict.WAIT, f"no quorum yet, {working} checker(s) still working; {tally}")
    if scattered and (len(voters) >= NONDETERMINISM_VOTERS or not more_possible):
        return Decision(
            Verdict.NONDETERMINISTIC,
            f"the {len(voters)} recomputations of the chunk by distinct donors disagree with "
            "the node's and with each other: the program computes different results from the "
            f"same input (it is nondeterministic); {tally}",
        )
    if more_possible:
        return Decision(Verdict.MORE, f"no quorum yet: one more checker is drawn; {tally}")
    if len(voters) < quorum and not (support and oppose) and not split:
        # Nobody contradicted anybody: there were too few donors to ask (a small cluster).
        return Decision(
            Verdict.UNDECIDED,
            f"only {len(voters)} donor(s) besides the node's could check it and a verdict "
            f"needs {quorum}, so nobody is blamed; {tally}",
        )
    return Decision(
        Verdict.UNDECIDED,
        f"the checkers disagree among themselves and no checker of another donor is left to "
        f"settle it, so nobody is blamed; {tally}",
    )


def checker_weight(record: ReputationRecord | None) -> float:
    """A candidate checker's weight in the draw: its verified history (checked rounds that
    passed, in a row), never its claimed speed. A node without a verified round weighs 1, one
    with v verified rounds in a row 1 + min(v, HISTORY_CAP): a fresh identity (a Sybil made for
    the purpose) is seldom drawn while checkers with a record are around."""
    if record is None:
        return 1.0
    return 1.0 + min(record.verified_in_a_row, HISTORY_CAP)
