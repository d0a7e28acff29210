"""SchedulerService: operators -> coordinator (nodes, jobs, events, cordon/drain, stats).

Drain keeps the node's agent up and idle; Drain with stop also asks it to leave (its next
heartbeat answer says so), which it does once its current task is done.

GetAllocation, PreviewAllocation, GetQueue and SetTenantWeight go to the training engine. Node
arguments accept a node id or a unique node name. SetTenantWeight names a tenant the
coordinator knows (coordinator/market/accounts.py) or asks to create it (else NOT_FOUND).
ListNodes and GetNode mark revoked nodes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Collection
from typing import TypeAlias

import grpc

from coordinator.accounting.credit_book import tenant_account
from coordinator.api.queries import get_job, get_queue, list_jobs, nodes_for_caller, watch_caps
from coordinator.api.quote_handler import quote_job
from coordinator.core.errors import (
    CoordinatorError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from coordinator.core.ids import USER_ID_PREFIX, check_text, is_job_id, is_node_id
from coordinator.core.principal import current_principal_id
from coordinator.core.stream_caps import StreamCaps
from coordinator.engine.api import TrainingEngine
from coordinator.market.accounts import require_known
from coordinator.nodes.registry import NodeRegistry, state_name
from coordinator.store.base import Store
from coordinator.store.blobs import BlobStore
from coordinator.store.events import EventLog
from coordinator.trust.auth import Authorizer, owner_filter, require_job_access
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2, scheduler_pb2

Ctx: TypeAlias = grpc.aio.ServicerContext

MAX_KIND_FILTERS = 32


def check_node_states(states: Collection[int]) -> list[int]:
    valid = set(common_pb2.NodeState.values()) - {common_pb2.NODE_STATE_UNSPECIFIED}
    for state in states:
        if state not in valid:
            raise InvalidArgumentError(f"unknown node state {state}")
    return list(states)


def _no_stop(req: scheduler_pb2.NodeRequest, rpc: str) -> None:
    if req.stop:
        raise InvalidArgumentError(f"stop is for Drain only, not {rpc}")


def job_state_name(state: int) -> str:
    name: str = common_pb2.JobState.Name(state)
    return name.removeprefix("JOB_STATE_")


class SchedulerService:
    def __init__(
        self,
        registry: NodeRegistry,
        store: Store,
        blobs: BlobStore,
        events: EventLog,
        engine: TrainingEngine,
        authorizer: Authorizer | None = None,
        watchers: StreamCaps | None = None,
        fee_ppm: int = 0,
    ) -> None:
        self._registry = registry
        self._fee_ppm = fee_ppm  # the platform fee QuoteJob adds to every part
        self._store = store
        self._blobs = blobs
        self._events = events
        self._engine = engine
        self._authorizer = authorizer
        # WatchEvents streams per identity (shared with JobService.WatchJob).
        self._watchers = watchers or watch_caps()
        self._started = time.monotonic()

    def _node(self, id_or_name: str) -> common_pb2.NodeInfo:
        check_text(id_or_name, "node_id", max_len=128, required=True)
        return self._registry.find(id_or_name)

    def _with_job_rates(self, nodes: list[common_pb2.NodeInfo]) -> list[common_pb2.NodeInfo]:
        """Fill in each node's samples/s on the live jobs the caller may see (a submitter:
        its own; operators: all) and whether it was revoked, on ``nodes`` (the registry's
        copies)."""
        rates = self._engine.job_rates(owner=owner_filter())
        for node in nodes:
            node.job_samples_per_second.update(rates.get(node.node_id, {}))
            node.revoked = self._authorizer is not None and self._authorizer.is_revoked(
                node.node_id
            )
        return nodes

    async def ListNodes(
        self, req: scheduler_pb2.ListNodesRequest, ctx: Ctx
    ) -> scheduler_pb2.ListNodesResponse:
        nodes = self._registry.list(check_node_states(req.states))
        nodes = await nodes_for_caller(self._with_job_rates(nodes), self._store)
        return scheduler_pb2.ListNodesResponse(nodes=nodes)

    async def GetNode(self, req: scheduler_pb2.GetNodeRequest, ctx: Ctx) -> common_pb2.NodeInfo:
        nodes = self._with_job_rates([self._node(req.node_id)])
        return (await nodes_for_caller(nodes, self._store))[0]

    async def ListJobs(
        self, req: scheduler_pb2.ListAllJobsRequest, ctx: Ctx
    ) -> scheduler_pb2.ListAllJobsResponse:
        jobs = await list_jobs(self._store, req.states, req.limit)
        return scheduler_pb2.ListAllJobsResponse(jobs=jobs)

    async def GetJob(self, req: scheduler_pb2.GetAnyJobRequest, ctx: Ctx) -> common_pb2.Job:
        return await get_job(self._store, req.job_id)

    async def GetAllocation(
        self, req: scheduler_pb2.GetAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        if owner_filter() is not None and is_job_id(req.job_id):
            job = await self._store.get_job(req.job_id)
            if job is not None:
                require_job_access(job)
        return await self._engine.get_allocation(req, ctx)

    async def PreviewAllocation(
        self, req: scheduler_pb2.PreviewAllocationRequest, ctx: Ctx
    ) -> common_pb2.Allocation:
        return await self._engine.preview_allocation(req, ctx)

    async def QuoteJob(
        self, req: scheduler_pb2.QuoteJobRequest, ctx: Ctx
    ) -> scheduler_pb2.QuoteJobResponse:
        return await quote_job(
            req, self._registry, self._store, self._engine, now_ms(), self._fee_ppm
        )

    async def WatchEvents(
        self, req: scheduler_pb2.WatchEventsRequest, ctx: Ctx
    ) -> AsyncIterator[common_pb2.Event]:
        if req.since_id < 0:
            raise InvalidArgumentError(f"since_id must not be negative, got {req.since_id}")
        node_id = ""
        if req.node_id:
            node_id = self._node(req.node_id).node_id
        if req.job_id:
            await get_job(self._store, req.job_id)
        if len(req.kinds) > MAX_KIND_FILTERS:
            raise InvalidArgumentError(f"too many kinds ({len(req.kinds)} > {MAX_KIND_FILTERS})")
        for kind in req.kinds:
            check_text(kind, "kind", max_len=64, required=True)
        with self._watchers.hold(current_principal_id()):
            async for event in self._events.watch(
                req.since_id,
                node_id=node_id,
                job_id=req.job_id,
                kinds=list(req.kinds),
                follow=req.follow,
            ):
                yield event

    async def Cordon(self, req: scheduler_pb2.NodeRequest, ctx: Ctx) -> common_pb2.NodeInfo:
        _no_stop(req, "Cordon")
        return await self._registry.cordon(self._node(req.node_id).node_id)

    async def Uncordon(self, req: scheduler_pb2.NodeRequest, ctx: Ctx) -> common_pb2.NodeInfo:
        _no_stop(req, "Uncordon")
        return await self._registry.uncordon(self._node(req.node_id).node_id)

    async def Drain(self, req: scheduler_pb2.NodeRequest, ctx: Ctx) -> common_pb2.NodeInfo:
        """No new work for the node, its agent stays up and idle; with ``stop`` the agent is
        also asked to leave once its current task is done."""
        return await self._registry.drain(self._node(req.node_id).node_id, stop=req.stop)

    async def Revoke(
        self, req: scheduler_pb2.RevokeRequest, ctx: Ctx
    ) -> scheduler_pb2.RevokeResponse:
        """Refuse a principal's certificates from now on: a node (by id or unique name) or a
        user id. A revoked node's lease then lapses; it is also cordoned at once."""
        check_text(req.principal, "principal", max_len=128, required=True)
        check_text(req.reason, "reason", max_len=1024)
        if self._authorizer is None:
            raise FailedPreconditionError(
                "the coordinator runs --insecure: there are no certificates to revoke"
            )
        principal, role = req.principal, ""
        try:
            node = self._registry.find(req.principal)
        except NotFoundError:
            node = None
        if node is not None:
            principal, role = node.node_id, "node"
        elif is_node_id(principal):
            role = "node"
        elif not principal.startswith(USER_ID_PREFIX):
            raise NotFoundError(f"no node or user {req.principal!r}")
        added = await self._store.add_revocation(principal, role or "user", req.reason)
        self._authorizer.revoke(principal)
        if added:
            await self._events.append(
                "principal.revoked",
                node_id=principal if role == "node" else "",
                message=f"{principal} revoked" + (f": {req.reason}" if req.reason else ""),
                attrs={"principal": principal, "reason": req.reason},
            )
            if node is not None and node.state != common_pb2.NODE_STATE_OFFLINE:
                try:
                    await self._registry.cordon(principal)
                except CoordinatorError:
                    pass
        return scheduler_pb2.RevokeResponse(principal=principal, already_revoked=not added)

    async def GetQueue(
        self, req: scheduler_pb2.GetQueueRequest, ctx: Ctx
    ) -> scheduler_pb2.GetQueueResponse:
        return get_queue(self._engine)

    async def SetTenantWeight(
        self, req: scheduler_pb2.SetTenantWeightRequest, ctx: Ctx
    ) -> scheduler_pb2.SetTenantWeightResponse:
        check_text(req.tenant, "tenant", max_len=128, required=True)
        if not req.create:
            await require_known(self._store, tenant_account(req.tenant), f"tenant {req.tenant!r}")
        weight = await self._engine.set_tenant_weight(req.tenant, req.weight)
        return scheduler_pb2.SetTenantWeightResponse(tenant=req.tenant, weight=weight)

    async def ClusterStats(
        self, req: scheduler_pb2.ClusterStatsRequest, ctx: Ctx
    ) -> scheduler_pb2.ClusterStatsResponse:
        """Counts keyed by short state names ("ONLINE", "QUEUED", ...), every state present.
        total_samples_per_second sums the eligible nodes' observed (else benchmarked)
        throughput."""
        nodes_by_state = {
            state_name(state): n for state, n in self._registry.counts_by_state().items()
        }
        jobs = await self._store.count_jobs_by_state()
        jobs_by_state = {
            job_state_name(state): jobs.get(state, 0)
            for state in common_pb2.JobState.values()
            if state != common_pb2.JOB_STATE_UNSPECIFIED
        }
        total_sps = sum(
            n.observed_samples_per_second or n.benchmark.samples_per_second
            for n in self._registry.eligible_nodes()
        )
        blob_stats = await self._blobs.stats()
        return scheduler_pb2.ClusterStatsResponse(
            nodes_by_state=nodes_by_state,
            jobs_by_state=jobs_by_state,
            total_samples_per_second=total_sps,
            blobs=blob_stats.count,
            blob_bytes=blob_stats.total_bytes,
            events=await self._store.count_events(),
            heartbeats_total=self._registry.heartbeats_total,
            uptime_ms=int((time.monotonic() - self._started) * 1000),
        )
