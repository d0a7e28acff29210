"""The bulk socket under mutual TLS (node_agent.ring.bulk_conn): after the TLS handshake and the
key-share exchange inside TLS, the stream is AES-256-GCM records. Over real sockets on
loopback: bytes arrive exactly (any split, both directions), nothing readable crosses the wire,
an altered, replayed or dropped record is refused, a cut stream is an error (not a short
read), only peers of our CA with the expected names get a sealed stream, and a ring survives a
peer that dies mid-transfer by naming it.

Token and certificate refusals of the listener itself: tests/integration/test_ring_bulk.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from epochmesh.identity import Identity
from node_agent.ring import bulk
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.bulk_conn import KEY_SHARE_BYTES, MAX_RECORD_BYTES, BulkError, TlsConn
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.wire import ring_chunk_header
from tests.integration.test_ring_allreduce import (
    CHUNK,
    _data,
    _expect_failures,
    _retry_without,
    started_peers,
)
from tests.integration.test_ring_bulk import _token
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(60)


def _identities(tmp_path: Path, n: int) -> list[Identity]:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path / "ca")
    return [issue_identity(ca, "node", f"node-{i}") for i in range(n)]


# ---------------------------------------------------------------------------------------------
# A relay on loopback between the two ends, which can alter what passes once armed


class Relay:
    """Forwards bytes both ways between a client and `target_port`. Armed (`mode`), it parses
    the client-to-server bytes as sealed records and alters the next record: flips a byte
    ("flip"), sends it twice ("replay"), drops it ("drop"), or sends half and closes ("cut")."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode: str | None = None
        self.seen = bytearray()  # every client-to-server byte
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        assert self._server is not None
        self._server.close()

    def close(self) -> None:
        for w in self._writers:
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        back = asyncio.create_task(self._pipe(up_reader, writer))
        try:
            await self._forward(reader, up_writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            up_writer.close()
            back.cancel()
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if self.mode is not None:  # armed while idle: `data` starts at a record
                buf = bytearray(data)
                while len(buf) < 4 or len(buf) < 20 + struct.unpack_from("<I", buf)[0]:
                    more = await reader.read(65536)
                    if not more:
                        return
                    buf += more
                end = 20 + struct.unpack_from("<I", buf)[0]
                record, rest = bytes(buf[:end]), bytes(buf[end:])
                mode, self.mode = self.mode, None
                if mode == "cut":
                    writer.write(record[: len(record) // 2])
                    await writer.drain()
                    return
                if mode == "flip":
                    record = record[:10] + bytes([record[10] ^ 1]) + record[11:]
                elif mode == "replay":
                    record += record
                elif mode == "drop":
                    record = b""
                data = record + rest
            self.seen += data
            writer.write(data)
            await writer.drain()

    def arm(self, mode: str) -> None:
        """Alter the next record; call it while nothing is in flight to the server."""
        self.mode = mode


# ---------------------------------------------------------------------------------------------
# A sealed pair: the TLS handshake and the share exchange as bulk.connect / BulkListener do them


async def _sealed_pair(
    sender_id: Identity, receiver_id: Identity, *, expect: str = "node-1", via: bool = False
) -> AsyncIterator[tuple[TlsConn, TlsConn, Relay | None]]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    relay: Relay | None = None
    async with contextlib.AsyncExitStack() as stack:
        port = listener.getsockname()[1]
        if via:
            relay = await stack.enter_async_context(Relay(port))
            port = relay.port
        client = socket.socket()
        client.setblocking(False)
        connected = loop.sock_connect(client, ("127.0.0.1", port))
        (server, _), _ = await asyncio.gather(loop.sock_accept(listener), connected)
        listener.close()
        server.setblocking(False)
        c = TlsConn(client, bulk.client_ssl_context(sender_id), server_hostname=expect)
        s = TlsConn(server, bulk.server_ssl_context(receiver_id))
        stack.callback(c.close)
        stack.callback(s.close)
        await asyncio.wait_for(asyncio.gather(c.handshake(), s.handshake()), 10)
        mine, theirs = os.urandom(KEY_SHARE_BYTES), os.urandom(KEY_SHARE_BYTES)
        await c.sendall([mine])
        got = bytearray(KEY_SHARE_BYTES)
        await s.recv_exactly(memoryview(got))
        await s.sendall([theirs])
        s.seal(bytes(got), theirs)
        back = bytearray(KEY_SHARE_BYTES)
        await c.recv_exactly(memoryview(back))
        c.seal(mine, bytes(back))
        yield c, s, relay


sealed_pair = contextlib.asynccontextmanager(_sealed_pair)


async def _read(conn: TlsConn, n: int, step: int) -> bytes:
    """`n` bytes from `conn` in reads of at most `step` bytes."""

    async def read() -> bytes:
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = await conn.recv_into(view[got : got + step])
            assert k > 0, f"end of stream after {got} of {n} bytes"
            got += k
        return bytes(out)

    return await asyncio.wait_for(read(), 20)


# ---------------------------------------------------------------------------------------------
# Bytes delivered exactly, sealed


async def test_bytes_arrive_exactly_in_any_split_and_sealed_on_the_wire(tmp_path: Path) -> None:
    ids = _identities(tmp_path, 2)
    sizes = [1, 7, 4096, 4097, 100_000, MAX_RECORD_BYTES, 2 * MAX_RECORD_BYTES + 3]
    marker = b"plaintext-marker-" * 64
    async with sealed_pair(ids[0], ids[1], via=True) as (c, s, relay):
        assert c.sealed and s.sealed and relay is not None
        for step, upto in ((5, 4097), (65536, None), (3 * MAX_RECORD_BYTES, None)):
            bufs = [
                marker + os.urandom(n) for n in sizes[: sizes.index(upto) + 1 if upto else None]
            ]
            bufs.append(b"")
            want = b"".join(bufs)
            sent = asyncio.create_task(c.sendall([memoryview(b) for b in bufs]))
            got = await _read(s, len(want), step)
            await sent
            assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest()
        # The other direction (the receiver's replies) is sealed too.
        await s.sendall([marker, b"ack"])
        assert await _read(c, len(marker) + 3, 1000) == marker + b"ack"
        # Nothing readable crossed the wire after the handshake.
        assert marker[:32] not in relay.seen
        # A clean end of the stream at a record boundary reads as the end.
        c.shutdown_write()
        assert await asyncio.wait_for(s.recv_into(memoryview(bytearray(10))), 10) == 0


# ---------------------------------------------------------------------------------------------
# Altered, replayed, dropped or cut records


@pytest.mark.parametrize("mode", ["flip", "replay", "drop", "cut"])
async def test_an_altered_or_cut_stream_is_refused(tmp_path: Path, mode: str) -> None:
    ids = _identities(tmp_path, 2)
    async with sealed_pair(ids[0], ids[1], via=True) as (c, s, relay):
        assert relay is not None
        await c.sendall([b"first record"])
        assert await _read(s, 12, 100) == b"first record"
        relay.arm(mode)
        payload = os.urandom(MAX_RECORD_BYTES)
        with contextlib.suppress(OSError):
            await c.sendall([payload])
            await c.sendall([b"next record"])
        target = memoryview(bytearray(MAX_RECORD_BYTES + 11))
        with pytest.raises(BulkError) as refused:
            await asyncio.wait_for(s.recv_exactly(target), 10)
        if mode == "cut":
            assert "closed inside a sealed record" in str(refused.value)
        else:
            assert "failed its authentication" in str(refused.value)


async def test_a_tampered_chunk_fails_the_ring_attempt_naming_the_sender(tmp_path: Path) -> None:
    """Node 1's stream to node 0 passes a relay that flips a byte of a chunk: node 0's
    listener refuses the stream, the attempt fails naming node 1, and no chunk was applied."""
    ids = _identities(tmp_path, 2)
    async with started_peers(2, ids) as peers:
        listener = peers.servers[0].bulk
        assert listener is not None
        task = asyncio.create_task(
            ring_allreduce(
                torch.ones(1000), peers.ring(0), peers.transports[0], 5.0, job_id="job", round=0
            )
        )
        reply = await _token(peers, 0, as_node=1, key=("job", 0, 0))
        async with Relay(reply.port) as relay:
            out = await asyncio.wait_for(
                bulk.connect(
                    "127.0.0.1",
                    relay.port,
                    reply.token,
                    node_id="node-0",
                    ssl_context=bulk.client_ssl_context(ids[1]),
                ),
                10,
            )
            header = ring_chunk_header(
                job_id="job",
                round=0,
                attempt=0,
                from_node_id="node-1",
                phase="reduce_scatter",
                segment=1,
            )
            relay.arm("flip")  # the chunk's frame header record
            with contextlib.suppress(BulkError):
                await out.write_chunk(header, 0, b"\0" * 2000)
                await asyncio.wait_for(out.finish(), 10)
            out.close()
        with pytest.raises(RingPeerFailed) as failed:
            await asyncio.wait_for(task, 20)
        assert failed.value.node_id == "node-1"
        assert peers.servers[0].service.received_chunks == 0


# ---------------------------------------------------------------------------------------------
# Mutual authentication before any sealed byte


async def test_no_sealed_stream_with_a_foreign_ca_or_a_wrong_name(tmp_path: Path) -> None:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ids = _identities(tmp_path, 2)
    foreign_ca = ensure_ca(tmp_path / "foreign")
    # Foreign certificates that trust our CA: only the other end can refuse them.
    as_sender = issue_identity(foreign_ca, "node", "node-0")
    as_sender = Identity(
        ca_pem=ids[0].ca_pem, cert_pem=as_sender.cert_pem, key_pem=as_sender.key_pem
    )
    as_receiver = issue_identity(foreign_ca, "node", "node-1")
    as_receiver = Identity(
        ca_pem=ids[1].ca_pem, cert_pem=as_receiver.cert_pem, key_pem=as_receiver.key_pem
    )
    for sender, receiver, expect in [
        (as_sender, ids[1], "node-1"),  # the receiver refuses the sender's certificate
        (ids[0], as_receiver, "node-1"),  # the sender refuses the receiver's certificate
        (ids[0], ids[1], "node-7"),  # the receiver is not the node the sender means to reach
    ]:
        with pytest.raises((ssl.SSLError, OSError, BulkError, asyncio.IncompleteReadError)):
            async with sealed_pair(sender, receiver, expect=expect):
                pass


# ---------------------------------------------------------------------------------------------
# A peer dying mid-transfer


async def test_a_peer_dying_mid_transfer_is_named_within_the_deadline(tmp_path: Path) -> None:
    n, victim, numel, deadline = 4, 2, 4 * 3 * CHUNK, 1.0
    ids = _identities(tmp_path, n)
    async with started_peers(n, ids) as peers:
        bufs = [_data(r, numel) for r in range(n)]
        tasks = [
            asyncio.create_task(
                ring_allreduce(
                    bufs[r], peers.ring(r), peers.transports[r], deadline, job_id="job", round=0
                )
            )
            for r in range(n)
        ]
        service = peers.servers[victim].service
        await async_wait_until(lambda: service.received_chunks >= 4, timeout=20, interval=0.001)
        tasks[victim].cancel()
        await peers.servers[victim].stop(None)
        await peers.transports[victim].close()
        survivors = [r for r in range(n) if r != victim]
        errors = await _expect_failures(
            [tasks[r] for r in survivors], "node-2", within_s=3 * deadline + 3
        )
        assert any(e.detected_here for e in errors)
        assert all(peers.transports[r].bulk_streams == 1 for r in survivors)
        with contextlib.suppress(BaseException):
            await tasks[victim]
        # The survivors' next attempt runs sealed over the bulk socket and sums right.
        await _retry_without(peers, survivors, numel)
        assert all(peers.transports[r].bulk_streams == 2 for r in survivors)
