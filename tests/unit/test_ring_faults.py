"""Who is struck for bad data sent into a ring, NaN/Inf or a tampered all-gather segment
(coordinator.rounds.ring_verdicts.fault_verdict), and how the next ring puts another witness next to an
accused member (keep_apart)."""

from __future__ import annotations

import copy

import pytest

from coordinator.rounds.ring_verdicts import fault_verdict, keep_apart
from epochmesh.v1 import agent_pb2

pytestmark = pytest.mark.timeout(10)

NF = agent_pb2.RING_FAULT_NON_FINITE
TA = agent_pb2.RING_FAULT_TAMPERED
NONE = agent_pb2.RING_FAULT_UNSPECIFIED
ORDER = ["a", "b", "c", "d"]  # b's left is a, c's left is b, a's left is d


@pytest.mark.parametrize(
    ("reports", "earlier", "can_retest", "struck", "retest"),
    [
        # b refused a's data: one witness, a stays for a retest; the relays count for nothing.
        ({"b": ("a", NF), "c": ("a", NONE), "a": ("a", NONE)}, {}, True, (), ("a",)),
        # The same with no attempt left (or no third member): no strike, no retest.
        ({"b": ("a", NF)}, {}, False, (), ()),
        # A second witness (another right neighbour, earlier): struck.
        ({"c": ("b", NF)}, {"b": {"a": 1}}, True, ("b",), ()),
        # The same witness again is still one word: retested, not struck.
        ({"c": ("b", NF)}, {"b": {"c": 1}}, True, (), ("b",)),
        # An accusation of a member that is not the reporter's left neighbour never counts.
        ({"b": ("c", NF), "d": ("a", NF)}, {"c": {"a": 1}, "a": {"c": 2}}, True, (), ()),
        # A fault reported without the kind (a relay, a stall) is no accusation.
        ({"b": ("a", NONE)}, {"a": {"c": 1}}, True, (), ()),
        # An unknown kind (a newer agent's) accuses nobody either.
        ({"b": ("a", 99)}, {"a": {"c": 1}}, True, (), ()),
    ],
)
def test_fault_verdict(
    reports: dict[str, tuple[str, int]],
    earlier: dict[str, dict[str, int]],
    can_retest: bool,
    struck: tuple[str, ...],
    retest: tuple[str, ...],
) -> None:
    before = copy.deepcopy(earlier)
    verdict = fault_verdict(ORDER, reports, earlier, 7, can_retest)
    assert tuple(verdict.struck) == struck, verdict
    assert verdict.retest == retest, verdict
    for n in struck:
        assert "fed NaN or Inf" in verdict.struck[n] and "round 7" in verdict.struck[n]
    for n in retest:
        assert verdict.witnesses[n] and n in verdict.reason
    assert earlier == before  # not modified in place


def test_witnesses_accumulate_over_attempts() -> None:
    first = fault_verdict(ORDER, {"b": ("a", NF)}, {}, 3, True)
    assert first.retest == ("a",) and not first.struck
    order = keep_apart(["a", "b", "c", "d"], first.witnesses)
    right = order[(order.index("a") + 1) % len(order)]
    assert right != "b" and sorted(order) == ORDER
    second = fault_verdict(order, {right: ("a", NF)}, first.witnesses, 3, True)
    assert tuple(second.struck) == ("a",)
    assert "b (round 3)" in second.struck["a"] and f"{right} (round 3)" in second.struck["a"]


@pytest.mark.parametrize(
    ("reports", "earlier", "struck", "retest"),
    [
        # b found a's forwarded segment tampered: one witness, a is retested.
        ({"b": ("a", TA), "c": ("a", NONE)}, {}, (), ("a",)),
        # c found b's tampered before: d's second word strikes c.
        ({"d": ("c", TA)}, {"c": {"b": 2}}, ("c",), ()),
        # A witness of NaN earlier and one of tampering now are two witnesses of bad data.
        ({"c": ("b", TA)}, {"b": {"a": 1}}, ("b",), ()),
        # Tampering named by a member that is not the accused's right neighbour never counts.
        ({"c": ("a", TA)}, {"a": {"b": 1}}, (), ()),
    ],
)
def test_tampering_verdict(
    reports: dict[str, tuple[str, int]],
    earlier: dict[str, dict[str, int]],
    struck: tuple[str, ...],
    retest: tuple[str, ...],
) -> None:
    verdict = fault_verdict(ORDER, reports, earlier, 7, True)
    assert tuple(verdict.struck) == struck, verdict
    assert verdict.retest == retest, verdict
    for n in struck:
        assert "forwarded tampered data" in verdict.struck[n], verdict.struck[n]
        assert "round 7" in verdict.struck[n]
    for n in retest:
        assert f"{n} is accused of forwarding tampered data by" in verdict.reason
        assert "alone: retried with another member to its right" in verdict.reason


@pytest.mark.parametrize(
    ("order", "avoid"),
    [
        (["a", "b", "c"], {"a": {"b"}}),
        (["a", "b", "c", "d", "e"], {"a": {"b", "c"}, "c": {"d"}}),
        (["x", "a", "b"], {"b": {"x"}}),
    ],
)
def test_keep_apart(order: list[str], avoid: dict[str, set[str]]) -> None:
    out = keep_apart(order, avoid)
    assert sorted(out) == sorted(order)
    n = len(out)
    assert all(out[(i + 1) % n] not in avoid.get(x, ()) for i, x in enumerate(out)), out


def test_keep_apart_leaves_rings_it_cannot_help() -> None:
    assert keep_apart(["a", "b"], {"a": {"b"}}) == ["a", "b"]
    assert keep_apart(["a", "b", "c"], {}) == ["a", "b", "c"]
    # Both others accused a: nothing satisfies it, the ring stays whole.
    assert sorted(keep_apart(["a", "b", "c"], {"a": {"b", "c"}})) == ["a", "b", "c"]
