"""Connections of the ring's bulk socket (`node_agent.ring.bulk`): plaintext, or mutual TLS
whose bulk bytes are sealed with AES-256-GCM records after the handshake.

Plaintext (``--insecure`` agents): the event loop's socket calls, no copy on the way out
(`sendmsg` of the caller's views) and none beyond the kernel's on the way in.

Mutual TLS: the handshake, the certificate checks and the token exchange run over TLS
(`ssl.SSLObject` on memory BIOs, on the event loop). In that exchange, inside TLS, each side
sends 32 random bytes (`KEY_SHARE_BYTES`); then both call `TlsConn.seal` and the connection
leaves TLS for records of its own, each sealed with AES-256-GCM:

    <u32 plaintext length> <ciphertext> <16-byte tag>

- keys: HKDF-SHA256 over the two shares (sender's first), 64 bytes: the first 32 key the
  sender-to-receiver direction, the last 32 the other; fresh for every connection, and known
  only to the two ends of the authenticated TLS channel that carried the shares;
- nonce: 4 zero bytes + the record's 64-bit sequence number in its direction (so a record
  that is dropped, replayed, reordered or moved to the other direction fails its tag);
- associated data: the 4-byte length prefix (a changed length fails the tag too);
- at most `MAX_RECORD_BYTES` of plaintext per record, and at most `MAX_SEALED_BYTES` per
  direction and connection (one ring attempt moves far less; past it the stream fails).

Why not TLS records all the way: Python's `ssl` cuts the data into 16 KiB records and its
OpenSSL (3.0 here) runs AES-GCM several times slower than the AES-GCM of `cryptography`'s own
OpenSSL build; on a 2-core machine that made TLS cost about 1.5 ms of CPU per MiB against
0.27 ms for plaintext, whether on the event loop (memory BIOs) or on blocking sockets in
worker threads (measured: no faster). One AES-GCM pass per 1 MiB chunk costs about 0.1 ms per
MiB and direction, so the sealed stream runs on the event loop, like the plaintext one.

A record fails (BulkError) on a bad tag, a length over the limit, or a connection that ends
inside a record; the stream then fails as a broken connection does. A record whose plaintext
fits the bytes the caller asked for is decrypted straight into the caller's buffer (a chunk's
payload lands where the ring wants it); a smaller request is served from one decrypted record.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import cast

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from epochmesh import identity as idm
from epochmesh.limits import MAX_CHUNK_BYTES

KEY_SHARE_BYTES = 32
TAG_BYTES = 16
# Plaintext bytes per sealed record: one chunk's payload (a frame header is a record of its own).
MAX_RECORD_BYTES = MAX_CHUNK_BYTES
# Bytes one direction of one connection may seal with its key (AES-GCM usage limit, with room).
MAX_SEALED_BYTES = 1 << 36
_RECORD = struct.Struct("<I")
_HKDF_INFO = b"epochmesh ring bulk records v1"
# Records up to this size are sealed into a fresh bytes object (frame headers, replies).
_SMALL_RECORD = 4096


class BulkError(Exception):
    """The bulk connection broke or was refused. `code` and `failed_node` come from the
    receiver's ERROR reply when it sent one."""

    def __init__(
        self, details: str, code: grpc.StatusCode | None = None, failed_node: str | None = None
    ) -> None:
        super().__init__(details)
        self.details = details
        self.code = code
        self.failed_node = failed_node


class Conn:
    """A connected non-blocking socket with async exact reads and gathered writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        return await self.loop.sock_recv_into(self.sock, view)

    async def recv_exactly(self, view: memoryview) -> None:
        got = 0
        n = len(view)
        while got < n:
            k = await self.recv_into(view[got:])
            if k == 0:
                raise BulkError(f"connection closed after {got} of {n} bytes")
            got += k

    async def sendall(self, bufs: Sequence[bytes | memoryview]) -> None:
        await self._send_raw(bufs)

    async def _send_raw(self, bufs: Sequence[bytes | memoryview]) -> None:
        sock = self.sock
        pending = [memoryview(b).cast("B") for b in bufs]
        while pending:
            try:
                sent = sock.sendmsg(pending)
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            while sent:
                head = pending[0]
                if sent >= len(head):
                    sent -= len(head)
                    pending.pop(0)
                else:
                    pending[0] = head[sent:]
                    sent = 0
            # Drop empty views (sendmsg of only empty buffers returns 0).
            while pending and not len(pending[0]):
                pending.pop(0)

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    async def handshake(self) -> None:
        return None

    def peer_principal(self) -> idm.Principal | None:
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)


def _record_keys(sender_share: bytes, receiver_share: bytes) -> tuple[bytes, bytes]:
    """(sender-to-receiver key, receiver-to-sender key) of one connection."""
    if len(sender_share) != KEY_SHARE_BYTES or len(receiver_share) != KEY_SHARE_BYTES:
        raise BulkError("malformed key share")
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=_HKDF_INFO).derive(
        sender_share + receiver_share
    )
    return okm[:32], okm[32:]


def _nonce(seq: int) -> bytes:
    return b"\0\0\0\0" + seq.to_bytes(8, "big")


class TlsConn(Conn):
    """Mutual TLS through ssl.SSLObject and memory BIOs for the handshake and the token
    exchange; after `seal`, AES-256-GCM records on the plain socket (see the module doc)."""

    RAW_READ = 256 * 1024

    def __init__(
        self, sock: socket.socket, ctx: ssl.SSLContext, *, server_hostname: str | None = None
    ) -> None:
        super().__init__(sock)
        self._raw = memoryview(bytearray(self.RAW_READ))
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._send_lock = asyncio.Lock()  # one sender of ciphertext at a time, in order
        self._ssl = ctx.wrap_bio(
            self._in,
            self._out,
            server_side=server_hostname is None,
            server_hostname=server_hostname,
        )
        self._sender_side = server_hostname is not None
        # Set by seal(): the record ciphers, sequence numbers and buffers.
        self._seal_out: AESGCM | None = None
        self._seal_in: AESGCM | None = None
        self._seq_out = 0
        self._seq_in = 0
        self._sealed_out = 0
        self._sealed_in = 0
        self._leftover = b""  # socket bytes the TLS layer read past its last record
        self._ct_out = bytearray()
        self._ct_in = bytearray()
        self._plain = bytearray()  # one decrypted record served to smaller reads
        self._plain_pos = 0
        self._plain_len = 0
        self._len_buf = bytearray(_RECORD.size)

    # -- TLS (handshake and token exchange) -----------------------------------------------------

    async def _flush(self) -> None:
        async with self._send_lock:
            data = self._out.read()
            if data:
                await self._send_raw([data])

    async def _fill(self) -> None:
        n = await self.loop.sock_recv_into(self.sock, self._raw)
        if not n:
            self._in.write_eof()
        else:
            self._in.write(self._raw[:n])

    async def handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    def _decrypt_tls(self, view: memoryview) -> int:
        """Decrypt what the incoming BIO holds into `view`: the bytes written, 0 at the end of
        the stream, -1 when more ciphertext is needed first."""
        got = 0
        n = len(view)
        while got < n:  # one record (16 KiB at most) per read
            try:
                # With a buffer, read returns the byte count (typeshed says bytes).
                k = cast(int, self._ssl.read(n - got, view[got:]))
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got
            if k <= 0:
                return got
            got += k
        return got if got else -1

    def peer_principal(self) -> idm.Principal | None:
        der = self._ssl.getpeercert(binary_form=True)
        if not der:
            return None
        try:
            return idm.principal_of(x509.load_der_x509_certificate(der))
        except (ValueError, idm.IdentityError):
            return None

    @property
    def sealed(self) -> bool:
        return self._seal_out is not None

    @property
    def sealed_bytes(self) -> tuple[int, int]:
        """Plaintext bytes sealed so far (sent, received) under this connection's keys."""
        return self._sealed_out, self._sealed_in

    def seal(self, sender_share: bytes, receiver_share: bytes) -> None:
        """Leave TLS: from now on both directions are AES-256-GCM records keyed from the two
        shares (exchanged inside TLS). Call it on both ends right after the exchange: the
        receiver after sending its share, the sender after reading it."""
        to_receiver, to_sender = _record_keys(sender_share, receiver_share)
        out_key, in_key = (
            (to_receiver, to_sender) if self._sender_side else (to_sender, to_receiver)
        )
        self._seal_out = AESGCM(out_key)
        self._seal_in = AESGCM(in_key)
        # Bytes the TLS layer has not consumed are the first bytes of the sealed stream. (It
        # reads one record at a time, so nothing past its last record is lost inside it.)
        self._leftover = self._in.read()

    # -- the byte stream (TLS before seal, records after) ---------------------------------------

    async def recv_into(self, view: memoryview) -> int:
        if self._seal_in is not None:
            return await self._recv_sealed(view)
        while True:
            got = self._decrypt_tls(view)
            if got >= 0:
                return got
            await self._flush()  # e.g. a key update
            await self._fill()

    async def sendall(self, bufs: Sequence[bytes | memoryview]) -> None:
        async with self._send_lock:
            if self._seal_out is not None:
                await self._send_sealed(bufs)
                return
            for b in bufs:
                view = memoryview(b).cast("B")
                while len(view):
                    n = self._ssl.write(view)
                    view = view[n:]
            data = self._out.read()
            if data:
                await self._send_raw([data])

    async def _send_sealed(self, bufs: Sequence[bytes | memoryview]) -> None:
        """One record per buffer (split at MAX_RECORD_BYTES), sent together in one gathered
        write where they can be; the large-record ciphertext buffer is reused, so a second
        large record waits until the first one is sent."""
        aead = self._seal_out
        assert aead is not None
        pending: list[bytes | memoryview] = []
        big_in_use = False
        for b in bufs:
            view = memoryview(b).cast("B")
            while len(view):
                part = view[:MAX_RECORD_BYTES]
                view = view[MAX_RECORD_BYTES:]
                n = len(part)
                self._sealed_out += n
                if self._sealed_out > MAX_SEALED_BYTES:
                    raise BulkError("the connection sealed its byte limit; open a new one")
                prefix = _RECORD.pack(n)
                nonce = _nonce(self._seq_out)
                self._seq_out += 1
                if n <= _SMALL_RECORD:
                    pending += [prefix, aead.encrypt(nonce, part, prefix)]
                    continue
                if big_in_use:
                    await self._send_raw(pending)
                    pending = []
                if len(self._ct_out) < n + TAG_BYTES:
                    self._ct_out = bytearray(MAX_RECORD_BYTES + TAG_BYTES)
                ct = memoryview(self._ct_out)[: n + TAG_BYTES]
                aead.encrypt_into(nonce, part, prefix, ct)
                pending += [prefix, ct]
                big_in_use = True
        if pending:
            await self._send_raw(pending)

    async def _read_raw(self, view: memoryview) -> int:
        if self._leftover:
            k = min(len(view), len(self._leftover))
            view[:k] = self._leftover[:k]
            self._leftover = self._leftover[k:]
            return k
        return await self.loop.sock_recv_into(self.sock, view)

    async def _read_raw_exactly(self, view: memoryview, what: str) -> bool:
        """Fill `view`; False at a clean end before its first byte, BulkError mid-way."""
        got = 0
        n = len(view)
        while got < n:
            k = await self._read_raw(view[got:])
            if k == 0:
                if got == 0 and what == "record length":
                    return False
                raise BulkError(f"connection closed inside a sealed {what}")
            got += k
        return True

    async def _recv_sealed(self, view: memoryview) -> int:
        if self._plain_pos < self._plain_len:
            k = min(len(view), self._plain_len - self._plain_pos)
            view[:k] = self._plain[self._plain_pos : self._plain_pos + k]
            self._plain_pos += k
            return k
        aead = self._seal_in
        assert aead is not None
        if not await self._read_raw_exactly(memoryview(self._len_buf), "record length"):
            return 0
        prefix = bytes(self._len_buf)
        n = int(_RECORD.unpack(prefix)[0])
        if n == 0 or n > MAX_RECORD_BYTES:
            raise BulkError(f"sealed record of {n} bytes (1 to {MAX_RECORD_BYTES})")
        self._sealed_in += n
        if self._sealed_in > MAX_SEALED_BYTES:
            raise BulkError("the connection's sealed byte limit was passed")
        if len(self._ct_in) < n + TAG_BYTES:
            self._ct_in = bytearray(max(n, _SMALL_RECORD) + TAG_BYTES)
        ct = memoryview(self._ct_in)[: n + TAG_BYTES]
        await self._read_raw_exactly(ct, "record")
        nonce = _nonce(self._seq_in)
        self._seq_in += 1
        if n <= len(view):
            target = view[:n]
        else:
            if len(self._plain) < n:
                self._plain = bytearray(max(n, _SMALL_RECORD))
            target = memoryview(self._plain)[:n]
        try:
            aead.decrypt_into(nonce, ct, prefix, target)
        except InvalidTag:
            raise BulkError(
                f"sealed record {self._seq_in - 1} failed its authentication (altered, "
                "replayed or reordered bytes)"
            ) from None
        if n <= len(view):
            return n
        k = len(view)
        view[:k] = self._plain[:k]
        self._plain_pos, self._plain_len = k, n
        return k


__all__ = ["BulkError", "Conn", "KEY_SHARE_BYTES", "MAX_RECORD_BYTES", "TlsConn"]
