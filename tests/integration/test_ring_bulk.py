"""The ring's bulk data path (node_agent.ring.bulk) over real sockets on loopback: it carries the ring,
its handshake checks tokens and certificates, bad or stale streams are refused and blamed on the
sender, and a peer without a (reachable) bulk socket is served over PushChunks instead.

Peers that die or stall mid-reduce over the bulk socket: tests/integration/test_ring_allreduce.py
(its rings run over the bulk socket, as agents do)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import torch

from epochmesh.identity import Identity
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import peer_pb2, peer_pb2_grpc
from node_agent.ring import bulk
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.bulk import BulkError
from node_agent.ring.bulk_conn import MAX_SEALED_BYTES, TlsConn
from node_agent.ring.client import peer_channel
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.service import PeerServer
from node_agent.ring.wire import ring_chunk_header
from tests.integration.test_ring_allreduce import (
    Peers,
    _allreduce_all,
    _data,
    _expected,
    started_peers,
)
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(60)


def _identities(tmp_path: Path, n: int) -> tuple[object, list[Identity]]:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path / "ca")
    return ca, [issue_identity(ca, "node", f"node-{i}") for i in range(n)]


async def _token(
    peers: Peers,
    target: int,
    *,
    as_node: int,
    identity: Identity | None = None,
    key: tuple[str, int, int] = ("job", 0, 0),
    from_node_id: str | None = None,
    announce: bool = True,
) -> peer_pb2.OpenBulkResponse:
    """OpenBulk on node `target`, called with node `as_node`'s certificate (or `identity`);
    `announce`: first give `target` the attempt, as its ring task does (ring of all peers)."""
    if announce:
        peers.servers[target].mailbox.announce(key, peers.ids, target, 60.0)
    ident = identity if identity is not None else peers.transports[as_node]._identity
    async with peer_channel(peers.addresses[target], peers.ids[target], ident) as ch:
        stub = peer_pb2_grpc.PeerServiceStub(ch)
        job, round_, attempt = key
        return await stub.OpenBulk(
            peer_pb2.OpenBulkRequest(
                job_id=job,
                round=round_,
                attempt=attempt,
                from_node_id=from_node_id or peers.ids[as_node],
            ),
            timeout=5,
        )


async def _connect(
    reply: peer_pb2.OpenBulkResponse, node_id: str, identity: Identity | None
) -> bulk.BulkOutput:
    ctx = bulk.client_ssl_context(identity) if identity is not None else None
    return await asyncio.wait_for(
        bulk.connect("127.0.0.1", reply.port, reply.token, node_id=node_id, ssl_context=ctx), 10
    )


def _assert_paths(
    peers: Peers, members: Sequence[int], bulk_streams: int, grpc_streams: int
) -> None:
    for m in members:
        t = peers.transports[m]
        assert (t.bulk_streams, t.grpc_streams) == (bulk_streams, grpc_streams), peers.ids[m]


# ---------------------------------------------------------------------------------------------
# The ring runs over it


@pytest.mark.parametrize("tls", [False, True])
async def test_the_ring_runs_over_the_bulk_socket(tmp_path: Path, tls: bool) -> None:
    n, numel = 3, 1_500_007
    identities = _identities(tmp_path, n)[1] if tls else None
    async with started_peers(n, identities) as peers:
        assert all(s.bulk is not None and s.bulk.port > 0 for s in peers.servers)
        for round_ in range(2):
            inputs = [_data(r, numel, seed=round_) for r in range(n)]
            bufs = [x.clone() for x in inputs]
            await _allreduce_all(peers, bufs, round_=round_)
            want = _expected(inputs)
            assert all(b.numpy().tobytes() == want for b in bufs)
        _assert_paths(peers, range(n), bulk_streams=2, grpc_streams=0)
        # The second round went on the connections the first one opened.
        assert [t.bulk_reused for t in peers.transports] == [1] * n
        assert [s.bulk.kept_streams for s in peers.servers if s.bulk] == [1] * n
        # Lossy codecs too (forwarded chunks are kept in buffers of their own).
        inputs = [_data(r, numel, seed=7) for r in range(n)]
        bufs = [x.clone() for x in inputs]
        await _allreduce_all(peers, bufs, round_=2, codec="int8")
        assert all(torch.equal(b, bufs[0]) for b in bufs)
        _assert_paths(peers, range(n), bulk_streams=3, grpc_streams=0)
        assert [t.bulk_reused for t in peers.transports] == [2] * n


# ---------------------------------------------------------------------------------------------
# Kept connections


async def _round(peers: Peers, round_: int, numel: int = 300_007) -> None:
    inputs = [_data(r, numel, seed=round_) for r in range(len(peers.ids))]
    bufs = [x.clone() for x in inputs]
    await _allreduce_all(peers, bufs, round_=round_)
    want = _expected(inputs)
    assert all(b.numpy().tobytes() == want for b in bufs)


def _kept_conn(peers: Peers, sender: int, receiver: int) -> bulk.Conn:
    """The connection `sender` keeps to `receiver` (taken out of its transport)."""
    kept = peers.transports[sender]._kept.pop(
        (peers.addresses[receiver], peers.ids[receiver]), None
    )
    assert kept is not None, "no kept connection"
    return kept[0]


@pytest.mark.parametrize("how", ["idle", "older_receiver"])
async def test_a_connection_the_receiver_does_not_keep_is_opened_afresh(
    tmp_path: Path, how: str
) -> None:
    """A receiver that closed a kept connection (its idle time ran out) or never keeps one (an
    older agent: OpenBulk says so): every attempt still goes over the bulk socket."""
    n = 3
    async with started_peers(n, _identities(tmp_path, n)[1]) as peers:
        listeners = [s.bulk for s in peers.servers if s.bulk is not None]
        for listener in listeners:
            if how == "idle":
                listener.keep_idle_s = 0.05
            else:
                listener.keep_alive = False
        await _round(peers, 0)
        if how == "idle":
            # Each receiver closes its kept connection; the senders do not know it yet.
            await async_wait_until(
                lambda: all(not listener._handlers for listener in listeners),
                timeout=10,
                message="the receivers did not close their idle connections",
            )
            assert all(t._kept for t in peers.transports)
        else:
            assert not any(t._kept for t in peers.transports)
        await _round(peers, 1)
        _assert_paths(peers, range(n), bulk_streams=2, grpc_streams=0)
        assert [t.bulk_reused for t in peers.transports] == [0] * n
        assert all(listener.kept_streams == 0 for listener in listeners)


async def test_a_kept_connection_is_checked_at_every_stream(tmp_path: Path) -> None:
    """The next stream on a kept connection is refused when its attempt does not have the
    connection's node as left neighbour here (or was never announced here), when it is
    malformed, and when its node was revoked meanwhile."""
    n = 3
    async with started_peers(n, _identities(tmp_path, n)[1]) as peers:
        await _round(peers, 0)
        # node-0's kept connection to node-1, for an attempt where node-2 is node-1's left.
        key = ("job", 1, 0)
        peers.servers[1].mailbox.announce(key, ["node-2", "node-1", "node-0"], 1, 60.0)
        with pytest.raises(BulkError) as refused:
            await asyncio.wait_for(bulk.resume(_kept_conn(peers, 0, 1), key), 10)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "has 'node-2', not 'node-0', as this node's left neighbour" in str(refused.value)
        await _round(peers, 2)  # keeps fresh connections again
        with pytest.raises(BulkError) as refused:
            await asyncio.wait_for(bulk.resume(_kept_conn(peers, 0, 1), ("job", 9, 0)), 10)
        assert "was not announced to this node" in str(refused.value)
        # Malformed: no job id.
        conn = _kept_conn(peers, 1, 2)
        await conn.sendall([bulk.MAGIC_NEXT + struct.pack("<Hqq", 0, 1, 0)])
        kind, body = await asyncio.wait_for(bulk._read_reply(conn), 10)
        assert kind == bulk.REPLY_ERROR
        assert bulk._parse_error(body).code == grpc.StatusCode.INVALID_ARGUMENT
        conn.close()
        # Revoked since the connection was opened.
        peers.servers[0].service.add_revoked(["node-2"])
        with pytest.raises(BulkError) as refused:
            await asyncio.wait_for(bulk.resume(_kept_conn(peers, 2, 0), ("job", 1, 0)), 10)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in refused.value.details


async def test_a_connection_past_half_its_sealed_bytes_is_not_kept(tmp_path: Path) -> None:
    """AES-GCM records go on with their sequence numbers on a kept connection: one that has
    sealed half the connection's byte limit is closed after its stream, and the next attempt
    opens a fresh one."""
    n = 2
    async with started_peers(n, _identities(tmp_path, n)[1]) as peers:
        await _round(peers, 0)
        conn = peers.transports[0]._kept[(peers.addresses[1], peers.ids[1])][0]
        assert isinstance(conn, TlsConn) and bulk.reusable(conn)
        conn._sealed_out = MAX_SEALED_BYTES // 2
        assert not bulk.reusable(conn)
        await _round(peers, 1)  # on the kept connection, which is then closed
        assert peers.transports[0].bulk_reused == 1
        assert (peers.addresses[1], peers.ids[1]) not in peers.transports[0]._kept
        await _round(peers, 2)  # a fresh connection
        assert peers.transports[0].bulk_reused == 1
        _assert_paths(peers, range(n), bulk_streams=3, grpc_streams=0)


async def test_at_its_limit_a_receiver_closes_an_idle_kept_connection(tmp_path: Path) -> None:
    n = 2
    identities = _identities(tmp_path, n)[1]
    async with started_peers(n, identities) as peers:
        await _round(peers, 0)
        listener = peers.servers[1].bulk
        assert listener is not None
        await async_wait_until(
            lambda: len(listener._idle) == 1, timeout=10, message="no idle kept connection"
        )
        listener.max_connections = 1
        key = ("job", 5, 0)
        out = await _connect(await _token(peers, 1, as_node=0, key=key), "node-1", identities[0])
        out.close()
        # The kept one is gone: its next stream is not taken.
        with pytest.raises((BulkError, OSError)):
            await asyncio.wait_for(bulk.resume(_kept_conn(peers, 0, 1), ("job", 6, 0)), 10)


# ---------------------------------------------------------------------------------------------
# Who may use it


async def test_tokens_and_certificates_are_checked(tmp_path: Path) -> None:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca, identities = _identities(tmp_path, 2)
    mallory = issue_identity(ca, "node", "node-9")  # type: ignore[arg-type]
    foreign = issue_identity(ensure_ca(tmp_path / "foreign"), "node", "node-0")
    async with started_peers(2, identities) as peers:
        me = identities[0]
        # The right name from a foreign CA (it trusts our CA, so only the receiver can refuse).
        impostor = Identity(ca_pem=me.ca_pem, cert_pem=foreign.cert_pem, key_pem=foreign.key_pem)
        # OpenBulk is authenticated like PushChunks: node-9 cannot ask as node-0.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _token(peers, 1, as_node=0, identity=mallory, from_node_id="node-0")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A token shown by another node's certificate is refused (and burnt).
        reply = await _token(peers, 1, as_node=0)
        assert len(reply.token) == bulk.TOKEN_BYTES and 0 < reply.expires_in_s <= 60
        with pytest.raises(BulkError) as refused:
            await _connect(reply, "node-1", mallory)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(BulkError) as refused:
            await _connect(reply, "node-1", me)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        # A fresh token works once; used again it is refused.
        reply = await _token(peers, 1, as_node=0)
        out = await _connect(reply, "node-1", me)
        with pytest.raises(BulkError) as refused:
            await _connect(reply, "node-1", me)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        out.close()
        # No token (random bytes of the right length), or not our protocol at all.
        fake = peer_pb2.OpenBulkResponse(port=reply.port, token=os.urandom(bulk.TOKEN_BYTES))
        with pytest.raises(BulkError) as refused:
            await _connect(fake, "node-1", me)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        ctx = bulk.client_ssl_context(me)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", reply.port, ssl=ctx, server_hostname="node-1"
        )
        writer.write(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
        said = b""
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            said = await asyncio.wait_for(reader.read(), 10)
        assert said == b""  # closed, nothing said
        writer.close()
        # A client of a foreign CA gets no connection, even with a valid token.
        reply = await _token(peers, 1, as_node=0)
        with pytest.raises((OSError, BulkError)):
            await _connect(reply, "node-1", impostor)
        # The sender checks the receiver's certificate names the node it means to reach.
        reply = await _token(peers, 1, as_node=0)
        with pytest.raises(ssl.SSLCertVerificationError):
            await _connect(reply, "node-2", me)
        # No TLS, no connection: a plaintext client is cut off.
        reply = await _token(peers, 1, as_node=0)
        with pytest.raises((OSError, BulkError)):
            await _connect(reply, "node-1", None)
        # And the ring still works after all that.
        inputs = [_data(r, 400_001) for r in range(2)]
        bufs = [x.clone() for x in inputs]
        await _allreduce_all(peers, bufs, round_=1)
        assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)
        _assert_paths(peers, range(2), bulk_streams=1, grpc_streams=0)


async def test_expired_tokens_and_stale_attempts_are_refused() -> None:
    async with started_peers(3, join_timeout_s=1.0) as peers:
        listener = peers.servers[1].bulk
        assert listener is not None
        listener.token_ttl_s = 0.0
        reply = await _token(peers, 1, as_node=0)
        with pytest.raises(BulkError) as refused:
            await _connect(reply, "node-1", None)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        listener.token_ttl_s = 10.0
        # Round 5 runs and ends: it and older rounds are over here.
        bufs = [_data(r, 1000) for r in range(3)]
        await _allreduce_all(peers, bufs, round_=5)
        for round_ in (5, 4):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _token(peers, 1, as_node=0, key=("job", round_, 0))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # A running attempt takes a stream from its left neighbour only.
        task = asyncio.create_task(
            ring_allreduce(
                torch.ones(1000), peers.ring(1), peers.transports[1], 5.0, job_id="job", round=6
            )
        )
        await asyncio.sleep(0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _token(peers, 1, as_node=2, key=("job", 6, 0))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # A token for attempt 0 of round 7, used after attempt 1 started: stale, refused.
        reply = await _token(peers, 1, as_node=0, key=("job", 7, 0))
        task.cancel()
        retry = asyncio.create_task(
            ring_allreduce(
                torch.ones(1000),
                peers.ring(1, attempt=1),
                peers.transports[1],
                5.0,
                job_id="job",
                round=7,
            )
        )
        await asyncio.sleep(0)
        out = await _connect(reply, "node-1", None)
        header = ring_chunk_header(
            job_id="job", round=7, attempt=0, from_node_id="node-0", phase="reduce_scatter"
        )
        with pytest.raises(BulkError) as refused:
            await out.write_chunk(header, 0, b"\0" * 1336)
            await asyncio.wait_for(out.finish(), 10)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        out.close()
        retry.cancel()
        for t in (task, retry):
            with contextlib.suppress(asyncio.CancelledError, RingPeerFailed):
                await t


async def test_malformed_or_oversized_frames_blame_the_sender() -> None:
    async with started_peers(2) as peers:
        for round_, bad in enumerate(["oversized", "wrong-size"]):
            task = asyncio.create_task(
                ring_allreduce(
                    torch.ones(1000),
                    peers.ring(0),
                    peers.transports[0],
                    5.0,
                    job_id="job",
                    round=round_,
                )
            )
            reply = await _token(peers, 0, as_node=1, key=("job", round_, 0))
            out = await _connect(reply, "node-0", None)
            header = ring_chunk_header(
                job_id="job",
                round=round_,
                attempt=0,
                from_node_id="node-1",
                phase="reduce_scatter",
                segment=1,
            )
            size = MAX_CHUNK_BYTES + 1 if bad == "oversized" else 1996
            with pytest.raises(BulkError) as refused:
                await out.write_chunk(header, 0, b"\0" * size)
                await asyncio.wait_for(out.finish(), 10)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            out.close()
            with pytest.raises(RingPeerFailed) as failed:
                await asyncio.wait_for(task, 10)
            assert failed.value.node_id == "node-1" and failed.value.detected_here


# ---------------------------------------------------------------------------------------------
# Fallback to PushChunks


async def test_fallback_to_push_chunks_without_a_bulk_socket(tmp_path: Path) -> None:
    n, numel = 3, 700_001
    _, identities = _identities(tmp_path, n)
    async with started_peers(n, identities) as peers:
        # Node 1 runs an older (or restricted) agent: OpenBulk is UNIMPLEMENTED.
        await peers.servers[1].stop(None)
        old = PeerServer(
            peers.addresses[1], identity=identities[1], bulk=False, join_timeout_s=60.0
        )
        await old.start()
        peers.servers[1] = old
        peers.transports[1].mailbox = old.mailbox
        for round_ in range(2):
            inputs = [_data(r, numel, seed=round_) for r in range(n)]
            bufs = [x.clone() for x in inputs]
            await _allreduce_all(peers, bufs, round_=round_)
            assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)
        # Node 0 (node 1's left neighbour) fell back; the others kept their bulk sockets.
        assert (peers.transports[0].bulk_streams, peers.transports[0].grpc_streams) == (0, 2)
        _assert_paths(peers, [1, 2], bulk_streams=2, grpc_streams=0)
        # Node 2's bulk socket cannot be reached (a firewall, say): PushChunks again.
        listener = peers.servers[2].bulk
        assert listener is not None
        await listener.stop()  # OpenBulk still hands out its (now closed) port
        inputs = [_data(r, numel, seed=5) for r in range(n)]
        bufs = [x.clone() for x in inputs]
        await _allreduce_all(peers, bufs, round_=2)
        assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)
        assert (peers.transports[1].bulk_streams, peers.transports[1].grpc_streams) == (2, 1)


async def test_the_bulk_socket_binds_the_peer_service_host() -> None:
    server = PeerServer("127.0.0.1:0")
    await server.start()
    try:
        assert server.bulk is not None
        with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5):
            pass
        assert server.bulk.host == "127.0.0.1"
    finally:
        await server.stop(None)
    assert server.bulk is None
