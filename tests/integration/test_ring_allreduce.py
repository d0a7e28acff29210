"""Ring all-reduce over real PeerServices on loopback: sums, bit-identity, codecs, refusals,
state transfer, and peers that die (kill -9, stopped server) or stall (SIGSTOP) mid-reduce."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from epochmesh.errors import CodecError
from epochmesh.identity import Identity
from epochmesh.ring.schedule import RingSchedule, chunk_elems_for, simulate_allreduce
from epochmesh.ring.seal import BLAKE3
from epochmesh.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from node_agent.ring.allreduce import Ring, ring_allreduce
from node_agent.ring.client import fetch_state, peer_channel, ping, probe_link
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.mailbox import StateSnapshot
from node_agent.ring.plan import attempt_plan
from node_agent.ring.receive import ReceiveSlot
from node_agent.ring.service import PeerServer
from node_agent.ring.transport import RingTransport
from node_agent.ring.wire import (
    WireError,
    abort_chunk,
    frame_ring_chunk,
    parse_ring_chunk,
    ring_chunk_header,
)
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(60)

CHUNK = chunk_elems_for("none")  # 262144 float32 = 1 MiB


def _data(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def _expected(inputs: Sequence[torch.Tensor]) -> bytes:
    """What every rank must hold, bit for bit: the reference run of the same schedule."""
    sch = RingSchedule.build(len(inputs), inputs[0].numel(), CHUNK)
    return simulate_allreduce(sch, [x.numpy() for x in inputs])[0].tobytes()


@dataclass
class Peers:
    servers: list[PeerServer]
    transports: list[RingTransport]
    ids: list[str]
    seal_digest: str = BLAKE3  # what the rings' assignments name

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def ring(self, rank: int, members: Sequence[int] | None = None, attempt: int = 0) -> Ring:
        members = list(range(len(self.ids))) if members is None else list(members)
        return Ring(
            [self.ids[m] for m in members],
            [self.servers[m].address for m in members],
            members.index(rank),
            attempt,
            self.seal_digest,
        )


@contextlib.asynccontextmanager
async def started_peers(
    n: int, identities: Sequence[Identity] | None = None, **server_kwargs: Any
) -> AsyncIterator[Peers]:
    ident: list[Identity | None] = list(identities) if identities else [None] * n
    servers = [PeerServer("127.0.0.1:0", identity=ident[i], **server_kwargs) for i in range(n)]
    for s in servers:
        await s.start()
    ids = [f"node-{i}" for i in range(n)]
    transports = [RingTransport.for_server(ids[i], servers[i], identity=ident[i]) for i in range(n)]
    try:
        yield Peers(servers, transports, ids)
    finally:
        for t in transports:
            await t.close()
        for s in servers:
            await s.stop(None)


async def _allreduce_all(
    peers: Peers,
    bufs: Sequence[torch.Tensor],
    *,
    members: Sequence[int] | None = None,
    attempt: int = 0,
    round_: int = 0,
    codec: str = "none",
    deadline_s: float = 10.0,
) -> None:
    members = list(range(len(peers.ids))) if members is None else list(members)
    await asyncio.gather(
        *(
            ring_allreduce(
                bufs[i],
                peers.ring(m, members, attempt),
                peers.transports[m],
                deadline_s,
                codec,
                job_id="job",
                round=round_,
            )
            for i, m in enumerate(members)
        )
    )


# ---------------------------------------------------------------------------------------------
# Correct sums


@pytest.mark.parametrize(("n", "numel"), [(3, 1_300_007), (4, 2_000_003), (2, 777)])
async def test_sums_are_bit_identical_and_right(n: int, numel: int) -> None:
    inputs = [_data(r, numel) for r in range(n)]
    bufs = [x.clone() for x in inputs]
    async with started_peers(n) as peers:
        await _allreduce_all(peers, bufs)
    want = _expected(inputs)
    for b in bufs:
        assert b.numpy().tobytes() == want
    ref = torch.stack([x.double() for x in inputs]).sum(0)
    assert torch.allclose(bufs[0].double(), ref, atol=1e-5)


@pytest.mark.parametrize(("codec", "atol"), [("fp16", 0.02), ("bf16", 0.1), ("int8", 0.2)])
async def test_wire_codecs_stay_bit_identical(codec: str, atol: float) -> None:
    n, numel = 3, 1_100_001
    inputs = [_data(r, numel, seed=3) for r in range(n)]
    bufs = [x.clone() for x in inputs]
    async with started_peers(n) as peers:
        await _allreduce_all(peers, bufs, codec=codec)
    for b in bufs[1:]:
        assert torch.equal(b, bufs[0])
    ref = torch.stack([x.double() for x in inputs]).sum(0)
    assert float((bufs[0].double() - ref).abs().max()) < atol


async def test_tiny_buffers_and_a_ring_of_one() -> None:
    async with started_peers(3) as peers:
        for numel in (0, 1, 2, 3):
            inputs = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(3)]
            bufs = [x.clone() for x in inputs]
            await _allreduce_all(peers, bufs, round_=numel)
            for b in bufs:
                assert torch.equal(b, torch.arange(numel, dtype=torch.float32) * 6)
        solo = torch.ones(5)
        assignment = common_pb2.RingAssignment(  # what the coordinator sends
            node_ids=["node-0"], peer_addresses=[peers.addresses[0]], rank=0, attempt=0
        )
        out = await ring_allreduce(
            solo, assignment, peers.transports[0], 1.0, job_id="solo", round=0
        )
        assert out is solo and torch.equal(solo, torch.ones(5))


async def test_bad_arguments_are_refused() -> None:
    async with started_peers(2) as peers:
        t = peers.transports[0]
        ring = peers.ring(0)
        with pytest.raises(ValueError, match="float32"):
            await ring_allreduce(
                torch.ones(4, dtype=torch.float64), ring, t, 1.0, job_id="j", round=0
            )
        with pytest.raises(ValueError, match="this node"):
            await ring_allreduce(torch.ones(4), peers.ring(1), t, 1.0, job_id="j", round=0)
        with pytest.raises(ValueError, match="codec"):
            await ring_allreduce(torch.ones(4), ring, t, 1.0, "topk", job_id="j", round=0)
        with pytest.raises(ValueError, match="deadline"):
            await ring_allreduce(torch.ones(4), ring, t, 0.0, job_id="j", round=0)


async def test_late_neighbour_and_many_rounds_over_kept_channels() -> None:
    n, numel = 3, 300_001
    async with started_peers(n) as peers:
        for round_ in range(3):
            inputs = [_data(r, numel, seed=round_) for r in range(n)]
            bufs = [x.clone() for x in inputs]

            async def late(i: int, bufs: list[torch.Tensor] = bufs, round_: int = round_) -> None:
                await asyncio.sleep(0.3 if i == 1 else 0.0)  # rank 1 is still "computing"
                ring = peers.ring(i)
                assignment = common_pb2.RingAssignment(  # the wire form works as the ring
                    node_ids=ring.node_ids,
                    peer_addresses=ring.peer_addresses,
                    rank=ring.rank,
                    attempt=ring.attempt,
                    deadline_seconds=5.0,
                )
                await ring_allreduce(
                    bufs[i], assignment, peers.transports[i], 5.0, job_id="job", round=round_
                )

            await asyncio.gather(*(late(i) for i in range(n)))
            want = _expected(inputs)
            assert all(b.numpy().tobytes() == want for b in bufs)
        # One channel per neighbour, reused across the rounds.
        assert all(len(t._channels) == 1 for t in peers.transports)


async def test_shapes_codecs_and_ranks_change_between_rounds() -> None:
    """Each round plans for its own (size, codec, rank): plans cached from earlier rounds of
    other shapes must not leak into it."""
    async with started_peers(3) as peers:
        rounds = [
            (300_001, "none", [0, 1, 2]),
            (40_000, "fp16", [2, 0, 1]),
            (300_001, "none", [1, 2, 0]),
        ]
        for round_, (numel, codec, members) in enumerate(rounds):
            inputs = [_data(m, numel, seed=round_) for m in members]  # in ring order
            bufs = [x.clone() for x in inputs]
            await _allreduce_all(peers, bufs, members=members, round_=round_, codec=codec)
            if codec == "none":
                want = _expected(inputs)
                assert all(b.numpy().tobytes() == want for b in bufs)
            else:
                assert all(torch.equal(b, bufs[0]) for b in bufs)


# ---------------------------------------------------------------------------------------------
# The PeerService's refusals, framing, state transfer, ping


def test_framing_is_plain_protobuf() -> None:
    spec = common_pb2.TensorSpec(dtype="float32", shape=[3], codec="none", nbytes=12)
    payload = np.arange(3, dtype=np.float32).tobytes()
    header = ring_chunk_header(
        job_id="j",
        round=7,
        attempt=2,
        from_node_id="a",
        phase="all_gather",
        step=1,
        segment=2,
        spec=spec,
        last=True,
    )
    framed = frame_ring_chunk(header, 4096, payload)
    msg = peer_pb2.RingChunk(
        job_id="j",
        round=7,
        attempt=2,
        from_node_id="a",
        phase="all_gather",
        step=1,
        segment=2,
        spec=spec,
        last=True,
        chunk=common_pb2.DataChunk(offset=4096, data=payload),
    )
    assert peer_pb2.RingChunk.FromString(framed) == msg
    for wire in (framed, msg.SerializeToString()):
        view = parse_ring_chunk(wire)
        assert (view.job_id, view.round, view.attempt, view.step, view.segment) == ("j", 7, 2, 1, 2)
        assert view.offset == 4096 and bytes(view.payload) == payload and view.last
        assert view.spec == spec
    # Unknown fields are skipped; a truncated message is refused.
    extra = framed + b"\xa8\x06\x01"  # field 101 varint
    assert bytes(parse_ring_chunk(extra).payload) == payload
    with pytest.raises(WireError):
        parse_ring_chunk(framed[:-5])
    with pytest.raises(WireError):
        parse_ring_chunk(framed + framed[len(header) :])  # the chunk twice
    abort = parse_ring_chunk(abort_chunk(("j", 1, 0), "a", "dead"))
    assert abort.phase == "abort" and bytes(abort.payload) == b"dead"


def test_framing_in_any_field_order_and_with_long_fields() -> None:
    """parse_ring_chunk's fast path (one-byte tags and lengths) and its general path agree with
    protobuf: chunk first, header fields on both sides of it, multi-byte lengths and tags."""
    payload = np.arange(300, dtype=np.float32).tobytes()
    long_id = "n" * 200  # a length that takes two varint bytes
    head = peer_pb2.RingChunk(job_id="j", round=300, attempt=1, from_node_id=long_id)
    tail = peer_pb2.RingChunk(phase="reduce_scatter", step=2, segment=1, last=True)
    chunk = peer_pb2.RingChunk(chunk=common_pb2.DataChunk(offset=8, data=payload))
    unknown = b"\xa8\x06\x05"  # field 101, varint: a two-byte tag
    wires = [
        chunk.SerializeToString() + head.SerializeToString() + tail.SerializeToString(),
        head.SerializeToString() + chunk.SerializeToString() + unknown + tail.SerializeToString(),
        unknown + tail.SerializeToString() + head.SerializeToString() + chunk.SerializeToString(),
    ]
    for wire in wires:
        view = parse_ring_chunk(wire)
        want = peer_pb2.RingChunk.FromString(wire)
        assert (view.job_id, view.round, view.attempt, view.from_node_id) == ("j", 300, 1, long_id)
        assert (view.phase, view.step, view.segment, view.last) == ("reduce_scatter", 2, 1, True)
        assert view.offset == want.chunk.offset == 8 and bytes(view.payload) == payload
    # A one-byte length that runs past the end, and a message cut right after a tag.
    with pytest.raises(WireError):
        parse_ring_chunk(b"\x0a\x05abc")
    with pytest.raises(WireError):
        parse_ring_chunk(head.SerializeToString() + b"\x10")


async def test_refusals_for_expired_unknown_and_foreign_streams() -> None:
    async with started_peers(2, join_timeout_s=0.3) as peers:
        bufs = [_data(r, 1000) for r in range(2)]
        await _allreduce_all(peers, bufs, round_=5)
        stub = peer_pb2_grpc.PeerServiceStub(peer_channel(peers.addresses[1]))

        def chunk(round_: int, sender: str = "node-0", job: str = "job") -> peer_pb2.RingChunk:
            return peer_pb2.RingChunk(
                job_id=job,
                round=round_,
                attempt=0,
                from_node_id=sender,
                phase="reduce_scatter",
                step=0,
                segment=0,
                chunk=common_pb2.DataChunk(offset=0, data=b"\0" * 8),
            )

        async def push(*msgs: peer_pb2.RingChunk) -> grpc.StatusCode:
            async def it() -> AsyncIterator[peer_pb2.RingChunk]:
                for m in msgs:
                    yield m

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushChunks(it(), timeout=5)
            return info.value.code()

        # An attempt that is over here, an old one, and one that never starts.
        assert await push(chunk(5)) == grpc.StatusCode.FAILED_PRECONDITION
        assert await push(chunk(4)) == grpc.StatusCode.FAILED_PRECONDITION
        t0 = time.monotonic()
        assert await push(chunk(9, job="other")) == grpc.StatusCode.FAILED_PRECONDITION
        assert time.monotonic() - t0 < 3.0
        # Garbage is INVALID_ARGUMENT, not a crash.
        raw = peer_channel(peers.addresses[1]).stream_unary(
            "/epochmesh.v1.PeerService/PushChunks",
            request_serializer=None,
            response_deserializer=None,
        )
        call = raw()
        await call.write(b"\x4a\xff\xff\xff\x0f")
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_bad_chunk_fails_the_attempt_and_names_the_sender() -> None:
    async with started_peers(2) as peers:
        task = asyncio.create_task(
            ring_allreduce(
                torch.ones(1000), peers.ring(0), peers.transports[0], 5.0, job_id="job", round=0
            )
        )
        # Node 1's first chunk, as a generated stub sends it, but 4 bytes short.
        bad = peer_pb2.RingChunk(
            job_id="job", round=0, attempt=0, from_node_id="node-1", phase="reduce_scatter",
            step=0, segment=1,
            spec=common_pb2.TensorSpec(dtype="float32", shape=[500], codec="none", nbytes=2000),
            chunk=common_pb2.DataChunk(offset=0, data=b"\0" * 1996),
        )  # fmt: skip
        stub = peer_pb2_grpc.PeerServiceStub(
            peers.transports[1].channel(peers.addresses[0], "node-0")
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PushChunks(iter([bad]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expected 2000 bytes" in (info.value.details() or "")
        with pytest.raises(RingPeerFailed) as failed:
            await asyncio.wait_for(task, 10)
        assert failed.value.node_id == "node-1" and failed.value.detected_here
        # Nameless chunks are refused outright.
        nameless = peer_pb2.RingChunk(job_id="", from_node_id="node-1", phase="reduce_scatter")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PushChunks(iter([nameless]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_mutual_tls_ring_checks_who_sends(tmp_path: Path) -> None:
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path / "ca")
    identities = [issue_identity(ca, "node", f"node-{i}") for i in range(3)]
    inputs = [_data(r, 700_001) for r in range(3)]
    bufs = [x.clone() for x in inputs]
    async with started_peers(3, identities) as peers:
        await _allreduce_all(peers, bufs)
        assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)
        # A certificate of node-9 cannot push chunks, or report failures, as node-2.
        mallory = issue_identity(ca, "node", "node-9")
        async with peer_channel(peers.addresses[0], "node-0", mallory) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            for phase in ("reduce_scatter", "abort"):
                forged = peer_pb2.RingChunk(
                    job_id="job", round=1, attempt=0, from_node_id="node-2", phase=phase
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PushChunks(iter([forged]), timeout=5)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert await ping(ch, timeout=5) > 0
        # No certificate, no connection.
        async with peer_channel(peers.addresses[0]) as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await ping(plain, timeout=3)


async def test_state_transfer_and_ping() -> None:
    tensors = {"w": torch.randn(700, 900), "b": torch.randn(900), "step": torch.tensor([3])}

    async def provider(job_id: str, min_version: int) -> StateSnapshot | None:
        return StateSnapshot(version=12, tensors=tensors) if job_id == "job" else None

    server = PeerServer("127.0.0.1:0", state_provider=provider)
    await server.start()
    try:
        async with peer_channel(server.address) as ch:
            got = await fetch_state(ch, "job", node_id="joiner", min_version=10, timeout=10)
            assert got.version == 12 and list(got.tensors) == ["w", "b", "step"]
            assert all(torch.equal(got.tensors[k], v) for k, v in tensors.items())
            with pytest.raises(CodecError):
                await fetch_state(ch, "job", expected={"w": (torch.float32, (1, 1))}, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await fetch_state(ch, "nope", timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await fetch_state(ch, "job", min_version=13, timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert await ping(ch, timeout=5, payload=b"x" * 1000) > 0
            rtt, bandwidth = await probe_link(ch)
            assert 0 < rtt < 1 and bandwidth > 1e6
    finally:
        await server.stop(None)


# ---------------------------------------------------------------------------------------------
# Failures mid-reduce


async def _expect_failures(
    tasks: Sequence[asyncio.Task[torch.Tensor]], failed: str, within_s: float
) -> list[RingPeerFailed]:
    t0 = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=within_s)
    assert not pending, f"survivors still running {within_s:.1f}s after the failure"
    errors = []
    for t in done:
        err = t.exception()
        assert isinstance(err, RingPeerFailed), f"expected RingPeerFailed, got {err!r}"
        assert err.node_id == failed, f"blamed {err.node_id!r}: {err}"
        errors.append(err)
    assert time.monotonic() - t0 < within_s
    return errors


async def _retry_without(peers: Peers, survivors: Sequence[int], numel: int) -> None:
    inputs = [_data(m, numel) for m in survivors]
    bufs = [x.clone() for x in inputs]
    await _allreduce_all(peers, bufs, members=survivors, attempt=1, deadline_s=5.0)
    want = _expected(inputs)
    assert all(b.numpy().tobytes() == want for b in bufs)


async def test_stopped_server_mid_reduce_is_named_and_the_retry_succeeds() -> None:
    n, victim, numel, deadline = 4, 2, 4 * 3 * CHUNK, 1.0
    async with started_peers(n) as peers:
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
        await _retry_without(peers, survivors, numel)


async def test_a_silent_member_is_named_not_its_starved_neighbours() -> None:
    """Node 1 takes its left neighbour's chunks and answers pings, but its sender hangs (a
    stuck GPU, say): it never sends. Node 2 (its right) starves first; nodes 3 and 4 time out
    on node 2 before node 2 gives up on node 1 (their waits start earlier), but node 2 answers
    them that it is starved itself, so they wait for its report instead of blaming it. Every
    survivor names node 1; the ring state a Ping reports is checked on the way."""
    n, victim, numel, deadline = 5, 1, 5 * 2 * CHUNK, 0.5
    key = ("job", 0, 0)
    async with started_peers(n) as peers:
        survivors = [r for r in range(n) if r != victim]
        # The victim's receive side of the attempt, with no run behind it.
        plan = attempt_plan(n, numel, "none", victim)
        hung = ReceiveSlot(
            key, plan.expect, victim, "none", _data(victim, numel).numpy(), peers.ids
        )
        peers.servers[victim].mailbox.register(hung)
        tasks = {
            r: asyncio.create_task(
                ring_allreduce(
                    _data(r, numel),
                    peers.ring(r),
                    peers.transports[r],
                    deadline,
                    job_id="job",
                    round=0,
                )
            )
            for r in survivors
        }
        asker = peers.transports[3]
        node2 = peers.addresses[2]

        async def node2_state() -> Any:
            return await asker.ring_status(node2, "node-2", key, timeout=2.0)

        state = await node2_state()
        t_end = time.monotonic() + 20
        while not state.starved_s and time.monotonic() < t_end:
            await asyncio.sleep(0.01)
            state = await node2_state()
        assert state.known and state.starved_s > 0 and not state.failed_node_id
        unknown = await asker.ring_status(node2, "node-2", ("job", 0, 7), timeout=2.0)
        assert not unknown.known and unknown.starved_s == 0 and not unknown.failed_node_id
        silent = await asker.ring_status(peers.addresses[victim], "node-1", key, timeout=2.0)
        assert silent.known and silent.starved_s == 0 and not silent.failed_node_id
        errors = await _expect_failures(
            list(tasks.values()), "node-1", within_s=(n + 4) * deadline + 8
        )
        assert [e for e in errors if e.detected_here], "nobody saw the failure itself"
        after = await node2_state()
        assert after.known and after.failed_node_id == "node-1" and after.starved_s == 0
        await _retry_without(peers, survivors, numel)


def _victim_main(conn: Any, rank: int, numel: int, mode: str, after_chunks: int) -> None:
    """A ring member in its own process that kills (-9) or stops (SIGSTOP) itself once it has
    received `after_chunks` chunks, i.e. in the middle of the reduce."""
    import asyncio

    advance = ReceiveSlot._advance

    def advance_then_stop(slot: Any, nbytes: int) -> None:
        # Right in the data path: a watcher task may only run after many more chunks.
        advance(slot, nbytes)
        if slot.pos >= after_chunks:
            conn.send("stopping")
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)

    ReceiveSlot._advance = advance_then_stop  # type: ignore[method-assign]

    async def main() -> None:
        server = PeerServer("127.0.0.1:0")
        await server.start()
        conn.send(server.address)
        ids, addresses, deadline = await asyncio.to_thread(conn.recv)
        transport = RingTransport.for_server(ids[rank], server)
        await ring_allreduce(
            _data(rank, numel),
            Ring(ids, addresses, rank),
            transport,
            deadline,
            job_id="job",
            round=0,
            join_timeout_s=20.0,
        )
        conn.send("finished")

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["kill", "stall"])
async def test_peer_process_dies_or_stalls_mid_reduce(mode: str) -> None:
    n, victim, numel, deadline = 3, 1, 3 * 4 * CHUNK, 1.0
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_victim_main, args=(child, victim, numel, mode, 6), daemon=True)
    proc.start()
    try:
        victim_address = await asyncio.wait_for(asyncio.to_thread(parent.recv), 40)
        async with started_peers(n) as peers:
            await peers.servers[victim].stop(None)  # the victim's place is the process's
            ids = peers.ids
            addresses = peers.addresses
            addresses[victim] = victim_address
            parent.send((ids, addresses, deadline))
            tasks = [
                asyncio.create_task(
                    ring_allreduce(
                        _data(r, numel),
                        Ring(ids, addresses, r),
                        peers.transports[r],
                        deadline,
                        job_id="job",
                        round=0,
                        join_timeout_s=20.0,
                    )
                )
                for r in range(n)
                if r != victim
            ]
            msg = await asyncio.wait_for(asyncio.to_thread(parent.recv), 40)
            assert msg == "stopping"
            # Dead: the streams break at once. Stalled: deadline + ping, then reports (slack
            # for a loaded 2-core host: a stalled neighbour takes up to three waits to name).
            await _expect_failures(tasks, "node-1", within_s=3 * deadline + 8)
            # The streams ran over the bulk sockets (as between agents).
            assert peers.transports[0].bulk_streams == peers.transports[2].bulk_streams == 1
            await _retry_without(peers, [0, 2], numel)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


# ---------------------------------------------------------------------------------------------
# The benchmark script (issue 7's figure) still runs end to end


def bench_figures(script: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run scripts/`script` with `args` (from the repository root); the JSON line it ends with."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


@pytest.mark.timeout(150)
def test_bench_script_compares_with_gloo_and_the_grpc_floor() -> None:
    figures = bench_figures(
        "bench_allreduce.py",
        *("--peers", "2", "--mb", "1", "--reps", "1", "--warmup", "0", "--floor"),
        *("--timeout", "120"),
        timeout=140,
    )
    assert figures["identical_across_ranks"] and figures["sums_match_gloo"]
    for key in ("ours_bus_gbps", "gloo_bus_gbps", "floor_bus_gbps"):
        assert figures[key] > 0
    assert {"ratio", "floor_vs_gloo", "ours_vs_floor"} <= figures.keys()
    # Our ring ran over the bulk sockets, as between agents (one stream per rank and run).
    assert figures["transport"] == "bulk"
    assert figures["ours_streams"] == {"bulk": 2, "grpc": 0, "bulk_kept": 0}
