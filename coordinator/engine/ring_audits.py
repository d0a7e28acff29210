"""Ring audits of a job's verification: each audited ring attempt's evidence, and its judgement.

A ring round in which any member is checked is audited (coordinator/engine/verifier.py, "Ring
members"): every member sends its sketches of what it sent and received in the reduce-scatter
and of its own contribution (`epochmesh.ring.evidence`); once all of it is in, `judge` names a
member that contradicts itself, and a hop whose two ends disagree undoes the round without
blaming either (the two are kept apart in later rings; a member that neighbours of two donors
other than its own disagree with is quarantined). `RingAudits` keeps the audits and the
disputed hops; its verdicts go to the job's `Verifier` through `AuditVerdicts`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from coordinator.core.errors import FailedPreconditionError, InvalidArgumentError
from coordinator.engine.ports import JobPort
from epochmesh.ring.evidence import RingEvidence, judge
from epochmesh.ring.weights import tail_sketch
from epochmesh.sketch import sketch
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import decode_bundle

log = logging.getLogger(__name__)

# Ring audits (round, attempt) remembered at most (older ones are dropped unjudged).
AUDITS_KEPT = 16


@dataclass
class RingAudit:
    """One audited ring round attempt: its members' evidence of the all-reduce, under one
    seed (see the module docstring)."""

    round: int
    attempt: int
    order: list[str]
    codec: str
    seed: int
    buckets: int
    scales: dict[str, float]  # member -> b_i / B (weighted: samples trained / samples handed out)
    weighted: bool  # a time-boxed attempt: contributions end in their weight's tail
    gateway: str
    external: tuple[common_pb2.TensorBundle, bytes] | None
    draws: dict[str, str | None]  # member -> its standing when its part is checked, else None
    deadline: float
    evidence: dict[str, RingEvidence] = field(default_factory=dict)
    updates: dict[str, torch.Tensor] = field(default_factory=dict)  # checked members' sketches
    applied: bool = False  # its attempt is the one the round applied


class AuditVerdicts(Protocol):
    """What the audits ask of the job's `Verifier`, which owns the verdicts (strikes aside):
    the audits call it, it holds them (`RingAudits` never imports the verifier)."""

    @property
    def accused(self) -> frozenset[str]:
        """The nodes this job's checks quarantined (read before accusing a node again)."""
        ...

    async def condemn(
        self, node: str, round_id: int, reason: str, evidence: Mapping[str, str], *, accuse: bool
    ) -> None:
        """``node``'s work of round ``round_id`` is wrong (``accuse``: proven, quarantine) or
        could not be verified: either way its unverified rounds are undone."""
        ...

    def changed_state(self) -> None:
        """Store the verification state soon (the disputed hops changed)."""
        ...


class RingAudits:
    """The ring audits of one job (see the module docstring)."""

    def __init__(self, runner: JobPort, verdicts: AuditVerdicts, evidence_wait_s: float) -> None:
        """``evidence_wait_s``: the least time a member has for its evidence (as said in the
        strike of a member that sent none)."""
        self.runner = runner
        self.verdicts = verdicts
        self.evidence_wait_s = evidence_wait_s
        # Ring audits by (round, attempt): None where the draw audited nothing. Members' TRAIN
        # tasks -> their audit; disputed hops: node -> {the other end: round}.
        self.audits: dict[tuple[int, int], RingAudit | None] = {}
        self.audit_of: dict[str, tuple[int, int]] = {}
        self.disputes: dict[str, dict[str, int]] = {}

    def add(self, key: tuple[int, int], audit: RingAudit | None) -> None:
        """The draw of attempt ``key`` (round, attempt) was made: ``audit``, or None when it
        audits nothing; only the newest AUDITS_KEPT are kept."""
        self.audits[key] = audit
        for old in sorted(self.audits)[:-AUDITS_KEPT]:
            self.drop(old)

    def drop(self, key: tuple[int, int]) -> None:
        audit = self.audits.pop(key, None)
        if audit is not None:
            for task_id in [t for t, k in self.audit_of.items() if k == key]:
                del self.audit_of[task_id]

    def disputed_partners(self) -> dict[str, set[str]]:
        """Ring members -> the right neighbours they must not get (disputed hops)."""
        return {n: set(partners) for n, partners in self.disputes.items()}

    async def on_evidence(self, req: agent_pb2.CommitSketchesRequest) -> None:
        """A member's evidence of an audited round (and, for a checked member, the sketch of
        its update): judged once every member's is in."""
        key = self.audit_of.get(req.task_id)
        audit = self.audits.get(key) if key is not None else None
        if (
            key is None
            or audit is None
            or req.node_id not in audit.scales
            or req.node_id in audit.evidence
        ):
            raise FailedPreconditionError(
                f"no ring evidence is awaited for task {req.task_id!r} of node {req.node_id}"
            )
        ring = req.ring
        if ring.seed != audit.seed or ring.buckets != audit.buckets:
            problem = (
                f"ring evidence under seed {ring.seed} / {ring.buckets} buckets; the round's is "
                f"{audit.seed} / {audit.buckets}"
            )
        else:
            try:
                evidence = RingEvidence.from_flat(
                    [ring.sent, ring.received, ring.own, ring.result],
                    len(audit.order),
                    audit.buckets,
                )
                problem = ""
            except ValueError as exc:
                problem = str(exc)
        if problem:
            self.drop(key)  # it cannot be judged: the round is undone instead
            self.runner.undo_from(audit.round, f"{req.node_id}: malformed ring evidence")
            raise InvalidArgumentError(f"ring evidence refused: {problem}")
        audit.evidence[req.node_id] = evidence
        if len(req.update_sketch) == audit.buckets and audit.draws.get(req.node_id) is not None:
            audit.updates[req.node_id] = torch.tensor(list(req.update_sketch), dtype=torch.float64)
        if len(audit.evidence) == len(audit.scales):
            self.drop(key)
            await self._judge(audit)

    async def _judge(self, audit: RingAudit) -> None:
        """Every member's evidence is in: judge it (`epochmesh.ring.evidence.judge`), checked
        members' contributions against their update sketches, and act on the verdict."""
        expected: dict[str, torch.Tensor] = {}
        external = None
        sent = audit.external
        if sent is not None and audit.gateway:
            external = await asyncio.to_thread(
                lambda: sketch(decode_bundle(*sent), audit.seed, audit.buckets)
            )
        offsets: dict[str, torch.Tensor] = {}
        tail = await self._weight_tail(audit) if audit.updates else None
        for m, update in audit.updates.items():
            expected[m] = audit.scales[m] * update
            if m == audit.gateway and external is not None:
                expected[m] = expected[m] + external
            if tail is not None:
                offsets[m] = audit.scales[m] * tail
        verdict = await asyncio.to_thread(
            judge, audit.order, audit.codec, audit.evidence, expected, offsets
        )
        if verdict.clean:
            log.info(
                "job %s: ring round %d (attempt %d) audited: %d members agree",
                self.runner.job_id,
                audit.round,
                audit.attempt,
                len(audit.order),
            )
            return
        for node, why in verdict.liars.items():
            await self.verdicts.condemn(
                node,
                audit.round,
                f"its contribution to ring round {audit.round}: {why}",
                {"check": "ring_contribution", "seed": str(audit.seed), "why": why[:300]},
                accuse=True,
            )
        for sender, receiver, why in verdict.hops:
            await self._disputed_hop(audit, sender, receiver, why)

    async def _weight_tail(self, audit: RingAudit) -> torch.Tensor | None:
        """A weighted attempt: the sketch of a weight of 1's tail in its members' buffers
        (epochmesh.ring.weights), else None."""
        if not audit.weighted:
            return None
        sizes = {name: t.numel() for name, t in self.runner.ps.params.items()}
        return await asyncio.to_thread(
            tail_sketch, sizes, len(audit.order), audit.seed, audit.buckets
        )

    async def _disputed_hop(self, audit: RingAudit, sender: str, receiver: str, why: str) -> None:
        """``sender`` and ``receiver`` disagree on what passed between them: one of them lies.
        The round is undone; the two are kept apart from now on, and a member that neighbours
        of two donors other than its own disagree with is quarantined (two neighbours of one
        donor, which could be one Sybil's two nodes, count as one)."""
        reason = f"ring round {audit.round}: {why}"
        self.runner.undo_from(audit.round, reason)
        await self.runner.ctx.events.append(
            "round.disputed",
            job_id=self.runner.job_id,
            message=f"{reason}; the round is undone, the two are kept apart"[:1024],
            attrs={"round": str(audit.round), "sender": sender, "receiver": receiver},
        )
        for a, b in ((sender, receiver), (receiver, sender)):
            self.disputes.setdefault(a, {})[b] = audit.round
        self.verdicts.changed_state()
        registry = self.runner.ctx.registry
        for node in (sender, receiver):
            partners = self.disputes.get(node, {})
            # A node without a donor is its own (checker_selection.donor's rule).
            donors = {registry.donor_of(p) or p for p in partners} - {
                registry.donor_of(node) or node
            }
            if len(donors) >= 2 and node not in self.verdicts.accused:
                await self.verdicts.condemn(
                    node,
                    audit.round,
                    f"{len(partners)} ring neighbours ({', '.join(sorted(partners))}) disagree "
                    "with what it says passed between them",
                    {
                        "check": "ring_hops",
                        "neighbours": ",".join(sorted(partners)),
                        "rounds": ",".join(str(r) for r in sorted(set(partners.values()))),
                    },
                    accuse=True,
                )

    async def overdue(self, now: float) -> None:
        """Audits past their deadline: one whose round was not applied (its attempt failed)
        is dropped; else every member that sent no evidence has its rounds undone and, while
        online, a strike."""
        for key, audit in list(self.audits.items()):
            if audit is None or now <= audit.deadline:
                continue
            self.drop(key)
            if not audit.applied:
                continue
            for node in [m for m in audit.order if m not in audit.evidence]:
                gone = not self.runner.ctx.registry.is_alive(node)
                why = "went offline before it sent" if gone else "did not send"
                await self.verdicts.condemn(
                    node,
                    audit.round,
                    f"it {why} its evidence of ring round {audit.round} (seed sent)",
                    {"check": "ring_evidence_missing"},
                    accuse=False,
                )
                if not gone:
                    await self.runner.ctx.registry.add_strike(
                        node,
                        f"no evidence of audited ring round {audit.round} within "
                        f"{self.evidence_wait_s:g}s of its report",
                        job_id=self.runner.job_id,
                    )

    def attempt_applied(self, round_id: int, attempt: int) -> None:
        """Ring round ``round_id`` was applied as its attempt ``attempt`` computed it: that
        attempt's audit waits for every member's evidence; the round's failed attempts' audits
        are dropped (their members may never have been told the seed)."""
        for key, audit in list(self.audits.items()):
            if audit is not None and audit.round == round_id:
                if audit.attempt == attempt:
                    audit.applied = True
                else:
                    self.drop(key)
