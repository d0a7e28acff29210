"""Ring rounds (aggregation = "ring") on the coordinator: `RingRounds` is the round strategy
of a `JobRunner` whose rounds aggregate between the agents instead of on the parameter server. The protocol
(members and externals, ring order, versions, retries, checkpoints pushed by a member,
restarts): docs/ring-rounds.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping

import torch

from coordinator.core.ids import new_task_id
from coordinator.engine.ports import JobPort
from coordinator.engine.strategies.ring_externals import external_sum
from coordinator.engine.strategies.ring_links import (
    largest_rtt_s,
    member_links,
    ring_link_bandwidth,
    slowest_bandwidth,
)
from coordinator.engine.strategies.ring_state import (
    PushedState,
    StatePush,
    StateTransfers,
    check_pushed_state,
)
from coordinator.rounds.ring_verdicts import (
    DEAD,
    Agreement,
    ChecksumVerdict,
    FaultVerdict,
    RingAttempt,
    checksum_verdict,
    fault_verdict,
    keep_apart,
    report_problem,
    state_key,
)
from coordinator.rounds.round_state import MAX_DEADLINE_EXTENSIONS, Part, RoundState
from coordinator.rounds.sample_ranges import head_of_runs
from epochmesh.errors import CodecError
from epochmesh.ring.schedule import RING_CODECS, ring_order, step_deadline_s
from epochmesh.ring.seal import ring_seal_digest
from epochmesh.ring.weights import RING_FEATURE_WEIGHTED
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import params_checksum

log = logging.getLogger(__name__)

# A round is formed at most this many times (the first attempt and two retries).
MAX_ATTEMPTS = 3
# Least per-step deadline: a neighbour's stall on a loaded host (GC, scheduling) is not death;
# a dead neighbour is found faster anyway (its stream breaks, or it falls silent).
STEP_DEADLINE_FLOOR_S = 3.0
# Round numbers handed out are persisted as a high-water mark this far ahead (one store write per
# this many rounds): agents key ring attempts by (job, round, attempt) and refuse old ones, so a
# restarted coordinator must not number a round as one that was in flight before.
ROUND_MARK_STEP = 64
ROUND_MARK_KEY = "ring_round_mark"


# The revocation list handed to ring members is read from the store at most this often.
REVOKED_REFRESH_S = 1.0


class RingRounds:
    """`coordinator.engine.strategy.Aggregation` for aggregation = "ring" (docs/ring-rounds.md)."""

    # Records and checkpoints (of a state a member pushes) are written in line.
    writes_in_background = False
    # Set round by round (`_weighted_ring`: weights by samples trained, epochmesh.ring.weights).
    time_boxing = False

    def __init__(self, runner: JobPort) -> None:
        self.runner = runner
        self.ring_version = 0
        self.holds: dict[str, int] = {}  # member -> the version it holds (last good report)
        self.attempt: RingAttempt | None = None
        self.push = StatePush()  # the state a member pushes after a round
        self._loaded_round = -1  # the round whose pushed state the ParameterServer holds
        # A state push was due (checkpoint, epoch end) and did not arrive: ask every round.
        self._state_overdue = False
        self._round_mark = 0  # round numbers below this one may have been handed out
        # Culprits of a failed attempt (node -> when): they sit out the following rounds for
        # one silence limit, long enough for a dead one to be found silent.
        self._suspects: dict[str, float] = {}
        # Measured agent -> agent links: (reporter, peer) -> (rtt_s, bandwidth bytes/s).
        self.links: dict[tuple[str, str], tuple[float, float]] = {}
        # The last round ran on nodes the scheduler had given away, to keep the state first.
        self._kept_state_round = False
        # Members whose checksums disagreed after a retry with no majority (nobody to blame):
        # no round runs on them alone until one with another member agrees (`cannot_run`).
        self._disputed: frozenset[str] = frozenset()
        self._dispute = ""
        # The checksums its rings agreed on, and who may fetch the state from whom.
        self.transfers = StateTransfers()
        # Revoked node ids handed to the members with their tasks, and when they were read.
        self._revoked: list[str] = []
        self._revoked_at = -math.inf
        # Members reported for sending bad data (NaN/Inf, a tampered all-gather segment):
        # accused -> {the right neighbour that refused its data: round} (`fault_verdict`).
        self._witnesses: dict[str, dict[str, int]] = {}

    # -- versions and state ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.ring_version

    @property
    def state_stale(self) -> bool:
        """The ParameterServer holds an older state than the ring's (normal between
        checkpoints: it can then serve neither checkpoints nor version v to a joiner)."""
        return self.runner.ps.version != self.ring_version

    async def restored(self, resumed: bool) -> None:
        """Versions go one further than in PS mode (the round in flight when the coordinator
        stopped made version newest+1 on its members, unrecorded), and round numbers continue
        past every one handed out (the persisted mark)."""
        if resumed:
            self.runner.ps.version += 1
            self.runner.job.params_version = self.runner.ps.version
            await self.runner.ctx.store.update_job(self.runner.job)
        raw = await self.runner.ctx.store.get_job_state(self.runner.job_id, ROUND_MARK_KEY)
        self._round_mark = int(raw.decode()) if raw else 0
        self.runner.next_round = max(self.runner.next_round, self._round_mark)
        self.ring_version = self.runner.ps.version
        self.holds.clear()

    async def _mark_round(self, round_id: int) -> None:
        if round_id >= self._round_mark:
            self._round_mark = round_id + ROUND_MARK_STEP
            await self.runner.ctx.store.put_job_state(
                self.runner.job_id, ROUND_MARK_KEY, str(self._round_mark).encode()
            )

    def may_checkpoint(self, last_round: int) -> bool:
        if self.state_stale:
            self._state_overdue = True
            log.warning(
                "job %s: no checkpoint after round %d: the coordinator holds version %d, the "
                "ring %d (the state is asked for again next round)",
                self.runner.job_id,
                last_round,
                self.runner.ps.version,
                self.ring_version,
            )
            return False
        return True

    def want_checkpoint(self, rs: RoundState) -> bool:
        # The round asked for the state (K rounds, epoch end, or an overdue one) and got it.
        return self._loaded_round == rs.round

    async def may_finish(self) -> bool:
        if self.state_stale:
            await self._rollback(
                f"the ring's final state (version {self.ring_version}) never reached the "
                "coordinator"
            )
            return False
        return True

    async def _rollback(self, reason: str) -> None:
        """Back to the last checkpoint, as after a coordinator restart: later rounds are rolled
        back (their samples pending again) and the version jumps past every one handed out."""
        await self.runner.ctx.events.append(
            "job.rolled_back",
            job_id=self.runner.job_id,
            message=f"{reason}: resuming from the last checkpoint",
        )
        log.warning("job %s: %s: rolling back to the last checkpoint", self.runner.job_id, reason)
        await self.runner.restore()
        rates = self.runner.planner.estimator.rates(
            [n for n in self.runner.nodes if n in self.runner.planner.estimator]
        )
        for n in self.runner.nodes:
            if n in self.runner.ledger.nodes or n not in rates:
                continue
            if self.runner.ledger.nodes:
                self.runner.ledger.add_node(n, rates[n])
            else:
                self.runner.ledger.assign_segments({n: rates[n]})

    async def hold_over(self) -> list[str]:
        """When the scheduler takes every live member that holds the ring's version away from
        the job while the coordinator holds an older one, those nodes run one more round first
        (at most one in a row), whose rank-0 member pushes the state: it is checkpointed before
        they leave (else it would leave with them)."""
        keep = [] if self._kept_state_round else self._nodes_keeping_state()
        self._kept_state_round = bool(keep)
        if keep:
            self._state_overdue = True  # push_state in this round
            log.info(
                "job %s: the scheduler takes the holders of version %d away; one more round "
                "on %s to keep the state first",
                self.runner.job_id,
                self.ring_version,
                ",".join(keep),
            )
        return keep

    def _nodes_keeping_state(self) -> list[str]:
        """The job's live nodes, when the scheduler's plan keeps none of the members that hold
        the ring's newest state and the coordinator's copy is older; else []."""
        if not self.state_stale or self.runner.ledger.complete:
            return []
        live = [
            n
            for n in self.runner.nodes
            if not self.runner.node_set.is_excluded(n)
            and self.runner.ctx.registry.is_alive(n)
            and not self.runner.host.is_silent(n)
        ]
        holders = [
            n for n in live if self._peer_address(n) and self.holds.get(n) == self.ring_version
        ]
        if not holders or len(live) < max(1, self.runner.spec.min_nodes):
            return []
        kept = set(self.runner.host.planned_nodes(self.runner.job_id))
        return [] if kept & set(holders) else live

    def _peer_address(self, node_id: str) -> str:
        info = self.runner.ctx.registry.get(node_id)
        return info.peer_address if info is not None else ""

    def _seal_digest(self, order: list[str]) -> str:
        """The digest the attempt's members seal the all-gather with: one all of them check."""
        infos = [self.runner.ctx.registry.get(n) for n in order]
        return ring_seal_digest(
            list(info.ring_seal_digests) if info is not None else [] for info in infos
        )

    def _weighted_ring(self, nodes: list[str]) -> bool:
        """Whether a round on ``nodes`` may be time-boxed: all of them members whose agents
        declared weighted contributions (an external node's update is summed in by the
        gateway at a weight fixed before the round)."""
        infos = [self.runner.ctx.registry.get(n) for n in nodes]
        return bool(infos) and all(
            i is not None and i.peer_address and RING_FEATURE_WEIGHTED in i.ring_features
            for i in infos
        )

    def cannot_run(self, nodes: list[str]) -> str:
        members = {n for n in nodes if self._peer_address(n)}
        if members and self._disputed and members <= self._disputed:
            return (
                f"waiting for a ring member other than {', '.join(sorted(self._disputed))}: "
                f"{self._dispute}; a member outside them decides by majority"
            )
        if members:
            return ""
        return (
            f"waiting for a ring member: aggregation is 'ring' and none of the {len(nodes)} "
            "node(s) runs a PeerService (agents started with --no-peer take part only through "
            "a member)"
        )

    def _holder(self, version: int, among: list[str], besides: str) -> str:
        """A member of ``among`` that holds ``version`` (not ``besides``), or ""."""
        for n in among:
            if n != besides and self.holds.get(n) == version:
                return n
        return ""

    # -- measurements -----------------------------------------------------------------------------

    def _numel(self) -> int:
        return sum(p.numel() for p in self.runner.ps.params.values())

    def ring_codec(self) -> str:
        codec = self.runner.spec.compression or "none"
        return codec if codec in RING_CODECS else "none"

    # -- a round --------------------------------------------------------------------------------

    async def run_round(self, nodes: list[str]) -> None:
        if self.runner.ledger.complete:
            await self.runner.next_epoch()
            return
        nodes = await self._without_suspects(nodes)
        if not nodes:
            return
        members = [n for n in nodes if self._peer_address(n)]
        v = self.ring_version
        if not self._holder(v, members, "") and self.state_stale:
            await self._rollback(f"no live ring member holds version {v}")
            return
        self.runner.planner.time_boxing = self._weighted_ring(nodes)
        round_id, parts, compute_deadline = self.runner.plan_parts(nodes)
        if not any(self._peer_address(n) for n in parts):
            # The end of an epoch gave the last samples to external nodes only: plan again
            # with the members alone (a ring round needs one).
            self.runner.ledger.abort_round(round_id)
            round_id, parts, compute_deadline = self.runner.plan_parts(members)
        await self._mark_round(round_id)
        for p in parts.values():
            p.member = bool(self._peer_address(p.node_id))
            p.required = True
        rs = RoundState(
            round=round_id,
            epoch=self.runner.ledger.epoch,
            version=v,
            deadline_s=compute_deadline,
            parts=parts,
        )
        self.runner.round_state = rs
        self.push.pushed = None
        push_state = (
            self._state_overdue
            or self.runner.ledger.pending_count
            == 0  # the epoch (maybe the job) ends with this round
            # A lone member would be the only holder of the new state: keep a copy here.
            or sum(1 for p in parts.values() if p.member) == 1
            or (
                self.runner.spec.checkpoint_every > 0
                and (self.runner.rounds_applied + 1) % self.runner.spec.checkpoint_every == 0
            )
        )
        await self._refresh_revoked()
        outcome = "failed"
        retried_tie = False
        verdict: ChecksumVerdict | None = None
        for number in range(MAX_ATTEMPTS):
            survivors = [p for p in parts.values() if p.status not in DEAD]
            if not any(p.member for p in survivors):
                outcome = "no members"
                break
            if not self._start_attempt(rs, number, survivors, push_state, compute_deadline):
                outcome = "no state"
                break
            await self.runner.notify()
            outcome = await self._wait_attempt(rs)
            note = ""
            if outcome == "ok":
                checksums = self._checksums(rs)
                verdict = checksum_verdict(checksums, retried_tie)
                if verdict.agreement is Agreement.FAIL:
                    outcome = "disputed" if self._room_beside(checksums) else "diverged"
                    break
                if (
                    verdict.agreement in (Agreement.AGREED, Agreement.EJECT)
                    and not checksums.keys() <= self._disputed
                ):
                    self._disputed, self._dispute = frozenset(), ""  # a majority has spoken
                if verdict.agreement is not Agreement.AGREED:
                    outcome = "failed"
                    note = verdict.reason
                    if verdict.agreement is Agreement.RETRY:
                        retried_tie = True
                    else:
                        await self._eject(rs, verdict)
            if outcome != "failed":
                break
            last = number == MAX_ATTEMPTS - 1
            faults = await self._judge_faults(rs, can_retest=not last)
            note = "; ".join(x for x in (note, faults.reason) if x)
            await self._retire_culprits(rs, last=last, note=note, keep=faults.retest)
        rs.closed = True
        rs.waited_s = time.monotonic() - rs.started
        if outcome == "ok":
            await self._succeed(rs)
            return
        if outcome == "diverged":
            assert verdict is not None
            await self._diverged(rs, verdict)
            return
        disputed = self._checksums(rs) if outcome == "disputed" else {}
        self.runner.ledger.abort_round(round_id)
        self.runner.round_state = None
        self.attempt = None
        if outcome == "stopped":
            return
        if outcome == "no state":
            await self._rollback(f"no live ring member holds version {v}")
        elif outcome == "disputed":
            assert verdict is not None
            await self._disputed_round(rs, verdict, disputed)
        else:
            await self.runner.ctx.events.append(
                "round.aborted",
                job_id=self.runner.job_id,
                message=(
                    f"round {round_id} aborted after {rs.attempts} attempt(s) ({outcome}); its "
                    f"samples are pending again in epoch {rs.epoch + 1}"
                ),
                attrs={"round": str(round_id), "attempts": str(rs.attempts)},
            )
        self.runner.host.round_finished(self.runner.job_id, self.runner.benchmark_task_ids())
        await self.runner.notify()

    async def _refresh_revoked(self) -> None:
        """The revoked node ids the members' PeerServices refuse (Task.revoked_node_ids): the
        store's revocations that name nodes (read at most every REVOKED_REFRESH_S)."""
        now = time.monotonic()
        if now - self._revoked_at < REVOKED_REFRESH_S:
            return
        self._revoked_at = now
        registry = self.runner.ctx.registry
        revoked = await self.runner.ctx.store.list_revocations()
        self._revoked = sorted(p for p in revoked if registry.get(p) is not None)

    async def _without_suspects(self, nodes: list[str]) -> list[str]:
        """``nodes`` less the recent culprits; [] (after waiting a little) when the rest could
        not run a round."""
        now = time.monotonic()
        limit = self.runner.host.silence_limit_s()
        self._suspects = {n: t for n, t in self._suspects.items() if now - t < limit}
        rest = [n for n in nodes if n not in self._suspects]
        if len(rest) == len(nodes):
            return nodes
        if len(rest) >= max(1, self.runner.spec.min_nodes) and not self.cannot_run(rest):
            return rest
        wait = min(self._suspects.values()) + limit - now
        try:
            await asyncio.wait_for(self.runner.stop_requested.wait(), timeout=max(0.01, wait))
        except TimeoutError:
            pass
        return []

    def _start_attempt(
        self,
        rs: RoundState,
        number: int,
        survivors: list[Part],
        push_state: bool,
        compute_deadline: float,
    ) -> bool:
        """Form the ring of attempt ``number`` and hand out its tasks; False when some node
        cannot get the round's version."""
        members = [p.node_id for p in survivors if p.member]
        externals = sorted(p.node_id for p in survivors if not p.member)
        rates = {n: self.runner.bench[n] for n in members if n in self.runner.bench}
        measured = member_links(self.links, members)
        order = ring_order(
            members,
            measured,
            node_rtt_s={n: b.rtt_ms / 1000.0 for n, b in rates.items() if b.rtt_ms > 0},
            node_bandwidth={
                n: b.bandwidth_bytes_per_second
                for n, b in rates.items()
                if b.bandwidth_bytes_per_second > 0
            },
        )
        # A member once accused of sending bad data gets another witness to its right, and the
        # ends of a hop whose ring audit they disagreed on are kept apart (verifier.py).
        avoid: dict[str, set[str]] = {n: set(w) for n, w in self._witnesses.items()}
        for n, others in self.runner.verifier.ring_disputes.items():
            avoid.setdefault(n, set()).update(others)
        order = keep_apart(order, avoid)
        bandwidth = slowest_bandwidth(self.runner.bench, order + externals)
        rtt = largest_rtt_s(self.runner.bench, order + externals)
        step = step_deadline_s(
            self._numel(),
            len(order),
            min(
                slowest_bandwidth(self.runner.bench, order), ring_link_bandwidth(self.links, order)
            ),
            rtt,
            codec=self.ring_codec(),
            floor_s=STEP_DEADLINE_FLOOR_S,
        )
        transfer = 4.0 * 2 * self.runner.ps.num_bytes() / bandwidth + 2 * rtt
        deadline = compute_deadline + transfer + 2 * (len(order) - 1) * step
        v = rs.version
        sources: dict[str, str] = {}
        for n in order + (externals if number == 0 else []):
            if n in order and self.holds.get(n) == v:
                continue
            holder = self._holder(v, order, n)
            if not holder and self.state_stale:
                return False
            sources[n] = holder
        # Time-boxed (a part with a box, no externals): members weigh by the samples trained.
        weighted = not externals and any(rs.parts[n].budget_s > 0 for n in order)
        att = RingAttempt(
            number=number,
            order=order,
            externals=externals,
            total=sum(
                rs.parts[n].samples if weighted else rs.parts[n].local_batch
                for n in order + externals
            ),
            gateway=order[0] if externals else "",
            push_state_node=order[0] if push_state else "",
            step_deadline_s=step,
            deadline_s=deadline,
            started=time.monotonic(),
            weighted=weighted,
        )
        self.attempt = att
        rs.attempts = number + 1
        self.push.pushed = None
        now = time.monotonic()
        digest = self._seal_digest(order)
        for rank, n in enumerate(order):
            part = rs.parts[n]
            part.task_id = new_task_id("t-")
            part.status = "pending"
            part.error = part.checksum = part.optim_checksum = part.failed_peer = ""
            part.ring_fault = agent_pb2.RING_FAULT_UNSPECIFIED
            part.trained = 0
            part.handed_out = now
            task = self.runner.train_task(rs, part)
            task.deadline_seconds = deadline
            task.ring.CopyFrom(
                common_pb2.RingAssignment(
                    node_ids=order,
                    peer_addresses=[self._peer_address(m) for m in order],
                    rank=rank,
                    attempt=number,
                    deadline_seconds=step,
                    seal_digest=digest,
                )
            )
            task.ring_total_samples = att.total
            task.ring_weighted = weighted
            task.revoked_node_ids.extend(self._revoked)
            task.push_state = n == att.push_state_node
            task.ring_gateway = n == att.gateway
            self._set_source(task, n, sources.get(n), deadline)
            self.runner.host.enqueue(n, task, self.runner.job_id)
        for n in externals:
            part = rs.parts[n]
            if number > 0:
                continue  # its task of the first attempt goes on (or its update is in)
            part.handed_out = now
            task = self.runner.train_task(rs, part)
            task.deadline_seconds = deadline
            task.ring_total_samples = att.total
            self._set_source(task, n, sources.get(n), deadline)
            self.runner.host.enqueue(n, task, self.runner.job_id)
        log.info(
            "job %s round %d attempt %d: ring %s (ordered by %s), %d external(s), B=%d, "
            "step deadline %.2fs, deadline %.2fs, version %d%s%s",
            self.runner.job_id,
            rs.round,
            number,
            ",".join(order),
            "measured peer links" if measured else "figures towards the coordinator",
            len(externals),
            att.total,
            step,
            deadline,
            v,
            ", push_state" if att.push_state_node else "",
            ", weighted (time-boxed)" if weighted else "",
        )
        return True

    def _set_source(
        self, task: agent_pb2.Task, node: str, holder: str | None, valid_s: float
    ) -> None:
        if holder:
            self.transfers.send(task, node, holder, self._peer_address(holder), valid_s)

    def authorize_state_transfer(self, source: str, requester: str) -> str | None:
        """None when `requester` was told to fetch this job's state from `source` (and its
        task may still run), else why not."""
        return self.transfers.refusal(source, requester, self.runner.job_id)

    async def _wait_attempt(self, rs: RoundState) -> str:
        """Until every member reported, or a failure is known (plus a short grace for the
        other members' reports, so that all culprits are named), or the deadline.
        Returns "ok" | "failed" | "stopped"."""
        att = self.attempt
        assert att is not None
        end = att.started + att.deadline_s
        grace = max(1.0, att.step_deadline_s)
        first_failure: float | None = None
        check_every = max(0.02, self.runner.ctx.registry.heartbeat_interval_s / 4)
        next_check = time.monotonic() + check_every
        members = [rs.parts[n] for n in att.order]
        externals = [rs.parts[n] for n in att.externals]
        extensions = 0
        while True:
            now = time.monotonic()
            if self.runner.stopping:
                return "stopped"
            if now >= next_check:
                self.runner.fail_silent(rs)
                next_check = now + check_every
            failing = any(p.status in (*DEAD, "reported_failed") for p in members) or any(
                p.status in DEAD for p in externals
            )
            waiting = [p for p in members if p.status == "pending"]
            if not waiting:
                ok = not failing and all(p.status == "received" for p in externals)
                return "ok" if ok else "failed"
            if failing:
                if self._culprits_known(att, rs):
                    return "failed"  # retry at once: the survivors may be stuck in the ring
                first_failure = first_failure if first_failure is not None else now
                if now - first_failure >= grace:
                    return "failed"
            if now >= end and self._extend_attempt(att, members, externals, extensions):
                extensions += 1
                end += att.deadline_s
                continue
            if now >= end:
                for p in [*waiting, *(p for p in externals if p.status == "pending")]:
                    p.status = "late"
                    p.error = f"missed the attempt's {att.deadline_s:.2f}s deadline"
                return "failed"
            rs.changed.clear()
            timeout = min(end, next_check) - now
            if first_failure is not None:
                timeout = min(timeout, first_failure + grace - now)
            try:
                await asyncio.wait_for(rs.changed.wait(), timeout=max(0.001, timeout))
            except TimeoutError:
                pass

    def _culprits_known(self, att: RingAttempt, rs: RoundState) -> bool:
        """A node of the attempt failed in the coordinator's own eyes (silent, offline,
        refused), or a member named a peer of the attempt as failed and that peer's right
        neighbour, the one member that saw its data (`fault_verdict`), has reported."""
        nodes = set(att.order) | set(att.externals)
        if any(rs.parts[n].status in DEAD for n in nodes):
            return True
        n = len(att.order)
        for m in att.order:
            p = rs.parts[m]
            if p.status != "reported_failed" or p.failed_peer not in nodes:
                continue
            if p.failed_peer not in att.order:
                return True
            right = att.order[(att.order.index(p.failed_peer) + 1) % n]
            if rs.parts[right].status != "pending":
                return True
        return False

    def _extend_attempt(
        self, att: RingAttempt, members: list[Part], externals: list[Part], extensions: int
    ) -> bool:
        """As `ParameterServerRounds._extend_deadline`: wait once more as long when nobody reported and
        nobody failed or fell silent (the estimates were wrong for everyone)."""
        parts = [*members, *externals]
        if extensions >= MAX_DEADLINE_EXTENSIONS or any(p.status != "pending" for p in parts):
            return False
        if any(self.runner.host.is_silent(p.node_id) for p in parts):
            return False
        log.info(
            "job %s attempt %d: nobody reported within the %.2fs deadline; waiting as long "
            "again (%d of %d)",
            self.runner.job_id,
            att.number,
            att.deadline_s,
            extensions + 1,
            MAX_DEADLINE_EXTENSIONS,
        )
        return True

    def _checksums(self, rs: RoundState) -> dict[str, str]:
        """Each member's checksum of the state after the step: its parameters' and, where it
        reports one, its optimizer state's (honest members hold both bit-identical)."""
        att = self.attempt
        assert att is not None
        return {n: state_key(rs.parts[n]) for n in att.order}

    async def _eject(self, rs: RoundState, verdict: ChecksumVerdict) -> None:
        """The members whose checksum lost to the majority's leave the round with a strike
        (`_retire_culprits` then takes them out: their samples return to pending)."""
        for n in verdict.minority:
            p = rs.parts[n]
            reason = (
                f"job {self.runner.job_id} round {rs.round}: its parameter checksum after the "
                f"ring step ({p.checksum[:16]}) differs from the majority's "
                f"({verdict.agreed[:16]})"
            )
            p.status = "rejected"
            p.error = f"diverged from the majority: {verdict.reason}"[:500]
            log.warning("job %s: ejecting %s: %s", self.runner.job_id, n, reason)
            await self.runner.ctx.registry.add_strike(n, reason, job_id=self.runner.job_id)
        await self.runner.ctx.events.append(
            "round.diverged",
            job_id=self.runner.job_id,
            message=f"round {rs.round}: {verdict.reason}; the minority is ejected with a strike",
            attrs={
                "round": str(rs.round),
                "agreed": verdict.agreed,
                "ejected": ",".join(verdict.minority),
                **{f"checksum.{n}": c for n, c in self._checksums(rs).items()},
            },
        )

    async def _judge_faults(self, rs: RoundState, can_retest: bool) -> FaultVerdict:
        """After a failed attempt: the members reported for sending bad data (`fault_verdict`);
        those two members witnessed are struck."""
        att = self.attempt
        assert att is not None
        reports = {
            n: (rs.parts[n].failed_peer, rs.parts[n].ring_fault)
            for n in att.order
            if rs.parts[n].status == "reported_failed"
        }
        verdict = fault_verdict(att.order, reports, self._witnesses, rs.round, can_retest)
        self._witnesses = verdict.witnesses
        for n, why in verdict.struck.items():
            log.warning("job %s round %d: striking %s: %s", self.runner.job_id, rs.round, n, why)
            await self.runner.ctx.registry.add_strike(
                n, f"job {self.runner.job_id} round {rs.round}: {why}", job_id=self.runner.job_id
            )
        return verdict

    async def _retire_culprits(
        self, rs: RoundState, last: bool, note: str = "", keep: tuple[str, ...] = ()
    ) -> None:
        """After a failed attempt: take the nodes that failed out of the round and say so
        (`note`: why, when no node is to blame). `keep`: members named failed that stay in
        the round all the same (accused by one witness: `fault_verdict`)."""
        att = self.attempt
        assert att is not None
        nodes = att.order + att.externals
        reasons: dict[str, str] = {}
        for n in nodes:
            p = rs.parts[n]
            if p.status in DEAD:
                reasons[n] = f"{p.status}: {p.error}"
        named: dict[str, list[str]] = {}
        for n in att.order:
            p = rs.parts[n]
            if p.status == "reported_failed" and p.failed_peer in nodes:
                named.setdefault(p.failed_peer, []).append(n)
        for culprit, reporters in named.items():
            if culprit in keep and culprit not in reasons:
                continue
            error = rs.parts[reporters[0]].error
            seen = f"reported failed by {', '.join(reporters)} ({error})"
            reasons[culprit] = f"{reasons[culprit]}; {seen}" if culprit in reasons else seen
        if not reasons:
            for n in att.order:
                p = rs.parts[n]
                if p.status == "reported_failed" and not p.failed_peer:
                    reasons[n] = f"failed: {p.error}"
        for n, why in reasons.items():
            self._suspects[n] = time.monotonic()
            p = rs.parts[n]
            p.status = "failed"
            p.error = why[:500]
            self.holds.pop(n, None)
            self.runner.note_failure(n, why)
        survivors = [n for n in att.order if n not in reasons]
        what = "; ".join(f"{n} {why}" for n, why in sorted(reasons.items())) or (
            note or "no node named"
        )
        if last:
            message = (
                f"round {rs.round} attempt {att.number + 1} failed ({what}); that was the last "
                f"of {MAX_ATTEMPTS} attempts"
            )
        else:
            message = (
                f"round {rs.round} attempt {att.number + 1} failed ({what}); retrying with "
                f"{len(survivors)} member(s)"
            )
        log.info("job %s: %s", self.runner.job_id, message)
        await self.runner.ctx.events.append(
            "round.retried",
            job_id=self.runner.job_id,
            message=message,
            attrs={
                "round": str(rs.round),
                "attempt": str(att.number),
                "failed": ",".join(sorted(reasons)),
                "reasons": what[:1000],
                "survivors": ",".join(survivors),
            },
        )

    async def _succeed(self, rs: RoundState) -> None:
        att = self.attempt
        assert att is not None
        t0 = time.monotonic()
        members = [rs.parts[n] for n in att.order]
        assert len({state_key(p) for p in members}) == 1, "run_round commits agreed rounds only"
        agreed = members[0].checksum
        new_version = rs.version + 1
        self.transfers.agree(new_version, agreed, members[0].optim_checksum)
        loaded = False
        if att.push_state_node:
            loaded = await self.push.load(self.runner, rs, att.push_state_node, agreed, new_version)
        for n in att.order + att.externals:
            p = rs.parts[n]
            if att.weighted and 0 < p.trained < p.samples:
                # A time-boxed member trained this prefix: only it commits, the rest is pending.
                p.ranges = head_of_runs(p.ranges, p.trained)
                p.samples = p.trained
                p.inner_steps = -(-p.trained // p.local_batch)
            p.status = "applied"
            p.grads = None
        for n in att.order:
            self.holds[n] = new_version
        self.ring_version = new_version
        self.runner.verifier.ring_attempt_applied(rs.round, att.number)
        if loaded:
            self._loaded_round = rs.round
        self._state_overdue = bool(att.push_state_node) and not loaded
        self.attempt = None
        self.push.pushed = None
        await self.runner.close_round(rs, t0)

    def _room_beside(self, checksums: Mapping[str, str]) -> bool:
        """Whether the job may hold a ring member beside the disputed ones (max_nodes), whose
        checksum can make a majority."""
        return self.runner.spec.max_nodes > len(checksums)

    async def _disputed_round(
        self, rs: RoundState, verdict: ChecksumVerdict, checksums: Mapping[str, str]
    ) -> None:
        """No majority after a retry: nobody is struck, the round's samples are pending again,
        every member keeps the round's version (the next round starts from it), and no round runs
        on these members alone until a member outside them joins (`cannot_run`)."""
        self._disputed = frozenset(checksums)
        self._dispute = f"their checksums disagreed twice in round {rs.round}"
        log.warning("job %s round %d: %s", self.runner.job_id, rs.round, verdict.reason)
        await self.runner.ctx.events.append(
            "round.disputed",
            job_id=self.runner.job_id,
            message=(
                f"round {rs.round}: {verdict.reason}; nobody is struck: the job waits for a "
                f"ring member other than {', '.join(sorted(checksums))}, whose checksum decides"
            ),
            attrs={
                "round": str(rs.round),
                "disputed": ",".join(sorted(checksums)),
                **{f"checksum.{n}": c for n, c in checksums.items()},
            },
        )

    async def _diverged(self, rs: RoundState, verdict: ChecksumVerdict) -> None:
        checksums = self._checksums(rs)
        message = (
            f"replicas diverged in round {rs.round}: {verdict.reason}; the job stops rather than "
            f"train on divergent replicas (max_nodes {self.runner.spec.max_nodes} leaves no room "
            "for a member whose checksum would decide)"
        )
        log.error("job %s: %s", self.runner.job_id, message)
        self.runner.ledger.abort_round(rs.round)
        self.runner.round_state = None
        self.attempt = None
        await self.runner.ctx.events.append(
            "job.diverged",
            job_id=self.runner.job_id,
            message=message,
            attrs={
                "round": str(rs.round),
                "version": str(rs.version + 1),
                **{f"checksum.{n}": c for n, c in checksums.items()},
            },
        )
        await self.runner.fail(message)
        self.runner.host.round_finished(self.runner.job_id, self.runner.benchmark_task_ids())
        await self.runner.notify()

    # -- RPC-side entry points ------------------------------------------------------------------

    def on_report(self, req: agent_pb2.ReportProgressRequest) -> None:
        if req.failed and self.runner.node_set.is_benchmark_task(req.node_id, req.task_id):
            self.runner.on_failure_report(req)  # a failed job benchmark
            return
        rs = self.runner.round_state
        att = self.attempt
        if rs is None or rs.closed or att is None:
            return
        part = rs.parts.get(req.node_id)
        if part is None or part.task_id != req.task_id:
            return
        for link in req.peer_links:  # validated by the service (count, ids, finite figures)
            self.links[(req.node_id, link.node_id)] = (
                link.rtt_ms / 1000.0,
                link.bandwidth_bytes_per_second,
            )
        if not part.member:
            self.runner.on_failure_report(req)
            return
        if part.status != "pending":
            return
        if req.ring_attempt != att.number and not req.failed:
            # The task id names the attempt; a success must also say which one it is about.
            log.info(
                "job %s round %d: %s reported success for attempt %d during attempt %d; ignored",
                self.runner.job_id,
                rs.round,
                req.node_id,
                req.ring_attempt,
                att.number,
            )
            return
        if req.failed:
            if req.job_fault:
                self.runner.on_job_fault(req.node_id, req.task_id, req.error or "failed")
            part.status = "reported_failed"
            part.error = (req.error or "failed")[:500]
            part.failed_peer = req.failed_peer_node_id[:128]
            part.ring_fault = req.ring_fault
        else:
            problem = report_problem(req, rs, att.weighted)
            if problem:
                part.status = "rejected"
                part.error = problem
            else:
                part.status = "reported"
                part.checksum = req.params_checksum
                part.optim_checksum = req.optim_checksum
                part.mean_loss = req.mean_loss
                part.compute_s = req.compute_seconds
                part.comm_s = req.communicate_seconds
                part.wall_s = time.monotonic() - part.handed_out
                part.arrived = time.monotonic()
                part.trained = req.samples_done if att.weighted else 0
                if req.samples_done != part.samples and not att.weighted:
                    log.warning(
                        "job %s round %d: %s reports %d samples, its part has %d",
                        self.runner.job_id,
                        rs.round,
                        req.node_id,
                        req.samples_done,
                        part.samples,
                    )
        rs.touch()

    async def agreed_params_checksum(self, version: int) -> str | None:
        """The checksum of the parameters of ``version`` (verification of a member's part that
        started from them): what its ring agreed on, else the coordinator's own when it holds
        that version (the start, a checkpoint, a rollback); None when neither is known."""
        agreed = self.transfers.agreed.get(version)
        if agreed is not None:
            return agreed[0]
        ps = self.runner.ps
        if ps.version == version:
            return await asyncio.to_thread(params_checksum, ps.snapshot())
        return None

    def expected_samples(self, node_id: str, task_id: str) -> int | None:
        rs = self.runner.round_state
        part = rs.parts.get(node_id) if rs is not None else None
        if part is None or part.member:
            return None  # members all-reduce; only externals push updates here
        return self.runner.part_samples(node_id, task_id)

    def wants_checkpoint(self, node_id: str, task_id: str) -> bool:
        rs = self.runner.round_state
        att = self.attempt
        if rs is None or att is None or self.push.pushed is not None:
            return False
        part = rs.parts.get(node_id)
        return (
            att.push_state_node == node_id
            and part is not None
            and part.task_id == task_id
            and part.status in ("pending", "reported")
        )

    async def submit_checkpoint(
        self, header: agent_pb2.UpdateHeader, tensors: dict[str, torch.Tensor]
    ) -> str:
        rs = self.runner.round_state
        if rs is None or not self.wants_checkpoint(header.node_id, header.task_id):
            return "no checkpoint of this task is expected (any more)"
        if header.params_version != rs.version + 1:
            raise CodecError(
                f"checkpoint of version {header.params_version}; round {rs.round} makes "
                f"version {rs.version + 1}"
            )
        params, checksum = await asyncio.to_thread(
            check_pushed_state, tensors, self.runner.ps, self.runner.spec
        )
        if not self.wants_checkpoint(header.node_id, header.task_id):
            return "no checkpoint of this task is expected (any more)"
        self.push.pushed = PushedState(
            node_id=header.node_id,
            task_id=header.task_id,
            version=header.params_version,
            checksum=checksum,
            tensors=tensors,
        )
        rs.touch()
        return ""

    async def parameters_payload(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        if req.external_round:
            return await external_sum(self.runner, lambda: self.attempt, req)
        return await self.runner.serve_parameters(req)


__all__ = [
    "MAX_ATTEMPTS",
    "RingRounds",
]
