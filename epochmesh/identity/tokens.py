"""Join tokens: ``emt1.<secret>.<ca-fingerprint>``; the coordinator stores only the SHA-256
of the secret (`hash_secret`)."""

from __future__ import annotations

import hashlib
import re
import secrets

from epochmesh.identity.x509 import IdentityError

TOKEN_PREFIX = "emt1"
_TOKEN_RE = re.compile(r"^emt1\.([A-Za-z0-9_-]{16,128})\.([0-9a-f]{64})$")


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
