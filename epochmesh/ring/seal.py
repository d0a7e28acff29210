"""The seal of a ring all-gather segment: its owner's digest of the segment's encoded bytes, the
owner's signature over it and the owner's node certificate (docs/ring-rounds.md, "Sealed
all-gather"). No networking: `node_agent.ring.allreduce` carries and checks seals.

Two digests (`SEAL_DIGESTS`), both 32 bytes: BLAKE3, which every member of a ring hashes about
3.5 times faster than SHA-256 here (3.7 against 1.07 GB/s on one core of the 2-core VM), and
SHA-256, what agents that do not declare BLAKE3 check. The coordinator names the ring's digest in
each attempt's RingAssignment: BLAKE3 when every member declared it at registration, else SHA-256.
The signed message names the digest (`seal_message`), so a seal made with one never checks as the
other.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import blake3
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from epochmesh.identity import (
    CLOCK_SKEW_S,
    ROLE_NODE,
    Identity,
    IdentityError,
    load_certificate,
    principal_of,
)

SEAL_CONTEXT = "epochmesh-ring-segment-v1"  # SHA-256 seals (what older agents make)
SEAL_CONTEXT_V2 = "epochmesh-ring-segment-v2"  # seals naming their digest
SHA256 = "sha256"
BLAKE3 = "blake3"
# The digests this agent can make and check, fastest first (declared at registration).
SEAL_DIGESTS = (BLAKE3, SHA256)
DIGEST_BYTES = 32  # both digests
# Certificates a verifier remembers as checked against its CA (a ring has one per member).
MAX_CACHED_CERTIFICATES = 256
_ECDSA = ec.ECDSA(hashes.SHA256())


class SealError(ValueError):
    """A seal that does not hold: the node that delivered it altered or made it up."""


class OwnerRevoked(SealError):
    """The segment's owner is on the revocation list: the owner is refused, not the node that
    delivered its seal (that one's list may simply be older)."""


@dataclass(frozen=True)
class Seal:
    digest: bytes  # SHA-256 of the segment's encoded bytes
    signature: bytes  # the owner's ECDSA P-256 (SHA-256) signature of `seal_message`
    certificate: bytes  # the owner's node certificate, DER


class SegmentHasher(Protocol):
    """An incremental digest of a segment's bytes (hashlib's and blake3's objects alike)."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


def seal_digest(name: str) -> str:
    """The digest a RingAssignment's `seal_digest` names ("" is SHA-256, what coordinators
    that name none mean); SealError for one this agent does not know."""
    digest = name or SHA256
    if digest not in SEAL_DIGESTS:
        raise SealError(f"unknown seal digest {name!r} (known: {', '.join(SEAL_DIGESTS)})")
    return digest


def ring_seal_digest(members: Iterable[Collection[str]]) -> str:
    """The digest a ring seals with, given what each member declared (NodeInfo's
    ring_seal_digests): the fastest one all of them check, as a RingAssignment names it ("" for
    SHA-256, which every agent checks, declared or not)."""
    common = set(SEAL_DIGESTS)
    for declared in members:
        common &= set(declared)
    best = next((d for d in SEAL_DIGESTS if d in common), SHA256)
    return "" if best == SHA256 else best


def segment_hasher(digest: str) -> SegmentHasher:
    """A fresh incremental hasher of `digest` (one of SEAL_DIGESTS)."""
    if digest == BLAKE3:
        return blake3.blake3()
    if digest == SHA256:
        return hashlib.sha256()
    raise SealError(f"unknown seal digest {digest!r}")


def seal_message(
    job_id: str,
    round_: int,
    attempt: int,
    segment: int,
    owner: str,
    digest: bytes,
    algorithm: str = SHA256,
) -> bytes:
    """What the owner of `segment` signs for attempt (job_id, round_, attempt), its segment
    hashed with `algorithm`: SHA-256 seals keep the first version's message (agents of that
    version check them); others name their digest."""
    tail = f"{job_id}|{round_}|{attempt}|{segment}|{owner}|{digest.hex()}"
    if algorithm == SHA256:
        return f"{SEAL_CONTEXT}|{tail}".encode()
    return f"{SEAL_CONTEXT_V2}|{algorithm}|{tail}".encode()


class SegmentSigner:
    """Seals segments as the node of `current()`'s identity (called at every seal, so that a
    renewed certificate is used from then on; its key is loaded once per identity)."""

    def __init__(self, current: Callable[[], Identity]) -> None:
        self._current = current
        self._identity: Identity | None = None
        self._der = b""
        self._key: ec.EllipticCurvePrivateKey | None = None

    def seal(self, message: bytes, digest: bytes) -> Seal:
        identity = self._current()
        if identity is not self._identity or self._key is None:
            key = serialization.load_pem_private_key(identity.key_pem, password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise IdentityError("the node key is not an EC key")
            self._der = load_certificate(identity.cert_pem).public_bytes(serialization.Encoding.DER)
            self._key, self._identity = key, identity
        return Seal(digest, self._key.sign(message, _ECDSA), self._der)


@dataclass(frozen=True)
class _Certified:
    node_id: str
    key: ec.EllipticCurvePublicKey
    not_before: float  # POSIX seconds
    not_after: float


class SegmentVerifier:
    """Checks seals against the CA (`ca_pem`) and the revocation list (`revoked()`, node ids).
    A certificate's CA signature is checked once (remembered by its DER bytes); its validity
    window (within `CLOCK_SKEW_S`), the owner's id and the revocation list at every seal."""

    def __init__(
        self,
        ca_pem: bytes,
        revoked: Callable[[], Collection[str]] = frozenset,
        *,
        clock: Callable[[], float] = time.time,
        max_cached: int = MAX_CACHED_CERTIFICATES,
    ) -> None:
        self._ca = load_certificate(ca_pem)
        self._revoked = revoked
        self._clock = clock
        self._max_cached = max_cached
        self._certified: OrderedDict[bytes, _Certified] = OrderedDict()

    def check(self, owner: str, message: bytes, seal: Seal) -> None:
        """SealError unless `seal` is `owner`'s valid signature of `message` (OwnerRevoked
        when the owner's certificates are revoked)."""
        if owner in self._revoked():
            raise OwnerRevoked(f"the certificate of the owner {owner!r} has been revoked")
        if len(seal.digest) != DIGEST_BYTES:
            raise SealError(f"the digest has {len(seal.digest)} bytes, not {DIGEST_BYTES}")
        cert = self._certify(seal.certificate)
        if cert.node_id != owner:
            raise SealError(f"the seal's certificate is that of {cert.node_id!r}, not {owner!r}")
        now = self._clock()
        if not cert.not_before - CLOCK_SKEW_S <= now <= cert.not_after + CLOCK_SKEW_S:
            raise SealError(f"the certificate of {owner!r} is expired or not yet valid")
        try:
            cert.key.verify(seal.signature, message, _ECDSA)
        except (InvalidSignature, ValueError):
            raise SealError(f"the signature is not {owner!r}'s signature of the digest") from None

    def _certify(self, der: bytes) -> _Certified:
        known = self._certified.get(der)
        if known is not None:
            self._certified.move_to_end(der)
            return known
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            raise SealError("the seal's certificate does not parse") from None
        try:
            cert.verify_directly_issued_by(self._ca)
        except Exception:  # noqa: BLE001 - InvalidSignature, ValueError, TypeError alike
            raise SealError("the seal's certificate is not one of the coordinator's CA") from None
        try:
            principal = principal_of(cert)
        except IdentityError as exc:
            raise SealError(f"the seal's certificate: {exc}") from None
        if principal.role != ROLE_NODE:
            raise SealError(f"the seal's certificate is a {principal.role} certificate")
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise SealError("the seal's certificate key is not an EC key")
        known = _Certified(
            principal.id,
            key,
            cert.not_valid_before_utc.timestamp(),
            cert.not_valid_after_utc.timestamp(),
        )
        self._certified[der] = known
        while len(self._certified) > self._max_cached:
            self._certified.popitem(last=False)
        return known


__all__ = [
    "BLAKE3",
    "DIGEST_BYTES",
    "SEAL_CONTEXT",
    "SEAL_CONTEXT_V2",
    "SEAL_DIGESTS",
    "SHA256",
    "SegmentHasher",
    "OwnerRevoked",
    "Seal",
    "SealError",
    "SegmentSigner",
    "SegmentVerifier",
    "seal_digest",
    "ring_seal_digest",
    "seal_message",
    "segment_hasher",
]
