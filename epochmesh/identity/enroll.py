"""The client side of enrollment and renewal: a join token buys a certificate
(`enroll_with_token`), the current certificate buys the next one (`renew_identity`)."""

from __future__ import annotations

import ssl

import grpc

from epochmesh.identity.bootstrap import fetch_ca
from epochmesh.identity.credentials import Identity
from epochmesh.identity.grpc_auth import (
    channel_credentials,
    coordinator_channel_options,
    secure_sync_channel,
)
from epochmesh.identity.tokens import parse_token
from epochmesh.identity.x509 import (
    IdentityError,
    create_csr,
    key_matches_certificate,
    new_private_key,
    verify_issued_by,
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
        stub = identity_pb2_grpc.IdentityServiceStub(channel)  # type: ignore[no-untyped-call]
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
        stub = identity_pb2_grpc.IdentityServiceStub(channel)  # type: ignore[no-untyped-call]
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
