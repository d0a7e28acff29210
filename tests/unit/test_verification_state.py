"""coordinator.verification.restart_state: a job's verification state survives its stored form (a
coordinator restart reads it back), ring members' disputed hops included; a state written
before disputes were kept still reads; a damaged one is refused with a reason (pure)."""

from __future__ import annotations

import json

import pytest

from coordinator.verification.restart_state import StoredVerification

pytestmark = pytest.mark.timeout(30)


def a_state() -> StoredVerification:
    return StoredVerification(
        as_of_round=12,
        unverified={"n-a": {9, 11, 10}, "n-b": set()},
        force={"n-c"},
        accused={"n-x"},
        trained={"new": 480, "building": 96, "trusted": 0},
        recomputed={"new": 40, "building": 8, "trusted": 0},
        verdicts={"passed": 7, "failed": 1, "undecided": 0},
        disputes={"n-a": {"n-d": 8}, "n-d": {"n-a": 8, "n-e": 11}},
    )


def test_the_state_reads_back_as_written() -> None:
    state = a_state()
    back = StoredVerification.from_bytes(state.to_bytes())
    assert back.unverified == {"n-a": {9, 10, 11}}  # a node with none left is not written
    state.unverified.pop("n-b")
    assert back == state
    assert back.disputes["n-d"] == {"n-a": 8, "n-e": 11}


def test_a_state_from_before_disputes_were_kept_reads_with_none() -> None:
    raw = json.loads(a_state().to_bytes())
    del raw["disputes"]
    back = StoredVerification.from_bytes(json.dumps(raw).encode())
    assert back.disputes == {}
    assert back.accused == {"n-x"}


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("as_of_round"),
        lambda s: s.update(unverified={"n-a": ["nine"]}),
        lambda s: s.update(trained=[1, 2]),
        lambda s: s.update(disputes={"n-a": {"n-d": "r8"}}),
    ],
)
def test_a_damaged_state_is_refused_with_a_reason(damage) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(a_state().to_bytes())
    damage(raw)
    with pytest.raises(ValueError, match="stored verification state unreadable"):
        StoredVerification.from_bytes(json.dumps(raw).encode())
    with pytest.raises(ValueError, match="unreadable"):
        StoredVerification.from_bytes(b"\xff not json")
