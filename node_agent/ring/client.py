"""The caller's side of a peer's PeerService: channels, pings and link probes, ring status, state.

`peer_channel` opens a channel to a node (mutual TLS naming it when there is an identity);
`ping`, `ring_status` and `probe_link` use Ping; `fetch_state` pulls a job's state over
TransferState and checks it. The server side is `node_agent.ring.service`.
"""

from __future__ import annotations

import math
import time

import grpc

from epochmesh import identity as idm
from epochmesh.errors import CodecError
from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import peer_pb2
from epochmesh.wire.tensors import (
    BundleAssembler,
    BundleLimits,
    Expected,
)
from node_agent.ring.mailbox import RingStatus, StateSnapshot
from node_agent.ring.wire import PING, TRANSFER_STATE, RingKey


async def ping(channel: grpc.aio.Channel, *, timeout: float, payload: bytes = b"") -> float:
    """Round-trip seconds of one Ping (raises grpc.aio.AioRpcError / TimeoutError)."""
    call = channel.unary_unary(
        PING,
        request_serializer=peer_pb2.PingRequest.SerializeToString,
        response_deserializer=peer_pb2.PingResponse.FromString,
    )
    t0 = time.perf_counter()
    reply = await call(peer_pb2.PingRequest(payload=payload), timeout=timeout)
    if reply.payload != payload:
        raise ValueError("peer echoed a different payload")
    return time.perf_counter() - t0


async def ring_status(channel: grpc.aio.Channel, key: RingKey, *, timeout: float) -> RingStatus:
    """Ping a ring member and return its state in attempt `key` (a peer from before this field
    answers "unknown"). Raises grpc.aio.AioRpcError / TimeoutError when it does not answer."""
    call = channel.unary_unary(
        PING,
        request_serializer=peer_pb2.PingRequest.SerializeToString,
        response_deserializer=peer_pb2.PingResponse.FromString,
    )
    job_id, round_, attempt = key
    reply = await call(
        peer_pb2.PingRequest(job_id=job_id, round=round_, attempt=attempt), timeout=timeout
    )
    starved = reply.starved_s if math.isfinite(reply.starved_s) else 0.0
    return RingStatus(reply.attempt_known, max(starved, 0.0), reply.failed_node_id)


async def probe_link(
    channel: grpc.aio.Channel, *, payload_bytes: int = MAX_CHUNK_BYTES, timeout: float = 10.0
) -> tuple[float, float]:
    """(rtt_s, bandwidth_bytes_per_s) to a peer: best of three empty pings, then a payload
    round trip (it travels both ways: 2 * payload_bytes over the time beyond the rtt)."""
    rtt = min([await ping(channel, timeout=timeout) for _ in range(3)])
    payload = bytes(min(payload_bytes, MAX_CHUNK_BYTES))
    t = min([await ping(channel, timeout=timeout, payload=payload) for _ in range(2)])
    bandwidth = 2 * len(payload) / max(t - rtt, 1e-6)
    return rtt, bandwidth


async def fetch_state(
    channel: grpc.aio.Channel,
    job_id: str,
    *,
    node_id: str = "",
    min_version: int = 0,
    expected: Expected | None = None,
    timeout: float | None = None,
    limits: BundleLimits | None = None,
) -> StateSnapshot:
    """Pull a job's parameters and optimizer state from a live peer (TransferState).

    Validates everything (`BundleAssembler`: header, chunk order and sizes, sha256, names,
    dtypes, shapes with `expected`, NaN/Inf). Raises grpc.aio.AioRpcError from the peer and
    CodecError for a bad stream.
    """
    call = channel.unary_stream(
        TRANSFER_STATE,
        request_serializer=peer_pb2.TransferStateRequest.SerializeToString,
        response_deserializer=peer_pb2.TransferStateResponse.FromString,
    )
    stream = call(
        peer_pb2.TransferStateRequest(job_id=job_id, node_id=node_id, version=min_version),
        timeout=timeout,
    )
    assembler: BundleAssembler | None = None
    version = -1
    async for part in stream:
        which = part.WhichOneof("part")
        if which == "header":
            if assembler is not None:
                raise CodecError("state transfer sent two headers")
            if part.header.job_id != job_id:
                raise CodecError(f"state transfer is for job {part.header.job_id!r}")
            version = part.header.version
            assembler = BundleAssembler(part.header.bundle, limits, expected=expected)
        elif which == "chunk":
            if assembler is None:
                raise CodecError("state transfer sent data before its header")
            assembler.add(part.chunk)
        else:
            raise CodecError("state transfer sent an empty message")
    if assembler is None:
        raise CodecError("state transfer ended without a header")
    if version < min_version:
        raise CodecError(f"peer sent version {version}, older than {min_version}")
    tensors = assembler.finish()
    return StateSnapshot(version=version, tensors=tensors)


def peer_channel(
    address: str, node_id: str = "", identity: idm.Identity | None = None
) -> grpc.aio.Channel:
    """A channel to the PeerService of node `node_id` at `address`: mutual TLS that checks the
    peer's certificate names `node_id` when an `identity` is given, else plaintext."""
    if identity is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if not node_id:
        raise ValueError("a TLS channel to a peer needs the peer's node id")
    return idm.peer_aio_channel(address, node_id, identity)
