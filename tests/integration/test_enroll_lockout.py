"""Enrollment lock-out against a real in-process coordinator (TLS, real SQLite, raw gRPC calls):
a flood of garbage join tokens (malformed, another coordinator's, a wrong MAC, unknown) takes
nothing from the coordinator's enrollment allowance, so a valid token still enrolls; renewals
have their own allowance, so even an exhausted enrollment budget delays no renewal, and one
principal's renewals cannot use up another's.

The coordinator listens on [::]:0 so that calls come from two loopback addresses (127.0.0.1
and ::1): the flood from one, the honest holders from the other.
"""

from __future__ import annotations

import datetime as dt
import secrets
from pathlib import Path

import grpc
import pytest

from coordinator.store.base import TokenRecord
from coordinator.trust import tokens
from coordinator.trust.tokens import EnrollLimits, RateLimit, create_token, issue_identity
from epochmesh import identity as idm
from epochmesh.timeutil import now_ms
from epochmesh.v1 import identity_pb2, identity_pb2_grpc
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)

S = grpc.StatusCode


async def enroll_raw(
    address: str, ca_pem: bytes, token: str
) -> identity_pb2.EnrollResponse | grpc.aio.AioRpcError:
    async with grpc.aio.secure_channel(
        address, idm.channel_credentials(ca_pem), options=idm.coordinator_channel_options()
    ) as ch:
        try:
            return await identity_pb2_grpc.IdentityServiceStub(ch).Enroll(
                identity_pb2.EnrollRequest(
                    token=token, csr_pem=idm.create_csr(idm.new_private_key())
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            return err


async def renew_raw(
    address: str, ident: idm.Identity
) -> identity_pb2.EnrollResponse | grpc.aio.AioRpcError:
    async with idm.secure_aio_channel(address, ident) as ch:
        try:
            return await identity_pb2_grpc.IdentityServiceStub(ch).RenewCertificate(
                identity_pb2.RenewCertificateRequest(csr_pem=idm.create_csr(ident.key_pem)),
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            return err


def code_of(result: object) -> S:
    if isinstance(result, grpc.aio.AioRpcError):
        return result.code()
    return S.OK


def garbage(fingerprint: str) -> list[str]:
    """Tokens a guesser sends: every way of being wrong, 40 of them."""
    other_fp = secrets.token_hex(32)
    out = []
    for i in range(10):
        out.append(f"junk-{i}")  # malformed
        out.append(f"emt1.{secrets.token_urlsafe(33)[:44]}.{other_fp}")  # another CA
        out.append(f"emt1.{secrets.token_urlsafe(33)[:44]}.{fingerprint}")  # a wrong MAC
        out.append(idm.new_token(fingerprint)[0])  # the old shape, unknown
    return out


async def test_garbage_enrolls_lock_out_neither_enrollment_nor_renewal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        tokens,
        "ENROLL_LIMITS",
        EnrollLimits(
            per_peer=RateLimit(100, 1.0),
            total=RateLimit(6, 1.0),
            renew_per_principal=RateLimit(2, 1.0),
            renew_total=RateLimit(5, 1.0),
        ),
    )
    async with in_process_coordinator(tmp_path / "data", listen="[::]:0") as coord:
        ca = coord.ca
        assert ca is not None
        port = coord.address.rsplit(":", 1)[1]
        attacker, honest = f"127.0.0.1:{port}", f"[::1]:{port}"

        # The flood: many more calls than the coordinator's total allowance, all refused.
        for guess in garbage(ca.fingerprint):
            result = await enroll_raw(attacker, ca.cert_pem, guess)
            assert code_of(result) == S.UNAUTHENTICATED, (guess[:20], result)

        # A valid token still enrolls, a token of an older version (no MAC) too.
        token = await create_token(coord.store, ca, "node", ttl_s=600, max_uses=20, donor="d")
        assert len(idm.parse_token(token)[0]) == 44  # a secret with its MAC
        first = await enroll_raw(honest, ca.cert_pem, token)
        assert isinstance(first, identity_pb2.EnrollResponse), first
        legacy, legacy_hash = idm.new_token(ca.fingerprint)
        await coord.store.add_token(
            TokenRecord(legacy_hash, "submitter", now_ms(), now_ms() + 600_000, reusable=False)
        )
        assert code_of(await enroll_raw(honest, ca.cert_pem, legacy)) == S.OK

        # Good tokens do count: the total of six is reached by the sixth.
        for _ in range(4):
            assert code_of(await enroll_raw(honest, ca.cert_pem, token)) == S.OK
        exhausted = await enroll_raw(honest, ca.cert_pem, token)
        assert code_of(exhausted) == S.RESOURCE_EXHAUSTED
        assert isinstance(exhausted, grpc.aio.AioRpcError)
        assert "for all callers together" in (exhausted.details() or "")

        # Renewals have their own allowance: a due certificate renews now.
        issued = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=400)
        due = [issue_identity(ca, "node", lifetime_s=600, issued_at=issued) for _ in range(3)]
        assert code_of(await renew_raw(honest, due[0])) == S.OK
        # ... per principal: one that renews again and again is held back, others are not.
        for _ in range(2):
            assert code_of(await renew_raw(attacker, due[1])) == S.OK
        refused = await renew_raw(attacker, due[1])
        assert code_of(refused) == S.RESOURCE_EXHAUSTED
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert "limit per principal" in (refused.details() or "")
        assert code_of(await renew_raw(honest, due[2])) == S.OK
