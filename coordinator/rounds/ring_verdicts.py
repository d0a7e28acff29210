"""Ring round rules: an attempt, and what members' checksums and fault reports decide.

`coordinator.engine.strategies.ring.RingRounds` runs the rounds and acts on these verdicts; they
take what they judge as arguments (the time included) and read no clock and do no I/O. The
protocol: docs/ring-rounds.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum

from coordinator.rounds.round_state import Part, RoundState
from epochmesh.v1 import agent_pb2, common_pb2

# Part statuses of a ring round that take a node out of the round.
DEAD = ("failed", "late", "rejected")
_CHECKSUM = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class RingAttempt:
    """One formation of the ring within a round."""

    number: int  # 0, 1, 2 (Task.ring.attempt)
    order: list[str]  # members, ring order
    externals: list[str]
    total: int  # B: sum of local_batch over members and externals (weighted: of their samples)
    gateway: str  # member that adds the externals' sum ("" without externals)
    push_state_node: str  # member asked for its state after the round ("" when none is due)
    step_deadline_s: float
    deadline_s: float
    started: float  # when it was formed (time.monotonic())
    external_sum: tuple[common_pb2.TensorBundle, bytes] | None = None
    # A time-boxed local SGD round (Task.ring_weighted): each member weighs its update by the
    # samples it trained over ``total``, which is then the samples handed out (epochmesh.ring.weights).
    weighted: bool = False


def report_problem(req: agent_pb2.ReportProgressRequest, rs: RoundState, weighted: bool) -> str:
    """Why a member's successful report of its part of ``rs`` cannot be taken ("" if it can):
    the version it made, its checksums, finite figures, and in a ``weighted`` (time-boxed)
    attempt the samples it trained, its weight in the all-reduce (whole steps of its part, or
    all of it)."""
    if req.params_version != rs.version + 1:
        return f"reported version {req.params_version}, the round makes {rs.version + 1}"
    if not _CHECKSUM.match(req.params_checksum):
        return "params_checksum is not a sha256 hex digest"
    if req.optim_checksum and not _CHECKSUM.match(req.optim_checksum):
        return "optim_checksum is not a sha256 hex digest"
    if not all(
        math.isfinite(x) and x >= 0 for x in (req.compute_seconds, req.communicate_seconds)
    ) or not math.isfinite(req.mean_loss):
        return "non-finite loss or times"
    if weighted:
        return rs.samples_problem(req.node_id, req.task_id, req.samples_done)
    return ""


class Agreement(Enum):
    """What the members' parameter checksums after a ring step decide (`checksum_verdict`)."""

    AGREED = "agreed"  # every member holds the same bits: the round commits
    EJECT = "eject"  # a strict majority agrees: the others are struck and the round retried
    RETRY = "retry"  # no majority, first time this round: retried once with the same members
    FAIL = "fail"  # no majority again: the job stops rather than train on divergent replicas


@dataclass(frozen=True)
class ChecksumVerdict:
    agreement: Agreement
    agreed: str  # the winning checksum ("" without a majority)
    minority: tuple[str, ...]  # members whose checksum lost (EJECT), sorted
    reason: str


def checksum_verdict(checksums: Mapping[str, str], retried_tie: bool) -> ChecksumVerdict:
    """Decide on the members' checksums after the step (member -> sha256 hex).

    Honest members all-reduce to bit-identical sums (epochmesh.ring.schedule), so they report one
    checksum; a member that reports another one stepped differently or lies. A checksum held by
    a strict majority of the members wins and the other members are ejected. Without one (two
    members that disagree, a tie, or as many checksums as members) nobody can be blamed: the
    round is retried once with the same members (a transient fault clears), and a second
    disagreement (`retried_tie`) is FAIL: nobody can be blamed (`RingRounds` then waits for a
    member outside the disputed ones, whose checksum decides, where the job has room for one;
    else the job stops).
    """
    groups: dict[str, list[str]] = {}
    for node, checksum in sorted(checksums.items()):
        groups.setdefault(checksum, []).append(node)
    what = "; ".join(f"{c[:16]}: {', '.join(ns)}" for c, ns in groups.items())
    if len(groups) <= 1:
        return ChecksumVerdict(Agreement.AGREED, next(iter(groups), ""), (), "checksums agree")
    best = max(groups, key=lambda c: (len(groups[c]), c))
    n = len(checksums)
    if 2 * len(groups[best]) > n:
        minority = tuple(sorted(node for c, ns in groups.items() if c != best for node in ns))
        return ChecksumVerdict(
            Agreement.EJECT,
            best,
            minority,
            f"{len(groups[best])} of {n} members agree on checksum {best[:16]}; "
            f"{', '.join(minority)} reported another ({what})",
        )
    if not retried_tie:
        return ChecksumVerdict(
            Agreement.RETRY,
            "",
            (),
            f"no majority among the {n} members' checksums ({what}); retrying the round once "
            "with the same members",
        )
    return ChecksumVerdict(
        Agreement.FAIL,
        "",
        (),
        f"no majority among the {n} members' checksums after a retry ({what})",
    )


def state_key(part: Part) -> str:
    """What a member's report says it holds after the step: its parameters' checksum, and its
    optimizer state's where it reports one."""
    return f"{part.checksum}+{part.optim_checksum}" if part.optim_checksum else part.checksum


@dataclass(frozen=True)
class FaultVerdict:
    """What the members' reports of bad data from their left neighbours decide after a failed
    attempt (`fault_verdict`)."""

    witnesses: dict[str, dict[str, int]]  # accused -> {accuser: round}, this one's included
    struck: dict[str, str]  # accused -> why it is struck (two witnesses or more)
    retest: tuple[str, ...]  # accused by one witness: kept in the round, away from it
    reason: str


# What each kind of agent_pb2.RingFault says of the accused: (why it is struck, what it is
# accused of). A kind not listed here accuses nobody.
FAULT_WORDS: dict[int, tuple[str, str]] = {
    agent_pb2.RING_FAULT_NON_FINITE: (
        "fed NaN or Inf values into the ring",
        "feeding NaN or Inf values",
    ),
    agent_pb2.RING_FAULT_TAMPERED: (
        "forwarded tampered data in the ring's all-gather (a segment that does not match its "
        "owner's seal)",
        "forwarding tampered data",
    ),
}


def fault_verdict(
    order: list[str],
    reports: Mapping[str, tuple[str, int]],
    witnesses: Mapping[str, Mapping[str, int]],
    round_: int,
    can_retest: bool,
) -> FaultVerdict:
    """Who sent bad data into the ring (NaN/Inf, a tampered all-gather segment: any kind of
    `FAULT_WORDS`), on the members' reports of an attempt (member -> (failed peer,
    agent_pb2.RingFault)) and the witnesses of earlier ones.

    Only a member's right neighbour receives its data (the stream's sender is the left
    neighbour's certificate), so a fault counts only when it names the reporter's left
    neighbour in `order`; the other members' reports only relay it. One witness is one
    member's word: it could be lying to get an honest neighbour struck. So an accused member
    is struck only once two different members witnessed a fault of it (in this job, of any
    kind); accused by one, it stays in the round (`can_retest`: an attempt is left and the ring
    has a third member) and the next ring puts another member to its right (`keep_apart`): a
    culprit sends that one bad data too and is struck, a framed member runs clean. Without a
    retest the accused leaves the round without a strike, as a node named failed does."""
    seen = {x: dict(w) for x, w in witnesses.items()}
    n = len(order)
    accused: dict[str, list[str]] = {}
    kinds: dict[str, set[int]] = {}
    for reporter, (peer, fault) in sorted(reports.items()):
        if fault not in FAULT_WORDS or reporter not in order or n < 2:
            continue
        if order[(order.index(reporter) - 1) % n] != peer or peer == reporter:
            continue
        seen.setdefault(peer, {})[reporter] = round_
        accused.setdefault(peer, []).append(reporter)
        kinds.setdefault(peer, set()).add(fault)
    struck: dict[str, str] = {}
    retest: list[str] = []
    for x in sorted(accused):
        w = seen[x]
        if len(w) >= 2:
            by = ", ".join(f"{a} (round {r})" for a, r in sorted(w.items()))
            why = " and ".join(FAULT_WORDS[k][0] for k in sorted(kinds[x]))
            struck[x] = f"{why}: refused by its right neighbours {by}"
        elif can_retest and n >= 3:
            retest.append(x)
    parts = [f"{x} {why}" for x, why in struck.items()] + [
        f"{x} is accused of "
        f"{' and '.join(FAULT_WORDS[k][1] for k in sorted(kinds[x]))} by "
        f"{', '.join(accused[x])} alone: retried with another member to its right"
        for x in retest
    ]
    return FaultVerdict(seen, struck, tuple(retest), "; ".join(parts))


def keep_apart(order: list[str], avoid: Mapping[str, Collection[str]]) -> list[str]:
    """`order` with every member `x` of `avoid` moved, where the ring allows, so that its right
    neighbour is none of `avoid[x]` (its earlier accusers: `fault_verdict`)."""
    n = len(order)
    if n < 3:
        return list(order)

    def broken(ring: list[str]) -> int:
        return sum(1 for i, x in enumerate(ring) if ring[(i + 1) % len(ring)] in avoid.get(x, ()))

    best = list(order)
    for x in order:
        if not avoid.get(x) or not broken(best):
            continue
        rest = [m for m in best if m != x]
        for j in range(len(rest)):
            cand = [*rest[:j], x, *rest[j:]]
            if broken(cand) < broken(best):
                best = cand
    return best
