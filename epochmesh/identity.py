"""Identities and TLS for every epochmesh program (pure helpers around `cryptography`).

Trust model (see DESIGN.md section 6 and docs/trust.md):

- The coordinator owns a certificate authority: an EC P-256 key and a self-signed CA
  certificate in its data dir (``ca.pem`` / ``ca.key``, 0600). It serves TLS with a server
  certificate of its own key (``server.pem`` / ``server.key``) issued by that CA, and sends the
  CA certificate along in the handshake, so a newcomer that knows only the CA's fingerprint
  (from its join token) can read the chain off the handshake (`fetch_server_chain`, no trust
  needed yet), pick the certificate whose SHA-256 the token names (`fetch_ca`) and from then on
  use it as its only root. (Data dirs of older versions served the CA certificate itself;
  `fetch_ca` accepts both.) Clients verify the server under the fixed name `COORDINATOR_NAME`
  (``grpc.ssl_target_name_override``), which the server certificate always carries, so the
  address one dials (an IP, a NAT'd name) does not matter: pinning the CA is what
  authenticates the coordinator.
- Everyone else holds a key pair made locally and a certificate issued by that CA through
  enrollment (CSR + join token): subject CN = principal id, OU = role, plus SAN DNS:<principal>
  so that peers can verify "this is node X" (`peer_channel_options`). Its lifetime is the join
  token's (bounded by the coordinator); the holder renews it with its current certificate
  (`renew_identity`) once `RENEWAL_OPENS_AT` of its lifetime has passed.
- Calls to the coordinator carry the certificate as call credentials (`CertificateAuth`):
  gRPC's Python server can either require a TLS client certificate on every connection or
  not ask for one at all, and enrollment, health checks and reflection must work without
  one. So the coordinator's TLS authenticates the server only, and each call sends the
  caller's certificate (DER) plus an ECDSA signature by its key over the method name and a
  timestamp, inside that TLS session; the coordinator verifies both (coordinator/trust/auth.py).
  Between peers (PeerService) it is plain mutual TLS (`peer_server_credentials`).
- A join token is ``emt1.<secret>.<ca-fingerprint>``; the coordinator stores only the
  SHA-256 of the secret (`hash_secret`).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epochmesh.grpc_util import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

ROLE_NODE = "node"
ROLE_SUBMITTER = "submitter"
ROLE_OPERATOR = "operator"
ROLES = (ROLE_NODE, ROLE_SUBMITTER, ROLE_OPERATOR)

# The name every coordinator certificate carries; clients verify the server under it.
COORDINATOR_NAME = "epochmesh-coordinator"
CA_VALIDITY_DAYS = 3650
CERT_VALIDITY_DAYS = 365
SERVER_CERT_VALIDITY_DAYS = 365
# A certificate may be renewed once this fraction of its lifetime has passed (the coordinator
# refuses earlier renewals); its holder renews at `RENEW_AT`, leaving time to retry.
RENEWAL_OPENS_AT = 0.5
RENEW_AT = 2.0 / 3.0
# Certificates are valid from this long before they are issued (clocks differ).
CLOCK_SKEW_S = 300
TOKEN_PREFIX = "emt1"
_TOKEN_RE = re.compile(r"^emt1\.([A-Za-z0-9_-]{16,128})\.([0-9a-f]{64})$")
_PRINCIPAL_RE = re.compile(r"^[a-z][a-z0-9-]{1,62}$")

# File names of an identity directory (agent data dir, CLI credentials dir).
CA_FILE = "ca.pem"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"


class IdentityError(ValueError):
    """A certificate, key, CSR or token that is malformed or does not verify."""


# -- keys, certificates, CSRs -----------------------------------------------------------------


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_private_key() -> bytes:
    """A fresh EC P-256 private key, PEM (PKCS#8, unencrypted)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"not a PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError("expected an EC private key")
    return key


def load_certificate(cert_pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate: {exc}") from None


def _san_entries(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        host = host.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def create_ca(hosts: Sequence[str] = (), days: int = CA_VALIDITY_DAYS) -> tuple[bytes, bytes]:
    """A new self-signed CA (cert PEM, key PEM). Its SANs (`COORDINATOR_NAME`, localhost,
    127.0.0.1, ::1 and ``hosts``) let coordinators of older versions serve it as their server
    certificate; this version serves `create_server_certificate`'s."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, COORDINATOR_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "epochmesh"),
        ]
    )
    now = _utcnow()
    sans = _san_entries([COORDINATOR_NAME, "localhost", "127.0.0.1", "::1", *hosts])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def create_server_certificate(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    hosts: Sequence[str] = (),
    days: int = SERVER_CERT_VALIDITY_DAYS,
) -> tuple[bytes, bytes]:
    """The coordinator's TLS server certificate (cert PEM, key PEM), with a key of its own,
    issued by the CA: SANs are `COORDINATOR_NAME`, localhost, 127.0.0.1, ::1 and ``hosts``;
    EKU serverAuth; it ends no later than the CA."""
    ca_cert = load_certificate(ca_cert_pem)
    ca_key = _load_key(ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _utcnow()
    sans = _san_entries([COORDINATOR_NAME, "localhost", "127.0.0.1", "::1", *hosts])
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    # Not the CA's name: a certificate whose subject equals its issuer's reads
                    # as self-issued to TLS libraries.
                    x509.NameAttribute(NameOID.COMMON_NAME, f"{COORDINATOR_NAME} server"),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "epochmesh"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def key_matches_certificate(key_pem: bytes, cert_pem: bytes) -> bool:
    """Whether ``key_pem`` is the private key of ``cert_pem``'s public key."""
    key = _load_key(key_pem)
    cert = load_certificate(cert_pem)
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt)


def certificate_hosts(cert_pem: bytes) -> list[str]:
    """The DNS names and IP addresses in a certificate's SAN."""
    cert = load_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    hosts: list[str] = list(san.get_values_for_type(x509.DNSName))
    hosts.extend(str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    return hosts


def create_csr(key_pem: bytes) -> bytes:
    """A certificate signing request for ``key_pem`` (the subject is chosen by the CA)."""
    key = _load_key(key_pem)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "enrollment")]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def check_csr(csr_pem: bytes) -> ec.EllipticCurvePublicKey:
    """The public key of a well-formed, self-signed EC CSR; IdentityError otherwise."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"not a PEM certificate signing request: {exc}") from None
    if not csr.is_signature_valid:
        raise IdentityError("the CSR's signature does not verify")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise IdentityError("the CSR must carry an EC public key")
    return public_key


def check_principal(principal: str) -> str:
    if not _PRINCIPAL_RE.match(principal):
        raise IdentityError(f"malformed principal id {principal[:80]!r}")
    return principal


def sign_csr(
    csr_pem: bytes,
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    principal: str,
    role: str,
    days: int = CERT_VALIDITY_DAYS,
    lifetime_s: float | None = None,
    issued_at: dt.datetime | None = None,
) -> bytes:
    """Issue a client (and peer server) certificate for the CSR's key: CN = principal,
    OU = role, SAN DNS:principal, EKU clientAuth + serverAuth. The CSR's own subject is
    ignored; its self-signature must verify. It is valid from ``issued_at`` (default now; tests
    back-date it) for ``lifetime_s`` seconds (default ``days``), never beyond the CA."""
    if role not in ROLES:
        raise IdentityError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
    check_principal(principal)
    public_key = check_csr(csr_pem)
    ca_cert = load_certificate(ca_cert_pem)
    ca_key = _load_key(ca_key_pem)
    now = _utcnow() if issued_at is None else issued_at
    lifetime = dt.timedelta(days=days) if lifetime_s is None else dt.timedelta(seconds=lifetime_s)
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, principal),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "epochmesh"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(principal)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def issued_and_expires_s(cert: x509.Certificate) -> tuple[float, float]:
    """(when the certificate was issued, when it expires), Unix seconds: issuance is its
    ``notBefore`` plus the `CLOCK_SKEW_S` every certificate is back-dated by."""
    not_before = cert.not_valid_before_utc.timestamp()
    not_after = cert.not_valid_after_utc.timestamp()
    return min(not_before + CLOCK_SKEW_S, not_after), not_after


def renewal_opens_s(cert: x509.Certificate) -> float:
    """When the coordinator starts to accept a renewal of ``cert`` (Unix seconds)."""
    issued, expires = issued_and_expires_s(cert)
    return issued + RENEWAL_OPENS_AT * (expires - issued)


def renewal_due_s(cert_pem: bytes) -> float:
    """When the holder of ``cert_pem`` should renew it (Unix seconds): at `RENEW_AT` of its
    lifetime, after the coordinator's window opens and well before it expires."""
    issued, expires = issued_and_expires_s(load_certificate(cert_pem))
    return issued + RENEW_AT * (expires - issued)


@dataclass(frozen=True)
class Principal:
    """Who a certificate speaks for."""

    id: str
    role: str
    serial: int = 0

    def __str__(self) -> str:
        return f"{self.role} {self.id}"


def principal_of(cert: x509.Certificate) -> Principal:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(cns) != 1 or len(ous) != 1:
        raise IdentityError("certificate subject lacks one CN and one OU")
    role = str(ous[0].value)
    if role not in ROLES:
        raise IdentityError(f"certificate carries an unknown role {role!r}")
    return Principal(id=str(cns[0].value), role=role, serial=cert.serial_number)


def principal_from_pem(cert_pem: bytes) -> Principal:
    return principal_of(load_certificate(cert_pem))


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the certificate's DER encoding, lowercase hex."""
    cert = load_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def verify_issued_by(cert_pem: bytes, ca_cert_pem: bytes) -> None:
    """Raise IdentityError unless ``cert_pem`` is signed by ``ca_cert_pem`` and valid now."""
    cert = load_certificate(cert_pem)
    ca = load_certificate(ca_cert_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature has no common base
        raise IdentityError(f"certificate not issued by this CA: {exc}") from None
    now = _utcnow()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise IdentityError("certificate expired or not yet valid")


# -- join tokens ----------------------------------------------------------------------------


def new_token(ca_fingerprint: str) -> tuple[str, str]:
    """A fresh join token and the hash of its secret (what the coordinator stores)."""
    secret = secrets.token_urlsafe(24)
    return f"{TOKEN_PREFIX}.{secret}.{ca_fingerprint}", hash_secret(secret)


def parse_token(token: str) -> tuple[str, str]:
    """(secret, CA fingerprint) of a join token; IdentityError when malformed."""
    match = _TOKEN_RE.match(token.strip())
    if match is None:
        raise IdentityError("malformed join token (expected emt1.<secret>.<64 hex>)")
    return match.group(1), match.group(2)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# -- files ----------------------------------------------------------------------------------


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents) with mode 0700; an existing one is kept as
    it is."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a new file, a rename) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write atomically (a temporary file, fsync, rename, fsync of the directory) with
    permissions ``mode`` from the start (never world-readable). A missing directory is made
    0700."""
    make_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@dataclass(frozen=True)
class Identity:
    """A CA certificate to trust plus our own certificate and key (all PEM). ``source``: the
    directory it was loaded from, if any (`CallSigner` follows a renewed certificate there)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    source: Path | None = field(default=None, compare=False, repr=False)

    @property
    def principal(self) -> Principal:
        return principal_from_pem(self.cert_pem)

    @staticmethod
    def exists(directory: Path) -> bool:
        return all((directory / n).is_file() for n in (CA_FILE, CERT_FILE, KEY_FILE))

    @classmethod
    def load(cls, directory: Path) -> Identity:
        try:
            return cls(
                ca_pem=(directory / CA_FILE).read_bytes(),
                cert_pem=(directory / CERT_FILE).read_bytes(),
                key_pem=(directory / KEY_FILE).read_bytes(),
                source=directory,
            )
        except OSError as exc:
            raise IdentityError(f"cannot read identity in {directory}: {exc}") from None

    def save(self, directory: Path) -> None:
        write_private(directory / KEY_FILE, self.key_pem)
        write_private(directory / CERT_FILE, self.cert_pem)
        write_private(directory / CA_FILE, self.ca_pem)


class IdentityFollower:
    """The current state of an identity loaded from a directory: when its ``cert.pem`` changes
    there (a renewal), `current()` loads the directory again (checked at most every
    ``check_s``). A new certificate whose key does not match, or that does not load, is
    logged and the one in use kept. An identity without a ``source`` never changes.
    Thread-safe: gRPC calls a certificate fetcher on its own threads."""

    def __init__(self, identity: Identity, check_s: float = 1.0) -> None:
        self._identity = identity
        self._check_s = check_s
        self._lock = threading.Lock()
        self._stamp = self._cert_stamp()
        self._checked = time.monotonic()

    def _cert_stamp(self) -> tuple[int, int, int] | None:
        source = self._identity.source
        if source is None:
            return None
        try:
            st = os.stat(source / CERT_FILE)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def current(self) -> Identity:
        source = self._identity.source
        now = time.monotonic()
        if source is None or now - self._checked < self._check_s:
            return self._identity
        with self._lock:
            if now - self._checked < self._check_s:
                return self._identity
            self._checked = now
            stamp = self._cert_stamp()
            if stamp is None or stamp == self._stamp:
                return self._identity
            self._stamp = stamp
            try:
                fresh = Identity.load(source)
                if not key_matches_certificate(fresh.key_pem, fresh.cert_pem):
                    raise IdentityError("its key does not match its certificate")
                load_certificate(fresh.cert_pem)
            except IdentityError as exc:
                log.warning(
                    "keeping the certificate in use: the one now in %s is unusable (%s)",
                    source,
                    exc,
                )
                return self._identity
            if fresh != self._identity:
                log.info("now using the certificate renewed in %s", source)
                self._identity = fresh
            return self._identity


# -- fetching the CA before trusting anything -------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise IdentityError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _unverified_chain_der(tls: ssl.SSLSocket) -> list[bytes]:
    """The certificates a TLS server sent (leaf first, DER), none of them verified."""
    public = getattr(tls, "get_unverified_chain", None)  # Python 3.13+
    if public is not None:
        return [bytes(c) for c in public()]
    sslobj: Any = getattr(tls, "_sslobj", None)
    if sslobj is not None and hasattr(sslobj, "get_unverified_chain"):  # 3.10-3.12
        import _ssl

        return [c.public_bytes(_ssl.ENCODING_DER) for c in sslobj.get_unverified_chain() or ()]
    der = tls.getpeercert(binary_form=True)
    return [der] if der else []


def fetch_server_chain(address: str, timeout: float = 5.0) -> list[bytes]:
    """The certificates a TLS server presents (PEM, leaf first), read without verifying
    anything."""
    host, port = split_address(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout) as sock:
        with context.wrap_socket(sock, server_hostname=COORDINATOR_NAME) as tls:
            chain = _unverified_chain_der(tls)
    if not chain:
        raise IdentityError(f"{address} presented no certificate")
    return [ssl.DER_cert_to_PEM_cert(der).encode() for der in chain]


def fetch_server_certificate(address: str, timeout: float = 5.0) -> bytes:
    """The certificate a TLS server presents (PEM, its leaf), read without verifying
    anything."""
    return fetch_server_chain(address, timeout)[0]


def fetch_ca(address: str, expected_fingerprint: str, timeout: float = 5.0) -> bytes:
    """The coordinator's CA certificate, verified against the fingerprint from a token: the
    certificate of the chain the server presents whose fingerprint the token names, which must
    have issued the server's own certificate (IdentityError otherwise: someone else answers at
    that address). A coordinator of an older version presents the CA itself."""
    chain = fetch_server_chain(address, timeout)
    expected = expected_fingerprint.lower()
    for pem in chain:
        if secrets.compare_digest(fingerprint(pem), expected):
            if pem != chain[0]:
                try:
                    load_certificate(chain[0]).verify_directly_issued_by(load_certificate(pem))
                except Exception:  # noqa: BLE001 - InvalidSignature, wrong issuer, algorithm
                    raise IdentityError(
                        f"the server at {address} presents the coordinator's CA "
                        f"{expected[:16]}... with a certificate that CA did not issue"
                    ) from None
            return pem
    got = fingerprint(chain[0])
    raise IdentityError(
        f"the server at {address} presented a certificate with fingerprint {got[:16]}..., "
        f"not the coordinator's CA {expected[:16]}... named in the token"
    )


# -- gRPC credentials -------------------------------------------------------------------------


def channel_credentials(
    ca_pem: bytes, key_pem: bytes | None = None, cert_pem: bytes | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
    )


AUTH_CERT_KEY = "x-epochmesh-cert-bin"
AUTH_SIG_KEY = "x-epochmesh-sig-bin"
AUTH_TS_KEY = "x-epochmesh-ts"
# How far a call's signed timestamp may be from the coordinator's clock.
AUTH_MAX_SKEW_MS = 300_000
# How long a client reuses the signature of a method. A signed (method, timestamp) is accepted
# for AUTH_MAX_SKEW_MS around its timestamp anyway, and it travels only inside the TLS session
# to the coordinator, so reusing it for a fraction of that window changes nothing about who can
# present it; it spares the client an ECDSA signature per call and lets the coordinator check a
# repeated signature with a dictionary lookup instead of an ECDSA verification (coordinator/
# auth.py). Well inside AUTH_MAX_SKEW_MS, so that a reused signature never arrives stale.
AUTH_SIGNATURE_REUSE_MS = 60_000

Metadata = tuple[tuple[str, str | bytes], ...]


def auth_payload(method_name: str, ts_ms: str) -> bytes:
    """What `CertificateAuth` signs for a call of ``method_name`` (e.g. "Register")."""
    return f"epochmesh-call-v1|{method_name}|{ts_ms}".encode()


class CallSigner:
    """The call credentials of one identity: per method, the certificate (DER), a timestamp and
    the key's signature over both, signed afresh every `AUTH_SIGNATURE_REUSE_MS`. An identity
    loaded from a directory is followed there: when its ``cert.pem`` changes (a renewal), the
    next call signs with the new certificate and key (checked at most every
    `RELOAD_CHECK_S`). Thread-safe (two threads may both sign a method at once; either result
    is valid)."""

    RELOAD_CHECK_S = 1.0

    def __init__(self, identity: Identity, reuse_ms: int = AUTH_SIGNATURE_REUSE_MS) -> None:
        self._identity = identity
        self._material = self._material_of(identity)
        self._reuse_ms = reuse_ms
        self._signed: dict[str, tuple[int, Metadata]] = {}
        self._follower = IdentityFollower(identity, self.RELOAD_CHECK_S)

    @staticmethod
    def _material_of(identity: Identity) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
        der = load_certificate(identity.cert_pem).public_bytes(serialization.Encoding.DER)
        return der, _load_key(identity.key_pem)

    def _follow_renewal(self) -> None:
        """Sign with the identity's renewed certificate once its directory holds one."""
        fresh = self._follower.current()
        if fresh is self._identity:
            return
        self._identity = fresh
        material = self._material_of(fresh)
        if material[0] != self._material[0]:
            self._material = material
            self._signed = {}
            log.info("calls now carry the certificate renewed in %s", fresh.source)

    def metadata(self, method_name: str, now_ms: int | None = None) -> Metadata:
        """The authentication metadata for a call of ``method_name`` (e.g. "Heartbeat")."""
        self._follow_renewal()
        now = int(time.time() * 1000) if now_ms is None else now_ms
        signed = self._signed
        cached = signed.get(method_name)
        if cached is not None and 0 <= now - cached[0] < self._reuse_ms:
            return cached[1]
        der, key = self._material
        ts = str(now)
        sig = key.sign(auth_payload(method_name, ts), ec.ECDSA(hashes.SHA256()))
        md: Metadata = ((AUTH_CERT_KEY, der), (AUTH_SIG_KEY, sig), (AUTH_TS_KEY, ts))
        if len(signed) > 256:  # a client calls a few dozen methods; bound it anyway
            signed.clear()
        signed[method_name] = (now, md)
        return md


class CertificateAuth(grpc.AuthMetadataPlugin):
    """Call credentials: the certificate (DER) and a signature by its key over the method name
    and a timestamp, on every call (see the module docstring for why; `CallSigner` for how
    often it signs)."""

    def __init__(self, identity: Identity) -> None:
        self._signer = CallSigner(identity)

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        try:
            callback(self._signer.metadata(context.method_name), None)
        except Exception as exc:  # noqa: BLE001 - reported to gRPC, which fails the call
            callback((), exc)


_Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


def _method_name(method: str | bytes) -> str:
    name = method.decode() if isinstance(method, bytes) else method
    return name.rsplit("/", 1)[-1]


class _AuthMetadata:
    """`CertificateAuth` as asyncio client interceptors: the same metadata, added on the event
    loop. gRPC runs a metadata plugin (call credentials) on a new Python thread for every call;
    that thread start and the GIL hand-overs cost the caller more than the call itself."""

    def __init__(self, signer: CallSigner) -> None:
        self._signer = signer

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self._signer.metadata(_method_name(details.method)):
            md.add(key, value)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, md, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first of the four kinds it implements only: one
# class per kind.
class _UnaryUnaryAuth(_AuthMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.details(details), request)


class _UnaryStreamAuth(_AuthMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.details(details), request)


class _StreamUnaryAuth(_AuthMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self.details(details), requests)


class _StreamStreamAuth(_AuthMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self.details(details), requests)


def auth_interceptors(identity: Identity) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors (for ``grpc.aio.secure_channel(..., interceptors=...)``) that add
    `CertificateAuth`'s metadata to every call: use them with ``channel_credentials(ca_pem)``
    instead of ``identity_credentials`` to spare a thread per call."""
    signer = CallSigner(identity)
    return [
        _UnaryUnaryAuth(signer),
        _UnaryStreamAuth(signer),
        _StreamUnaryAuth(signer),
        _StreamStreamAuth(signer),
    ]


def verify_call_signature(cert: x509.Certificate, method_name: str, ts_ms: str, sig: bytes) -> None:
    """IdentityError unless ``sig`` is the certificate key's signature of the call and the
    timestamp is within `AUTH_MAX_SKEW_MS` of now."""
    try:
        ts = int(ts_ms)
    except ValueError:
        raise IdentityError("malformed call timestamp") from None
    if abs(time.time() * 1000 - ts) > AUTH_MAX_SKEW_MS:
        raise IdentityError("call timestamp too far from the coordinator's clock")
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise IdentityError("certificate key is not EC")
    try:
        key.verify(sig, auth_payload(method_name, ts_ms), ec.ECDSA(hashes.SHA256()))
    except Exception:  # noqa: BLE001 - InvalidSignature and malformed DER alike
        raise IdentityError("call signature does not verify") from None


# An idle channel kept for the life of the process, so that closing a channel never destroys
# gRPC's event engine: the last channel's close waits for the engine's threads while holding
# the GIL, and a thread that is releasing `CertificateAuth` (a Python plugin) needs the GIL, so
# the process froze (seen once in the test suite: grpc/grpc#42247, open in grpcio 1.85).
_event_engine_keeper: grpc.Channel | None = None


def _keep_event_engine() -> None:
    global _event_engine_keeper
    if _event_engine_keeper is None:
        _event_engine_keeper = grpc.insecure_channel("127.0.0.1:9")  # never called


def identity_credentials(identity: Identity) -> grpc.ChannelCredentials:
    """Credentials to call the coordinator as ``identity``: TLS that trusts only its CA, plus
    `CertificateAuth` call credentials."""
    _keep_event_engine()
    return grpc.composite_channel_credentials(
        channel_credentials(identity.ca_pem),
        grpc.metadata_call_credentials(CertificateAuth(identity), name="epochmesh-cert"),
    )


def peer_channel_credentials(identity: Identity) -> grpc.ChannelCredentials:
    """Mutual TLS with a peer: trust only the CA, present our own certificate."""
    return channel_credentials(identity.ca_pem, identity.key_pem, identity.cert_pem)


def coordinator_channel_options() -> list[tuple[str, str | int]]:
    """Channel options to dial the coordinator over TLS (shared options + target name)."""
    return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", COORDINATOR_NAME)]


def coordinator_server_credentials(
    ca_cert_pem: bytes, key_pem: bytes, cert_pem: bytes | None = None
) -> grpc.ServerCredentials:
    """The coordinator's TLS: its server certificate ``cert_pem`` (with its key ``key_pem``)
    sent together with the CA certificate, so that a newcomer can read the CA off the
    handshake (`fetch_ca`); without ``cert_pem`` the CA certificate itself (``key_pem`` then
    being the CA key) as older versions did. Client certificates from the CA are verified when
    presented but not required (enrollment and health work without one; the coordinator's role
    check refuses everything else)."""
    chain = ca_cert_pem if cert_pem is None else cert_pem.rstrip(b"\n") + b"\n" + ca_cert_pem
    return grpc.ssl_server_credentials(
        [(key_pem, chain)], root_certificates=ca_cert_pem, require_client_auth=False
    )


def peer_server_credentials(identity: Identity) -> grpc.ServerCredentials:
    """A node's PeerService TLS: its own certificate, and a certificate from the same CA is
    required of every caller. Read the caller's node id in a handler with
    `peer_principal(context)`. An identity loaded from a directory is followed there
    (`IdentityFollower`): handshakes after a renewal present the renewed certificate."""
    if identity.source is None:
        return grpc.ssl_server_credentials(
            [(identity.key_pem, identity.cert_pem)],
            root_certificates=identity.ca_pem,
            require_client_auth=True,
        )
    follower = IdentityFollower(identity)
    served = [identity]

    def config(ident: Identity) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(ident.key_pem, ident.cert_pem)], root_certificates=ident.ca_pem
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each handshake; None keeps the configuration in use.
        current = follower.current()
        if current == served[0]:
            return None
        served[0] = current
        return config(current)

    return grpc.dynamic_ssl_server_credentials(
        config(identity), fetch, require_client_authentication=True
    )


def peer_channel_options(node_id: str) -> list[tuple[str, str | int]]:
    """Options to dial node ``node_id``'s PeerService: TLS verifies that the certificate the
    peer presents was issued by our CA for exactly ``node_id`` (SAN DNS:<node_id>)."""
    return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", node_id)]


def peer_aio_channel(address: str, node_id: str, identity: Identity) -> grpc.aio.Channel:
    """A channel to the PeerService of node ``node_id`` at ``address``, authenticated both
    ways with certificates of the coordinator's CA."""
    return grpc.aio.secure_channel(
        address, peer_channel_credentials(identity), options=peer_channel_options(node_id)
    )


def principal_from_context(auth_context: dict[str, list[bytes]]) -> Principal | None:
    """The principal of a verified client certificate in a gRPC auth context, else None."""
    pems = auth_context.get("x509_pem_cert") or []
    if not pems:
        return None
    try:
        return principal_from_pem(pems[0])
    except IdentityError:
        return None


def peer_principal(context: grpc.aio.ServicerContext) -> Principal | None:
    """The caller's principal in a TLS server handler (None on a plaintext channel)."""
    return principal_from_context(context.auth_context())


# -- enrollment (the client side) -------------------------------------------------------------


def secure_sync_channel(address: str, identity: Identity) -> grpc.Channel:
    """A blocking channel to the coordinator authenticated with ``identity``."""
    return grpc.secure_channel(
        address, identity_credentials(identity), options=coordinator_channel_options()
    )


def secure_aio_channel(
    address: str, identity: Identity, extra_options: Sequence[tuple[str, int]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to the coordinator authenticated with ``identity``: TLS that trusts
    only its CA, and the `CertificateAuth` metadata added by a client interceptor (no thread
    per call, unlike ``identity_credentials``; the coordinator sees the same calls)."""
    return grpc.aio.secure_channel(
        address,
        channel_credentials(identity.ca_pem),
        options=[*coordinator_channel_options(), *extra_options],
        interceptors=auth_interceptors(identity),
    )


def enroll_with_token(address: str, token: str, name: str = "", timeout: float = 10.0) -> Identity:
    """Join the coordinator at ``address``: fetch its CA and check it against the token's
    fingerprint, make a key pair here, send a CSR with the token, and return the identity
    (the private key never leaves this process). IdentityError for a malformed token or a CA
    mismatch; grpc.RpcError when the coordinator refuses (UNAUTHENTICATED: token unknown,
    used or expired)."""
    from epochmesh.v1 import identity_pb2, identity_pb2_grpc

    _, expected = parse_token(token)
    try:
        ca_pem = fetch_ca(address, expected, timeout=timeout)
    except (OSError, ssl.SSLError) as exc:
        raise ConnectionError(
            f"cannot fetch the coordinator certificate from {address}: {exc}"
        ) from exc
    key_pem = new_private_key()
    request = identity_pb2.EnrollRequest(
        token=token.strip(), csr_pem=create_csr(key_pem), name=name
    )
    with grpc.secure_channel(
        address, channel_credentials(ca_pem), options=coordinator_channel_options()
    ) as channel:
        stub = identity_pb2_grpc.IdentityServiceStub(channel)
        response = stub.Enroll(request, timeout=timeout)
    identity = Identity(ca_pem=ca_pem, cert_pem=response.certificate_pem, key_pem=key_pem)
    verify_issued_by(identity.cert_pem, ca_pem)
    return identity


def renew_identity(address: str, identity: Identity, timeout: float = 10.0) -> Identity:
    """``identity`` with a new certificate for the same key, asked of the coordinator at
    ``address`` with the current certificate (accepted once `RENEWAL_OPENS_AT` of its lifetime
    has passed, until it expires). grpc.RpcError when the coordinator refuses; IdentityError
    when the answer is not a certificate of this CA for the same principal and key."""
    from epochmesh.v1 import identity_pb2, identity_pb2_grpc

    request = identity_pb2.RenewCertificateRequest(csr_pem=create_csr(identity.key_pem))
    with secure_sync_channel(address, identity) as channel:
        stub = identity_pb2_grpc.IdentityServiceStub(channel)
        response = stub.RenewCertificate(request, timeout=timeout)
    renewed = Identity(
        ca_pem=identity.ca_pem,
        cert_pem=response.certificate_pem,
        key_pem=identity.key_pem,
        source=identity.source,
    )
    verify_issued_by(renewed.cert_pem, identity.ca_pem)
    before, after = identity.principal, renewed.principal
    if (before.id, before.role) != (after.id, after.role):
        raise IdentityError(f"the renewed certificate names {after}, not {before}")
    if not key_matches_certificate(renewed.key_pem, renewed.cert_pem):
        raise IdentityError("the renewed certificate is not for this key")
    return renewed


# -- dashboard login codes ------------------------------------------------------------------------
# A logged-in CLI user opens the dashboard as itself: `epochmesh dashboard` signs a login code
# with its certificate's key (the call-signature scheme, for the pseudo-method DashboardLogin);
# the dashboard verifies it like a call, once, within AUTH_MAX_SKEW_MS of its timestamp.

LOGIN_CODE_PREFIX = "eml1."
LOGIN_CODE_METHOD = "DashboardLogin"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def make_login_code(identity: Identity, now_ms: int | None = None) -> str:
    """A one-time dashboard login code for ``identity``'s principal."""
    ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
    cert = load_certificate(identity.cert_pem)
    sig = _load_key(identity.key_pem).sign(
        auth_payload(LOGIN_CODE_METHOD, ts), ec.ECDSA(hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    return f"{LOGIN_CODE_PREFIX}{_b64(der)}.{ts}.{_b64(sig)}"


def parse_login_code(code: str) -> tuple[bytes, str, bytes]:
    """(certificate DER, timestamp, signature) of a login code; IdentityError if malformed."""
    if not code.startswith(LOGIN_CODE_PREFIX):
        raise IdentityError("not a dashboard login code")
    parts = code[len(LOGIN_CODE_PREFIX) :].split(".")
    if len(parts) != 3 or not parts[1].isdigit():
        raise IdentityError("malformed dashboard login code")
    try:
        return _unb64(parts[0]), parts[1], _unb64(parts[2])
    except (ValueError, binascii.Error):
        raise IdentityError("malformed dashboard login code") from None
