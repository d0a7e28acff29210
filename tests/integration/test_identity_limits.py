"""Identities against a real in-process coordinator (TLS, real SQLite, raw gRPC calls), each
test playing the attacker and checking that honest participants are unaffected: join-token
use limits (also under a race), certificate lifetimes from the token bounded by the
coordinator, renewal with the current certificate (and what it refuses), a running channel
that follows a renewed certificate, the agent's renewer, Enroll rate limits per address and in
all, a quarantined donor's new nodes refused, and a data dir of schema 7 upgraded."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.main import main as coordinator_main
from coordinator.store.sqlite import SqliteStore
from coordinator.trust import tokens
from coordinator.trust.tokens import (
    DEFAULT_CERT_TTL_S,
    MAX_CERT_TTL_S,
    EnrollLimits,
    RateLimit,
    create_token,
    issue_identity,
)
from epochmesh import identity as idm
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from node_agent.core.identity import CertificateRenewer, renew_if_due
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(60)

S = grpc.StatusCode
NODE, SUBMITTER, OPERATOR = "node", "submitter", "operator"


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(tmp_path / "data", lease_ttl_s=60.0) as c:
        yield c


def ca_of(coord: Coordinator) -> tokens.CertificateAuthority:
    assert coord.ca is not None
    return coord.ca


def anonymous(address: str, ca_pem: bytes) -> grpc.aio.Channel:
    """A TLS channel that trusts the CA and presents no certificate (how one enrolls)."""
    return grpc.aio.secure_channel(
        address, idm.channel_credentials(ca_pem), options=idm.coordinator_channel_options()
    )


async def enroll_raw(
    address: str, ca_pem: bytes, token: str, key_pem: bytes | None = None
) -> identity_pb2.EnrollResponse | grpc.aio.AioRpcError:
    """One raw Enroll call: the answer, or the error it raised."""
    key_pem = key_pem or idm.new_private_key()
    async with anonymous(address, ca_pem) as ch:
        stub = identity_pb2_grpc.IdentityServiceStub(ch)
        try:
            return await stub.Enroll(
                identity_pb2.EnrollRequest(token=token, csr_pem=idm.create_csr(key_pem)),
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            return err


async def renew_raw(
    address: str, ident: idm.Identity, csr_pem: bytes | None = None
) -> identity_pb2.EnrollResponse | grpc.aio.AioRpcError:
    async with idm.secure_aio_channel(address, ident) as ch:
        stub = identity_pb2_grpc.IdentityServiceStub(ch)
        request = identity_pb2.RenewCertificateRequest(
            csr_pem=idm.create_csr(ident.key_pem) if csr_pem is None else csr_pem
        )
        try:
            return await stub.RenewCertificate(request, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err


async def probe(address: str, ident: idm.Identity) -> S:
    async with idm.secure_aio_channel(address, ident) as ch:
        try:
            await agent_pb2_grpc.AgentServiceStub(ch).Probe(agent_pb2.ProbeRequest(), timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return S.OK


def lifetime_s(cert_pem: bytes) -> float:
    issued, expires = idm.issued_and_expires_s(idm.load_certificate(cert_pem))
    return expires - issued


def refused(result: object, code: S, *words: str) -> None:
    assert isinstance(result, grpc.aio.AioRpcError), result
    assert result.code() == code, (result.code(), result.details())
    for word in words:
        assert word in (result.details() or ""), result.details()


# -- use limits and lifetimes ---------------------------------------------------------------------


async def test_token_use_limit_from_the_cli_even_under_a_race(
    coord: Coordinator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = ca_of(coord)
    argv = ["token", "create", "--data-dir", str(coord.config.data_dir), "--role", NODE]
    # (in a thread: the command runs its own event loop)
    assert (
        await asyncio.to_thread(
            coordinator_main, [*argv, "--uses", "3", "--cert-ttl", "2h", "--donor", "dana"]
        )
        == 0
    )
    token = capsys.readouterr().out.strip()
    # Ten holders of the token rush at once: exactly three get in.
    results = await asyncio.gather(
        *(enroll_raw(coord.address, ca.cert_pem, token) for _ in range(10))
    )
    admitted = [r for r in results if isinstance(r, identity_pb2.EnrollResponse)]
    assert len(admitted) == 3
    for result in results:
        if not isinstance(result, identity_pb2.EnrollResponse):
            refused(result, S.UNAUTHENTICATED, "use limit is 3", "--uses 3")
    # The three honest nodes hold working certificates that live what the token said.
    for reply in admitted:
        assert abs(lifetime_s(reply.certificate_pem) - 2 * 3600) < 5
    stored = await coord.store.get_token(idm.hash_secret(idm.parse_token(token)[0]))
    assert stored is not None and stored.uses == 3 and stored.max_uses == 3
    # A single-use token says so the second time; the default lifetime is the coordinator's.
    once = await create_token(coord.store, ca, SUBMITTER, ttl_s=60)
    first = await enroll_raw(coord.address, ca.cert_pem, once)
    assert isinstance(first, identity_pb2.EnrollResponse)
    assert abs(lifetime_s(first.certificate_pem) - DEFAULT_CERT_TTL_S) < 5
    refused(await enroll_raw(coord.address, ca.cert_pem, once), S.UNAUTHENTICATED, "already used")
    unknown, _ = idm.new_token(ca.fingerprint)
    refused(await enroll_raw(coord.address, ca.cert_pem, unknown), S.UNAUTHENTICATED, "unknown")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cert-ttl", "91d"], "90d (the coordinator's maximum), got 91d"),
        (["--cert-ttl", "1m"], "between 10m and 90d"),
        (["--cert-ttl", "soon"], "not a duration"),
        (["--uses", "0"], "must be 1 to 100000"),
        (["--uses", "100001"], "1 to 100000"),
    ],
)
def test_token_create_refuses_out_of_policy_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: list[str], message: str
) -> None:
    data = tmp_path / "d"
    assert (
        coordinator_main(["token", "create", "--data-dir", str(data), "--role", NODE, *extra]) == 2
    )
    assert message in caplog.text
    assert not data.exists()


def test_uses_and_reusable_exclude_each_other(tmp_path: Path) -> None:
    argv = ["token", "create", "--data-dir", str(tmp_path / "d"), "--role", NODE]
    with pytest.raises(SystemExit) as exit_:
        coordinator_main([*argv, "--uses", "2", "--reusable"])
    assert exit_.value.code == 2


# -- renewal --------------------------------------------------------------------------------------


def backdated(coord: Coordinator, role: str, lifetime: float, age: float) -> idm.Identity:
    """A certificate issued ``age`` seconds ago for ``lifetime`` seconds."""
    issued = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age)
    return issue_identity(ca_of(coord), role, lifetime_s=lifetime, issued_at=issued)


async def test_renewal_with_the_current_certificate(coord: Coordinator) -> None:
    ca = ca_of(coord)
    # Too early: before half of its lifetime has passed.
    young = backdated(coord, NODE, lifetime=600, age=10)
    refused(
        await renew_raw(coord.address, young),
        S.FAILED_PRECONDITION,
        "half of its lifetime (10m)",
        "opens at",
    )
    # Due: a new certificate for the same node, for the same lifetime from now.
    due = backdated(coord, NODE, lifetime=600, age=400)
    reply = await renew_raw(coord.address, due)
    assert isinstance(reply, identity_pb2.EnrollResponse), reply
    renewed = idm.Identity(ca.cert_pem, reply.certificate_pem, due.key_pem)
    assert renewed.principal.id == due.principal.id == reply.principal
    assert renewed.principal.role == NODE and renewed.principal.serial != due.principal.serial
    assert abs(lifetime_s(reply.certificate_pem) - 600) < 5
    assert reply.expires_ms > time.time() * 1000 + 590_000
    assert await probe(coord.address, renewed) == S.OK
    # A certificate of the old 365-day kind is renewed within the coordinator's maximum.
    old_style = backdated(coord, SUBMITTER, lifetime=365 * 86400, age=200 * 86400)
    reply = await renew_raw(coord.address, old_style)
    assert isinstance(reply, identity_pb2.EnrollResponse), reply
    assert abs(lifetime_s(reply.certificate_pem) - MAX_CERT_TTL_S) < 5
    # A bad CSR: INVALID_ARGUMENT, and the coordinator keeps serving.
    refused(
        await renew_raw(coord.address, due, csr_pem=b"junk"),
        S.INVALID_ARGUMENT,
        "certificate signing request",
    )
    events = [e.kind for e in await coord.store.list_events(kinds=["principal.renewed"])]
    assert len(events) == 2


async def test_renewal_refuses_the_revoked_the_expired_and_strangers(coord: Coordinator) -> None:
    ca = ca_of(coord)
    victim = backdated(coord, NODE, lifetime=600, age=400)
    async with idm.secure_aio_channel(coord.address, coord.issue_identity(OPERATOR)) as ch:
        await scheduler_pb2_grpc.SchedulerServiceStub(ch).Revoke(
            scheduler_pb2.RevokeRequest(principal=victim.principal.id, reason="stolen"),
            timeout=10,
        )
    refused(await renew_raw(coord.address, victim), S.UNAUTHENTICATED, "revoked")
    expired = backdated(coord, NODE, lifetime=600, age=700)
    refused(await renew_raw(coord.address, expired), S.UNAUTHENTICATED, "expired")
    other_cert, other_key = idm.create_ca()
    stranger = issue_identity(
        tokens.CertificateAuthority(other_cert, other_key), OPERATOR, lifetime_s=600
    )
    stranger = idm.Identity(ca.cert_pem, stranger.cert_pem, stranger.key_pem)
    refused(await renew_raw(coord.address, stranger), S.UNAUTHENTICATED, "not issued by")
    async with anonymous(coord.address, ca.cert_pem) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await identity_pb2_grpc.IdentityServiceStub(ch).RenewCertificate(
                identity_pb2.RenewCertificateRequest(csr_pem=b""), timeout=10
            )
    refused(err.value, S.UNAUTHENTICATED, "a certificate is required")
    # An honest node next to them renews as usual.
    honest = backdated(coord, NODE, lifetime=600, age=400)
    assert isinstance(await renew_raw(coord.address, honest), identity_pb2.EnrollResponse)


async def test_a_running_channel_follows_the_renewed_certificate(
    coord: Coordinator, tmp_path: Path
) -> None:
    """The agent's coordinator channel keeps working across its certificate's expiry once the
    renewed one is in its data dir (the renewal by node_agent.core.identity.renew_if_due)."""
    short = backdated(coord, NODE, lifetime=8, age=6)  # expires in about 2 s
    directory = tmp_path / "agent"
    short.save(directory)
    loaded = idm.Identity.load(directory)
    async with idm.secure_aio_channel(coord.address, loaded) as ch:
        agent = agent_pb2_grpc.AgentServiceStub(ch)
        await agent.Probe(agent_pb2.ProbeRequest(), timeout=10)
        renewed = await asyncio.to_thread(renew_if_due, directory, coord.address)
        assert renewed.principal.serial != short.principal.serial
        assert (directory / idm.CERT_FILE).read_bytes() == renewed.cert_pem
        assert (directory / idm.KEY_FILE).read_bytes() == short.key_pem  # the key stays
        _, old_expiry = idm.issued_and_expires_s(idm.load_certificate(short.cert_pem))
        await async_wait_until(lambda: time.time() > old_expiry + 0.5, timeout=10)
        # The old certificate alone is refused now ...
        assert await probe(coord.address, short) == S.UNAUTHENTICATED
        # ... but the running channel has moved to the renewed one.
        await agent.Probe(agent_pb2.ProbeRequest(), timeout=10)


async def test_the_agents_renewer_renews_before_expiry(coord: Coordinator, tmp_path: Path) -> None:
    directory = tmp_path / "agent"
    backdated(coord, NODE, lifetime=600, age=100).save(directory)  # not due: untouched
    before = (directory / idm.CERT_FILE).read_bytes()
    assert await asyncio.to_thread(renew_if_due, directory, coord.address) is not None
    assert (directory / idm.CERT_FILE).read_bytes() == before
    due = backdated(coord, NODE, lifetime=600, age=450)
    due.save(directory)
    renewer = CertificateRenewer(directory, coord.address, retry_s=1.0).start()
    try:
        await async_wait_until(lambda: renewer.renewals == 1, timeout=20)
    finally:
        renewer.stop()
    fresh = idm.Identity.load(directory)
    assert fresh.principal.id == due.principal.id
    assert idm.renewal_due_s(fresh.cert_pem) > time.time() + 300
    assert await probe(coord.address, fresh) == S.OK


# -- rate limits --------------------------------------------------------------------------------


async def test_enroll_rate_limits_per_address_and_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = EnrollLimits(per_peer=RateLimit(5, 1.0), total=RateLimit(4, 1.0))
    monkeypatch.setattr(tokens, "ENROLL_LIMITS", limits)
    async with in_process_coordinator(tmp_path / "data", listen="[::]:0") as coord:
        ca = ca_of(coord)
        port = coord.address.rsplit(":", 1)[1]
        attacker, honest = f"127.0.0.1:{port}", f"[::1]:{port}"
        # The attacker tries tokens from one address: five answers, then RESOURCE_EXHAUSTED.
        for _ in range(5):
            guess, _ = idm.new_token(ca.fingerprint)
            refused(await enroll_raw(attacker, ca.cert_pem, guess), S.UNAUTHENTICATED)
        for _ in range(3):
            guess, _ = idm.new_token(ca.fingerprint)
            refused(
                await enroll_raw(attacker, ca.cert_pem, guess),
                S.RESOURCE_EXHAUSTED,
                "limit per address is at most 5 at once, then 1 per minute",
            )
        # Another address is unaffected, and the attacker's unknown tokens took nothing from
        # the total: four honest enrollments fit.
        token = await create_token(coord.store, ca, NODE, ttl_s=60, max_uses=10, donor="dana")
        for _ in range(4):
            ok = await enroll_raw(honest, ca.cert_pem, token)
            assert isinstance(ok, identity_pb2.EnrollResponse), ok
        # The fifth good token meets the coordinator's total.
        refused(
            await enroll_raw(honest, ca.cert_pem, token),
            S.RESOURCE_EXHAUSTED,
            "for all callers together is at most 4 at once",
        )
        # The token's refused use was not spent; the server goes on serving other calls.
        stored = await coord.store.get_token(idm.hash_secret(idm.parse_token(token)[0]))
        assert stored is not None and stored.uses == 4
        assert await probe(honest, coord.issue_identity(NODE)) == S.OK


# -- donors -------------------------------------------------------------------------------------


async def test_a_quarantined_donor_enrolls_no_new_nodes(coord: Coordinator) -> None:
    ca = ca_of(coord)
    mallory = await create_token(coord.store, ca, NODE, ttl_s=60, max_uses=5, donor="mallory")
    alice = await create_token(coord.store, ca, NODE, ttl_s=60, max_uses=5, donor="alice")
    key = idm.new_private_key()
    caught = await enroll_raw(coord.address, ca.cert_pem, mallory, key)
    assert isinstance(caught, identity_pb2.EnrollResponse)
    ident = idm.Identity(ca.cert_pem, caught.certificate_pem, key)
    node_id = ident.principal.id
    async with idm.secure_aio_channel(coord.address, ident) as ch:
        agent = agent_pb2_grpc.AgentServiceStub(ch)
        await agent.Register(agent_pb2.RegisterRequest(name="m"), timeout=10)
    await coord.registry.quarantine(node_id, "caught cheating", {})
    # A fresh certificate would wipe its record: refused, naming the rule and the node.
    refused(
        await enroll_raw(coord.address, ca.cert_pem, mallory),
        S.PERMISSION_DENIED,
        "donor mallory has a quarantined node",
        node_id,
    )
    stored = await coord.store.get_token(idm.hash_secret(idm.parse_token(mallory)[0]))
    assert stored is not None and stored.uses == 1  # the refused attempt used nothing
    # Another donor's nodes enroll as usual.
    assert isinstance(
        await enroll_raw(coord.address, ca.cert_pem, alice), identity_pb2.EnrollResponse
    )


# -- upgrade ------------------------------------------------------------------------------------


async def test_a_schema_7_data_dir_upgrades_and_its_tokens_work(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ca = tokens.ensure_ca(data)  # as an older `token create` made it: no server certificate
    old = await SqliteStore.open(data / "coordinator.db", target_version=7)
    assert old.schema_version == 7
    await old.close()
    token, token_hash = idm.new_token(ca.fingerprint)
    db = sqlite3.connect(data / "coordinator.db")
    try:  # a reusable token as version 7 stored it (no use limit, no certificate lifetime)
        db.execute(
            "INSERT INTO tokens (token_hash, role, created_ms, expires_ms, reusable, uses, donor)"
            " VALUES (?, 'node', 0, ?, 1, 0, '')",
            (token_hash, int(time.time() * 1000) + 60_000),
        )
        db.commit()
    finally:
        db.close()
    async with in_process_coordinator(data) as coord:
        assert coord.store.schema_version >= 8
        for _ in range(2):  # reusable without a limit, as it was made
            reply = await enroll_raw(coord.address, ca.cert_pem, token)
            assert isinstance(reply, identity_pb2.EnrollResponse), reply
            assert abs(lifetime_s(reply.certificate_pem) - DEFAULT_CERT_TTL_S) < 5
