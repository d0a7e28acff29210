"""A member that forwards a tampered all-gather segment, against real PeerServers over mutual TLS
(node certificates of one CA) and a real ring all-reduce: its right neighbour refuses the
segment (it does not match its owner's seal) and names it with RING_FAULT_TAMPERED, so that no
honest member ends with other parameters than the rest. Then against the real engine: the
tamperer is struck on a second witness, no honest member ever is, and the job succeeds with
every sample trained once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.engine import Engine
from epochmesh.ring.schedule import ALL_GATHER
from epochmesh.ring.seal import (
    BLAKE3,
    SEAL_DIGESTS,
    SHA256,
    SegmentSigner,
    seal_message,
    segment_hasher,
)
from epochmesh.v1 import agent_pb2, common_pb2, peer_pb2
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.bulk import BulkError
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.service import PeerServer
from node_agent.ring.transport import RingOutput, RingTransport
from node_agent.ring.wire import RingKey
from tests.integration.ring_members import RingMember, ring_agents
from tests.integration.test_ring_allreduce import (
    Peers,
    _allreduce_all,
    _data,
    _expected,
    bench_figures,
)
from tests.integration.test_ring_coordinator import check_exactly_once, new_world, ring_job, run_job
from tests.integration.test_ring_peer_attacks import _tls_peers
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)


class TamperingOutput:
    """The stream of a hostile forwarder: every all-gather chunk it forwards (step >= 1) has a
    bit flipped (a finite change, unseen by the NaN check). `reseal`: it also replaces the
    owner's seal with its own signature over the tampered bytes."""

    def __init__(
        self, out: RingOutput, signer: SegmentSigner | None, owners: list[str], digest: str
    ) -> None:
        self._out = out
        self._signer = signer
        self._owners = owners
        self._digest = digest  # the ring's seal digest
        self._hasher = segment_hasher(digest)
        self.tampered = 0

    async def write_chunk(self, header: bytes, offset: int, payload: bytes | memoryview) -> None:
        head = peer_pb2.RingChunk.FromString(header)
        if head.phase == ALL_GATHER and head.step >= 1:
            data = bytearray(payload)
            data[0] ^= 0x40
            payload = bytes(data)
            self.tampered += 1
            if self._signer is not None:
                if offset == 0:
                    self._hasher = segment_hasher(self._digest)
                self._hasher.update(payload)
                if head.last:
                    owner = self._owners[(head.segment - 1) % len(self._owners)]
                    digest = self._hasher.digest()
                    message = seal_message(
                        head.job_id,
                        head.round,
                        head.attempt,
                        head.segment,
                        owner,
                        digest,
                        self._digest,
                    )
                    seal = self._signer.seal(message, digest)
                    head.segment_digest = seal.digest
                    head.owner_signature = seal.signature
                    head.owner_certificate = seal.certificate
                    header = head.SerializeToString()
        await self._out.write_chunk(header, offset, payload)

    async def finish(self) -> int:
        return await self._out.finish()

    async def failure(self, exc: BaseException, timeout: float) -> BulkError:
        return await self._out.failure(exc, timeout)

    def on_broken(self, callback: Callable[[BaseException], None]) -> None:
        self._out.on_broken(callback)

    def done(self) -> bool:
        return self._out.done()

    def close(self) -> None:
        self._out.close()


class TamperingTransport(RingTransport):
    """A RingTransport whose streams to the right neighbour tamper (`TamperingOutput`);
    `owners`: the ring's node ids (whose seals a resealing forwarder replaces), `digest` the
    ring's seal digest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reseal = False
        self.owners: list[str] = []
        self.digest = BLAKE3
        self.outputs: list[TamperingOutput] = []

    async def open_output(
        self, address: str, node_id: str, key: RingKey, timeout: float
    ) -> RingOutput:
        out = await super().open_output(address, node_id, key, timeout)
        tampering = TamperingOutput(
            out, self.signer if self.reseal else None, self.owners, self.digest
        )
        self.outputs.append(tampering)
        return tampering


@pytest.mark.parametrize(
    ("bulk", "codec", "reseal", "digest"),
    [
        (True, "none", False, BLAKE3),
        (False, "none", False, SHA256),
        (True, "fp16", True, SHA256),
        (False, "bf16", True, BLAKE3),
    ],
)
async def test_a_tampering_forwarder_is_blamed_by_its_right_neighbour(
    tmp_path: Path, bulk: bool, codec: str, reseal: bool, digest: str
) -> None:
    """node-1 flips a bit in every segment it forwards in the all-gather: node-2 refuses the
    first one, and every member fails the attempt naming node-1; only node-2 reports the
    fault as its own finding. The retry without node-1 gets the right sums. Rings sealed
    with either digest."""
    n, numel = 4, 4 * 300_000 + 3  # two chunks per segment
    async with _tls_peers(tmp_path, n) as (peers, _):
        peers.seal_digest = digest
        honest = peers.transports[1]
        hostile = TamperingTransport.for_server(
            "node-1", peers.servers[1], identity=honest._identity
        )
        assert isinstance(hostile, TamperingTransport)
        hostile.reseal, hostile.owners = reseal, list(peers.ids)
        hostile.digest = peers.ring(1).seal_digest
        peers.transports[1] = hostile
        await honest.close()
        for t in peers.transports:
            t.bulk = bulk
        inputs = [_data(r, numel) for r in range(n)]
        bufs = [x.clone() for x in inputs]
        results = await ring_allreduce_all(peers, bufs, codec)
        # node-0 never receives a segment node-1 forwarded: it may finish (with the right
        # sums) before the failure reaches it.
        if not isinstance(results[0], RingPeerFailed) and codec == "none":
            assert results[0].numpy().tobytes() == _expected(inputs)
        failures = {r: x for r, x in enumerate(results) if isinstance(x, RingPeerFailed)}
        assert set(failures) >= {1, 2, 3}, results
        assert {x.node_id for x in failures.values()} == {"node-1"}, failures
        faults = {r: x.fault for r, x in failures.items()}
        assert faults.pop(2) == agent_pb2.RING_FAULT_TAMPERED
        assert set(faults.values()) == {agent_pb2.RING_FAULT_UNSPECIFIED}, faults
        words = "certificate is that of 'node-1'" if reseal else "does not match"
        assert words in failures[2].reason, failures[2].reason
        assert hostile.outputs[0].tampered >= 1
        paths = (hostile.bulk_streams, hostile.grpc_streams)
        assert paths == ((1, 0) if bulk else (0, 1)), paths
        # The survivors' retry, sealed as ever, is right to the bit.
        ok = [inputs[0].clone(), inputs[2].clone(), inputs[3].clone()]
        await _allreduce_all(peers, ok, members=[0, 2, 3], attempt=1, round_=3, codec=codec)
        assert len({b.numpy().tobytes() for b in ok}) == 1
        if codec == "none":
            assert ok[0].numpy().tobytes() == _expected([inputs[0], inputs[2], inputs[3]])


async def ring_allreduce_all(
    peers: Peers, bufs: list[torch.Tensor], codec: str
) -> list[torch.Tensor | BaseException]:
    return await asyncio.gather(
        *(
            ring_allreduce(
                bufs[r],
                peers.ring(r),
                peers.transports[r],
                5.0,
                codec,
                job_id="job",
                round=3,
            )
            for r in range(len(bufs))
        ),
        return_exceptions=True,
    )


# -- against the engine --------------------------------------------------------------------------


async def test_a_tampering_member_is_struck_and_no_honest_one_is(tmp_path: Path) -> None:
    """Every member declares the digests this version checks: the rings seal with BLAKE3."""
    packed = ring_job(tmp_path, min_nodes=3, max_nodes=4)
    world = new_world(packed)
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:

        def member(name: str, server: PeerServer) -> RingMember:
            cls = TamperingTransport if name == "m3" else RingTransport
            return RingMember(world, server, transport_cls=cls)

        async with ring_agents(
            coord, world, ["m1", "m2", "m3", "m4"], member, lambda name: SEAL_DIGESTS
        ) as agents:
            final, rounds, events = await run_job(coord, packed)
            digests = {t.ring.seal_digest for a in agents for t in a.tasks if t.ring.node_ids}
            ids = {a.name: a.node_id for a in agents}
            strikes = {a.name: coord.registry.get(a.node_id).strikes for a in agents}
            members = {a.name: a.on_train for a in agents}
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    assert digests == {BLAKE3}, digests
    assert strikes["m3"] >= 1, strikes
    assert all(strikes[n] == 0 for n in ("m1", "m2", "m4")), strikes
    struck = [e for e in events if e.kind == "node.strike"]
    assert struck and {e.node_id for e in struck} == {ids["m3"]}
    assert "forwarded tampered data in the ring's all-gather" in struck[0].message
    # No round diverged: no honest member ever held a tampered segment.
    assert not [e for e in events if e.kind in ("round.diverged", "job.diverged")]
    # The honest members saw it: the right neighbours of m3 refused its data themselves.
    witnesses = {
        a
        for a, m in members.items()
        if isinstance(m, RingMember)
        for f in m.failures
        if f.fault == agent_pb2.RING_FAULT_TAMPERED and f.node_id == ids["m3"]
    }
    assert len(witnesses) >= 2 and "m3" not in witnesses, witnesses
    assert not any(
        f.fault != agent_pb2.RING_FAULT_UNSPECIFIED and f.node_id != ids["m3"]
        for m in members.values()
        if isinstance(m, RingMember)
        for f in m.failures
    )
    retried = [e for e in events if e.kind == "round.retried"]
    assert any(
        "accused of forwarding tampered data" in e.message
        and "alone: retried with another member to its right" in e.message
        for e in retried
    ), [e.message for e in retried]


def test_the_seal_bench_times_both_digests() -> None:
    """scripts/bench_ring_seal.py (small sizes): figures for BLAKE3 and SHA-256, and a real
    sealed ring with each (its ranks' sums identical, else it fails)."""
    figures = bench_figures(
        "bench_ring_seal.py",
        *("--members", "4", "--mb", "4", "--ring", "2", "--ring-mb", "2", "--reps", "1"),
        timeout=80,
    )
    for digest in SEAL_DIGESTS:
        assert figures[f"{digest}_mib_per_s"] > 0
        assert figures[f"ring_{digest}_s"] > 0 and figures[f"ring_{digest}_vs_unsealed"] > 0
    assert figures["ring_unsealed_s"] > 0 and figures["seal_wire_bytes_per_segment"] > 500
