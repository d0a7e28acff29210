"""What a job's verification must keep across a coordinator restart (job state
``verification``; coordinator/engine/verifier.py writes it after every change): pure, its JSON form
apart from the store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class StoredVerification:
    """A job's verification state as stored."""

    as_of_round: int  # every applied round up to it is in `unverified` or verified
    unverified: dict[str, set[int]] = field(default_factory=dict)  # node -> applied rounds
    force: set[str] = field(default_factory=set)  # nodes whose next part is checked
    accused: set[str] = field(default_factory=set)  # nodes this job quarantined
    # The job.verification figures: samples trained / recomputed by standing, verdicts.
    trained: dict[str, int] = field(default_factory=dict)
    recomputed: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    # Ring members' disputed hops: node -> {the other end: the round}.
    disputes: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "as_of_round": self.as_of_round,
                "unverified": {n: sorted(r) for n, r in sorted(self.unverified.items()) if r},
                "force": sorted(self.force),
                "accused": sorted(self.accused),
                "trained": dict(self.trained),
                "recomputed": dict(self.recomputed),
                "verdicts": dict(self.verdicts),
                "disputes": {n: dict(sorted(p.items())) for n, p in sorted(self.disputes.items())},
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StoredVerification:
        """The state ``to_bytes`` wrote (one written before ring disputes were kept has none);
        ValueError when it cannot be read."""
        try:
            state = json.loads(raw.decode())
            return cls(
                as_of_round=int(state["as_of_round"]),
                unverified={
                    str(n): {int(r) for r in rounds} for n, rounds in state["unverified"].items()
                },
                force={str(n) for n in state["force"]},
                accused={str(n) for n in state["accused"]},
                trained=_counts(state["trained"]),
                recomputed=_counts(state["recomputed"]),
                verdicts=_counts(state["verdicts"]),
                disputes={
                    str(n): {str(m): int(r) for m, r in partners.items()}
                    for n, partners in state.get("disputes", {}).items()
                },
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"stored verification state unreadable ({e})") from e


def _counts(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise TypeError(f"counts are {type(raw).__name__}, not an object")
    return {str(k): int(v) for k, v in raw.items()}
