"""The PeerService's wire: method names, `RingKey`, and RingChunk framing without protobuf objects.

Data path. ``PushChunks`` does not go through protobuf objects: requests are handled as raw
bytes (`frame_ring_chunk` writes a RingChunk around a payload with one copy, `parse_ring_chunk`
reads one and returns the payload as a memoryview of the received bytes, no copy). The bytes on
the wire are ordinary RingChunk messages, so generated stubs interoperate both ways. This
roughly halves the CPU the data path needs, which decides the throughput when several agents
share a machine. The bulk socket (`node_agent.ring.bulk`) carries the same header bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from epochmesh.v1 import common_pb2, peer_pb2

SERVICE_NAME = "epochmesh.v1.PeerService"
PUSH_CHUNKS = f"/{SERVICE_NAME}/PushChunks"
TRANSFER_STATE = f"/{SERVICE_NAME}/TransferState"
PING = f"/{SERVICE_NAME}/Ping"
OPEN_BULK = f"/{SERVICE_NAME}/OpenBulk"
ABORT_PHASE = "abort"
FAILED_NODE_KEY = "epochmesh-failed-node"
MAX_ID_CHARS = 256

RingKey = tuple[str, int, int]  # (job_id, round, attempt)


class WireError(ValueError):
    """Bytes that are not a well-formed RingChunk (answered with INVALID_ARGUMENT)."""


# ---------------------------------------------------------------------------------------------
# Wire framing of RingChunk without protobuf objects for the payload


@dataclass(frozen=True)
class RingChunkView:
    """A parsed RingChunk whose payload is a view of the received bytes."""

    job_id: str
    round: int
    attempt: int
    from_node_id: str
    phase: str
    step: int
    segment: int
    spec: common_pb2.TensorSpec
    offset: int
    payload: memoryview
    last: bool
    # The owner's seal of an all-gather segment (on its last chunk; empty otherwise).
    segment_digest: bytes = b""
    owner_signature: bytes = b""
    owner_certificate: bytes = b""

    @property
    def key(self) -> RingKey:
        return (self.job_id, self.round, self.attempt)


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip_field(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("field runs past the end of the message")
    return pos


def ring_chunk_header(
    *,
    job_id: str,
    round: int,
    attempt: int,
    from_node_id: str,
    phase: str,
    step: int = 0,
    segment: int = 0,
    spec: common_pb2.TensorSpec | None = None,
    last: bool = False,
) -> bytes:
    """Serialized RingChunk fields other than `chunk` (prefix of `frame_ring_chunk`)."""
    msg = peer_pb2.RingChunk(
        job_id=job_id,
        round=round,
        attempt=attempt,
        from_node_id=from_node_id,
        phase=phase,
        step=step,
        segment=segment,
        last=last,
    )
    if spec is not None:
        msg.spec.CopyFrom(spec)
    header: bytes = msg.SerializeToString()
    return header


def ring_chunk_seal(digest: bytes, signature: bytes, certificate: bytes) -> bytes:
    """Serialized RingChunk seal fields (11-13), appended to a chunk's header."""
    seal: bytes = peer_pb2.RingChunk(
        segment_digest=digest, owner_signature=signature, owner_certificate=certificate
    ).SerializeToString()
    return seal


def frame_ring_chunk(header: bytes, offset: int, payload: bytes | memoryview) -> bytes:
    """A serialized RingChunk: `header` (from `ring_chunk_header`) plus field 9, the DataChunk
    {offset, data=payload}. One copy of the payload; equal to what protobuf would produce."""
    n = memoryview(payload).nbytes
    inner = (b"\x08" + varint(offset) if offset else b"") + b"\x12" + varint(n)
    return b"".join((header, b"\x4a", varint(len(inner) + n), inner, payload))


def parse_ring_chunk(data: bytes) -> RingChunkView:
    """Parse a serialized RingChunk; the payload is a zero-copy view of `data`.

    Accepts any valid encoding (fields in any order, unknown fields skipped); the DataChunk
    (field 9) must appear at most once. One-byte tags and lengths (every field our senders
    write except the chunk itself) take a fast path.
    """
    end = len(data)
    pos = 0
    spans: list[tuple[int, int]] = []  # header fields, adjacent ones merged
    chunk_span: tuple[int, int] | None = None
    while pos < end:
        start = pos
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if number == 9:
            if wire_type != 2:
                raise WireError("RingChunk.chunk must be length-delimited")
            if chunk_span is not None:
                raise WireError("RingChunk.chunk appears twice")
            length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise WireError("RingChunk.chunk runs past the end of the message")
            chunk_span = (pos, pos + length)
            pos += length
            continue
        if wire_type == 2 and pos < end and data[pos] < 0x80:
            pos += 1 + data[pos]
            if pos > end:
                raise WireError("field runs past the end of the message")
        elif wire_type == 0 and pos < end and data[pos] < 0x80:
            pos += 1
        else:
            pos = _skip_field(data, pos, end, wire_type)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], pos)
        else:
            spans.append((start, pos))
    mv = memoryview(data)
    if len(spans) == 1:
        header_bytes = data[spans[0][0] : spans[0][1]]
    else:
        header_bytes = b"".join([mv[a:b] for a, b in spans])
    try:
        head = peer_pb2.RingChunk.FromString(header_bytes)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"malformed RingChunk: {exc}") from None
    offset = 0
    payload = mv[0:0]
    if chunk_span is not None:
        pos, cend = chunk_span
        while pos < cend:
            tag, pos = _read_varint(data, pos, cend)
            number, wire_type = tag >> 3, tag & 7
            if number == 1 and wire_type == 0:
                offset, pos = _read_varint(data, pos, cend)
                if offset >= 1 << 63:
                    offset -= 1 << 64
            elif number == 2 and wire_type == 2:
                length, pos = _read_varint(data, pos, cend)
                if pos + length > cend:
                    raise WireError("DataChunk.data runs past the end of the chunk")
                payload = mv[pos : pos + length]
                pos += length
            else:
                pos = _skip_field(data, pos, cend, wire_type)
    return RingChunkView(
        job_id=head.job_id,
        round=head.round,
        attempt=head.attempt,
        from_node_id=head.from_node_id,
        phase=head.phase,
        step=head.step,
        segment=head.segment,
        spec=head.spec,
        offset=offset,
        payload=payload,
        last=head.last,
        segment_digest=head.segment_digest,
        owner_signature=head.owner_signature,
        owner_certificate=head.owner_certificate,
    )


def abort_chunk(key: RingKey, from_node_id: str, failed_node_id: str) -> bytes:
    """The RingChunk reporting that `failed_node_id` failed in attempt `key`."""
    job_id, round_, attempt = key
    header = ring_chunk_header(
        job_id=job_id, round=round_, attempt=attempt, from_node_id=from_node_id, phase=ABORT_PHASE
    )
    return frame_ring_chunk(header, 0, failed_node_id.encode())


def failed_node_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The failed node a PeerService named in its trailing metadata, if any."""
    try:
        for k, v in metadata or ():
            if k == FAILED_NODE_KEY:
                return v.decode() if isinstance(v, bytes) else str(v)
    except (TypeError, ValueError):
        return None
    return None


def parse_checked_ring_chunk(raw: bytes) -> RingChunkView:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise WireError("expected a serialized RingChunk")
    chunk = parse_ring_chunk(bytes(raw) if not isinstance(raw, bytes) else raw)
    if not chunk.job_id or len(chunk.job_id) > MAX_ID_CHARS:
        raise WireError(f"job_id must have 1..{MAX_ID_CHARS} characters")
    if not chunk.from_node_id or len(chunk.from_node_id) > MAX_ID_CHARS:
        raise WireError(f"from_node_id must have 1..{MAX_ID_CHARS} characters")
    return chunk


def failed_id_of(chunk: RingChunkView) -> str:
    try:
        text = bytes(chunk.payload[:MAX_ID_CHARS]).decode()
    except UnicodeDecodeError:
        raise WireError("an abort chunk's data must be the failed node id in UTF-8") from None
    return text or chunk.from_node_id
