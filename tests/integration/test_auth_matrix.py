"""Trust against a real in-process coordinator (TLS, its own CA per test): every RPC x every
kind of caller answers the exact gRPC status, enrollment with join tokens, node and job
ownership, revocation (also across a restart), and --insecure.

Callers: no certificate, an expired certificate, one from a foreign CA, one whose principal
was revoked, and valid certificates of each role. An allowed call sends an empty request, so
its status is the handler's own answer (NullEngine: UNIMPLEMENTED for the engine's RPCs).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from coordinator.app import Coordinator
from coordinator.store.base import TokenRecord
from epochmesh import identity as idm
from epochmesh.timeutil import now_ms
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    identity_pb2,
    identity_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    market_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

S = grpc.StatusCode
OK = "OK"
SERVICES: tuple[ServiceDescriptor, ...] = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    job_pb2.DESCRIPTOR.services_by_name["JobService"],
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    market_pb2.DESCRIPTOR.services_by_name["MarketService"],
)
NODE, SUBMITTER, OPERATOR = "node", "submitter", "operator"
ANY_USER = {SUBMITTER, OPERATOR}
# method -> (roles admitted, status of an empty request once admitted)
EXPECTED: dict[str, tuple[set[str], str | S]] = {
    "AgentService/Register": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/Heartbeat": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/Leave": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/ReportBenchmark": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/NextTask": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/FetchBlob": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/PushUpdate": ({NODE, OPERATOR}, S.UNIMPLEMENTED),
    "AgentService/PullParameters": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/ReportProgress": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/Probe": ({NODE, OPERATOR}, OK),
    "AgentService/AuthorizeStateTransfer": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/CommitSketches": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "AgentService/ReportCheck": ({NODE, OPERATOR}, S.INVALID_ARGUMENT),
    "JobService/UploadBlob": (ANY_USER, S.INVALID_ARGUMENT),
    "JobService/GetBlobStatus": (ANY_USER, S.INVALID_ARGUMENT),
    "JobService/DeleteBlob": (ANY_USER, S.INVALID_ARGUMENT),
    "JobService/SubmitJob": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/GetJob": (ANY_USER, S.INVALID_ARGUMENT),
    "JobService/ListJobs": (ANY_USER, OK),
    "JobService/WatchJob": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/CancelJob": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/DownloadResult": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/GetRounds": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/GetJobEvents": (ANY_USER, S.INVALID_ARGUMENT),
    "JobService/GetQueue": (ANY_USER, S.UNIMPLEMENTED),
    "JobService/SetJobPriority": (ANY_USER, S.INVALID_ARGUMENT),
    "SchedulerService/ListNodes": (ANY_USER, OK),
    "SchedulerService/GetNode": (ANY_USER, S.INVALID_ARGUMENT),
    "SchedulerService/ListJobs": ({OPERATOR}, OK),
    "SchedulerService/GetJob": ({OPERATOR}, S.INVALID_ARGUMENT),
    "SchedulerService/GetAllocation": (ANY_USER, S.UNIMPLEMENTED),
    "SchedulerService/PreviewAllocation": (ANY_USER, S.UNIMPLEMENTED),
    "SchedulerService/QuoteJob": (ANY_USER, S.INVALID_ARGUMENT),
    "SchedulerService/WatchEvents": ({OPERATOR}, OK),
    "SchedulerService/Cordon": ({OPERATOR}, S.INVALID_ARGUMENT),
    "SchedulerService/Uncordon": ({OPERATOR}, S.INVALID_ARGUMENT),
    "SchedulerService/Drain": ({OPERATOR}, S.INVALID_ARGUMENT),
    "SchedulerService/ClusterStats": (ANY_USER, OK),
    "SchedulerService/Revoke": ({OPERATOR}, S.INVALID_ARGUMENT),
    "SchedulerService/GetQueue": ({OPERATOR}, S.UNIMPLEMENTED),
    "SchedulerService/SetTenantWeight": ({OPERATOR}, S.INVALID_ARGUMENT),
    "MarketService/GrantCredits": ({OPERATOR}, S.INVALID_ARGUMENT),
    "MarketService/GetBalance": (ANY_USER, OK),
    "MarketService/GetStatement": (ANY_USER, OK),
    "MarketService/AddBudget": (ANY_USER, S.INVALID_ARGUMENT),
}


def all_methods() -> list[tuple[ServiceDescriptor, MethodDescriptor]]:
    return [(s, m) for s in SERVICES for m in s.methods]


def test_the_table_names_every_rpc() -> None:
    assert sorted(f"{s.name}/{m.name}" for s, m in all_methods()) == sorted(EXPECTED)


async def call_empty(
    channel: grpc.aio.Channel, service: ServiceDescriptor, method: MethodDescriptor
) -> str | S:
    """Call ``method`` with an empty request (one empty message for a client stream, every
    response read for a server stream); OK or the status code."""
    req = message_factory.GetMessageClass(method.input_type)()
    path = f"/{service.full_name}/{method.name}"
    ser = type(req).SerializeToString
    try:
        if method.client_streaming:
            su = channel.stream_unary(path, request_serializer=ser)
            await su(iter([req]), timeout=10)
        elif method.server_streaming:
            us = channel.unary_stream(path, request_serializer=ser)
            async for _ in us(req, timeout=10):
                pass
        else:
            uu = channel.unary_unary(path, request_serializer=ser)
            await uu(req, timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return OK


async def statuses(channel: grpc.aio.Channel) -> dict[str, str | S]:
    return {f"{s.name}/{m.name}": await call_empty(channel, s, m) for s, m in all_methods()}


def expected_for(role: str) -> dict[str, str | S]:
    return {
        name: (code if role in roles else S.PERMISSION_DENIED)
        for name, (roles, code) in EXPECTED.items()
    }


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(tmp_path / "data", lease_ttl_s=60.0) as c:
        yield c


def ca_only_channel(coord: Coordinator) -> grpc.aio.Channel:
    assert coord.ca is not None
    return grpc.aio.secure_channel(
        coord.address,
        idm.channel_credentials(coord.ca.cert_pem),
        options=idm.coordinator_channel_options(),
    )


def expired_identity(coord: Coordinator) -> idm.Identity:
    """A certificate of the right CA and role whose validity ended yesterday."""
    assert coord.ca is not None
    ca_cert = idm.load_certificate(coord.ca.cert_pem)
    ca_key = serialization.load_pem_private_key(coord.ca.key_pem, None)
    key_pem = idm.new_private_key()
    key = serialization.load_pem_private_key(key_pem, None)
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(x509.NameOID.COMMON_NAME, "u-0000000001"),
            x509.NameAttribute(x509.NameOID.ORGANIZATIONAL_UNIT_NAME, OPERATOR),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=2))
        .not_valid_after(now - dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    return idm.Identity(ca_pem=coord.ca.cert_pem, cert_pem=cert_pem, key_pem=key_pem)


@pytest.mark.parametrize("role", [NODE, SUBMITTER, OPERATOR])
async def test_every_rpc_for_every_role(coord: Coordinator, role: str) -> None:
    async with idm.secure_aio_channel(coord.address, coord.issue_identity(role)) as ch:
        assert await statuses(ch) == expected_for(role)


@pytest.mark.parametrize("caller", ["no certificate", "expired", "foreign CA", "revoked"])
async def test_every_rpc_refuses_unauthenticated_callers(coord: Coordinator, caller: str) -> None:
    if caller == "no certificate":
        channel = ca_only_channel(coord)
    elif caller == "expired":
        channel = idm.secure_aio_channel(coord.address, expired_identity(coord))
    elif caller == "foreign CA":
        other = idm.create_ca()
        key = idm.new_private_key()
        cert = idm.sign_csr(
            idm.create_csr(key), other[0], other[1], principal="u-0000000002", role=OPERATOR
        )
        assert coord.ca is not None
        channel = idm.secure_aio_channel(
            coord.address, idm.Identity(ca_pem=coord.ca.cert_pem, cert_pem=cert, key_pem=key)
        )
    else:
        victim = coord.issue_identity(OPERATOR)
        async with idm.secure_aio_channel(coord.address, coord.issue_identity(OPERATOR)) as op:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(op)
            reply = await sched.Revoke(
                scheduler_pb2.RevokeRequest(principal=victim.principal.id, reason="test")
            )
            assert reply.principal == victim.principal.id and not reply.already_revoked
        channel = idm.secure_aio_channel(coord.address, victim)
    async with channel:
        got = await statuses(channel)
    assert got == dict.fromkeys(EXPECTED, S.UNAUTHENTICATED)


async def test_plaintext_client_cannot_talk_to_a_tls_coordinator(coord: Coordinator) -> None:
    async with grpc.aio.insecure_channel(coord.address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ClusterStats(scheduler_pb2.ClusterStatsRequest(), timeout=3)
    assert err.value.code() == S.UNAVAILABLE


async def _enroll(coord: Coordinator, token: str, csr: bytes | None = None) -> str | S:
    async with ca_only_channel(coord) as ch:
        stub = identity_pb2_grpc.IdentityServiceStub(ch)
        req = identity_pb2.EnrollRequest(
            token=token, csr_pem=csr or idm.create_csr(idm.new_private_key())
        )
        try:
            await stub.Enroll(req, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return OK


async def test_enrollment_tokens(coord: Coordinator) -> None:
    from coordinator.trust.tokens import create_token

    assert coord.ca is not None
    single = await create_token(coord.store, coord.ca, NODE, ttl_s=60)
    assert await _enroll(coord, single) == OK
    assert await _enroll(coord, single) == S.UNAUTHENTICATED  # single use

    reusable = await create_token(coord.store, coord.ca, SUBMITTER, ttl_s=60, reusable=True)
    assert await _enroll(coord, reusable) == OK
    assert await _enroll(coord, reusable) == OK

    # An expired token (stored already past its expiry).
    token, token_hash = idm.new_token(coord.ca.fingerprint)
    created = now_ms() - 120_000
    await coord.store.add_token(
        TokenRecord(token_hash, NODE, created, created + 60_000, reusable=True)
    )
    assert await _enroll(coord, token) == S.UNAUTHENTICATED

    # A token naming another coordinator's CA, an unknown secret, garbage.
    other_fp = idm.fingerprint(idm.create_ca()[0])
    foreign, _ = idm.new_token(other_fp)
    unknown, _ = idm.new_token(coord.ca.fingerprint)
    for bad in (foreign, unknown, "emt1.nope", "x" * 300):
        assert await _enroll(coord, bad) in (S.UNAUTHENTICATED, S.INVALID_ARGUMENT), bad
    assert await _enroll(coord, foreign) == S.UNAUTHENTICATED
    assert await _enroll(coord, unknown) == S.UNAUTHENTICATED

    # A bad CSR is INVALID_ARGUMENT and does not spend the token.
    fresh = await create_token(coord.store, coord.ca, OPERATOR, ttl_s=60)
    assert await _enroll(coord, fresh, csr=b"not a csr") == S.INVALID_ARGUMENT
    assert await _enroll(coord, fresh) == OK


async def test_enroll_with_token_gives_a_working_identity(coord: Coordinator) -> None:
    import asyncio

    from coordinator.trust.tokens import create_token

    assert coord.ca is not None
    token = await create_token(coord.store, coord.ca, SUBMITTER, ttl_s=60)
    ident = await asyncio.to_thread(idm.enroll_with_token, coord.address, token, "me")
    assert ident.principal.role == SUBMITTER and ident.principal.id.startswith("u-")
    assert ident.ca_pem == coord.ca.cert_pem
    async with idm.secure_aio_channel(coord.address, ident) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        assert list((await jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=10)).jobs) == []
    # A token whose fingerprint does not match the CA the server presents: refused before
    # anything is sent.
    bad, _ = idm.new_token("0" * 64)
    with pytest.raises(idm.IdentityError, match="fingerprint"):
        await asyncio.to_thread(idm.enroll_with_token, coord.address, bad)


async def test_a_node_acts_only_as_itself(coord: Coordinator) -> None:
    a, b = coord.issue_identity(NODE), coord.issue_identity(NODE)
    async with (
        idm.secure_aio_channel(coord.address, a) as cha,
        idm.secure_aio_channel(coord.address, b) as chb,
    ):
        agent_a, agent_b = (
            agent_pb2_grpc.AgentServiceStub(cha),
            agent_pb2_grpc.AgentServiceStub(chb),
        )
        reg_a = await agent_a.Register(agent_pb2.RegisterRequest(name="a"), timeout=10)
        assert reg_a.node_id == a.principal.id  # the certificate names the node
        reg_b = await agent_b.Register(agent_pb2.RegisterRequest(name="b"), timeout=10)
        assert reg_b.node_id == b.principal.id

        async def code(coro: object) -> S:
            try:
                await coro  # type: ignore[misc]
            except grpc.aio.AioRpcError as err:
                return err.code()
            return S.OK

        hb = agent_pb2.HeartbeatRequest(node_id=b.principal.id, lease_id=reg_b.lease_id)
        assert await code(agent_a.Heartbeat(hb, timeout=10)) == S.PERMISSION_DENIED
        assert await code(agent_b.Heartbeat(hb, timeout=10)) == S.OK
        again = agent_pb2.RegisterRequest(name="a", node_id=b.principal.id)
        assert await code(agent_a.Register(again, timeout=10)) == S.PERMISSION_DENIED
        leave = agent_pb2.LeaveRequest(node_id=b.principal.id, lease_id=reg_b.lease_id)
        assert await code(agent_a.Leave(leave, timeout=10)) == S.PERMISSION_DENIED

        header = agent_pb2.UpdateHeader(node_id=b.principal.id, lease_id=reg_b.lease_id)
        push = agent_a.PushUpdate(iter([agent_pb2.PushUpdateRequest(header=header)]), timeout=10)
        assert await code(push) == S.PERMISSION_DENIED
        info = coord.registry.find(b.principal.id)
        assert info.state == common_pb2.NODE_STATE_ONLINE  # untouched by a's attempts


async def test_submitters_see_only_their_own_jobs(coord: Coordinator) -> None:
    alice, bob = coord.issue_identity(SUBMITTER), coord.issue_identity(SUBMITTER)
    job_a = await coord.store.create_job(common_pb2.Job(name="a"), owner=alice.principal.id)
    job_b = await coord.store.create_job(common_pb2.Job(name="b"), owner=bob.principal.id)
    async with (
        idm.secure_aio_channel(coord.address, alice) as cha,
        idm.secure_aio_channel(coord.address, coord.issue_identity(OPERATOR)) as cho,
    ):
        jobs = job_pb2_grpc.JobServiceStub(cha)
        got = await jobs.GetJob(job_pb2.GetJobRequest(job_id=job_a.job_id), timeout=10)
        assert got.owner == alice.principal.id
        listed = await jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=10)
        assert [j.job_id for j in listed.jobs] == [job_a.job_id]
        for call in (
            jobs.GetJob(job_pb2.GetJobRequest(job_id=job_b.job_id), timeout=10),
            jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job_b.job_id), timeout=10),
            jobs.GetRounds(job_pb2.GetRoundsRequest(job_id=job_b.job_id), timeout=10),
            jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=job_b.job_id), timeout=10),
            scheduler_pb2_grpc.SchedulerServiceStub(cha).GetAllocation(
                scheduler_pb2.GetAllocationRequest(job_id=job_b.job_id), timeout=10
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == S.PERMISSION_DENIED, err.value
        for stream in (
            jobs.WatchJob(job_pb2.WatchJobRequest(job_id=job_b.job_id), timeout=10),
            jobs.DownloadResult(job_pb2.DownloadResultRequest(job_id=job_b.job_id), timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
            assert err.value.code() == S.PERMISSION_DENIED

        # Operators see every job.
        every = await scheduler_pb2_grpc.SchedulerServiceStub(cho).ListJobs(
            scheduler_pb2.ListAllJobsRequest(), timeout=10
        )
        assert {j.job_id for j in every.jobs} == {job_a.job_id, job_b.job_id}
        op_jobs = await job_pb2_grpc.JobServiceStub(cho).ListJobs(
            job_pb2.ListJobsRequest(), timeout=10
        )
        assert len(op_jobs.jobs) == 2


async def test_revocation_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with in_process_coordinator(data) as coord:
        node = coord.issue_identity(NODE)
        operator = coord.issue_identity(OPERATOR)
        async with idm.secure_aio_channel(coord.address, node) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            await agent.Register(agent_pb2.RegisterRequest(name="doomed"), timeout=10)
        async with idm.secure_aio_channel(coord.address, operator) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            reply = await sched.Revoke(scheduler_pb2.RevokeRequest(principal="doomed"), timeout=10)
            assert reply.principal == node.principal.id
            again = await sched.Revoke(
                scheduler_pb2.RevokeRequest(principal=node.principal.id), timeout=10
            )
            assert again.already_revoked
            events = [
                e.kind
                async for e in sched.WatchEvents(
                    scheduler_pb2.WatchEventsRequest(kinds=["principal.revoked"]), timeout=10
                )
            ]
            assert events == ["principal.revoked"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sched.Revoke(scheduler_pb2.RevokeRequest(principal="nobody"), timeout=10)
            assert err.value.code() == S.NOT_FOUND
    async with in_process_coordinator(data) as coord:
        async with idm.secure_aio_channel(coord.address, node) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.Probe(agent_pb2.ProbeRequest(), timeout=10)
            assert err.value.code() == S.UNAUTHENTICATED
            assert "revoked" in (err.value.details() or "")
        async with idm.secure_aio_channel(coord.address, operator) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            await sched.ClusterStats(scheduler_pb2.ClusterStatsRequest(), timeout=10)


async def test_insecure_mode_is_plaintext_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="coordinator.app"):
        async with in_process_coordinator(tmp_path / "data", insecure=True) as coord:
            assert coord.ca is None
            async with grpc.aio.insecure_channel(coord.address) as ch:
                sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
                await sched.ClusterStats(scheduler_pb2.ClusterStatsRequest(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await sched.Revoke(scheduler_pb2.RevokeRequest(principal="x"), timeout=10)
                assert err.value.code() == S.FAILED_PRECONDITION
    assert any("PLAINTEXT" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "data" / "ca.pem").exists()


async def test_peer_mtls_names_the_caller_and_checks_the_callee(tmp_path: Path) -> None:
    """The helpers a node's PeerService uses: mutual TLS with certificates of one CA; the
    handler reads the caller's node id; the dialer accepts only the node it meant to reach."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path / "ca")
    a = issue_identity(ca, NODE, "n-00000000aa")
    b = issue_identity(ca, NODE, "n-00000000bb")
    seen: list[idm.Principal | None] = []

    class Health(health_pb2_grpc.HealthServicer):
        async def Check(self, request: object, context: grpc.aio.ServicerContext) -> object:
            seen.append(idm.peer_principal(context))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_secure_port("127.0.0.1:0", idm.peer_server_credentials(a))
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        async with idm.peer_aio_channel(address, a.principal.id, b) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert seen == [idm.Principal(id=b.principal.id, role=NODE, serial=b.principal.serial)]
        # Dialing "node cc" but reaching node aa: the TLS handshake fails.
        async with idm.peer_aio_channel(address, "n-00000000cc", b) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=3
                )
            assert err.value.code() == S.UNAVAILABLE
        assert len(seen) == 1
    finally:
        await server.stop(0)
