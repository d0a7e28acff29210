"""Dashboard login codes: a logged-in CLI user opens the dashboard as itself.

`epochmesh dashboard` signs a login code with its certificate's key (the call-signature scheme,
for the pseudo-method DashboardLogin); the dashboard verifies it like a call, once, within
AUTH_MAX_SKEW_MS of its timestamp.
"""

from __future__ import annotations

import base64
import binascii
import time

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from epochmesh.identity.credentials import Identity
from epochmesh.identity.grpc_auth import auth_payload
from epochmesh.identity.x509 import IdentityError, load_certificate, load_key

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
    sig = load_key(identity.key_pem).sign(
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
