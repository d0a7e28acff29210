"""AgentService: node agents -> coordinator (leases, benchmarks, blobs, probes).

The training RPCs (NextTask, PushUpdate, PullParameters, ReportProgress) go to the engine;
NextTask, PullParameters and ReportProgress are lease-checked first.
Method names are the RPC names; the server wraps them (error mapping, malformed input).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from coordinator.core.errors import CoordinatorError, InvalidArgumentError, PermissionDeniedError
from coordinator.core.ids import check_text, require_node_id, require_sha256
from coordinator.core.principal import current_principal
from coordinator.core.stream_caps import StreamCaps, fetch_caps
from coordinator.engine.api import TrainingEngine
from coordinator.nodes.registry import NodeRegistry, require_price
from coordinator.store.blobs import BlobStore
from coordinator.trust.auth import require_self
from epochmesh.errors import CodecError
from epochmesh.identity import ROLE_NODE
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import MAX_BUCKETS, MAX_CHUNKS

Ctx: TypeAlias = grpc.aio.ServicerContext

MAX_DEVICES = 64
# Values of each part of a ring member's evidence (segments x buckets: 1 MiB of float64).
MAX_RING_EVIDENCE_VALUES = 131_072
MAX_LABELS = 64
# Ring seal digests, and ring features, a registration may declare (each).
MAX_RING_NAMES = 16
MAX_BENCHMARK_POINTS = 64
_FILLER = bytes(MAX_CHUNK_BYTES)


def _require_lease_id(value: str) -> str:
    return check_text(value, "lease_id", max_len=64, required=True)


def validate_device(device: common_pb2.Device, where: str) -> None:
    check_text(device.kind, f"{where}.kind", max_len=32)
    check_text(device.name, f"{where}.name", max_len=256)
    check_text(device.compute_capability, f"{where}.compute_capability", max_len=32)
    check_text(device.driver, f"{where}.driver", max_len=128)
    if device.index < 0 or device.total_memory_bytes < 0 or device.cores < 0:
        raise InvalidArgumentError(f"{where} has a negative index, memory or core count")


def validate_benchmark(result: common_pb2.BenchmarkResult) -> None:
    if result.job_id:
        check_text(result.job_id, "result.job_id", max_len=64)
    validate_device(result.device, "result.device")
    if len(result.points) > MAX_BENCHMARK_POINTS:
        raise InvalidArgumentError(
            f"too many benchmark points ({len(result.points)} > {MAX_BENCHMARK_POINTS})"
        )
    numbers = {
        "samples_per_second": result.samples_per_second,
        "rtt_ms": result.rtt_ms,
        "bandwidth_bytes_per_second": result.bandwidth_bytes_per_second,
        "slowdown": result.slowdown,
    }
    for i, point in enumerate(result.points):
        numbers[f"points[{i}].samples_per_second"] = point.samples_per_second
        if point.batch_size < 0 or point.peak_memory_bytes < 0:
            raise InvalidArgumentError(f"points[{i}] has a negative batch size or memory")
    for name, value in numbers.items():
        if not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"result.{name} must be a finite number >= 0, got {value}")
    if result.max_batch_size < 0:
        raise InvalidArgumentError("result.max_batch_size must not be negative")


async def _own_updates(
    first: agent_pb2.PushUpdateRequest | None,
    messages: AsyncIterator[agent_pb2.PushUpdateRequest],
) -> AsyncIterator[agent_pb2.PushUpdateRequest]:
    """The update stream again (``first`` already read), refused (PERMISSION_DENIED) when a
    header names another node."""
    if first is not None:
        yield first
    async for msg in messages:
        if msg.WhichOneof("part") == "header":
            require_self(msg.header.node_id)
        yield msg


class AgentService:
    def __init__(
        self,
        registry: NodeRegistry,
        blobs: BlobStore,
        engine: TrainingEngine,
        fetchers: StreamCaps | None = None,
    ) -> None:
        self._registry = registry
        self._blobs = blobs
        self._engine = engine
        self._fetchers = fetchers or fetch_caps()

    async def Register(
        self, req: agent_pb2.RegisterRequest, ctx: Ctx
    ) -> agent_pb2.RegisterResponse:
        check_text(req.name, "name", max_len=128, required=True)
        if req.node_id:
            require_node_id(req.node_id)
        # A node with a certificate is the node its certificate names.
        principal = current_principal()
        node_id, new_id_ok = req.node_id, False
        if principal is not None and principal.role == ROLE_NODE:
            if req.node_id and req.node_id != principal.id:
                raise PermissionDeniedError(
                    f"node {principal.id} may not register as {req.node_id}: "
                    "its certificate names only itself"
                )
            node_id, new_id_ok = principal.id, True
        check_text(req.peer_address, "peer_address", max_len=256)
        check_text(req.agent_version, "agent_version", max_len=64)
        if len(req.devices) > MAX_DEVICES:
            raise InvalidArgumentError(f"too many devices ({len(req.devices)} > {MAX_DEVICES})")
        for i, device in enumerate(req.devices):
            validate_device(device, f"devices[{i}]")
        if len(req.labels) > MAX_LABELS:
            raise InvalidArgumentError(f"too many labels ({len(req.labels)} > {MAX_LABELS})")
        for key, value in req.labels.items():
            check_text(key, "label key", max_len=128, required=True)
            check_text(value, f"label {key!r}", max_len=256)
        require_price(req.price_micro_per_hour)
        for what, names in (
            ("ring seal digest", req.ring_seal_digests),
            ("ring feature", req.ring_features),
        ):
            if len(names) > MAX_RING_NAMES:
                raise InvalidArgumentError(f"too many {what}s ({len(names)} > {MAX_RING_NAMES})")
            for name in names:
                check_text(name, what, max_len=32, required=True)
        reg = await self._registry.register(
            name=req.name,
            devices=list(req.devices),
            peer_address=req.peer_address,
            agent_version=req.agent_version,
            labels=dict(req.labels),
            node_id=node_id,
            new_id_ok=new_id_ok,
            price_micro_per_hour=req.price_micro_per_hour,
            ring_seal_digests=list(req.ring_seal_digests),
            ring_features=list(req.ring_features),
        )
        return agent_pb2.RegisterResponse(
            node_id=reg.node_id,
            lease_id=reg.lease_id,
            lease_ttl_ms=self._registry.lease_ttl_ms,
            heartbeat_interval_ms=self._registry.heartbeat_interval_ms,
        )

    async def Heartbeat(
        self, req: agent_pb2.HeartbeatRequest, ctx: Ctx
    ) -> agent_pb2.HeartbeatResponse:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.task_id, "task_id", max_len=128)
        require_price(req.price_micro_per_hour)
        state = await self._registry.heartbeat(
            req.node_id,
            req.lease_id,
            draining=req.draining,
            price_micro_per_hour=req.price_micro_per_hour,
        )
        cancel = bool(req.task_id) and self._engine.cancel_task(req.node_id, req.task_id)
        return agent_pb2.HeartbeatResponse(
            lease_ttl_ms=self._registry.lease_ttl_ms,
            heartbeat_interval_ms=self._registry.heartbeat_interval_ms,
            state=state,  # type: ignore[arg-type]
            cancel_task=cancel,
            leave=self._registry.leave_requested(req.node_id),
        )

    async def Leave(self, req: agent_pb2.LeaveRequest, ctx: Ctx) -> agent_pb2.LeaveResponse:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.reason, "reason", max_len=1024)
        await self._registry.leave(req.node_id, req.lease_id, req.reason)
        return agent_pb2.LeaveResponse()

    async def ReportBenchmark(
        self, req: agent_pb2.ReportBenchmarkRequest, ctx: Ctx
    ) -> agent_pb2.ReportBenchmarkResponse:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.task_id, "task_id", max_len=128)
        if not req.HasField("result"):
            raise InvalidArgumentError("result is required")
        validate_benchmark(req.result)
        self._registry.check_lease(req.node_id, req.lease_id)
        # A job's benchmark must answer a task of that job handed to this node: checked before
        # anything is stored or logged to the job's owner.
        self._engine.check_benchmark(req.node_id, req.task_id, req.result)
        await self._registry.set_benchmark(req.node_id, req.result)
        await self._engine.on_benchmark(req.node_id, req.result)
        return agent_pb2.ReportBenchmarkResponse()

    async def NextTask(self, req: agent_pb2.NextTaskRequest, ctx: Ctx) -> agent_pb2.Task:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        if req.wait_ms < 0:
            raise InvalidArgumentError(f"wait_ms must not be negative, got {req.wait_ms}")
        self._registry.check_lease(req.node_id, req.lease_id)
        return await self._engine.next_task(req, ctx)

    async def FetchBlob(
        self, req: agent_pb2.FetchBlobRequest, ctx: Ctx
    ) -> AsyncIterator[agent_pb2.FetchBlobResponse]:
        require_sha256(req.sha256)
        if req.offset < 0:
            raise InvalidArgumentError(f"offset must not be negative, got {req.offset}")
        # A node reads only its jobs' blobs; decided before the blob is looked up, so the
        # answer says nothing about blobs of others.
        principal = current_principal()
        if (
            principal is not None
            and principal.role == ROLE_NODE
            and not self._engine.may_fetch_blob(principal.id, req.sha256)
        ):
            raise PermissionDeniedError(
                f"node {principal.id} may fetch only the blobs of the jobs it works for or has "
                f"a check of; blob {req.sha256} is not one of them"
            )
        with self._fetchers.hold(principal.id if principal is not None else ""):
            async for offset, data, total in self._blobs.read_chunks(req.sha256, req.offset):
                yield agent_pb2.FetchBlobResponse(
                    total_size=total, chunk=common_pb2.DataChunk(offset=offset, data=data)
                )

    async def PushUpdate(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: Ctx
    ) -> agent_pb2.PushUpdateResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is not None and first.WhichOneof("part") == "header":
            require_self(first.header.node_id)  # before the engine reads a byte
        try:
            return await self._engine.push_update(_own_updates(first, messages), ctx)
        except (InvalidArgumentError, CodecError) as exc:
            # A refused update (wrong shape/dtype/size, NaN/Inf, ...): the engine returned the
            # slice to pending; the node gets a strike (quarantined at the limit).
            if first is not None and first.WhichOneof("part") == "header":
                header = first.header
                try:  # only a node holding its lease: never a strike for a forged header
                    self._registry.check_lease(header.node_id, header.lease_id)
                except CoordinatorError:
                    raise exc from None
                await self._registry.add_strike(
                    header.node_id, f"refused update: {exc}", job_id=header.job_id[:64]
                )
            raise

    async def PullParameters(
        self, req: agent_pb2.PullParametersRequest, ctx: Ctx
    ) -> AsyncIterator[agent_pb2.PullParametersResponse]:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        self._registry.check_lease(req.node_id, req.lease_id)
        async for part in self._engine.pull_parameters(req, ctx):
            yield part

    async def ReportProgress(
        self, req: agent_pb2.ReportProgressRequest, ctx: Ctx
    ) -> agent_pb2.ReportProgressResponse:
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.task_id, "task_id", max_len=128)
        check_text(req.params_checksum, "params_checksum", max_len=128)
        check_text(req.failed_peer_node_id, "failed_peer_node_id", max_len=128)
        if req.ring_attempt < 0 or req.params_version < 0 or req.samples_done < 0:
            raise InvalidArgumentError(
                "ring_attempt, params_version and samples_done must not be negative"
            )
        _check_peer_links(req)
        self._registry.check_lease(req.node_id, req.lease_id)
        return await self._engine.report_progress(req, ctx)

    async def CommitSketches(
        self, req: agent_pb2.CommitSketchesRequest, ctx: Ctx
    ) -> agent_pb2.CommitSketchesResponse:
        """The sketches of a checked update's chunks (coordinator/engine/verifier.py). Malformed ones
        are INVALID_ARGUMENT with a strike."""
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.job_id, "job_id", max_len=128, required=True)
        check_text(req.task_id, "task_id", max_len=128, required=True)
        if len(req.sketches) > MAX_CHUNKS * MAX_BUCKETS:
            raise InvalidArgumentError(
                f"{len(req.sketches)} sketch values (at most {MAX_CHUNKS * MAX_BUCKETS})"
            )
        if len(req.update_sketch) > MAX_BUCKETS:
            raise InvalidArgumentError(
                f"an update sketch of {len(req.update_sketch)} values (at most {MAX_BUCKETS})"
            )
        ring = req.ring
        if any(
            len(v) > MAX_RING_EVIDENCE_VALUES
            for v in (ring.sent, ring.received, ring.own, ring.result)
        ):
            raise InvalidArgumentError(
                f"ring evidence of more than {MAX_RING_EVIDENCE_VALUES} values per part"
            )
        self._registry.check_lease(req.node_id, req.lease_id)
        try:
            return await self._engine.commit_sketches(req)
        except InvalidArgumentError as exc:
            await self._registry.add_strike(req.node_id, str(exc), job_id=req.job_id[:64])
            raise

    async def ReportCheck(
        self, req: agent_pb2.ReportCheckRequest, ctx: Ctx
    ) -> agent_pb2.ReportCheckResponse:
        """A checker's recomputation of another node's chunk. A malformed one is
        INVALID_ARGUMENT with a strike."""
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.task_id, "task_id", max_len=128, required=True)
        check_text(req.error, "error", max_len=4096)
        if len(req.sketch) > MAX_BUCKETS:
            raise InvalidArgumentError(f"{len(req.sketch)} sketch values (at most {MAX_BUCKETS})")
        self._registry.check_lease(req.node_id, req.lease_id)
        try:
            await self._engine.report_check(req)
        except InvalidArgumentError as exc:
            await self._registry.add_strike(req.node_id, str(exc))
            raise
        return agent_pb2.ReportCheckResponse()

    async def AuthorizeStateTransfer(
        self, req: agent_pb2.AuthorizeStateTransferRequest, ctx: Ctx
    ) -> agent_pb2.AuthorizeStateTransferResponse:
        """May `requester_node_id` have job `job_id`'s state from the caller (a TransferState
        call the caller received)? Only if the coordinator told it to fetch it there."""
        require_node_id(req.node_id)
        require_self(req.node_id)
        _require_lease_id(req.lease_id)
        check_text(req.job_id, "job_id", max_len=128, required=True)
        require_node_id(req.requester_node_id, "requester_node_id")
        self._registry.check_lease(req.node_id, req.lease_id)
        reason = self._engine.authorize_state_transfer(
            req.job_id, req.node_id, req.requester_node_id
        )
        return agent_pb2.AuthorizeStateTransferResponse(allowed=reason is None, reason=reason or "")

    async def Probe(self, req: agent_pb2.ProbeRequest, ctx: Ctx) -> agent_pb2.ProbeResponse:
        """Echo ``payload`` when response_bytes is 0, else answer response_bytes of filler.
        Both are capped at 1 MiB."""
        if len(req.payload) > MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"probe payload of {len(req.payload)} bytes exceeds {MAX_CHUNK_BYTES} bytes"
            )
        if not 0 <= req.response_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"response_bytes must be within 0..{MAX_CHUNK_BYTES}, got {req.response_bytes}"
            )
        if req.response_bytes:
            return agent_pb2.ProbeResponse(payload=_FILLER[: req.response_bytes])
        return agent_pb2.ProbeResponse(payload=req.payload)


MAX_PEER_LINKS = 64


def _check_peer_links(req: agent_pb2.ReportProgressRequest) -> None:
    """Measured peer links: at most MAX_PEER_LINKS, each naming another node once, with a
    finite positive round trip (under a minute) and bandwidth."""
    if len(req.peer_links) > MAX_PEER_LINKS:
        raise InvalidArgumentError(
            f"{len(req.peer_links)} peer links; at most {MAX_PEER_LINKS} per report"
        )
    seen: set[str] = set()
    for link in req.peer_links:
        require_node_id(link.node_id, "peer_links.node_id")
        if link.node_id == req.node_id or link.node_id in seen:
            raise InvalidArgumentError(
                f"peer link to {link.node_id!r}: a node measures each other node at most once"
            )
        seen.add(link.node_id)
        if not (math.isfinite(link.rtt_ms) and 0 < link.rtt_ms < 60_000):
            raise InvalidArgumentError(
                f"peer link to {link.node_id!r}: rtt_ms must be within (0, 60000), "
                f"got {link.rtt_ms}"
            )
        bw = link.bandwidth_bytes_per_second
        if not (math.isfinite(bw) and bw > 0):
            raise InvalidArgumentError(
                f"peer link to {link.node_id!r}: bandwidth_bytes_per_second must be positive, "
                f"got {bw}"
            )
