"""gRPC credentials for the three channel kinds: a client calling the coordinator (TLS that
trusts only the CA, plus the caller's certificate and a signature by its key on every call:
`CallSigner`, as call credentials or asyncio interceptors), the coordinator's own server
credentials and the call-signature check, and mutual TLS between peers. See the
`epochmesh.identity` package docstring for why calls carry signatures."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.identity.credentials import Identity, IdentityFollower
from epochmesh.identity.x509 import (
    COORDINATOR_NAME,
    IdentityError,
    Principal,
    load_certificate,
    load_key,
    principal_from_pem,
)

log = logging.getLogger(__name__)


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
# trust/auth.py). Well inside AUTH_MAX_SKEW_MS, so that a reused signature never arrives stale.
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
        return der, load_key(identity.key_pem)

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


class CertificateAuth(grpc.AuthMetadataPlugin):  # type: ignore[misc]  # grpc has no type stubs
    """Call credentials: the certificate (DER) and a signature by its key over the method name
    and a timestamp, on every call (see the `epochmesh.identity` docstring for why;
    `CallSigner` for how often it signs)."""

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
class _UnaryUnaryAuth(_AuthMetadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.details(details), request)


class _UnaryStreamAuth(_AuthMetadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self.details(details), request)


class _StreamUnaryAuth(_AuthMetadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: _Continuation, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self.details(details), requests)


class _StreamStreamAuth(_AuthMetadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
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
