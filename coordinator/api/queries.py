"""The job and queue queries the services share, each as the caller may see it.

A submitter sees only its own jobs (coordinator/trust/auth.py `owner_filter`,
`require_job_access`) and, of the scheduler's queue, its own entries, its own weight and how
many other jobs there are; of the nodes (`nodes_for_caller`), neither their peer addresses, nor
the ids of other tenants' jobs they run, nor the evidence of their failed checks; operators
(and --insecure callers) see everything. Also the checks of
a query's arguments (list limits, job states, priorities) and the one cap on watch streams that
WatchJob and WatchEvents share.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from coordinator.core.errors import InvalidArgumentError, NotFoundError
from coordinator.core.ids import require_job_id
from coordinator.core.stream_caps import StreamCaps
from coordinator.engine.api import TrainingEngine
from coordinator.store.base import Store
from coordinator.trust.auth import owner_filter, require_job_access
from epochmesh.spec import DEFAULT_PRIORITY, PRIORITIES
from epochmesh.v1 import common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from coordinator.scheduling.cluster_scheduler import JobPlan


DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000


def clamp_limit(limit: int) -> int:
    if limit < 0:
        raise InvalidArgumentError(f"limit must not be negative, got {limit}")
    return DEFAULT_LIST_LIMIT if limit == 0 else min(limit, MAX_LIST_LIMIT)


def check_job_states(states: Collection[int]) -> list[int]:
    valid = set(common_pb2.JobState.values()) - {common_pb2.JOB_STATE_UNSPECIFIED}
    for state in states:
        if state not in valid:
            raise InvalidArgumentError(f"unknown job state {state}")
    return list(states)


async def get_job(store: Store, job_id: str) -> common_pb2.Job:
    """The job, if the caller may see it (a submitter: only its own, else PERMISSION_DENIED)."""
    require_job_id(job_id)
    job = await store.get_job(job_id)
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    require_job_access(job)
    return job


async def list_jobs(store: Store, states: Collection[int], limit: int) -> list[common_pb2.Job]:
    """Jobs the caller may see (a submitter: only its own)."""
    return await store.list_jobs(
        states=check_job_states(states), owner=owner_filter(), limit=clamp_limit(limit)
    )


def check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise InvalidArgumentError(
            f"unknown priority {priority[:32]!r}: use one of {', '.join(PRIORITIES)}"
        )
    return priority


def queue_entry(job: common_pb2.Job, plan: JobPlan) -> scheduler_pb2.QueueEntry:
    return scheduler_pb2.QueueEntry(
        job_id=job.job_id,
        name=job.name,
        tenant=job.owner,
        priority=job.spec.priority or DEFAULT_PRIORITY,
        state=job.state,
        fair_share=plan.fair_share,
        value=plan.value,
        nodes_held=len(plan.nodes),
        node_ids=plan.nodes,
        nodes_wanted=plan.wanted,
        min_nodes=job.spec.min_nodes,
        waiting=plan.waiting,
        reason=plan.reason,
        submitted_ms=job.created_ms,
    )


def get_queue(engine: TrainingEngine) -> scheduler_pb2.GetQueueResponse:
    """The scheduler's queue as the caller may see it: a submitter gets its own jobs, its own
    weight and the count of the other live jobs; operators everything."""
    queue = engine.queue()
    weights = dict(engine.scheduling.weights)
    owner = owner_filter()
    if owner is None:
        return scheduler_pb2.GetQueueResponse(
            jobs=[queue_entry(job, plan) for job, plan in queue], tenant_weights=weights
        )
    mine = [queue_entry(job, plan) for job, plan in queue if job.owner == owner]
    return scheduler_pb2.GetQueueResponse(
        jobs=mine,
        tenant_weights={owner: weights[owner]} if owner in weights else {},
        other_jobs=len(queue) - len(mine),
    )


async def nodes_for_caller(
    nodes: list[common_pb2.NodeInfo], store: Store
) -> list[common_pb2.NodeInfo]:
    """``nodes`` (copies, changed in place) as the caller may see them: for a submitter
    without each donor's peer address, without the id of a job of another tenant the node
    runs (its own stay) and without the evidence of a failed check (it names others' rounds);
    for operators unchanged."""
    owner = owner_filter()
    if owner is None:
        return nodes
    running = {node.current_job_id for node in nodes if node.current_job_id}
    live = (common_pb2.JOB_STATE_QUEUED, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PAUSED)
    jobs = await store.list_jobs(states=live, owner=owner) if running else []
    mine = {job.job_id for job in jobs if job.job_id in running}
    for node in nodes:
        node.peer_address = ""
        if node.current_job_id not in mine:
            node.current_job_id = ""
        node.reputation.last_failure_evidence = ""
    return nodes


def watch_caps(per_identity: int = 32, total: int = 1024) -> StreamCaps:
    """The cap of WatchJob and WatchEvents streams (one, shared by both services)."""
    return StreamCaps("WatchJob/WatchEvents", per_identity, total, "--max-watch-streams")
