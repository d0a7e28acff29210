"""The coordinator's certificate authority on disk, join tokens, and enrollment.

Files in the data dir: ``ca.pem`` (the CA certificate, also the server certificate) and
``ca.key`` (0600). `ensure_ca` creates them on first use (the coordinator's first start or the
first ``token create``), under an flock so that both may race safely.

Tokens (``epochmesh-coordinator token create --role R [--ttl 24h] [--reusable] [--donor NAME]``)
are stored as the SHA-256 of their secret with role, expiry, use count and, for a node token,
its donor. `enroll` redeems one: it checks that the token names this CA, uses it (single-use
unless reusable; expired or used: UNAUTHENTICATED), picks the principal id (a fresh node id for
role node, ``u-<hex>`` for a user), records a node token's donor for the new node (in the same
transaction) and signs the caller's CSR.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from coordinator.nodes import new_node_id
from coordinator.store import InvalidArgumentError, Store, TokenRecord, UnauthenticatedError
from epochmesh import identity
from epochmesh.timeutil import duration_seconds, now_ms

log = logging.getLogger(__name__)

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CA_LOCK_FILE = "ca.lock"
DEFAULT_TTL_S = 24 * 3600.0
MAX_TTL_S = 366 * 24 * 3600.0
USER_ID_PREFIX = "u-"

_DONOR_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def parse_ttl(text: str) -> float:
    """Seconds of a duration such as ``90``, ``30s``, ``15m``, ``24h``, ``7d``."""
    seconds = duration_seconds(text)
    if seconds is None:
        raise ValueError(f"not a duration: {text!r} (examples: 30m, 24h, 7d)")
    if not 0 < seconds <= MAX_TTL_S:
        raise ValueError(f"duration must be positive and at most 366d, got {text!r}")
    return seconds


def check_donor(name: str) -> str:
    """``name`` if it may name a donor (1-64 of A-Z a-z 0-9 . _ -), else ValueError."""
    if not _DONOR_RE.fullmatch(name):
        raise ValueError(
            f"not a donor name: {name[:80]!r} (1-64 characters of letters, digits, '.', '_', '-')"
        )
    return name


@dataclass(frozen=True)
class CertificateAuthority:
    cert_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> str:
        return identity.fingerprint(self.cert_pem)


def ensure_ca(data_dir: Path, hosts: tuple[str, ...] = ()) -> CertificateAuthority:
    """Load the CA from ``data_dir``, creating it (with ``hosts`` as extra SANs) if absent."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = data_dir / CA_CERT_FILE, data_dir / CA_KEY_FILE
    fd = os.open(data_dir / CA_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not (cert_path.exists() and key_path.exists()):
            cert_pem, key_pem = identity.create_ca(hosts)
            identity.write_private(key_path, key_pem)
            identity.write_private(cert_path, cert_pem, mode=0o644)
            log.info(
                "created the coordinator CA in %s (fingerprint %s)",
                data_dir,
                identity.fingerprint(cert_pem),
            )
        ca = CertificateAuthority(cert_path.read_bytes(), key_path.read_bytes())
    finally:
        os.close(fd)
    missing = [h for h in hosts if h.strip("[]") not in identity.certificate_hosts(ca.cert_pem)]
    if missing:
        log.warning(
            "--advertise %s is not in the existing CA certificate's names; epochmesh clients "
            "verify the name %s and are not affected, other TLS clients need it as authority",
            ", ".join(missing),
            identity.COORDINATOR_NAME,
        )
    return ca


async def create_token(
    store: Store,
    ca: CertificateAuthority,
    role: str,
    ttl_s: float,
    reusable: bool = False,
    donor: str = "",
) -> str:
    """A new join token for ``role`` that expires after ``ttl_s`` seconds. A node token with a
    ``donor`` enrolls nodes that earn for ``donor:<donor>`` (without: each for its own id)."""
    if role not in identity.ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(identity.ROLES)})")
    if donor:
        if role != identity.ROLE_NODE:
            raise ValueError(f"a donor is for node tokens only, not for role {role}")
        check_donor(donor)
    token, token_hash = identity.new_token(ca.fingerprint)
    created = now_ms()
    await store.add_token(
        TokenRecord(
            token_hash=token_hash,
            role=role,
            created_ms=created,
            expires_ms=created + int(ttl_s * 1000),
            reusable=reusable,
            donor=donor,
        )
    )
    return token


def new_user_id() -> str:
    return USER_ID_PREFIX + secrets.token_hex(5)


@dataclass(frozen=True)
class Enrollment:
    certificate_pem: bytes
    principal: str
    role: str


async def enroll(store: Store, ca: CertificateAuthority, token: str, csr_pem: bytes) -> Enrollment:
    """Redeem ``token`` and sign ``csr_pem``. UnauthenticatedError for a token that is
    malformed, for another coordinator, unknown, used or expired; InvalidArgumentError for a
    bad CSR (the token is then not used)."""
    try:
        secret, fingerprint = identity.parse_token(token)
    except identity.IdentityError as exc:
        raise UnauthenticatedError(str(exc)) from None
    if fingerprint != ca.fingerprint:
        raise UnauthenticatedError("the token was issued by another coordinator (CA mismatch)")
    if len(csr_pem) > 16 * 1024:
        raise InvalidArgumentError("csr_pem is too large")
    try:
        identity.check_csr(csr_pem)  # before the token is spent
    except identity.IdentityError as exc:
        raise InvalidArgumentError(f"bad certificate signing request: {exc}") from None
    async with store.transaction():
        record = await store.redeem_token(identity.hash_secret(secret), now_ms())
        if record is None:
            raise UnauthenticatedError("join token unknown, already used, or expired")
        principal = new_node_id() if record.role == identity.ROLE_NODE else new_user_id()
        if record.role == identity.ROLE_NODE and record.donor:
            await store.set_node_donor(principal, record.donor)
    cert = identity.sign_csr(
        csr_pem, ca.cert_pem, ca.key_pem, principal=principal, role=record.role
    )
    return Enrollment(certificate_pem=cert, principal=principal, role=record.role)


def issue_identity(ca: CertificateAuthority, role: str, principal: str = "") -> identity.Identity:
    """A key pair and certificate made directly by the CA (tests, local tools)."""
    if not principal:
        principal = new_node_id() if role == identity.ROLE_NODE else new_user_id()
    key = identity.new_private_key()
    cert = identity.sign_csr(
        identity.create_csr(key), ca.cert_pem, ca.key_pem, principal=principal, role=role
    )
    return identity.Identity(ca_pem=ca.cert_pem, cert_pem=cert, key_pem=key)
