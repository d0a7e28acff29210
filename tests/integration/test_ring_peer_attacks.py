"""Hostile peers against real PeerServers over mutual TLS (node certificates of one CA): planted
aborts, streams and bulk tokens for attempts nobody announced, per-peer caps, revoked
certificates, silent bulk connections, NaN fed into the ring. Each test ends with the honest
members' ring running to the right sums.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from epochmesh.identity import Identity
from epochmesh.v1 import agent_pb2, peer_pb2, peer_pb2_grpc
from node_agent.ring import bulk
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.client import peer_channel
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.wire import PUSH_CHUNKS, abort_chunk, ring_chunk_header
from tests.integration.test_ring_allreduce import (
    Peers,
    _allreduce_all,
    _data,
    _expected,
    started_peers,
)
from tests.integration.test_ring_bulk import _assert_paths, _token

pytestmark = pytest.mark.timeout(60)

KEY = ("job", 5, 0)


def _identities(tmp_path: Path, names: Sequence[str]) -> list[Identity]:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path / "ca")
    return [issue_identity(ca, "node", name) for name in names]  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _tls_peers(tmp_path: Path, n: int) -> AsyncIterator[tuple[Peers, Identity]]:
    """n peers node-0.. with node certificates, and the certificate of node-9, a stranger."""
    ids = _identities(tmp_path, [f"node-{i}" for i in range(n)] + ["node-9"])
    async with started_peers(n, ids[:n]) as peers:
        yield peers, ids[n]


async def _push(
    peers: Peers, target: int, identity: Identity, frames: Sequence[bytes]
) -> grpc.aio.AioRpcError | None:
    """A hand-driven PushChunks stream of raw RingChunk frames; the refusal, if any."""
    async with peer_channel(peers.addresses[target], peers.ids[target], identity) as ch:
        call = ch.stream_unary(
            PUSH_CHUNKS,
            request_serializer=None,
            response_deserializer=peer_pb2.RingAck.FromString,
        )(timeout=10)
        try:
            for f in frames:
                await call.write(f)
            await call.done_writing()
            await call
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def _refused(err: grpc.aio.AioRpcError | None, code: grpc.StatusCode, *words: str) -> None:
    assert err is not None, "accepted"
    assert err.code() == code, (err.code(), err.details())
    assert all(w in (err.details() or "") for w in words), err.details()


async def _honest_round(peers: Peers, round_: int, n: int = 3) -> None:
    inputs = [_data(r, 50_001) for r in range(n)]
    bufs = [x.clone() for x in inputs]
    await _allreduce_all(peers, bufs, round_=round_)
    assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)


async def test_planted_aborts_are_refused_and_never_fire(tmp_path: Path) -> None:
    """Aborts are taken only for attempts the node has a task of, from their members, naming a
    member; a revoked certificate is refused. The honest round then runs unharmed."""
    async with _tls_peers(tmp_path, 3) as (peers, mallory):
        me = peers.transports[0]._identity
        assert me is not None
        # A future round, before any task of it: nobody's abort is stored.
        for ident, sender in ((mallory, "node-9"), (me, "node-0")):
            err = await _push(peers, 2, ident, [abort_chunk(KEY, sender, "node-1")])
            _refused(err, grpc.StatusCode.FAILED_PRECONDITION, "not open", "ring tasks")
        # Announced (node-2's task arrived): a non-member may not report, nor name a stranger.
        peers.servers[2].mailbox.announce(KEY, peers.ids, 2, 60.0)
        err = await _push(peers, 2, mallory, [abort_chunk(KEY, "node-9", "node-1")])
        _refused(err, grpc.StatusCode.PERMISSION_DENIED, "not a member")
        err = await _push(peers, 2, me, [abort_chunk(KEY, "node-0", "node-9")])
        _refused(err, grpc.StatusCode.INVALID_ARGUMENT, "not a member")
        # A certificate on the coordinator's revocation list is refused, whatever it asks.
        peers.servers[2].service.add_revoked(["node-9"])
        err = await _push(peers, 2, mallory, [abort_chunk(KEY, "node-9", "node-1")])
        _refused(err, grpc.StatusCode.UNAUTHENTICATED, "revoked")
        async with peer_channel(peers.addresses[2], "node-2", mallory) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await peer_pb2_grpc.PeerServiceStub(ch).Ping(peer_pb2.PingRequest(), timeout=5)
        _refused(info.value, grpc.StatusCode.UNAUTHENTICATED, "revoked")
        # The victim node-1 is not blamed: the attempt the aborts aimed at runs to its sums.
        await _honest_round(peers, round_=5)


async def test_streams_and_tokens_only_for_announced_attempts_within_per_peer_caps(
    tmp_path: Path,
) -> None:
    async with _tls_peers(tmp_path, 3) as (peers, mallory):
        peers.servers[1].service.announce_wait_s = 0.5
        left = peers.transports[0]._identity
        assert left is not None
        head = ring_chunk_header(
            job_id="job", round=9, attempt=0, from_node_id="node-0", phase="reduce_scatter"
        )
        data = head + b"\x4a\x00"
        # No task of round 9 on node-1: neither a stream nor a bulk token.
        err = await _push(peers, 1, left, [data])
        _refused(err, grpc.StatusCode.FAILED_PRECONDITION, "not announced")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _token(peers, 1, as_node=0, key=("job", 9, 0), announce=False)
        _refused(info.value, grpc.StatusCode.FAILED_PRECONDITION, "not announced")
        # Announced: only the left neighbour gets tokens, at most MAX_TOKENS_PER_PEER unused.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _token(peers, 1, as_node=2, key=("job", 9, 0))
        _refused(info.value, grpc.StatusCode.FAILED_PRECONDITION, "not this node's left")
        for _ in range(bulk.MAX_TOKENS_PER_PEER):
            await _token(peers, 1, as_node=0, key=("job", 9, 0))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _token(peers, 1, as_node=0, key=("job", 9, 0))
        _refused(info.value, grpc.StatusCode.RESOURCE_EXHAUSTED, "per peer")
        # A stranger holding streams open for attempts of its own making: capped per peer.
        fake = ring_chunk_header(
            job_id="job", round=99, attempt=0, from_node_id="node-9", phase="reduce_scatter"
        )
        peers.servers[1].service.announce_wait_s = 20.0
        held = [
            asyncio.create_task(_push(peers, 1, mallory, [fake + b"\x4a\x00"]))
            for _ in range(peers.servers[1].service.max_streams_per_peer)
        ]
        service = peers.servers[1].service
        deadline = time.monotonic() + 10
        while service._peer_streams.get("node-9", 0) < service.max_streams_per_peer:
            assert time.monotonic() < deadline, "the stranger's streams never arrived"
            await asyncio.sleep(0.02)
        err = await _push(peers, 1, mallory, [fake + b"\x4a\x00"])
        _refused(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "per peer", "node-9")
        # Meanwhile the honest members' round runs: over their bulk sockets, but node-0 still
        # holds its unused tokens of round 9 on node-1 and sends over PushChunks there.
        await _honest_round(peers, round_=10)
        _assert_paths(peers, [1, 2], bulk_streams=1, grpc_streams=0)
        _assert_paths(peers, [0], bulk_streams=0, grpc_streams=1)
        for t in held:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def test_silent_bulk_connections_are_cut_after_a_short_handshake_timeout(
    tmp_path: Path,
) -> None:
    async with _tls_peers(tmp_path, 3) as (peers, _):
        listener = peers.servers[1].bulk
        assert listener is not None and listener.handshake_timeout_s <= 5.0
        loop = asyncio.get_running_loop()
        silent: list[socket.socket] = []
        for _ in range(listener.max_handshakes):
            s = socket.create_connection(("127.0.0.1", listener.port))
            s.setblocking(False)
            silent.append(s)
        deadline = time.monotonic() + 5
        while listener.handshaking < listener.max_handshakes:
            assert time.monotonic() < deadline, listener.handshaking
            await asyncio.sleep(0.02)
        # One more while they wait: closed at once.
        extra = socket.create_connection(("127.0.0.1", listener.port))
        extra.setblocking(False)
        t0 = time.monotonic()
        assert await asyncio.wait_for(loop.sock_recv(extra, 1), 2) == b""
        assert time.monotonic() - t0 < 2
        extra.close()
        # The silent ones are cut when the handshake timeout passes.
        for s in silent:
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(loop.sock_recv(s, 1), 10) == b""
            s.close()
        assert time.monotonic() - t0 < listener.handshake_timeout_s + 3
        assert listener.handshaking == 0
        await _honest_round(peers, round_=1)
        _assert_paths(peers, range(3), bulk_streams=1, grpc_streams=0)


async def test_a_member_feeding_nan_is_blamed_by_its_neighbour(tmp_path: Path) -> None:
    """node-0's buffer holds a NaN: node-1 refuses the chunk that carries it, and every member
    fails the attempt naming node-0; the retry without it gets the right sums."""
    async with _tls_peers(tmp_path, 3) as (peers, _):
        inputs = [_data(r, 50_001) for r in range(3)]
        bufs = [x.clone() for x in inputs]
        bufs[0][7] = float("nan")
        results = await asyncio.gather(
            *(
                ring_allreduce(
                    bufs[r], peers.ring(r), peers.transports[r], 5.0, job_id="job", round=3
                )
                for r in range(3)
            ),
            return_exceptions=True,
        )
        assert all(isinstance(r, RingPeerFailed) for r in results), results
        assert {r.node_id for r in results if isinstance(r, RingPeerFailed)} == {"node-0"}
        assert any("NaN or Inf" in r.reason for r in results if isinstance(r, RingPeerFailed))
        # Only node-1, which received node-0's data, reports the fault (as its own finding).
        faults = [r.fault if isinstance(r, RingPeerFailed) else None for r in results]
        assert faults == [
            agent_pb2.RING_FAULT_UNSPECIFIED,
            agent_pb2.RING_FAULT_NON_FINITE,
            agent_pb2.RING_FAULT_UNSPECIFIED,
        ]
        ok = [inputs[1].clone(), inputs[2].clone()]
        await _allreduce_all(peers, ok, members=[1, 2], attempt=1, round_=3)
        expected = (inputs[1] + inputs[2]).numpy().tobytes()
        assert all(b.numpy().tobytes() == expected for b in ok)
