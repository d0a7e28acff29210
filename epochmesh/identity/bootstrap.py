"""Fetching the coordinator's CA before trusting anything: the chain its TLS handshake
presents is read without verification (`fetch_server_chain`), and the certificate whose
fingerprint the join token names is kept (`fetch_ca`), from then on the only root."""

from __future__ import annotations

import secrets
import socket
import ssl
from typing import Any

from epochmesh.identity.x509 import COORDINATOR_NAME, IdentityError, fingerprint, load_certificate


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
