"""Seals of ring all-gather segments (epochmesh.ring.seal) and their check in a ring member's
receive slot (node_agent.ring.receive.ReceiveSlot), without a network: a segment that does
not match its owner's seal is refused naming the left neighbour that delivered it."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from epochmesh.identity import Identity
from epochmesh.ring.schedule import ALL_GATHER
from epochmesh.ring.seal import (
    BLAKE3,
    SEAL_CONTEXT,
    SHA256,
    OwnerRevoked,
    Seal,
    SealError,
    SegmentSigner,
    SegmentVerifier,
    ring_seal_digest,
    seal_digest,
    seal_message,
    segment_hasher,
)
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.ring.mailbox import ChunkRejected
from node_agent.ring.plan import attempt_plan
from node_agent.ring.receive import ReceiveSlot
from node_agent.ring.wire import RingChunkView

pytestmark = pytest.mark.timeout(30)

NODES = ["node-0", "node-1", "node-2"]
KEY = ("job", 4, 1)
DIGEST = hashlib.sha256(b"segment").digest()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    """Node identities of one CA, a submitter's of the same CA and a node-0 of another CA."""
    from coordinator.trust.tokens import ensure_ca, issue_identity

    base: Path = tmp_path_factory.mktemp("ca")
    ca, other = ensure_ca(base / "ca"), ensure_ca(base / "other")
    ids = {n: issue_identity(ca, "node", n) for n in NODES}
    ids["submitter"] = issue_identity(ca, "submitter", "alice")
    ids["stranger"] = issue_identity(other, "node", "node-0")
    return ids  # type: ignore[return-value]


def _sign(
    identity: Identity,
    owner: str,
    digest: bytes = DIGEST,
    segment: int = 1,
    algorithm: str = SHA256,
) -> Seal:
    message = seal_message(*KEY, segment, owner, digest, algorithm)
    return SegmentSigner(lambda: identity).seal(message, digest)


def _check(world: dict[str, Identity], seal: Seal, owner: str = "node-0", **kw: object) -> None:
    verifier = SegmentVerifier(world["node-1"].ca_pem, **kw)  # type: ignore[arg-type]
    verifier.check(owner, seal_message(*KEY, 1, owner, seal.digest), seal)


# -- signer and verifier -------------------------------------------------------------------------


def test_a_seal_verifies_for_its_owner_only(world: dict[str, Identity]) -> None:
    seal = _sign(world["node-0"], "node-0")
    _check(world, seal)
    assert len(seal.digest) == 32 and seal.certificate
    with pytest.raises(SealError, match="certificate is that of 'node-0'"):
        _check(world, seal, owner="node-2")


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        # Another digest under the owner's signature (data swapped, digest recomputed).
        (lambda s, w: dataclasses.replace(s, digest=hashlib.sha256(b"x").digest()), "signature"),
        # The forwarder's own signature and certificate over its digest.
        (lambda s, w: _sign(w["node-1"], "node-0"), "certificate is that of 'node-1'"),
        # The owner's certificate with the forwarder's signature.
        (
            lambda s, w: dataclasses.replace(s, signature=_sign(w["node-1"], "node-0").signature),
            "signature",
        ),
        # A certificate of another CA that names the owner.
        (lambda s, w: _sign(w["stranger"], "node-0"), "not one of the coordinator's CA"),
        # A user's certificate of the same CA.
        (lambda s, w: _sign(w["submitter"], "node-0"), "submitter certificate"),
        (lambda s, w: dataclasses.replace(s, certificate=b"\x30\x03junk"), "does not parse"),
        (lambda s, w: dataclasses.replace(s, signature=b""), "signature"),
        (lambda s, w: dataclasses.replace(s, digest=b"short"), "digest has 5 bytes"),
    ],
)
def test_a_seal_that_was_altered_is_refused(
    world: dict[str, Identity], tamper: Callable[[Seal, dict[str, Identity]], Seal], words: str
) -> None:
    seal = tamper(_sign(world["node-0"], "node-0"), world)
    with pytest.raises(SealError, match=words) as caught:
        _check(world, seal)
    assert not isinstance(caught.value, OwnerRevoked)


def test_a_seal_is_bound_to_its_attempt_and_segment(world: dict[str, Identity]) -> None:
    seal = _sign(world["node-0"], "node-0")
    verifier = SegmentVerifier(world["node-1"].ca_pem)
    for job, round_, attempt, segment in [("job", 4, 2, 1), ("job", 5, 1, 1), ("job", 4, 1, 2)]:
        with pytest.raises(SealError, match="signature"):
            message = seal_message(job, round_, attempt, segment, "node-0", DIGEST)
            verifier.check("node-0", message, seal)


def test_a_revoked_owner_is_refused_as_the_owner(world: dict[str, Identity]) -> None:
    seal = _sign(world["node-0"], "node-0")
    revoked: set[str] = set()
    verifier = SegmentVerifier(world["node-1"].ca_pem, lambda: revoked)
    message = seal_message(*KEY, 1, "node-0", DIGEST)
    verifier.check("node-0", message, seal)
    revoked.add("node-0")  # the list is read at every check
    with pytest.raises(OwnerRevoked):
        verifier.check("node-0", message, seal)


def test_an_expired_certificate_is_refused_beyond_the_clock_skew(
    world: dict[str, Identity],
) -> None:
    seal = _sign(world["node-0"], "node-0")
    year = 366 * 86400.0
    _check(world, seal, clock=lambda: time.time() + 60)
    with pytest.raises(SealError, match="expired or not yet valid"):
        _check(world, seal, clock=lambda: time.time() + 5 * year)
    with pytest.raises(SealError, match="expired or not yet valid"):
        _check(world, seal, clock=lambda: time.time() - 3600)


def test_the_signer_follows_a_renewed_identity(world: dict[str, Identity]) -> None:
    """The identity in use is asked for at every seal: after a renewal (here: another
    certificate and key altogether) the new certificate signs."""
    current = [world["node-0"]]
    signer = SegmentSigner(lambda: current[0])
    first = signer.seal(seal_message(*KEY, 1, "node-0", DIGEST), DIGEST)
    _check(world, first)
    current[0] = world["node-2"]
    second = signer.seal(seal_message(*KEY, 1, "node-2", DIGEST), DIGEST)
    assert second.certificate != first.certificate
    _check(world, second, owner="node-2")


def test_the_verifier_remembers_few_certificates(world: dict[str, Identity]) -> None:
    verifier = SegmentVerifier(world["node-1"].ca_pem, max_cached=2)
    for owner in NODES:
        seal = _sign(world[owner], owner)
        verifier.check(owner, seal_message(*KEY, 1, owner, DIGEST), seal)
    assert len(verifier._certified) == 2


# -- the receive slot ----------------------------------------------------------------------------

N, NUMEL = 3, 3 * 300_000  # two chunks per segment
RANK = 1  # receives from node-0; all_gather step 1 is node-2's segment, forwarded by node-0


def _chunks(
    world: dict[str, Identity], data: np.ndarray, digest: str = SHA256
) -> list[RingChunkView]:
    """What node-0 sends node-1 in one honest attempt (all-gather segments sealed with
    `digest`)."""
    plan = attempt_plan(N, NUMEL, "none", RANK)
    out: list[RingChunkView] = []
    hasher = segment_hasher(digest)
    for e in plan.expect:
        payload = memoryview(data[e.lo : e.hi].tobytes())
        seal = Seal(b"", b"", b"")
        if e.phase == ALL_GATHER:
            if e.offset == 0:
                hasher = segment_hasher(digest)
            hasher.update(payload)
            if e.last:
                owner = NODES[(e.segment - 1) % N]
                seal = _sign(world[owner], owner, hasher.digest(), e.segment, digest)
        out.append(
            RingChunkView(
                *KEY,
                from_node_id="node-0",
                phase=e.phase,
                step=e.step,
                segment=e.segment,
                spec=common_pb2.TensorSpec(codec="none"),
                offset=e.offset,
                payload=payload,
                last=e.last,
                segment_digest=seal.digest,
                owner_signature=seal.signature,
                owner_certificate=seal.certificate,
            )
        )
    return out


def _slot(
    world: dict[str, Identity], revoked: frozenset[str] = frozenset(), digest: str = SHA256
) -> ReceiveSlot:
    verifier = SegmentVerifier(world["node-1"].ca_pem, lambda: revoked)
    plan = attempt_plan(N, NUMEL, "none", RANK)
    buf = np.zeros(NUMEL, dtype=np.float32)
    return ReceiveSlot(KEY, plan.expect, RANK, "none", buf, NODES, verifier=verifier, digest=digest)


def _feed(slot: ReceiveSlot, chunks: list[RingChunkView]) -> ChunkRejected | None:
    for c in chunks:
        try:
            slot.on_chunk(c)
        except ChunkRejected as exc:
            return exc
    return None


def _forwarded(chunks: list[RingChunkView]) -> list[int]:
    """Indices of the chunks of all_gather step 1 (node-2's segment, forwarded by node-0)."""
    return [i for i, c in enumerate(chunks) if c.phase == ALL_GATHER and c.step == 1]


async def test_the_slot_takes_sealed_segments_and_keeps_their_seals(
    world: dict[str, Identity],
) -> None:
    data = np.arange(NUMEL, dtype=np.float32)
    chunks = _chunks(world, data)
    slot = _slot(world)
    assert _feed(slot, chunks) is None and slot.complete and slot.failure is None
    for seg in {c.segment for c in chunks if c.phase == ALL_GATHER}:
        assert slot.seal_of(seg)  # what this node forwards
    assert slot.seal_of(RANK + 1) == b""  # its own segment: it seals that one itself


async def test_blake3_seals_check_in_a_blake3_ring_only(world: dict[str, Identity]) -> None:
    """A ring whose assignment names BLAKE3 takes BLAKE3 seals; a member told SHA-256 refuses
    them (its digest differs), and a BLAKE3 member refuses SHA-256 seals the same way."""
    data = np.arange(NUMEL, dtype=np.float32)
    slot = _slot(world, digest=BLAKE3)
    assert _feed(slot, _chunks(world, data, BLAKE3)) is None and slot.complete
    assert slot.failure is None
    for told, sent in ((SHA256, BLAKE3), (BLAKE3, SHA256)):
        slot = _slot(world, digest=told)
        err = _feed(slot, _chunks(world, data, sent))
        assert err is not None and "does not match its owner's digest" in str(err), (told, err)
        assert slot.failure is not None and slot.failure.node_id == "node-0"


def test_the_signed_message_names_its_digest(world: dict[str, Identity]) -> None:
    """SHA-256 seals sign the first version's message (older agents check them); others name
    their digest, so a BLAKE3 seal never checks as a SHA-256 one with the same 32 bytes."""
    v1 = seal_message(*KEY, 1, "node-0", DIGEST)
    assert v1 == seal_message(*KEY, 1, "node-0", DIGEST, SHA256)
    assert v1 == f"{SEAL_CONTEXT}|job|4|1|1|node-0|{DIGEST.hex()}".encode()
    assert seal_message(*KEY, 1, "node-0", DIGEST, BLAKE3).startswith(
        b"epochmesh-ring-segment-v2|blake3|job|4|1|1|node-0|"
    )
    seal = _sign(world["node-0"], "node-0", algorithm=BLAKE3)
    verifier = SegmentVerifier(world["node-1"].ca_pem)
    verifier.check("node-0", seal_message(*KEY, 1, "node-0", DIGEST, BLAKE3), seal)
    with pytest.raises(SealError, match="signature"):
        verifier.check("node-0", seal_message(*KEY, 1, "node-0", DIGEST, SHA256), seal)


def test_a_ring_seals_with_blake3_when_every_member_checks_it() -> None:
    both = ["blake3", "sha256"]
    assert ring_seal_digest([both, both, ["blake3"]]) == BLAKE3
    assert ring_seal_digest([both, [], both]) == ""  # an older agent: SHA-256 for all
    assert ring_seal_digest([both, ["sha256", "md5"]]) == ""
    assert ring_seal_digest([["md5"], ["md5"]]) == ""  # unknown names are never chosen
    assert seal_digest("") == SHA256 and seal_digest(BLAKE3) == BLAKE3
    with pytest.raises(SealError, match="unknown seal digest 'md5'"):
        seal_digest("md5")
    assert segment_hasher(BLAKE3).digest() != segment_hasher(SHA256).digest()
    assert segment_hasher(SHA256).digest() == hashlib.sha256().digest()


def _flip(c: RingChunkView) -> RingChunkView:
    data = bytearray(c.payload)
    data[0] ^= 0x40  # a finite change: the NaN check does not see it
    return dataclasses.replace(c, payload=memoryview(bytes(data)))


@pytest.mark.parametrize("which", ["first", "last"])
async def test_a_tampered_forwarded_segment_blames_the_left_neighbour(
    world: dict[str, Identity], which: str
) -> None:
    chunks = _chunks(world, np.arange(NUMEL, dtype=np.float32))
    idx = _forwarded(chunks)
    i = idx[0] if which == "first" else idx[-1]
    chunks[i] = _flip(chunks[i])
    slot = _slot(world)
    err = _feed(slot, chunks)
    assert err is not None and "does not match its owner's digest" in str(err)
    assert err.failed_node is None  # the refusal names the sender
    assert slot.failure is not None and slot.failure.node_id == "node-0"
    assert slot.failure.fault == agent_pb2.RING_FAULT_TAMPERED
    assert slot.pos == idx[-1] and slot.seal_of(chunks[idx[-1]].segment) == b""


@pytest.mark.parametrize(
    ("forge", "words"),
    [
        ("unsealed", "without its owner's seal"),
        ("resealed", "certificate is that of 'node-0'"),
        ("other_segment", "signature"),
    ],
)
async def test_a_forged_seal_blames_the_left_neighbour(
    world: dict[str, Identity], forge: str, words: str
) -> None:
    chunks = _chunks(world, np.arange(NUMEL, dtype=np.float32))
    idx = _forwarded(chunks)
    for i in idx:
        chunks[i] = _flip(chunks[i])
    last = chunks[idx[-1]]
    hasher = hashlib.sha256()
    for i in idx:
        hasher.update(chunks[i].payload)
    digest = hasher.digest()
    if forge == "unsealed":
        seal = Seal(b"", b"", b"")
    elif forge == "resealed":  # node-0 signs its own tampered digest
        seal = _sign(world["node-0"], "node-2", digest, last.segment)
    else:  # node-2's seal of the same bytes for another segment (replayed)
        seal = _sign(world["node-2"], "node-2", digest, last.segment + 1)
    chunks[idx[-1]] = dataclasses.replace(
        last,
        segment_digest=seal.digest,
        owner_signature=seal.signature,
        owner_certificate=seal.certificate,
    )
    slot = _slot(world)
    err = _feed(slot, chunks)
    assert err is not None and words in str(err), err
    assert slot.failure is not None and slot.failure.node_id == "node-0"
    assert slot.failure.fault == agent_pb2.RING_FAULT_TAMPERED


async def test_a_revoked_owner_is_the_failed_node_without_a_fault(
    world: dict[str, Identity],
) -> None:
    chunks = _chunks(world, np.arange(NUMEL, dtype=np.float32))
    slot = _slot(world, revoked=frozenset({"node-2"}))
    err = _feed(slot, chunks)
    assert err is not None and err.failed_node == "node-2"
    assert slot.failure is not None and slot.failure.node_id == "node-2"
    assert slot.failure.fault == agent_pb2.RING_FAULT_UNSPECIFIED


async def test_without_identities_segments_travel_unsealed(world: dict[str, Identity]) -> None:
    chunks = _chunks(world, np.arange(NUMEL, dtype=np.float32))
    i = _forwarded(chunks)[0]
    chunks[i] = _flip(chunks[i])
    plan = attempt_plan(N, NUMEL, "none", RANK)
    buf = np.zeros(NUMEL, dtype=np.float32)
    slot = ReceiveSlot(KEY, plan.expect, RANK, "none", buf, NODES)
    assert _feed(slot, chunks) is None and slot.complete
