"""A checked part's recomputations: the pending check's record, and acting on the quorum rule.

The job's `Verifier` (coordinator/engine/verifier.py) keeps one `PendingCheck` per checked
part and hands its drawn chunk to checkers of other donors. Each answer is compared here with
the node's committed chunk and with the other checkers' answers (`compare`), and the pure rule
`coordinator.verification.quorum.decide` says what they decide; `act` carries the decision out
through the verifier's `CheckOutcomes`: a pass, an accusation with its evidence, one more
checker, a wait, an undecided check, or a program declared nondeterministic (the job's fault:
no donor struck, no pay forfeited, the submitter told). Checkers that contradicted the
deciding quorum get a strike (never a quarantine).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from coordinator.engine.checker_selection import checker_candidates, device_kind, donor
from coordinator.engine.ports import JobPort
from coordinator.verification.quorum import Decision, Recomputation, Verdict, decide, pair
from epochmesh.sketch import relative_distance
from epochmesh.v1 import common_pb2
from epochmesh.verification import loss_matches, recompute_tolerance

log = logging.getLogger(__name__)

# A checker that fails or does not answer is replaced; at most this many checkers per check.
MAX_CHECKERS = 4


@dataclass
class Checker:
    node_id: str
    task_id: str
    deadline: float
    distance: float = math.nan  # to the node's committed chunk
    loss: float = math.nan
    agrees: bool | None = None  # with the node; None: not answered
    sketch: torch.Tensor | None = None  # its recomputation's sketch (compared with the others')


@dataclass
class PendingCheck:
    """One checked part, from its update to the verdict."""

    node_id: str
    task_id: str  # the TRAIN task
    round: int
    version: int
    ranges: np.ndarray  # the part's sample runs
    chunks: list[tuple[int, float]]  # committed (samples, loss) per chunk
    codec: str
    seed: int
    buckets: int
    update_sketch: torch.Tensor | None  # None: a ring member's, sent with its sketches
    deadline: float  # for the sketches
    state: str = "sketches"  # sketches | snapshot (local SGD) | checking
    chunk_sketches: torch.Tensor | None = None
    chunk: int = -1
    # Local SGD: the committed start digest of each chunk, the part's samples per step, and
    # the uploaded start state of the chunk drawn (encoded, for the checker's task).
    digests: list[bytes] = field(default_factory=list)
    local_batch: int = 0
    snapshot: tuple[common_pb2.TensorBundle, bytes] | None = None
    checkers: list[Checker] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    standing: str = "new"  # the node's standing when its part was drawn (see Verifier.samples)


class CheckOutcomes(Protocol):
    """What `act` asks of the job's `Verifier`, which owns the checks and their verdicts (this
    module never imports the verifier)."""

    async def passed(self, pc: PendingCheck) -> None:
        """The node's chunk was reproduced: its rounds up to ``pc.round`` are verified."""
        ...

    async def failed(
        self, pc: PendingCheck, reason: str, evidence: Mapping[str, str], *, accuse: bool
    ) -> None:
        """The node's update is wrong (``accuse``: proven, quarantine)."""
        ...

    async def inconclusive(self, pc: PendingCheck, why: str) -> None:
        """No verdict: nobody is blamed."""
        ...

    async def add_checker(self, pc: PendingCheck) -> bool:
        """Hand the chunk to one more checker of a new donor; False when none can be drawn."""
        ...

    async def nondeterministic(
        self, pc: PendingCheck, reason: str, evidence: Mapping[str, str]
    ) -> None:
        """The job's program computes different results from the same input."""
        ...


def tolerance(runner: JobPort, pc: PendingCheck, a: str, b: str) -> float:
    """The relative distance allowed between two computations of ``pc``'s chunk on nodes
    ``a`` and ``b`` (their device kinds; a local SGD chunk's inner steps)."""
    registry = runner.ctx.registry
    return recompute_tolerance(
        device_kind(registry, a), device_kind(registry, b), local_sgd=bool(pc.digests)
    )


def record_answer(
    runner: JobPort, pc: PendingCheck, checker: Checker, values: list[float], loss: float
) -> None:
    """A checker's recomputation: its sketch and loss, and whether they agree with the
    node's committed chunk."""
    assert pc.chunk_sketches is not None
    theirs = torch.tensor(values, dtype=torch.float64)
    allowed = tolerance(runner, pc, pc.node_id, checker.node_id)
    checker.sketch = theirs
    checker.distance = relative_distance(theirs, pc.chunk_sketches[pc.chunk])
    checker.loss = loss
    checker.agrees = checker.distance <= allowed and loss_matches(
        pc.chunks[pc.chunk][1], loss, allowed
    )


def compare(runner: JobPort, pc: PendingCheck) -> tuple[list[Recomputation], set[frozenset[str]]]:
    """The answered checkers as the quorum rule reads them, and the pairs of them whose
    recomputations agree (sketch and loss within the tolerance of their devices)."""
    registry = runner.ctx.registry
    answered = [c for c in pc.checkers if c.agrees is not None and c.sketch is not None]
    answers = [
        Recomputation(c.node_id, donor(registry, c.node_id), bool(c.agrees)) for c in answered
    ]
    agreeing: set[frozenset[str]] = set()
    for i, a in enumerate(answered):
        for b in answered[i + 1 :]:
            assert a.sketch is not None and b.sketch is not None
            allowed = tolerance(runner, pc, a.node_id, b.node_id)
            if relative_distance(a.sketch, b.sketch) <= allowed and loss_matches(
                a.loss, b.loss, allowed
            ):
                agreeing.add(pair(a.node_id, b.node_id))
    return answers, agreeing


def more_possible(runner: JobPort, pc: PendingCheck) -> bool:
    """Whether one more checker of a new donor can be drawn for ``pc``."""
    if len(pc.tried) >= MAX_CHECKERS:
        return False
    return bool(checker_candidates(runner, pc.node_id, [c.node_id for c in pc.checkers], pc.tried))


def judge(runner: JobPort, pc: PendingCheck) -> Decision:
    """The quorum rule on ``pc``'s checkers as they stand."""
    answers, agreeing = compare(runner, pc)
    return decide(
        donor(runner.ctx.registry, pc.node_id),
        answers,
        agreeing,
        working=sum(1 for c in pc.checkers if c.agrees is None),
        more_possible=more_possible(runner, pc),
    )


def evidence(runner: JobPort, pc: PendingCheck, decision: Decision) -> dict[str, str]:
    """The recomputations behind ``decision``: the deciding checkers first."""
    answered = [c for c in pc.checkers if c.agrees is not None]
    first = [c for c in answered if c.node_id in decision.quorum]
    ordered = first + [c for c in answered if c not in first]
    lead = ordered[0].node_id if ordered else pc.node_id
    out = {
        "check": "recomputation",
        "round": str(pc.round),
        "chunk": str(pc.chunk),
        "seed": str(pc.seed),
        "tolerance": f"{tolerance(runner, pc, pc.node_id, lead):.3g}",
        "committed_loss": f"{pc.chunks[pc.chunk][1]:.9g}",
        "verdict": decision.verdict.value,
    }
    for i, c in enumerate(ordered):
        out[f"checker{i + 1}"] = c.node_id
        out[f"distance{i + 1}"] = f"{c.distance:.6g}"
        out[f"loss{i + 1}"] = f"{c.loss:.9g}"
    return out


async def act(runner: JobPort, outcomes: CheckOutcomes, pc: PendingCheck) -> None:
    """Decide on ``pc`` (`judge`) and carry the decision out (see the module docstring)."""
    for _ in range(MAX_CHECKERS + 1):
        decision = judge(runner, pc)
        log.log(
            # "wait": a checker answered and the other is still working, every check once
            logging.DEBUG if decision.verdict is Verdict.WAIT else logging.INFO,
            "job %s: check of %s's round %d: %s (%s)",
            runner.job_id,
            pc.node_id,
            pc.round,
            decision.verdict.value,
            decision.reason,
        )
        for node in decision.struck:
            checker = next(c for c in pc.checkers if c.node_id == node)
            await runner.ctx.registry.add_strike(
                node,
                f"its recomputation of a chunk of {pc.node_id}'s round {pc.round} (distance "
                f"{checker.distance:.3g}) contradicted the checkers of other donors who agreed "
                f"({', '.join(decision.quorum)})",
                job_id=runner.job_id,
            )
        verdict = decision.verdict
        if verdict is Verdict.PASS:
            await outcomes.passed(pc)
        elif verdict is Verdict.ACCUSE:
            answered = [c for c in pc.checkers if c.node_id in decision.quorum]
            await outcomes.failed(
                pc,
                f"its chunk {pc.chunk} of round {pc.round} was recomputed by "
                + " and ".join(c.node_id for c in answered)
                + " (relative distances "
                + ", ".join(f"{c.distance:.3g}" for c in answered)
                + f"), who agree with each other: {decision.reason}",
                evidence(runner, pc, decision),
                accuse=True,
            )
        elif verdict is Verdict.NONDETERMINISTIC:
            await outcomes.nondeterministic(pc, decision.reason, evidence(runner, pc, decision))
        elif verdict is Verdict.UNDECIDED:
            await outcomes.inconclusive(pc, decision.reason)
        elif verdict is Verdict.MORE:
            if not await outcomes.add_checker(pc):
                continue  # none could be drawn after all: decide without
        return
    await outcomes.inconclusive(pc, "no checker could be drawn")
