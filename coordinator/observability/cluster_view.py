"""The cluster as the dashboard and the metrics endpoint see it, read from the same node
registry, store, engine and credit ledger the gRPC services use.

`ClusterView` runs on the coordinator's event loop (it awaits the store); what it returns is
plain data (`ClusterState`, dicts of JSON types) that the HTTP thread formats. `Viewer` says
whose eyes: an operator (or a trusted loopback caller) sees everything, a submitter only its
own jobs, their rounds and events (another tenant's job on a node shows as ``"other"``).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.core.ids import is_job_id
from coordinator.observability.round_stats import Histogram, JobRounds, RoundStats
from coordinator.store.base import Store
from epochmesh.identity import ROLE_OPERATOR, ROLE_SUBMITTER
from epochmesh.job_ref import match_jobs
from epochmesh.spec import DEFAULT_PRIORITY
from epochmesh.v1 import common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from coordinator.engine.api import TrainingEngine
    from coordinator.market.credit_ledger import CreditLedger
    from coordinator.nodes.registry import NodeRegistry

LIVE_JOB_STATES = (
    common_pb2.JOB_STATE_QUEUED,
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_PAUSED,
)
ENDED_JOB_STATES = (
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
)
# Ended jobs the dashboard lists (newest first).
RECENT_ENDED_JOBS = 50
# Rounds read from the store per job and refresh (a long job's history arrives over a few).
ROUNDS_PER_READ = 2000
EVENTS_PAGE = 200
OTHER_JOB = "other"
# Events counted by kind for the metrics (kinds come from code; the cap is a backstop).
MAX_EVENT_KINDS = 256


def node_state_name(state: int) -> str:
    name: str = common_pb2.NodeState.Name(state)
    return name.removeprefix("NODE_STATE_")


def job_state_name(state: int) -> str:
    name: str = common_pb2.JobState.Name(state)
    return name.removeprefix("JOB_STATE_")


@dataclass(frozen=True)
class Viewer:
    """Who looks. ``principal`` empty and role operator: a trusted caller (loopback, or a
    coordinator without TLS)."""

    role: str = ROLE_OPERATOR
    principal: str = ""

    @property
    def owner(self) -> str | None:
        """The owner the jobs are restricted to (None: all)."""
        return self.principal if self.role == ROLE_SUBMITTER else None

    def sees(self, job: common_pb2.Job) -> bool:
        owner = self.owner
        return owner is None or job.owner == owner

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "principal": self.principal}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def node_speed(node: common_pb2.NodeInfo) -> float:
    return node.observed_samples_per_second or node.benchmark.samples_per_second


def device_label(node: common_pb2.NodeInfo) -> str:
    if not node.devices:
        return ""
    dev = node.devices[0]
    label = dev.kind + (f":{dev.index}" if dev.kind == "cuda" else "")
    return f"{label} {dev.name}".strip() if dev.name and dev.name != dev.kind else label


def node_dict(node: common_pb2.NodeInfo, visible_jobs: set[str] | None) -> dict[str, Any]:
    """``visible_jobs``: the job ids whose id the viewer may see (None: all)."""
    job = node.current_job_id
    if job and visible_jobs is not None and job not in visible_jobs:
        job = OTHER_JOB
    rep = node.reputation
    return {
        "node_id": node.node_id,
        "name": node.name,
        "state": node_state_name(node.state),
        "device": device_label(node),
        "samples_per_second": round(node_speed(node), 3),
        "benchmark_samples_per_second": round(node.benchmark.samples_per_second, 3),
        "current_job": job,
        "price_micro_per_hour": node.price_micro_per_hour,
        "strikes": node.strikes,
        "reputation": {
            "verified_in_a_row": rep.verified_in_a_row,
            "verified_total": rep.verified_total,
            "failed_total": rep.failed_total,
        },
        "parts_applied": node.parts_applied,
        "parts_failed": node.parts_failed,
        "last_heartbeat_ms": node.last_heartbeat_ms,
    }


def job_dict(
    job: common_pb2.Job, nodes_held: int | None = None, reason: str = ""
) -> dict[str, Any]:
    spec = job.spec
    total = job.samples_total
    return {
        "job_id": job.job_id,
        "name": job.name,
        "owner": job.owner,
        "state": job_state_name(job.state),
        "priority": spec.priority or DEFAULT_PRIORITY,
        "aggregation": spec.aggregation,
        "epoch": job.epoch,
        "epochs": spec.epochs,
        "round": job.round,
        "samples_done": job.samples_done,
        "samples_total": total,
        "progress": job.samples_done / total if total > 0 else 0.0,
        "last_loss": _finite(job.last_loss),
        "eta_seconds": _finite(job.eta_seconds) if job.eta_seconds > 0 else None,
        "spent_micro": job.spent_micro,
        "escrow_micro": job.escrow_micro,
        "budget_micro": spec.budget_micro if spec.HasField("budget_micro") else None,
        "created_ms": job.created_ms,
        "updated_ms": job.updated_ms,
        "message": job.message,
        "nodes_held": nodes_held,
        "reason": reason,
    }


def event_dict(event: common_pb2.Event) -> dict[str, Any]:
    return {
        "id": event.id,
        "time_ms": event.time_ms,
        "kind": event.kind,
        "node_id": event.node_id,
        "job_id": event.job_id,
        "message": event.message,
    }


_JOB_ID_RE = re.compile(r"\bj-[0-9a-f]{10}\b")


def redact_jobs(text: str, visible: set[str]) -> str:
    """``text`` with the ids of jobs not in ``visible`` replaced by "another job" (an event of
    a submitter's job may name the job a node came from)."""
    return _JOB_ID_RE.sub(lambda m: m.group(0) if m.group(0) in visible else "another job", text)


def account_kind(account: str) -> str:
    """ "tenant" for "tenant:u-1", and so on; "mint" and "platform" are their own kinds."""
    return account.split(":", 1)[0]


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    priority: str
    waiting: bool
    nodes_held: int
    reason: str


@dataclass
class ClusterState:
    """One consistent read of the cluster (no viewer applied)."""

    time_ms: int
    nodes: list[common_pb2.NodeInfo]
    jobs_by_state: dict[str, int]
    # Live jobs, then the newest ended ones.
    jobs: list[common_pb2.Job]
    queue: dict[str, QueueEntry]
    ledger_by_kind: dict[str, int]
    heartbeats_total: int
    events_by_kind: dict[str, int]
    # Per tracked job: (rounds, samples, round-duration histogram) read from its rounds.
    job_rounds: dict[str, tuple[int, int, Histogram]] = field(default_factory=dict)
    # Per node: (compute, communicate) histograms of its applied parts.
    node_parts: dict[str, tuple[Histogram, Histogram]] = field(default_factory=dict)


def _copy_histogram(h: Histogram) -> Histogram:
    return Histogram(h.bounds, list(h.counts), h.total, h.count)


class ClusterView:
    """Reads for the dashboard and the metrics. Call its coroutines on the coordinator's loop."""

    def __init__(
        self,
        registry: NodeRegistry,
        store: Store,
        engine: TrainingEngine,
        credits: CreditLedger,
        retention_s: float = 600.0,
    ) -> None:
        self._registry = registry
        self._store = store
        self._engine = engine
        self._credits = credits
        self.stats = RoundStats(retention_ms=int(retention_s * 1000))
        self.events_by_kind: Counter[str] = Counter()
        store.add_event_listener(self._on_event)

    def _on_event(self, event: common_pb2.Event) -> None:
        if event.kind in self.events_by_kind or len(self.events_by_kind) < MAX_EVENT_KINDS:
            self.events_by_kind[event.kind] += 1

    # -- reading -----------------------------------------------------------------------------

    def _queue(self) -> dict[str, QueueEntry]:
        try:
            queue = self._engine.queue()
        except Exception:  # noqa: BLE001 - an engine without a scheduler (NullEngine)
            return {}
        return {
            job.job_id: QueueEntry(
                job.job_id,
                job.spec.priority or DEFAULT_PRIORITY,
                plan.waiting,
                len(plan.nodes),
                plan.reason,
            )
            for job, plan in queue
        }

    async def _jobs(self) -> list[common_pb2.Job]:
        live = await self._store.list_jobs(states=LIVE_JOB_STATES)
        ended = await self._store.list_jobs(states=ENDED_JOB_STATES, limit=RECENT_ENDED_JOBS)
        return [*live, *ended]

    async def _read_rounds(self, job_id: str) -> JobRounds:
        """Brings the job's `JobRounds` up to date with the store (a long history: a page per
        call)."""
        records = await self._store.list_rounds(
            job_id, since_round=self.stats.cursor(job_id), limit=ROUNDS_PER_READ
        )
        self.stats.add(job_id, records)
        return self.stats.job(job_id)

    async def state(self) -> ClusterState:
        """Everything the metrics need; also refreshes the round statistics of the jobs
        listed and prunes those of jobs ended long ago."""
        now = int(time.time() * 1000)
        nodes = self._registry.list()
        jobs = await self._jobs()
        counts = await self._store.count_jobs_by_state()
        ended_ms: dict[str, int] = {}
        for job in jobs:
            if job.state in ENDED_JOB_STATES:
                ended_ms[job.job_id] = job.updated_ms
                if now - job.updated_ms > self.stats.retention_ms:
                    continue  # long over: no series for it
            await self._read_rounds(job.job_id)
        for job_id in list(self.stats.jobs):
            if job_id not in ended_ms and job_id not in {j.job_id for j in jobs}:
                ended_ms[job_id] = 0  # no longer listed: gone
        active = [
            n.node_id
            for n in nodes
            if n.state not in (common_pb2.NODE_STATE_OFFLINE, common_pb2.NODE_STATE_UNSPECIFIED)
        ]
        self.stats.prune(ended_ms, active, now)
        by_kind: dict[str, int] = {}
        for account, balance in self._credits.balances().items():
            kind = account_kind(account)
            by_kind[kind] = by_kind.get(kind, 0) + balance
        return ClusterState(
            time_ms=now,
            nodes=nodes,
            jobs_by_state={
                job_state_name(s): counts.get(s, 0)
                for s in common_pb2.JobState.values()
                if s != common_pb2.JOB_STATE_UNSPECIFIED
            },
            jobs=[j for j in jobs if j.job_id in self.stats.jobs or j.state in LIVE_JOB_STATES],
            queue=self._queue(),
            ledger_by_kind=by_kind,
            heartbeats_total=self._registry.heartbeats_total,
            events_by_kind=dict(self.events_by_kind),
            job_rounds={
                job_id: (r.rounds, r.samples, _copy_histogram(r.duration))
                for job_id, r in self.stats.jobs.items()
            },
            node_parts={
                node_id: (_copy_histogram(p.compute), _copy_histogram(p.communicate))
                for node_id, p in self.stats.node_parts.items()
            },
        )

    # -- the dashboard's API -----------------------------------------------------------------

    async def overview(self, viewer: Viewer) -> dict[str, Any]:
        """Nodes, the jobs the viewer may see (live, then the newest ended), cluster totals."""
        nodes = self._registry.list()
        jobs = [j for j in await self._jobs() if viewer.sees(j)]
        queue = self._queue()
        visible = None if viewer.owner is None else {j.job_id for j in jobs}
        by_state: dict[str, int] = {}
        for node in nodes:
            name = node_state_name(node.state)
            by_state[name] = by_state.get(name, 0) + 1
        live_speed = sum(
            node_speed(n)
            for n in nodes
            if n.state in (common_pb2.NODE_STATE_ONLINE, common_pb2.NODE_STATE_BUSY)
        )
        return {
            "viewer": viewer.to_dict(),
            "time_ms": int(time.time() * 1000),
            "nodes": [node_dict(n, visible) for n in nodes],
            "nodes_by_state": by_state,
            "samples_per_second": round(live_speed, 3),
            "jobs": [
                job_dict(
                    j,
                    queue[j.job_id].nodes_held if j.job_id in queue else None,
                    queue[j.job_id].reason if j.job_id in queue else "",
                )
                for j in jobs
            ],
        }

    async def find_job(self, viewer: Viewer, job_id: str) -> common_pb2.Job | None:
        """The job if it exists and the viewer may see it (else None: the same answer for
        both, so a submitter learns nothing of others' job ids)."""
        if not is_job_id(job_id):
            return None
        job = await self._store.get_job(job_id)
        if job is None or not viewer.sees(job):
            return None
        return job

    async def find_jobs(self, viewer: Viewer, ref: str) -> list[common_pb2.Job]:
        """The jobs the viewer sees that ``ref`` names: a full id, an id prefix or a job name,
        as in the CLI (epochmesh/job_ref.py)."""
        if is_job_id(ref):
            job = await self.find_job(viewer, ref)
            if job is not None:
                return [job]
        return match_jobs(ref, [j for j in await self._jobs() if viewer.sees(j)])

    async def job_detail(
        self, viewer: Viewer, job_id: str, since_round: int
    ) -> dict[str, Any] | None:
        """The job, its loss/throughput points after ``since_round``, each node's share and
        compute vs communicate seconds, and the live allocation; None when not visible."""
        job = await self.find_job(viewer, job_id)
        if job is None:
            return None
        rounds = await self._read_rounds(job_id)
        names = {n.node_id: n.name for n in self._registry.list()}
        shares = rounds.shares()
        allocation: dict[str, dict[str, Any]] = {}
        if job.state in LIVE_JOB_STATES:
            try:
                alloc = await self._engine.get_allocation(
                    scheduler_pb2.GetAllocationRequest(job_id=job_id),
                    None,
                )
                for na in alloc.nodes:
                    allocation[na.node_id] = {
                        "share": round(na.share, 6),
                        "local_batch": na.local_batch,
                        "samples_per_second": round(na.samples_per_second, 3),
                    }
            except Exception:  # noqa: BLE001 - no engine, or the runner is gone meanwhile
                allocation = {}
        node_ids = list(dict.fromkeys([*rounds.nodes, *allocation]))
        queue = self._queue().get(job_id)
        return {
            "viewer": viewer.to_dict(),
            "job": job_dict(
                job,
                queue.nodes_held if queue else None,
                queue.reason if queue else "",
            ),
            "rounds_seen": rounds.cursor,
            "points": [p.to_dict() for p in rounds.points_after(since_round)],
            "nodes": [
                {
                    "node_id": node_id,
                    "name": names.get(node_id, ""),
                    "share": round(shares.get(node_id, 0.0), 6),
                    **rounds.nodes[node_id].to_dict(),
                    "live": allocation.get(node_id),
                }
                if node_id in rounds.nodes
                else {
                    "node_id": node_id,
                    "name": names.get(node_id, ""),
                    "share": 0.0,
                    "samples": 0,
                    "compute_seconds": 0.0,
                    "communicate_seconds": 0.0,
                    "parts_applied": 0,
                    "parts_failed": 0,
                    "live": allocation.get(node_id),
                }
                for node_id in node_ids
            ],
        }

    async def events(self, viewer: Viewer, since_id: int, limit: int) -> dict[str, Any]:
        """Events after ``since_id`` (newest ``limit`` when since_id is 0), oldest first; a
        submitter gets those of its own jobs only."""
        limit = max(1, min(limit, EVENTS_PAGE))
        if since_id <= 0:
            since_id = max(0, await self._store.last_event_id() - limit * 5)
        owner = viewer.owner
        mine: set[str] = set()
        if owner is not None:
            mine = {j.job_id for j in await self._store.list_jobs(owner=owner, limit=1000)}
        out: list[dict[str, Any]] = []
        last = since_id
        batch = await self._store.list_events(since_id, limit=EVENTS_PAGE * 5)
        for event in batch:
            last = event.id
            if owner is None:
                out.append(event_dict(event))
            elif event.job_id in mine:
                shown = event_dict(event)
                shown["message"] = redact_jobs(event.message, mine)
                out.append(shown)
        return {"events": out[-limit:], "last_id": last}
