"""IdentityService: enrollment (join token + CSR -> certificate) and renewal. No client
certificate is needed to call Enroll: the token is the credential (coordinator/trust/tokens.py).
RenewCertificate authenticates its caller by the current certificate, as every other service
does (coordinator/trust/auth.py). Enroll is rate-limited per peer address, and a token that
passes `tokens.screen_token` (format, CA, MAC) also in all; renewals have buckets of their own,
per principal and in all, taken once the caller is authenticated (`tokens.EnrollRateLimiter`):
RESOURCE_EXHAUSTED, naming the limit."""

from __future__ import annotations

import time
from typing import TypeAlias

import grpc

from coordinator.core.errors import FailedPreconditionError
from coordinator.core.ids import check_text
from coordinator.store.base import Store
from coordinator.store.events import EventLog
from coordinator.trust import tokens
from coordinator.trust.auth import Authorizer
from coordinator.trust.tokens import (
    CertificateAuthority,
    EnrollLimits,
    EnrollRateLimiter,
    enroll,
    renew,
)
from epochmesh.identity import load_certificate
from epochmesh.v1 import identity_pb2

Ctx: TypeAlias = grpc.aio.ServicerContext

RENEW_METHOD = "epochmesh.v1.IdentityService/RenewCertificate"


class IdentityService:
    def __init__(
        self,
        store: Store,
        ca: CertificateAuthority,
        events: EventLog,
        authorizer: Authorizer | None = None,
        limits: EnrollLimits | None = None,
    ) -> None:
        self._store = store
        self._ca = ca
        self._events = events
        self._authorizer = authorizer
        limits = limits or tokens.ENROLL_LIMITS
        self._limiter = EnrollRateLimiter(limits, calls="enrollment calls")
        self._renewals = EnrollRateLimiter(
            limits.renewals(), calls="certificate renewals", per="principal"
        )

    def _response(self, cert_pem: bytes, principal: str, role: str) -> identity_pb2.EnrollResponse:
        cert = load_certificate(cert_pem)
        return identity_pb2.EnrollResponse(
            certificate_pem=cert_pem,
            ca_pem=self._ca.cert_pem,
            principal=principal,
            role=role,
            expires_ms=int(cert.not_valid_after_utc.timestamp() * 1000),
        )

    async def Enroll(
        self, req: identity_pb2.EnrollRequest, ctx: Ctx
    ) -> identity_pb2.EnrollResponse:
        self._limiter.check_peer(tokens.peer_key(ctx.peer()), time.monotonic())
        check_text(req.token, "token", max_len=256, required=True)
        check_text(req.name, "name", max_len=128)
        await tokens.screen_token(self._store, self._ca, req.token)
        self._limiter.check_total(time.monotonic())
        result = await enroll(self._store, self._ca, req.token, req.csr_pem)
        await self._events.append(
            "principal.enrolled",
            message=f"{result.role} {result.principal} enrolled"
            + (f" ({req.name})" if req.name else ""),
            node_id=result.principal if result.role == "node" else "",
            attrs={"principal": result.principal, "role": result.role, "name": req.name},
        )
        return self._response(result.certificate_pem, result.principal, result.role)

    async def RenewCertificate(
        self, req: identity_pb2.RenewCertificateRequest, ctx: Ctx
    ) -> identity_pb2.EnrollResponse:
        if self._authorizer is None:
            raise FailedPreconditionError("this coordinator runs without TLS: nothing to renew")
        principal, current = self._authorizer.authenticate_certificate(RENEW_METHOD, ctx)
        self._renewals.check(principal.id, time.monotonic())
        result = renew(self._ca, current, req.csr_pem, time.time())
        response = self._response(result.certificate_pem, result.principal, result.role)
        await self._events.append(
            "principal.renewed",
            message=f"{principal} renewed its certificate (until "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(response.expires_ms / 1000))} UTC)",
            node_id=principal.id if principal.role == "node" else "",
            attrs={
                "principal": principal.id,
                "role": principal.role,
                "expires_ms": str(response.expires_ms),
            },
        )
        return response
