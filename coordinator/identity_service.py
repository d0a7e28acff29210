"""IdentityService: enrollment (join token + CSR -> certificate). No client certificate is
needed to call it: the token is the credential (coordinator/tokens.py)."""

from __future__ import annotations

import grpc

from coordinator.events import EventLog
from coordinator.store import Store, check_text
from coordinator.tokens import CertificateAuthority, enroll
from epochmesh.identity import load_certificate
from epochmesh.v1 import identity_pb2

Ctx = grpc.aio.ServicerContext


class IdentityService:
    def __init__(self, store: Store, ca: CertificateAuthority, events: EventLog) -> None:
        self._store = store
        self._ca = ca
        self._events = events

    async def Enroll(
        self, req: identity_pb2.EnrollRequest, ctx: Ctx
    ) -> identity_pb2.EnrollResponse:
        check_text(req.token, "token", max_len=256, required=True)
        check_text(req.name, "name", max_len=128)
        result = await enroll(self._store, self._ca, req.token, req.csr_pem)
        cert = load_certificate(result.certificate_pem)
        await self._events.append(
            "principal.enrolled",
            message=f"{result.role} {result.principal} enrolled"
            + (f" ({req.name})" if req.name else ""),
            node_id=result.principal if result.role == "node" else "",
            attrs={"principal": result.principal, "role": result.role, "name": req.name},
        )
        return identity_pb2.EnrollResponse(
            certificate_pem=result.certificate_pem,
            ca_pem=self._ca.cert_pem,
            principal=result.principal,
            role=result.role,
            expires_ms=int(cert.not_valid_after_utc.timestamp() * 1000),
        )
