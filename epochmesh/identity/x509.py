"""X.509 for epochmesh: the CA, the coordinator's server certificate, keys, CSRs, the
certificates the CA issues, their renewal windows, and the principals they name.

Every key is EC P-256. A certificate issued through enrollment names its holder as subject
CN = principal id, OU = role, plus SAN DNS:<principal> (`sign_csr`); `principal_of` reads it
back. Pure helpers around `cryptography`: no network, no files.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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
_PRINCIPAL_RE = re.compile(r"^[a-z][a-z0-9-]{1,62}$")


class IdentityError(ValueError):
    """A certificate, key, CSR or token that is malformed or does not verify."""


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


def load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
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
    ca_key = load_key(ca_key_pem)
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
    key = load_key(key_pem)
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
    key = load_key(key_pem)
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
    ca_key = load_key(ca_key_pem)
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
