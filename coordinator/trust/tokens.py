"""The coordinator's certificate authority on disk, join tokens, enrollment and renewal.

Files in the data dir (made 0700, and an existing one open to others made private with all in
it at start): ``ca.pem`` and ``ca.key`` (0600), the trust root, and
``server.pem`` / ``server.key`` (0600), the TLS server certificate the CA issued to a key of
its own. `ensure_ca` creates the CA on first use (the coordinator's first start or the first
``token create``), under an flock so that both may race safely, and refuses to go on when only
one of its two files is there (`TrustRootError`: a new trust root would silently disown every
enrolled agent and user). `ensure_server_certificate` issues the server certificate when it is
missing, unusable, about to expire or lacks an ``--advertise`` name (data dirs of older
versions have none). Every key and certificate is written atomically and its directory fsynced.

Tokens (``epochmesh-coordinator token create --role R [--ttl 24h] [--uses N | --reusable]
[--cert-ttl 30d] [--donor NAME]``) are stored as the SHA-256 of their secret with role, expiry,
use count and limit, the lifetime of the certificates they enroll and, for a node token, its
donor. `enroll` redeems one: it checks that the token names this CA, uses it (refusals say
which rule: unknown, expired, used, used up; a node token's donor with a quarantined node:
PERMISSION_DENIED), picks the principal id (a fresh node id for role
node, ``u-<hex>`` for a user), records a node token's donor for the new node (in the same
transaction) and signs the caller's CSR for the token's certificate lifetime (bounded by
`MAX_CERT_TTL_S`). `renew` signs a new certificate for a caller authenticated by its current
one, once half of its lifetime has passed.

A token's secret carries a MAC keyed by the CA key (`token_mac_ok`): `screen_token` refuses a
malformed token, one of another coordinator and one whose MAC is wrong without a database read
(tokens of older versions, without a MAC, are looked up once: an unknown one is refused).
Enroll calls are limited per peer address first, and only a token that passed the screen is
counted against the coordinator's total (`EnrollRateLimiter.admit_peer` / `admit_total`), so
garbage from many addresses cannot use up the enrollment allowance of honest holders.
Renewals, authenticated by a valid certificate, have their own buckets, per principal and in
all (`EnrollLimits.renew_per_principal`, `renew_total`): no flood of enrollments delays one.
"""

from __future__ import annotations

import base64
import datetime as dt
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509

from coordinator.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from coordinator.core.ids import new_node_id, new_user_id
from coordinator.store.base import Store, TokenRecord
from coordinator.store.permissions import tighten_data_dir
from epochmesh import identity
from epochmesh.fsutil import make_private_dir, write_private
from epochmesh.timeutil import duration_seconds, now_ms

log = logging.getLogger(__name__)

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CA_LOCK_FILE = "ca.lock"
SERVER_CERT_FILE = "server.pem"
SERVER_KEY_FILE = "server.key"
# A server certificate with less than this left is issued again at start.
SERVER_CERT_RENEW_BEFORE_S = 30 * 24 * 3600.0
DEFAULT_TTL_S = 24 * 3600.0
MAX_TTL_S = 366 * 24 * 3600.0
# Certificates enrolled with a token live `--cert-ttl` (default 30 days), at most 90 days, at
# least 10 minutes; their holders renew them (agents do so by themselves).
DEFAULT_CERT_TTL_S = 30 * 24 * 3600.0
MAX_CERT_TTL_S = 90 * 24 * 3600.0
MIN_CERT_TTL_S = 600.0
MAX_TOKEN_USES = 100_000

_DONOR_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
# A token's secret: 16 random bytes and 16 bytes of their MAC, each base64url (22 + 22).
_NONCE_BYTES = 16
_MAC_BYTES = 16
_MAC_SECRET_CHARS = 44


class TrustRootError(RuntimeError):
    """The CA files in the data dir are incomplete or unusable: the coordinator must not start
    (nor make a new CA, which would disown every enrolled party)."""


def _days(seconds: float) -> str:
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{seconds / 86400:g}d"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


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


def parse_cert_ttl(text: str) -> float:
    """Seconds of a certificate lifetime such as ``12h`` or ``30d``, within the coordinator's
    bounds (`MIN_CERT_TTL_S` to `MAX_CERT_TTL_S`); ValueError naming them otherwise."""
    seconds = duration_seconds(text)
    if seconds is None:
        raise ValueError(f"not a duration: {text!r} (examples: 12h, 7d, 30d)")
    return check_cert_ttl(seconds)


def check_cert_ttl(seconds: float) -> float:
    if not MIN_CERT_TTL_S <= seconds <= MAX_CERT_TTL_S:
        raise ValueError(
            f"a certificate lifetime must be between {_days(MIN_CERT_TTL_S)} and "
            f"{_days(MAX_CERT_TTL_S)} (the coordinator's maximum), got {_days(seconds)}"
        )
    return seconds


def check_node_token(role: str, reusable: bool, max_uses: int, donor: str) -> None:
    """InvalidArgumentError for a node token that enrolls more than one node without a donor:
    each of its nodes would be a donor of its own, so one holder could enroll any number of
    unrelated-looking donors (and a donor with a quarantined node could come back as new)."""
    if role == identity.ROLE_NODE and (reusable or max_uses > 1) and not donor:
        how = "--reusable" if reusable else f"--uses {max_uses}"
        raise InvalidArgumentError(
            f"a node token for more than one enrollment ({how}) needs --donor NAME: without "
            "it every node it enrolls is a donor of its own, so one holder could enroll any "
            "number of unrelated-looking donors; name the donor its nodes earn for, or make "
            "single-use node tokens (one per node)"
        )


def check_uses(uses: int) -> int:
    if not 1 <= uses <= MAX_TOKEN_USES:
        raise ValueError(f"a token's use limit must be 1 to {MAX_TOKEN_USES}, got {uses}")
    return uses


# -- the CA on disk -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CertificateAuthority:
    """The CA's certificate and key; with the TLS server certificate and its own key once
    `ensure_server_certificate` made or loaded them (empty: none)."""

    cert_pem: bytes
    key_pem: bytes
    server_cert_pem: bytes = field(default=b"", repr=False)
    server_key_pem: bytes = field(default=b"", repr=False)

    @property
    def fingerprint(self) -> str:
        return identity.fingerprint(self.cert_pem)


def ensure_data_dir(data_dir: Path) -> None:
    """Create the data dir 0700; make an existing one that others may read or enter private,
    with everything in it (coordinator/store/permissions.py; DataDirPermissionError, a
    RuntimeError, when that is impossible)."""
    make_private_dir(data_dir)
    tighten_data_dir(data_dir)


@contextmanager
def _ca_lock(data_dir: Path) -> Iterator[None]:
    fd = os.open(data_dir / CA_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_ca(data_dir: Path) -> CertificateAuthority:
    cert_path, key_path = data_dir / CA_CERT_FILE, data_dir / CA_KEY_FILE
    try:
        ca = CertificateAuthority(cert_path.read_bytes(), key_path.read_bytes())
    except OSError as exc:
        raise TrustRootError(f"cannot read the coordinator CA in {data_dir}: {exc}") from None
    try:
        cert = identity.load_certificate(ca.cert_pem)
        matches = identity.key_matches_certificate(ca.key_pem, ca.cert_pem)
    except identity.IdentityError as exc:
        raise TrustRootError(
            f"the coordinator CA in {data_dir} is unusable ({exc}): restore {CA_CERT_FILE} and "
            f"{CA_KEY_FILE} from a backup"
        ) from None
    if not matches:
        raise TrustRootError(
            f"{key_path} is not the key of {cert_path}: restore the pair from a backup"
        )
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise TrustRootError(f"{cert_path} is not a CA certificate")
    return ca


def ensure_ca(data_dir: Path, hosts: tuple[str, ...] = ()) -> CertificateAuthority:
    """Load the CA from ``data_dir``, creating it (with ``hosts`` as extra SANs) when neither
    of its files exists. TrustRootError when only one does, or they are unusable."""
    ensure_data_dir(data_dir)
    cert_path, key_path = data_dir / CA_CERT_FILE, data_dir / CA_KEY_FILE
    with _ca_lock(data_dir):
        have_cert, have_key = cert_path.exists(), key_path.exists()
        if have_cert != have_key:
            present, absent = (cert_path, key_path) if have_cert else (key_path, cert_path)
            raise TrustRootError(
                f"the coordinator CA in {data_dir} is incomplete: {present.name} is there but "
                f"{absent.name} is missing. Refusing to start rather than make a new trust root "
                f"(every enrolled agent and user would be refused). Restore {absent.name} from "
                f"a backup; or, to start over with a new CA (everyone enrolls again), remove "
                f"{present.name} too"
            )
        if not have_cert:
            cert_pem, key_pem = identity.create_ca(hosts)
            # The key first: the certificate's arrival completes the pair.
            write_private(key_path, key_pem)
            write_private(cert_path, cert_pem, mode=0o644)
            log.info(
                "created the coordinator CA in %s (fingerprint %s)",
                data_dir,
                identity.fingerprint(cert_pem),
            )
        return _load_ca(data_dir)


def _server_certificate_problem(
    ca: CertificateAuthority, cert_pem: bytes, key_pem: bytes, hosts: tuple[str, ...]
) -> str:
    """Why the stored server certificate must be issued again ("" when it is fine)."""
    try:
        cert = identity.load_certificate(cert_pem)
        if not identity.key_matches_certificate(key_pem, cert_pem):
            return "its key does not match"
        cert.verify_directly_issued_by(identity.load_certificate(ca.cert_pem))
    except Exception as exc:  # noqa: BLE001 - malformed, wrong issuer, bad signature alike
        return f"unusable ({exc or type(exc).__name__})"
    if cert.not_valid_after_utc.timestamp() - now_ms() / 1000 < SERVER_CERT_RENEW_BEFORE_S:
        return "it expires within 30 days"
    names = identity.certificate_hosts(cert_pem)
    missing = [h for h in (identity.COORDINATOR_NAME, *hosts) if h.strip("[]") not in names]
    if missing:
        return f"it lacks the names {', '.join(missing)}"
    return ""


def ensure_server_certificate(
    data_dir: Path, ca: CertificateAuthority, hosts: tuple[str, ...] = ()
) -> CertificateAuthority:
    """``ca`` with the coordinator's TLS server certificate and key from ``data_dir``, issued
    (with ``hosts`` as extra names) when missing, unusable, expiring within 30 days or lacking
    one of ``hosts``. The server key is not the CA's: losing it costs nothing but a new one."""
    cert_path, key_path = data_dir / SERVER_CERT_FILE, data_dir / SERVER_KEY_FILE
    with _ca_lock(data_dir):
        try:
            cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
            problem = _server_certificate_problem(ca, cert_pem, key_pem, hosts)
        except FileNotFoundError:
            problem = "none yet"
        if problem:
            cert_pem, key_pem = identity.create_server_certificate(ca.cert_pem, ca.key_pem, hosts)
            write_private(key_path, key_pem)
            write_private(cert_path, cert_pem, mode=0o644)
            log.info(
                "issued the coordinator's TLS server certificate (%s) in %s", problem, data_dir
            )
    return CertificateAuthority(ca.cert_pem, ca.key_pem, cert_pem, key_pem)


# -- tokens and enrollment ----------------------------------------------------------------------


async def create_token(
    store: Store,
    ca: CertificateAuthority,
    role: str,
    ttl_s: float,
    reusable: bool = False,
    donor: str = "",
    max_uses: int = 0,
    cert_ttl_s: float = DEFAULT_CERT_TTL_S,
) -> str:
    """A new join token for ``role`` that expires after ``ttl_s`` seconds and enrolls
    certificates that live ``cert_ttl_s``. Single use, unless ``reusable`` (until it expires)
    or ``max_uses`` (that many enrollments). A node token with a ``donor`` enrolls nodes that
    earn for ``donor:<donor>`` (without: each for its own id). InvalidArgumentError for a node
    token of more than one enrollment without a donor (`check_node_token`)."""
    if role not in identity.ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(identity.ROLES)})")
    check_node_token(role, reusable, max_uses, donor)
    if donor:
        if role != identity.ROLE_NODE:
            raise ValueError(f"a donor is for node tokens only, not for role {role}")
        check_donor(donor)
    if max_uses:
        check_uses(max_uses)
    check_cert_ttl(cert_ttl_s)
    token, token_hash = new_join_token(ca)
    created = now_ms()
    await store.add_token(
        TokenRecord(
            token_hash=token_hash,
            role=role,
            created_ms=created,
            expires_ms=created + int(ttl_s * 1000),
            reusable=reusable or max_uses > 1,
            donor=donor,
            max_uses=max_uses if max_uses > 1 else 0,
            cert_ttl_ms=int(cert_ttl_s * 1000),
        )
    )
    return token


@dataclass(frozen=True)
class Enrollment:
    certificate_pem: bytes
    principal: str
    role: str


def _refusal(record: TokenRecord | None, now: int) -> str:
    """Why a token could not be redeemed, naming the rule."""
    if record is None:
        return UNKNOWN_TOKEN
    if record.expires_ms <= now:
        expired = dt.datetime.fromtimestamp(record.expires_ms / 1000, dt.UTC)
        return f"join token expired at {expired:%Y-%m-%d %H:%M:%S} UTC"
    if not record.reusable:
        return (
            "join token already used: it was for one enrollment "
            "(`token create --uses N` makes one for N)"
        )
    return (
        f"join token used up: its use limit is {record.max_uses} enrollments "
        f"(`token create --uses {record.max_uses}`), all of them made"
    )


def _check_csr(csr_pem: bytes) -> None:
    if len(csr_pem) > 16 * 1024:
        raise InvalidArgumentError("csr_pem is too large (at most 16 KiB)")
    try:
        identity.check_csr(csr_pem)
    except identity.IdentityError as exc:
        raise InvalidArgumentError(f"bad certificate signing request: {exc}") from None


def token_cert_ttl_s(record: TokenRecord) -> float:
    """The lifetime of the certificates ``record`` enrolls: its own (tokens made before use
    limits had none: the default), never above `MAX_CERT_TTL_S`."""
    ttl = record.cert_ttl_ms / 1000 if record.cert_ttl_ms > 0 else DEFAULT_CERT_TTL_S
    return min(max(ttl, MIN_CERT_TTL_S), MAX_CERT_TTL_S)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _token_mac(ca: CertificateAuthority, nonce: str) -> str:
    key = hashlib.sha256(b"epochmesh join-token mac v1\0" + ca.key_pem).digest()
    return _b64(hmac.new(key, nonce.encode(), hashlib.sha256).digest()[:_MAC_BYTES])


def new_join_token(ca: CertificateAuthority) -> tuple[str, str]:
    """A fresh join token of this CA (``emt1.<nonce><mac>.<fingerprint>``, the format of
    `identity.new_token`) and the hash of its secret (what the store keeps)."""
    nonce = _b64(secrets.token_bytes(_NONCE_BYTES))
    secret = nonce + _token_mac(ca, nonce)
    return f"{identity.TOKEN_PREFIX}.{secret}.{ca.fingerprint}", identity.hash_secret(secret)


def token_has_mac(secret: str) -> bool:
    """Whether a token secret has the shape of one with a MAC (tokens of older versions are
    32 random characters)."""
    return len(secret) == _MAC_SECRET_CHARS


def token_mac_ok(ca: CertificateAuthority, secret: str) -> bool:
    nonce, mac = secret[:-22], secret[-22:]
    return hmac.compare_digest(mac, _token_mac(ca, nonce))


UNKNOWN_TOKEN = "join token unknown to this coordinator"


def join_token_hash(ca: CertificateAuthority, token: str) -> str:
    """The stored hash of a join token of this CA; UnauthenticatedError for a malformed token,
    one another coordinator issued, or one with a wrong MAC (no database read)."""
    try:
        secret, fingerprint = identity.parse_token(token)
    except identity.IdentityError as exc:
        raise UnauthenticatedError(str(exc)) from None
    if fingerprint != ca.fingerprint:
        raise UnauthenticatedError("the token was issued by another coordinator (CA mismatch)")
    if token_has_mac(secret) and not token_mac_ok(ca, secret):
        raise UnauthenticatedError(UNKNOWN_TOKEN)
    return identity.hash_secret(secret)


async def screen_token(store: Store, ca: CertificateAuthority, token: str) -> str:
    """`join_token_hash`, and for a token without a MAC (made by an older version) a look-up:
    UnauthenticatedError when the store has never heard of it. What passes may still be
    expired or used up (`enroll` says so); what fails cost no enrollment allowance."""
    token_hash = join_token_hash(ca, token)
    if not token_has_mac(identity.parse_token(token)[0]):
        if await store.get_token(token_hash) is None:
            raise UnauthenticatedError(UNKNOWN_TOKEN)
    return token_hash


async def enroll(store: Store, ca: CertificateAuthority, token: str, csr_pem: bytes) -> Enrollment:
    """Redeem ``token`` and sign ``csr_pem``. UnauthenticatedError for a token that is
    malformed, for another coordinator, unknown, expired, used or used up (the message says
    which); InvalidArgumentError for a bad CSR (the token is then not used)."""
    token_hash = join_token_hash(ca, token)
    _check_csr(csr_pem)  # before the token is spent
    async with store.transaction():
        now = now_ms()
        record = await store.redeem_token(token_hash, now)
        if record is None:
            raise UnauthenticatedError(_refusal(await store.get_token(token_hash), now))
        principal = new_node_id() if record.role == identity.ROLE_NODE else new_user_id()
        if record.role == identity.ROLE_NODE and record.donor:
            caught = await store.quarantined_nodes_of_donor(record.donor)
            if caught:  # the token's use is rolled back with the transaction
                raise PermissionDeniedError(
                    f"donor {record.donor} has a quarantined node ({caught[0]}): no new node "
                    "enrolls for a donor while one of its nodes is quarantined (a fresh "
                    "certificate does not wipe a donor's record)"
                )
            await store.set_node_donor(principal, record.donor)
    cert = identity.sign_csr(
        csr_pem,
        ca.cert_pem,
        ca.key_pem,
        principal=principal,
        role=record.role,
        lifetime_s=token_cert_ttl_s(record),
    )
    return Enrollment(certificate_pem=cert, principal=principal, role=record.role)


def renew(
    ca: CertificateAuthority, current: x509.Certificate, csr_pem: bytes, now_s: float
) -> Enrollment:
    """A new certificate for the principal of ``current`` (a certificate of this CA the caller
    authenticated with) and the key of ``csr_pem``: its lifetime is ``current``'s, bounded by
    `MAX_CERT_TTL_S`. FailedPreconditionError before `identity.RENEWAL_OPENS_AT` of
    ``current``'s lifetime has passed; InvalidArgumentError for a bad CSR."""
    _check_csr(csr_pem)
    principal = identity.principal_of(current)
    issued, expires = identity.issued_and_expires_s(current)
    opens = identity.renewal_opens_s(current)
    if now_s < opens:
        at = dt.datetime.fromtimestamp(opens, dt.UTC)
        raise FailedPreconditionError(
            f"renewal of {principal}'s certificate opens at {at:%Y-%m-%d %H:%M:%S} UTC: a "
            f"certificate is renewed once half of its lifetime ({_days(expires - issued)}) "
            "has passed"
        )
    lifetime = min(max(expires - issued, MIN_CERT_TTL_S), MAX_CERT_TTL_S)
    cert = identity.sign_csr(
        csr_pem,
        ca.cert_pem,
        ca.key_pem,
        principal=principal.id,
        role=principal.role,
        lifetime_s=lifetime,
    )
    return Enrollment(certificate_pem=cert, principal=principal.id, role=principal.role)


def issue_identity(
    ca: CertificateAuthority,
    role: str,
    principal: str = "",
    lifetime_s: float = DEFAULT_CERT_TTL_S,
    issued_at: dt.datetime | None = None,
) -> identity.Identity:
    """A key pair and certificate made directly by the CA (tests, local tools), valid for
    ``lifetime_s`` from ``issued_at`` (default now)."""
    if not principal:
        principal = new_node_id() if role == identity.ROLE_NODE else new_user_id()
    key = identity.new_private_key()
    cert = identity.sign_csr(
        identity.create_csr(key),
        ca.cert_pem,
        ca.key_pem,
        principal=principal,
        role=role,
        lifetime_s=lifetime_s,
        issued_at=issued_at,
    )
    return identity.Identity(ca_pem=ca.cert_pem, cert_pem=cert, key_pem=key)


# -- rate limits --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RateLimit:
    """A token bucket: ``burst`` calls at once, refilled at ``per_minute``."""

    burst: int
    per_minute: float

    def describe(self) -> str:
        return f"at most {self.burst} at once, then {self.per_minute:g} per minute"


@dataclass(frozen=True)
class EnrollLimits:
    """Limits on Enroll calls per peer address (an IPv6 address counts by its /64) and, for
    tokens that pass `screen_token`, for the whole coordinator; and on RenewCertificate calls
    of authenticated callers, per principal and in all (apart from Enroll's)."""

    per_peer: RateLimit = RateLimit(burst=20, per_minute=30.0)
    total: RateLimit = RateLimit(burst=200, per_minute=600.0)
    renew_per_principal: RateLimit = RateLimit(burst=5, per_minute=2.0)
    renew_total: RateLimit = RateLimit(burst=200, per_minute=600.0)

    def renewals(self) -> EnrollLimits:
        """The limits of the renewal buckets, in the shape `EnrollRateLimiter` takes."""
        return EnrollLimits(per_peer=self.renew_per_principal, total=self.renew_total)


# The limits a coordinator applies (tests lower them).
ENROLL_LIMITS = EnrollLimits()


def peer_key(peer: str) -> str:
    """The address a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) is limited as:
    the IPv4 address, or the /64 of an IPv6 address (one host gets a whole /64)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at

    def refill(self, limit: RateLimit, now: float) -> None:
        rate = limit.per_minute / 60.0
        self.tokens = min(float(limit.burst), self.tokens + max(0.0, now - self.at) * rate)
        self.at = now

    def wait_s(self, limit: RateLimit) -> int:
        """Whole seconds (at least 1) until the bucket holds a call again."""
        rate = limit.per_minute / 60.0
        return max(1, math.ceil((1.0 - self.tokens) / rate)) if rate > 0 else 3600


class EnrollRateLimiter:
    """Token buckets per peer (or principal) and in all (a pure object: the clock is passed
    in). A call refused by its peer's bucket takes nothing from the total, so one address
    cannot use up the coordinator's allowance for everyone else. ``calls`` and ``per`` name
    the calls and the key in refusals."""

    MAX_PEERS = 10_000

    def __init__(
        self,
        limits: EnrollLimits,
        calls: str = "enrollment and renewal calls",
        per: str = "address",
    ) -> None:
        self.limits = limits
        self.calls = calls
        self.per = per
        self._peers: OrderedDict[str, _Bucket] = OrderedDict()
        self._total: _Bucket | None = None

    def admit(self, peer: str, now: float) -> str:
        """ "" when a call from ``peer`` may go ahead (and it is counted against both
        buckets), else why not."""
        reason = self._peer_reason(peer, now)
        if not reason:
            reason = self._total_reason(now)
        if not reason:
            self._peers[peer].tokens -= 1.0
            assert self._total is not None
            self._total.tokens -= 1.0
        return reason

    def admit_peer(self, peer: str, now: float) -> str:
        """`admit` against ``peer``'s bucket alone (the total is `admit_total`'s)."""
        reason = self._peer_reason(peer, now)
        if not reason:
            self._peers[peer].tokens -= 1.0
        return reason

    def admit_total(self, now: float) -> str:
        """`admit` against the total alone."""
        reason = self._total_reason(now)
        if not reason:
            assert self._total is not None
            self._total.tokens -= 1.0
        return reason

    def _peer_reason(self, peer: str, now: float) -> str:
        limits = self.limits
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = _Bucket(float(limits.per_peer.burst), now)
            self._peers[peer] = bucket
            while len(self._peers) > self.MAX_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
            bucket.refill(limits.per_peer, now)
        if bucket.tokens < 1.0:
            return (
                f"too many {self.calls} from {peer}: the limit per {self.per} is "
                f"{limits.per_peer.describe()}; retry in {bucket.wait_s(limits.per_peer)} s"
            )
        return ""

    def _total_reason(self, now: float) -> str:
        limits = self.limits
        total = self._total
        if total is None:
            total = self._total = _Bucket(float(limits.total.burst), now)
        else:
            total.refill(limits.total, now)
        if total.tokens < 1.0:
            return (
                f"too many {self.calls} at this coordinator: the limit for all "
                f"callers together is {limits.total.describe()}; retry in "
                f"{total.wait_s(limits.total)} s"
            )
        return ""

    def check(self, peer: str, now: float) -> None:
        """ResourceExhaustedError unless `admit`."""
        _raise_unless(self.admit(peer, now))

    def check_peer(self, peer: str, now: float) -> None:
        """ResourceExhaustedError unless `admit_peer`."""
        _raise_unless(self.admit_peer(peer, now))

    def check_total(self, now: float) -> None:
        """ResourceExhaustedError unless `admit_total`."""
        _raise_unless(self.admit_total(now))


def _raise_unless(reason: str) -> None:
    if reason:
        raise ResourceExhaustedError(reason)
