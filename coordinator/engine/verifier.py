"""Verification of a parameter-server job's updates while it runs (issue 20; protocol in
docs/verification-protocol.md).

Per job, one `Verifier`:

1. At push: the update's chunk commitments must fit it (`epochmesh.verification`), else it is
   refused (INVALID_ARGUMENT, a strike). Whether this part is checked is drawn from the node's
   reputation (`coordinator.verification.reputation`) with the coordinator's secret randomness, only now
   that the update is in; a checked part gets a fresh secret seed in the PushUpdate response,
   and the coordinator keeps the sketch of the update under it.
2. CommitSketches: the node's per-chunk sketches must add up to its update's sketch (within
   the codec's tolerance): a node that sent something its chunks do not contain is caught here,
   at no compute.
3. Only then is the chunk to recompute drawn, and two nodes of two other donors (drawn by
   their verified history) recompute it from the round's starting parameters (CHECK tasks,
   ahead of their queues), with the program's random draws seeded as on the node (the task
   names it). Each sketch is compared with the node's and with the other checkers', within the
   tolerance measured for the pair of devices, and the quorum rule
   (coordinator/verification/quorum.py, acted on by coordinator/engine/recomputation.py)
   decides: checkers of distinct donors must agree with each other before any verdict (more
   checkers are drawn while they do not). A quorum that reproduces the node's chunk passes it;
   a quorum that agrees on another result accuses it: it is quarantined with the evidence, its
   updates since its last verified round are undone (the runner rolls back to the state before
   the first of them) and its reputation is reset. Checkers that contradicted the quorum get a
   strike. Recomputations that all disagree with each other declare the program
   nondeterministic: the job fails for its program's fault, nobody is struck and no pay is
   forfeited.

Local SGD parts (their chunks are runs of inner steps, docs/verification-protocol.md): the node
commits with its update the digest of the state (parameters and inner optimizer state) each
chunk started from; its chunk sketches are of parameter differences and add up unweighted. The
chunk drawn is answered in CommitSketchesResponse and the node uploads that chunk's start state
(PushUpdate kind "snapshot"): its digest must be the committed one, and its parameters must be
the round's parameters less the committed sketches of the chunks before it (else the node is
accused with check "snapshot"); the checker runs the chunk's steps from that state.

Ring members (docs/verification-protocol.md "Ring members"): the coordinator never
sees a member's update. The member commits its chunks with its report (ReportProgress), learns
in the answer whether the part is checked (and the seed), and sends its chunk sketches with the
sketch of its update; after the chunk is drawn it uploads the parameters the round started
from, which must hash to the checksum its ring agreed on for that version
(`coordinator.verification.snapshot_check.ring_start_problem`); the checker recomputes from them. A round in
which any member is checked is audited (`RingAudit`): one seed for the round, revealed to each
member in the answer to its report (every contribution is fixed in the all-reduce by then);
every member sends its sketches of what it sent and received in the reduce-scatter and of its
own contribution (`epochmesh.ring.evidence`), a checked member's contribution must sketch to
b_i / B times its update, and `judge` names a member that contradicts itself (quarantined,
check `ring_contribution`). A hop whose two ends disagree undoes the round without blaming
either; the two are kept apart in later rings, and a member that two different neighbours
disagree with is quarantined (check `ring_hops`). A local SGD member commits start digests as a
parameter-server local SGD node does, and uploads the drawn chunk's start state with the
round's start parameters beside it: those are checked against the ring's checksum first.

Screening (`coordinator.verification.screening`) of each round's updates runs at no compute before they are
applied: a flagged update is discarded (its samples return to pending) and the node's next part
is checked whatever its reputation.

A coordinator restart keeps what the checks established (job state ``verification``, written
after every change): each node's applied rounds that no check has vouched for yet, the nodes
this job accused (their held pay is never released), the forced checks, the ring members'
disputed hops and the figures of the ``job.verification`` event. The checks and ring audits
under way when it stopped cannot go on (their seeds and sketches were in memory): every node
with unverified rounds has its next part checked (and, in a ring, its round audited), whose
pass vouches for them and whose failure undoes them, across the restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from coordinator.core.errors import FailedPreconditionError, InvalidArgumentError
from coordinator.core.ids import new_task_id
from coordinator.engine.checker_selection import (
    checker_candidates,
    draw_checker,
    slice_runs,
)
from coordinator.engine.ports import JobPort, RingStatePort
from coordinator.engine.recomputation import (
    MAX_CHECKERS,
    Checker,
    PendingCheck,
    act,
    record_answer,
)
from coordinator.engine.ring_audits import RingAudit, RingAudits
from coordinator.engine.verification_store import StateWriter, read_stored
from coordinator.rounds.ring_verdicts import RingAttempt
from coordinator.rounds.round_state import Part, RoundState
from coordinator.rounds.sample_ranges import head_of_runs
from coordinator.verification.reputation import (
    CHECK_FRACTION,
    P_FLOOR,
    ReputationRecord,
    check_probability,
    checked_micro_batches,
    should_check,
)
from coordinator.verification.restart_state import StoredVerification
from coordinator.verification.screening import Screening, extend_history, per_step, screen
from coordinator.verification.snapshot_check import ring_start_problem, snapshot_problem
from epochmesh.ring.weights import weight_of
from epochmesh.sketch import combine, relative_distance, sketch
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import (
    PART_CHUNKS,
    SKETCH_BUCKETS,
    commitment_problem,
    consistency_tolerance,
    local_sgd_commitment_problem,
    split_round_start,
)
from epochmesh.wire.tensors import encode_bundle

log = logging.getLogger(__name__)
NS = common_pb2.NodeState

WATCH_EVERY_S = 0.25
# How long the job's end waits for the last checks.
SETTLE_MAX_S = 120.0


class Verifier:
    """The verification state of one job (see the module docstring)."""

    def __init__(
        self,
        runner: JobPort,
        rng: random.Random | None = None,
        *,
        ring_state: RingStatePort | None = None,
    ) -> None:
        """``ring_state``: the ring strategy's agreed state, for a ring job's audits and
        start-parameter checks (None in a parameter-server job)."""
        self.runner = runner
        # The least time a node has for its sketches (a ring member for its evidence), and a
        # checker for its recomputation (CoordinatorConfig).
        self.sketch_wait_s = runner.ctx.config.sketch_wait_s
        self.check_wait_s = runner.ctx.config.check_wait_s
        self.ring_state = ring_state
        spec = runner.spec
        self.ring = spec.aggregation == "ring"
        self.local_sgd = spec.sync == "local_sgd"
        # Twice the chunks, each checked by two checkers at once (`_start_checks`).
        self.verify_chunks = PART_CHUNKS
        self.rng = rng or random.SystemRandom()
        self._pending: dict[str, PendingCheck] = {}  # by TRAIN task id
        self._by_check_task: dict[str, str] = {}  # CHECK task id -> TRAIN task id
        self._unverified: dict[str, set[int]] = {}  # node -> rounds applied, not verified
        self._force: set[str] = set()  # nodes whose next part is checked (screening)
        self._accused: set[str] = set()  # nodes this job quarantined
        # node -> the first rounds of the failures being acted on (until their forfeit is done)
        self._condemning: dict[str, list[int]] = {}
        self._history: tuple[float, ...] = ()
        self._payloads: dict[int, tuple[common_pb2.TensorBundle, bytes]] = {}
        # The parameters the open round started from (kept for its checks' recomputation).
        self._round_payload: tuple[int, tuple[common_pb2.TensorBundle, bytes]] | None = None
        self._changed = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._closed_round = 0  # every applied round up to it is in _unverified or verified
        self._writer = StateWriter(runner, self.state)
        # Samples trained and recomputed, by the node's standing when its update came: "new"
        # (checked every round), "trusted" (at the floor probability), "building" (between):
        # the check overhead is recomputed / trained (a sample costs the same either way).
        self.trained: dict[str, int] = {"new": 0, "building": 0, "trusted": 0}
        self.recomputed: dict[str, int] = {"new": 0, "building": 0, "trusted": 0}
        self.verdicts: dict[str, int] = {
            "passed": 0,
            "failed": 0,
            "undecided": 0,
            "nondeterministic": 0,
        }
        # Ring audits (coordinator/engine/ring_audits.py): their verdicts come back here.
        self.audits = RingAudits(runner, self, evidence_wait_s=self.sketch_wait_s)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._watch is None:
            self._watch = asyncio.create_task(self._watchdog(), name=f"verify-{self.runner.job_id}")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
            self._watch = None
        await self._writer.written()

    # -- across a restart ------------------------------------------------------------------------

    def state(self) -> StoredVerification:
        """What a restarted coordinator must know (see the module docstring)."""
        unverified = {n: set(r) for n, r in self._unverified.items() if r}
        for pc in self._pending.values():
            unverified.setdefault(pc.node_id, set()).add(pc.round)
        return StoredVerification(
            as_of_round=self._closed_round,
            unverified=unverified,
            force=self._force | {pc.node_id for pc in self._pending.values()},
            accused=set(self._accused),
            trained=dict(self.trained),
            recomputed=dict(self.recomputed),
            verdicts=dict(self.verdicts),
            disputes={n: dict(p) for n, p in self.audits.disputes.items()},
        )

    def changed_state(self) -> None:
        """Store the state soon (one writer task; it writes the newest state when it runs)."""
        self._writer.changed()

    async def restore(self, kept_up_to: int) -> None:
        """After a coordinator restart, once the runner restored its state from the checkpoint
        after round ``kept_up_to`` (later rounds rolled back): the stored state, plus the
        applied parts of rounds recorded after it was written."""
        stored = await read_stored(self.runner, kept_up_to)
        if stored is None:
            return
        self._unverified = stored.unverified
        self.on_rolled_back(kept_up_to)
        self._closed_round = kept_up_to
        self._force = stored.force | {n for n, r in self._unverified.items() if r}
        self._accused = stored.accused
        self.audits.disputes = stored.disputes
        self.trained, self.recomputed, self.verdicts = (
            {k: getattr(stored, name).get(k, 0) for k in getattr(self, name)}
            for name in ("trained", "recomputed", "verdicts")
        )
        log.info(
            "job %s: verification state restored: %d node(s) with unverified rounds (from round "
            "%s), %d accused",
            self.runner.job_id,
            sum(1 for r in self._unverified.values() if r),
            self.first_unverified_round(),
            len(stored.accused),
        )
        self.changed_state()

    async def settle(self, max_s: float = SETTLE_MAX_S) -> None:
        """Wait until every pending check has its verdict (each has a deadline), at most
        ``max_s``."""
        end = time.monotonic() + max_s
        while self._pending and time.monotonic() < end and not self.runner.stopping:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=WATCH_EVERY_S * 4)
            except TimeoutError:
                pass

    @property
    def accused(self) -> frozenset[str]:
        """The nodes this job's checks quarantined."""
        return frozenset(self._accused)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def first_unverified_round(self) -> int | None:
        """The oldest applied round some node's update in it is not verified yet."""
        rounds = [min(r) for r in self._unverified.values() if r]
        rounds += [pc.round for pc in self._pending.values()]
        return min(rounds, default=None)

    # -- push ------------------------------------------------------------------------------------

    def commitment_problem(self, h: agent_pb2.UpdateHeader, part: Part | None) -> str:
        """Why an update's chunk commitments do not fit it ("")."""
        if self.local_sgd and part is None:
            return ""  # not an open part: the update is refused for that
        return self._chunks_problem(h.chunks, h.num_samples, h.mean_loss, part)

    def _chunks_problem(
        self,
        chunks: Sequence[agent_pb2.ChunkCommitment],
        num_samples: int,
        mean_loss: float,
        part: Part | None,
    ) -> str:
        if self.local_sgd:
            assert part is not None
            return local_sgd_commitment_problem(
                [(c.samples, c.loss, c.start_digest) for c in chunks],
                num_samples,
                mean_loss,
                part.assigned or part.samples,
                part.local_batch,
                self.verify_chunks,
            )
        return commitment_problem(
            [(c.samples, c.loss) for c in chunks], num_samples, mean_loss, self.verify_chunks
        )

    async def on_update(
        self, h: agent_pb2.UpdateHeader, grads: Mapping[str, torch.Tensor], part: Part | None
    ) -> agent_pb2.CheckSpec | None:
        """The update of an open part was taken: draw whether it is checked, and if so its
        seed (for the PushUpdate response)."""
        if part is None or not h.chunks:
            return None
        standing = self._draw(h.node_id, h.num_samples)
        if standing is None:
            return None
        version = h.params_version
        if self._round_payload is not None and self._round_payload[0] == version:
            self._payloads[version] = self._round_payload[1]
        seed = self.rng.getrandbits(63)
        update_sketch = await asyncio.to_thread(sketch, grads, seed, SKETCH_BUCKETS)
        if h.node_id in self._accused:  # caught meanwhile: its update is discarded anyway
            return None
        wait = self._sketch_wait()
        self._pending[h.task_id] = PendingCheck(
            node_id=h.node_id,
            task_id=h.task_id,
            round=h.round,
            version=version,
            ranges=part.ranges.copy(),
            chunks=[(c.samples, c.loss) for c in h.chunks],
            codec=self.runner.spec.compression or "none",
            seed=seed,
            buckets=SKETCH_BUCKETS,
            update_sketch=update_sketch,
            deadline=time.monotonic() + wait,
            standing=standing,
            digests=[c.start_digest for c in h.chunks] if self.local_sgd else [],
            local_batch=part.local_batch,
        )
        self.changed_state()
        return agent_pb2.CheckSpec(seed=seed, buckets=SKETCH_BUCKETS)

    def _draw(self, node_id: str, samples: int) -> str | None:
        """Count ``samples`` trained by ``node_id`` and draw whether its part is checked (with
        the coordinator's secret randomness, after the part's update is fixed): its standing
        ("new", "building", "trusted") if so, else None."""
        forced = node_id in self._force
        standing, record = self._standing(node_id)
        self.trained[standing] += samples
        if not (forced or should_check(record, self.rng)):
            return None
        self._force.discard(node_id)
        return standing

    def _standing(self, node_id: str) -> tuple[str, ReputationRecord]:
        """The node's standing ("new", "building", "trusted") and its reputation record."""
        record = self.runner.ctx.registry.reputation(node_id)
        p = check_probability(record)
        return ("new" if p >= 1.0 else "trusted" if p <= P_FLOOR else "building"), record

    def ring_commitment_problem(self, req: agent_pb2.ReportProgressRequest, part: Part) -> str:
        """Why a ring member's successful report's chunk commitments do not fit it ("")."""
        return self._chunks_problem(req.chunks, req.samples_done, req.mean_loss, part)

    def on_ring_report(
        self,
        req: agent_pb2.ReportProgressRequest,
        part: Part,
        rs: RoundState,
        attempt: RingAttempt,
    ) -> tuple[agent_pb2.CheckSpec | None, agent_pb2.CheckSpec | None]:
        """A ring member's successful report of its part of ``rs`` in ``attempt`` was taken:
        (its check's seed, the round audit's seed), each None when not drawn. Whose parts are
        checked is drawn for every member at the first report of the attempt, and the attempt
        is audited when any is: one seed, handed to each member only with its own report."""
        if not req.chunks:
            return None, None
        key = (rs.round, attempt.number)
        if key not in self.audits.audits:
            # A time-boxed member's samples are counted at its own report (what it trained).
            draws = {
                m: self._draw(m, 0 if attempt.weighted else rs.parts[m].samples)
                for m in attempt.order
                if m in rs.parts
            }
            audit = None
            if any(d is not None for d in draws.values()):
                audit = RingAudit(
                    round=rs.round,
                    attempt=attempt.number,
                    order=list(attempt.order),
                    codec=self._ring_state().ring_codec(),
                    seed=self.rng.getrandbits(63),
                    buckets=SKETCH_BUCKETS,
                    scales={
                        m: rs.parts[m].local_batch / attempt.total
                        for m in attempt.order
                        if m in rs.parts
                    },
                    weighted=attempt.weighted,
                    gateway=attempt.gateway,
                    external=attempt.external_sum,
                    draws=draws,
                    deadline=time.monotonic() + self._sketch_wait(),
                )
            self.audits.add(key, audit)
        if attempt.weighted:
            self.trained[self._standing(req.node_id)[0]] += req.samples_done
        audit = self.audits.audits[key]
        if audit is None or req.node_id not in audit.scales:
            return None, None
        if attempt.weighted:  # its weight: the samples it trained (the ring strategy checked it)
            audit.scales[req.node_id] = weight_of(req.samples_done, attempt.total)
        self.audits.audit_of[req.task_id] = key
        spec = agent_pb2.CheckSpec(seed=audit.seed, buckets=audit.buckets)
        standing = audit.draws.get(req.node_id)
        if standing is None or req.node_id in self._accused:
            return None, spec
        self._pending[req.task_id] = PendingCheck(
            node_id=req.node_id,
            task_id=req.task_id,
            round=rs.round,
            version=rs.version,
            ranges=(
                head_of_runs(part.ranges, req.samples_done)  # a time-boxed member's prefix
                if attempt.weighted and 0 < req.samples_done < part.samples
                else part.ranges.copy()
            ),
            chunks=[(c.samples, c.loss) for c in req.chunks],
            codec="none",  # the member sketches its update itself: no wire codec between
            seed=audit.seed,
            buckets=audit.buckets,
            update_sketch=None,
            deadline=time.monotonic() + self._sketch_wait(),
            standing=standing,
            digests=[c.start_digest for c in req.chunks] if self.local_sgd else [],
            local_batch=part.local_batch,
        )
        self.changed_state()
        return spec, spec

    def _ring_state(self) -> RingStatePort:
        assert self.ring_state is not None, "a ring job's verifier is given the ring's state"
        return self.ring_state

    def _sketch_wait(self) -> float:
        return max(self.sketch_wait_s, 3.0 * self.runner.round_seconds())

    # -- sketches --------------------------------------------------------------------------------

    async def on_sketches(
        self, req: agent_pb2.CommitSketchesRequest
    ) -> agent_pb2.CommitSketchesResponse:
        """The node's chunk sketches (a ring member's also its evidence of an audited round);
        the answer names the chunk whose start state a local SGD node or a ring member uploads
        next."""
        if req.HasField("ring"):
            await self.audits.on_evidence(req)
            if req.task_id not in self._pending:  # none wanted, or judged meanwhile
                return agent_pb2.CommitSketchesResponse()
        pc = self._pending.get(req.task_id)
        if pc is None or pc.node_id != req.node_id or pc.state != "sketches":
            raise FailedPreconditionError(
                f"no sketches are awaited for task {req.task_id!r} of node {req.node_id}"
            )
        k = len(pc.chunks)
        problem = ""
        if req.seed != pc.seed:
            problem = f"sketches under seed {req.seed}, the seed sent was {pc.seed}"
        elif len(req.sketches) != k * pc.buckets:
            problem = (
                f"{len(req.sketches)} sketch values; {k} chunks x {pc.buckets} buckets "
                f"= {k * pc.buckets} expected"
            )
        elif len(req.update_sketch) != (pc.buckets if pc.update_sketch is None else 0):
            problem = (
                f"an update sketch of {len(req.update_sketch)} values; "
                + ("a ring member sends its own" if pc.update_sketch is None else "none")
                + " is expected"
            )
        else:
            # Through numpy: a repeated field straight into a buffer (torch.tensor of a list
            # goes value by value, 15x slower).
            values = torch.from_numpy(np.asarray(req.sketches, dtype=np.float64))
            own = torch.from_numpy(np.asarray(req.update_sketch, dtype=np.float64))
            if not bool(torch.isfinite(values).all()) or not bool(torch.isfinite(own).all()):
                problem = "the sketches hold NaN or Inf"
        if problem:
            await self.failed(
                pc, f"its sketch commitment is malformed: {problem}", {}, accuse=False
            )
            raise InvalidArgumentError(f"sketches refused: {problem}")
        pc.chunk_sketches = values.reshape(k, pc.buckets)
        update_sketch = own if pc.update_sketch is None else pc.update_sketch
        pc.update_sketch = update_sketch
        total = sum(n for n, _ in pc.chunks)
        combined = combine(
            [
                (1.0 if pc.digests else n / total, pc.chunk_sketches[i])
                for i, (n, _) in enumerate(pc.chunks)
            ]
        )
        tolerance = consistency_tolerance(pc.codec)
        distance = relative_distance(combined, update_sketch)
        if tolerance is not None and not distance <= tolerance:
            await self.failed(
                pc,
                f"its update is not the sum of its committed chunks (relative distance "
                f"{distance:.3g} > {tolerance:g} allowed for codec {pc.codec})",
                {
                    "check": "consistency",
                    "distance": f"{distance:.6g}",
                    "tolerance": f"{tolerance:g}",
                },
                accuse=True,
            )
            return agent_pb2.CommitSketchesResponse()
        pc.chunk = checked_micro_batches(k, CHECK_FRACTION, self.rng)[0]
        if pc.digests or self.ring:  # a ring job's members and externals alike
            pc.state = "snapshot"
            pc.deadline = time.monotonic() + self._sketch_wait()
            self._changed.set()
            return agent_pb2.CommitSketchesResponse(snapshot_wanted=True, snapshot_chunk=pc.chunk)
        pc.state = "checking"
        await self._start_checks(pc)
        return agent_pb2.CommitSketchesResponse()

    async def on_snapshot(
        self,
        h: agent_pb2.UpdateHeader,
        tensors: Mapping[str, torch.Tensor],
        payload: tuple[common_pb2.TensorBundle, bytes],
    ) -> None:
        """A local SGD node's upload of the start state of its chunk drawn: it must be what it
        committed (digest) and where its committed chunks before it lead from the round's
        parameters (sketches); then the chunk goes to a checker with it. In a ring job the
        upload carries the round's parameters too (`_agreed_start`; a synchronous part's upload
        is only them)."""
        pc = self._pending.get(h.task_id)
        if pc is None or pc.node_id != h.node_id or pc.state != "snapshot":
            raise FailedPreconditionError(
                f"no start state is awaited for task {h.task_id!r} of node {h.node_id}"
            )
        if h.snapshot_chunk != pc.chunk:
            raise InvalidArgumentError(
                f"the start state of chunk {h.snapshot_chunk} was sent; chunk {pc.chunk} was drawn"
            )
        if not pc.digests:
            if await self._agreed_start(pc, tensors):
                pc.state = "checking"
                await self._start_checks(pc)
            return
        if self.ring:  # the round's start parameters came with the chunk's start state
            tensors, start = split_round_start(tensors)
            if not await self._agreed_start(pc, start):
                return
            payload = await asyncio.to_thread(encode_bundle, tensors)
        round_payload = self._payloads.get(pc.version)
        if round_payload is None:
            await self.inconclusive(pc, f"the parameters of version {pc.version} are gone")
            return
        assert pc.chunk_sketches is not None
        problem, evidence = await asyncio.to_thread(
            snapshot_problem,
            tensors,
            pc.digests[pc.chunk],
            round_payload,
            pc.chunk_sketches[: pc.chunk],
            pc.seed,
            pc.buckets,
        )
        if problem:
            await self.failed(
                pc,
                f"the start state of its chunk {pc.chunk} {problem}",
                {"check": "snapshot", "chunk": str(pc.chunk), **evidence},
                accuse=True,
            )
            return
        pc.snapshot = payload
        pc.state = "checking"
        await self._start_checks(pc)

    async def _agreed_start(self, pc: PendingCheck, tensors: Mapping[str, torch.Tensor]) -> bool:
        """A ring job's upload of the parameters a checked part started from ("param/<name>"):
        they must be the ones its ring agreed on (kept for the checker's recomputation, or the
        local SGD start state's check). False when the check ended here (failed: they are
        not; undecided: the ring's checksum is gone) or was settled meanwhile."""
        agreed = await self._ring_state().agreed_params_checksum(pc.version)
        if agreed is None:
            await self.inconclusive(pc, f"the ring's checksum of version {pc.version} is gone")
            return False
        expected = self.runner.ps.expected()
        problem, evidence, params = await asyncio.to_thread(
            ring_start_problem, tensors, expected, agreed
        )
        if problem:
            await self.failed(
                pc,
                f"the parameters it says its round {pc.round} started from {problem}",
                {"check": "snapshot", **evidence},
                accuse=True,
            )
            return False
        if self._settled(pc):
            return False
        self._payloads[pc.version] = await asyncio.to_thread(encode_bundle, params)
        return True

    # -- recomputation ---------------------------------------------------------------------------

    async def _start_checks(self, pc: PendingCheck) -> None:
        """The chunk drawn goes to two checkers of two other donors at once (where there are
        two): a verdict needs a quorum of checkers of distinct donors that agree with each
        other (coordinator/engine/recomputation.py), and a second checker sent only after the
        first answered would cost another round. Parts are cut into twice the chunks, so that
        two checkers recompute as many samples as one did."""
        if await self.add_checker(pc) and not self._settled(pc):
            await self.add_checker(pc)
        if not pc.checkers and not self._settled(pc):
            await act(self.runner, self, pc)  # nobody to check: undecided

    async def add_checker(self, pc: PendingCheck) -> bool:
        """Hand the chosen chunk to one more checker (a new donor, drawn by verified history);
        False when none can be drawn."""
        if len(pc.tried) >= MAX_CHECKERS:
            return False
        candidates = checker_candidates(
            self.runner, pc.node_id, [c.node_id for c in pc.checkers], pc.tried
        )
        if not candidates:
            return False
        node = draw_checker(self.runner, candidates, self.rng)
        start = int(sum(n for n, _ in pc.chunks[: pc.chunk]))
        end = start + int(pc.chunks[pc.chunk][0])
        runs = slice_runs(pc.ranges, start, end)
        task_id = new_task_id("c-")
        task = self.runner.check_task(
            task_id,
            pc.round,
            pc.version,
            runs,
            agent_pb2.CheckSpec(seed=pc.seed, buckets=pc.buckets),
            pc.snapshot if pc.digests else self._payloads.get(pc.version),
            local_batch=pc.local_batch if pc.digests else 0,
        )
        task.checked_node_id = pc.node_id  # its id seeds the program's draws, as on the node
        wait = max(self.check_wait_s, 4.0 * self.runner.round_seconds())
        pc.checkers.append(Checker(node, task_id, time.monotonic() + wait))
        pc.tried.add(node)
        self._by_check_task[task_id] = pc.task_id
        self.recomputed[pc.standing] += end - start
        self.runner.host.enqueue(node, task, self.runner.job_id)
        return True

    def is_check_task(self, node_id: str, task_id: str) -> bool:
        pc = self._pending.get(self._by_check_task.get(task_id, ""))
        if pc is None:
            return False
        return any(
            c.task_id == task_id and c.node_id == node_id and c.agrees is None for c in pc.checkers
        )

    def open_task_ids(self) -> set[str]:
        return set(self._by_check_task)

    async def on_check_report(self, req: agent_pb2.ReportCheckRequest) -> None:
        pc = self._pending.get(self._by_check_task.get(req.task_id, ""))
        checker = None
        if pc is not None:
            checker = next(
                (c for c in pc.checkers if c.task_id == req.task_id and c.node_id == req.node_id),
                None,
            )
        if pc is None or checker is None or checker.agrees is not None:
            raise FailedPreconditionError(
                f"task {req.task_id!r} is not an open check of node {req.node_id}"
            )
        self._by_check_task.pop(req.task_id, None)
        if req.failed:
            log.info(
                "job %s: checker %s could not recompute %s's round %d: %s",
                self.runner.job_id,
                req.node_id,
                pc.node_id,
                pc.round,
                req.error,
            )
            pc.checkers.remove(checker)
            await act(self.runner, self, pc)
            return
        if len(req.sketch) != pc.buckets or not all(math.isfinite(x) for x in req.sketch):
            pc.checkers.remove(checker)
            await act(self.runner, self, pc)
            raise InvalidArgumentError(
                f"check report refused: a sketch of {len(req.sketch)} finite values is expected "
                f"({pc.buckets})"
            )
        record_answer(self.runner, pc, checker, list(req.sketch), req.loss)
        await act(self.runner, self, pc)

    # -- verdicts --------------------------------------------------------------------------------

    def _forget(self, pc: PendingCheck) -> None:
        self._pending.pop(pc.task_id, None)
        for c in pc.checkers:
            self._by_check_task.pop(c.task_id, None)
        still = {p.version for p in self._pending.values()}
        for v in [v for v in self._payloads if v not in still]:
            del self._payloads[v]
        self._changed.set()

    def _settled(self, pc: PendingCheck) -> bool:
        """Whether ``pc`` already has its verdict (or was dropped: its node failed another
        check meanwhile)."""
        return self._pending.get(pc.task_id) is not pc

    async def passed(self, pc: PendingCheck) -> None:
        if self._settled(pc):
            return
        self._forget(pc)
        self.verdicts["passed"] += 1
        self.changed_state()
        # Verified: the node's rounds up to this one, but any whose own check still runs.
        running = {p.round for p in self._pending.values() if p.node_id == pc.node_id}
        rounds = self._unverified.get(pc.node_id)
        if rounds:
            for r in [r for r in rounds if r <= pc.round and r not in running]:
                rounds.discard(r)
        # Pay is released up to the round checked, short of any earlier round of the node
        # whose check still runs (a failure there forfeits what is held from it on) and of a
        # failure being acted on (its forfeit is on its way). Decided now, before anything is
        # awaited: a verdict that comes meanwhile must find this pay still held.
        up_to = min(
            [pc.round]
            + [p.round - 1 for p in self._pending.values() if p.node_id == pc.node_id]
            + [first - 1 for first in self._condemning.get(pc.node_id, [])]
        )
        await self.runner.ctx.registry.record_check(pc.node_id, pc.round, True)
        await self.runner.release_pay(pc.node_id, up_to)
        log.info(
            "job %s: %s's round %d verified (chunk %d recomputed by %s)",
            self.runner.job_id,
            pc.node_id,
            pc.round,
            pc.chunk,
            ", ".join(c.node_id for c in pc.checkers),
        )

    async def inconclusive(self, pc: PendingCheck, why: str) -> None:
        if self._settled(pc):
            return
        self._forget(pc)
        self.verdicts["undecided"] += 1
        self.changed_state()
        log.warning(
            "job %s: the check of %s's round %d is undecided: %s",
            self.runner.job_id,
            pc.node_id,
            pc.round,
            why,
        )
        await self.runner.ctx.events.append(
            "node.check_undecided",
            node_id=pc.node_id,
            job_id=self.runner.job_id,
            message=f"the check of its round {pc.round} is undecided: {why}",
            attrs={"round": str(pc.round)},
        )

    async def nondeterministic(
        self, pc: PendingCheck, reason: str, evidence: Mapping[str, str]
    ) -> None:
        """The recomputations of ``pc``'s chunk all disagree: the job's program computes
        different results from the same input. Its fault, not a donor's: nobody is struck,
        the node's held pay is released, the submitter is told (an event, and the job fails
        with the reason at its next round)."""
        if self._settled(pc):
            return
        self._forget(pc)
        self.verdicts["nondeterministic"] += 1
        self.changed_state()
        message = (
            f"its program is nondeterministic: round {pc.round}'s chunk {pc.chunk} of "
            f"{pc.node_id} was computed differently by every node that ran it ({reason}); a "
            "program must compute the same result from the same input and seed (random draws "
            "are seeded per chunk; avoid uninitialised tensors and nondeterministic kernels)"
        )
        log.warning("job %s: %s", self.runner.job_id, message)
        await self.runner.ctx.events.append(
            "job.nondeterministic",
            job_id=self.runner.job_id,
            message=message,
            attrs={"node": pc.node_id, **evidence},
        )
        await self.runner.release_pay(pc.node_id, pc.round)
        if not self.runner.node_set.job_fault_verdict:
            self.runner.node_set.job_fault_verdict = message

    async def failed(
        self, pc: PendingCheck, reason: str, evidence: Mapping[str, str], *, accuse: bool
    ) -> None:
        """The node's update of ``pc.round`` is wrong (``accuse``: proven, quarantine) or
        could not be verified: either way its unverified rounds are undone."""
        if self._settled(pc):
            return
        self._forget(pc)
        await self.condemn(pc.node_id, pc.round, reason, evidence, accuse=accuse)

    async def condemn(
        self, node: str, round_id: int, reason: str, evidence: Mapping[str, str], *, accuse: bool
    ) -> None:
        """``node``'s work of round ``round_id`` is wrong (``accuse``: proven, quarantine) or
        could not be verified: either way its unverified rounds are undone."""
        if accuse:
            self._accused.add(node)
        self.verdicts["failed"] += 1
        for other in [p for p in self._pending.values() if p.node_id == node]:
            self._forget(other)
        # Its applied updates that no check has passed since (rounds a rollback undid are gone
        # from the set), and the update of the round checked: it may be applied by now, or be
        # being applied (the round's apply runs in a thread and had taken it already), however
        # early it was caught; undoing that round costs one round when it was not.
        rounds = self._unverified.pop(node, set()) | {round_id}
        first = min(rounds)
        self.changed_state()
        attrs = {"round": str(round_id), **evidence}
        # Until its forfeit is done, no check of the node that passes meanwhile releases the
        # pay held from ``first`` on (`passed`).
        self._condemning.setdefault(node, []).append(first)
        try:
            if accuse:
                text = f"failed verification in job {self.runner.job_id}: {reason}"
                await self.runner.ctx.registry.record_check(node, round_id, False, text)
                await self.runner.ctx.registry.quarantine(
                    node, text, attrs, job_id=self.runner.job_id
                )
            await self.runner.on_verification_failed(node, first, reason, accuse=accuse)
        finally:
            acting = self._condemning[node]
            acting.remove(first)
            if not acting:
                del self._condemning[node]

    async def _missed(
        self, pc: PendingCheck, verbs: tuple[str, str], what: str, check: str, strike: str
    ) -> None:
        """The node did not send ``what`` in time: its unverified updates are undone, and a
        node still online gets a strike (``verbs``: how the reason says it, gone / online)."""
        gone = not self.runner.ctx.registry.is_alive(pc.node_id)
        why = verbs[0] if gone else verbs[1]
        await self.failed(pc, f"it {why} {what}", {"check": check}, accuse=False)
        if not gone:
            await self.runner.ctx.registry.add_strike(pc.node_id, strike, job_id=self.runner.job_id)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            try:
                await self.audits.overdue(now)
            except Exception:
                log.exception("job %s: ring audits failed", self.runner.job_id)
            for pc in list(self._pending.values()):
                if pc.task_id not in self._pending:
                    continue
                try:
                    if pc.state == "sketches" and now > pc.deadline:
                        await self._missed(
                            pc,
                            ("went offline before", "did not send"),
                            f"the sketches of its round {pc.round} (seed sent)",
                            "sketches_missing",
                            f"no sketch commitment for round {pc.round} within "
                            f"{self._sketch_wait():.3g}s of its update",
                        )
                    elif pc.state == "snapshot" and now > pc.deadline:
                        await self._missed(
                            pc,
                            ("went offline before it uploaded", "did not upload"),
                            f"the start state of its chunk {pc.chunk} of round {pc.round} "
                            "(drawn for a check)",
                            "snapshot_missing",
                            f"no start state of its checked chunk for round {pc.round}",
                        )
                    elif pc.state == "checking":
                        late = [c for c in pc.checkers if c.agrees is None and now > c.deadline]
                        for c in late:
                            log.info(
                                "job %s: checker %s did not answer for %s's round %d in time:"
                                " dropped, no strike (another may be drawn)",
                                self.runner.job_id,
                                c.node_id,
                                pc.node_id,
                                pc.round,
                            )
                            pc.checkers.remove(c)
                            self._by_check_task.pop(c.task_id, None)
                        if late:
                            await act(self.runner, self, pc)
                except Exception:
                    log.exception(
                        "job %s: verification of %s failed", self.runner.job_id, pc.node_id
                    )
                    self._forget(pc)

    # -- rounds ----------------------------------------------------------------------------------

    def screen(self, received: list[Part]) -> list[tuple[Part, str]]:
        """Screen a round's received updates before they are applied; returns the flagged
        ones with the reason. A flagged node's next part is checked whatever its record. The
        update itself is applied: on real training (small parts, a model near convergence)
        honest updates fall outside the bands now and then (seen: norm ratios from 0.01 to
        800 in the two-tenant and fault-tolerance tests), so screening alone never discards
        or accuses; a recomputation decides."""
        if len(received) < 3:
            return []
        parts = [
            (p.samples, per_step(p.grads or {}, p.inner_steps) if self.local_sgd else p.grads or {})
            for p in received
        ]
        result: Screening = screen(parts, history=self._history)
        self._history = extend_history(self._history, result)
        flagged = []
        for p, figures in zip(received, result.nodes, strict=True):
            if figures.suspicious:
                self._force.add(p.node_id)
                flagged.append((p, figures.reason))
        if flagged:
            self.changed_state()
        return flagged

    def round_started(
        self, version: int, payload: tuple[common_pb2.TensorBundle, bytes] | None
    ) -> None:
        """A round starts from parameters ``version`` (encoded: ``payload``)."""
        self._round_payload = None if payload is None else (version, payload)

    def checks_on(self, node_id: str) -> bool:
        """Whether the node has a check of this job to run (it may pull older parameters)."""
        return any(
            c.node_id == node_id and c.agrees is None
            for pc in self._pending.values()
            for c in pc.checkers
        )

    def on_round_closed(self, rs: RoundState) -> None:
        for p in rs.parts.values():
            if p.status == "applied":
                self._unverified.setdefault(p.node_id, set()).add(rs.round)
        self._closed_round = max(self._closed_round, rs.round)
        self.changed_state()

    @property
    def ring_disputes(self) -> dict[str, set[str]]:
        """Ring members -> the right neighbours they must not get (disputed hops)."""
        return self.audits.disputed_partners()

    def ring_attempt_applied(self, round_id: int, attempt: int) -> None:
        """Ring round ``round_id`` was applied as its attempt ``attempt`` computed it (see
        `RingAudits.attempt_applied`)."""
        self.audits.attempt_applied(round_id, attempt)

    def on_rolled_back(self, after_round: int) -> None:
        """Rounds after ``after_round`` were undone: nothing of them is left to verify for the
        job (the checks still running keep judging their nodes)."""
        for rounds in self._unverified.values():
            for r in [r for r in rounds if r > after_round]:
                rounds.discard(r)
        self._closed_round = min(self._closed_round, after_round)
        self.changed_state()

    def summary(self) -> dict[str, str]:
        """The job's verification figures (the ``job.verification`` event's attributes):
        samples trained and recomputed by standing, the overhead, the verdicts."""
        out = {}
        for standing in ("new", "building", "trusted"):
            trained, recomputed = self.trained[standing], self.recomputed[standing]
            out[f"trained_{standing}"] = str(trained)
            out[f"recomputed_{standing}"] = str(recomputed)
            out[f"overhead_{standing}"] = f"{recomputed / trained:.4f}" if trained else ""
        out.update({k: str(v) for k, v in self.verdicts.items()})
        return out

    def payload(self, version: int) -> tuple[common_pb2.TensorBundle, bytes] | None:
        """The parameters of an older version kept for a check's recomputation."""
        return self._payloads.get(version)
