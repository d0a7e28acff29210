"""Property-based fuzzing of a live coordinator process (TLS, real engine) and of a node's
PeerService: random bytes, random well-typed messages and mangled blob uploads go to every
RPC, as every kind of caller. The servers must keep serving, never answer INTERNAL/UNKNOWN
(a crash), and the coordinator's state afterwards must be consistent: every published blob's
bytes match its sha256 and size, no job or round appeared from garbage, and the store opens
cleanly after a SIGTERM.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochmesh import identity as idm
from epochmesh.v1 import (
    agent_pb2,
    common_pb2,
    identity_pb2,
    job_pb2,
    peer_pb2,
    scheduler_pb2,
)
from tests.procs import CoordinatorProc, health_status, identity_for, start_coordinator

pytestmark = pytest.mark.timeout(300)

SERVICES = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    job_pb2.DESCRIPTOR.services_by_name["JobService"],
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    identity_pb2.DESCRIPTOR.services_by_name["IdentityService"],
)
METHODS = [(s.full_name, m) for s in SERVICES for m in s.methods]
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerService"]
PEER_METHODS = [(PEER_SERVICE.full_name, m) for m in PEER_SERVICE.methods]
CRASH = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CALL_TIMEOUT_S = 2.0
ROLES = ("operator", "node", "submitter", "none")

_INT_TYPES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor, draw: Any) -> Any:
    t = field.type
    if t in _INT_TYPES:
        lo, hi = _INT_TYPES[t]
        return draw(st.one_of(st.integers(lo, hi), st.sampled_from([0, 1, -1 if lo else 0, hi])))
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
    if t == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if t == FieldDescriptor.TYPE_STRING:
        return draw(
            st.one_of(
                st.text(max_size=40),
                st.sampled_from(["", "j-0123456789", "n-0123456789", "a" * 300, "u-0000000000"]),
                st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
            )
        )
    if t == FieldDescriptor.TYPE_BYTES:
        return draw(st.binary(max_size=256))
    if t == FieldDescriptor.TYPE_ENUM:
        return draw(st.sampled_from([v.number for v in field.enum_type.values] + [99, -1]))
    raise AssertionError(f"unhandled field type {t}")


def _fill(msg: Any, descriptor: Descriptor, draw: Any, depth: int) -> None:
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                key_f, val_f = (
                    field.message_type.fields_by_name["key"],
                    field.message_type.fields_by_name["value"],
                )
                for _ in range(draw(st.integers(0, 3))):
                    key = _scalar(key_f, draw)
                    if val_f.type == FieldDescriptor.TYPE_MESSAGE:
                        _fill(getattr(msg, field.name)[key], val_f.message_type, draw, depth + 1)
                    else:
                        getattr(msg, field.name)[key] = _scalar(val_f, draw)
                continue
            if depth >= 2:
                continue
            if field.is_repeated:
                for _ in range(draw(st.integers(0, 3))):
                    _fill(getattr(msg, field.name).add(), field.message_type, draw, depth + 1)
            else:
                sub = getattr(msg, field.name)
                sub.SetInParent()
                _fill(sub, field.message_type, draw, depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).extend(
                _scalar(field, draw) for _ in range(draw(st.integers(0, 3)))
            )
        else:
            setattr(msg, field.name, _scalar(field, draw))


@st.composite
def payloads(draw: Any, method: MethodDescriptor) -> bytes:
    """One request message: random bytes, a mangled valid one, or a random well-typed one."""
    kind = draw(st.sampled_from(["bytes", "message", "mangled"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    cls = message_factory.GetMessageClass(method.input_type)
    msg = cls()
    _fill(msg, method.input_type, draw, 0)
    data = msg.SerializeToString()
    if kind == "mangled" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i + 1 :]
    return data


@st.composite
def uploads(draw: Any) -> list[bytes]:
    """An UploadBlob stream for a small payload, correct or subtly wrong."""
    data = draw(st.binary(min_size=1, max_size=2048))
    sha = hashlib.sha256(data).hexdigest()
    size = len(data)
    fault = draw(
        st.sampled_from(["none", "flip", "short", "long", "offset", "size", "extra_header"])
    )
    header = job_pb2.UploadBlobHeader(sha256=sha, size=size)
    if fault == "size":
        header.size = draw(st.integers(-5, 5000))
    chunks = [data]
    if fault == "flip":
        i = draw(st.integers(0, size - 1))
        chunks = [data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]]
    elif fault == "short":
        chunks = [data[: max(0, size - 1)]]
    elif fault == "long":
        chunks = [data + b"x"]
    msgs = [job_pb2.UploadBlobRequest(header=header)]
    offset = draw(st.integers(-3, 3)) if fault == "offset" else 0
    for c in chunks:
        msgs.append(job_pb2.UploadBlobRequest(chunk=common_pb2.DataChunk(offset=offset, data=c)))
    if fault == "extra_header":
        msgs.append(job_pb2.UploadBlobRequest(header=header))
    return [m.SerializeToString() for m in msgs]


def _call(
    channel: grpc.Channel, service: str, method: MethodDescriptor, msgs: list[bytes]
) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(iter(msgs), timeout=CALL_TIMEOUT_S):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(iter(msgs), timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            for n, _ in enumerate(channel.unary_stream(path)(msgs[0], timeout=CALL_TIMEOUT_S)):
                if n > 64:
                    break
        else:
            channel.unary_unary(path)(msgs[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProc, dict[str, grpc.Channel]]]:
    proc = start_coordinator(tmp_path_factory.mktemp("fuzz") / "coord")
    channels: dict[str, grpc.Channel] = {}
    try:
        ca = (proc.data_dir / "ca.pem").read_bytes()
        for role in ROLES:
            if role == "none":
                channels[role] = grpc.secure_channel(
                    proc.address,
                    idm.channel_credentials(ca),
                    options=idm.coordinator_channel_options(),
                )
            else:
                ident = identity_for(proc.address, role)
                assert ident is not None
                channels[role] = idm.secure_sync_channel(proc.address, ident)
        yield proc, channels
    finally:
        for ch in channels.values():
            ch.close()
        proc.kill9()


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_coordinator_survives_hostile_messages(
    live: tuple[CoordinatorProc, dict[str, grpc.Channel]], data: Any
) -> None:
    proc, channels = live
    role = data.draw(st.sampled_from(ROLES), label="role")
    if data.draw(st.integers(0, 4), label="upload?") == 0:
        service, method = (
            "epochmesh.v1.JobService",
            job_pb2.DESCRIPTOR.services_by_name["JobService"].methods_by_name["UploadBlob"],
        )
        msgs = data.draw(uploads(), label="upload")
    else:
        service, method = data.draw(st.sampled_from(METHODS), label="method")
        count = data.draw(
            st.integers(0 if method.client_streaming else 1, 3 if method.client_streaming else 1)
        )
        msgs = [data.draw(payloads(method), label="msg") for _ in range(count)]
    code = _call(channels[role], service, method, msgs)
    assert code not in CRASH, (role, service, method.name, code)
    assert proc.running()


def test_state_is_consistent_after_the_fuzzing(
    live: tuple[CoordinatorProc, dict[str, grpc.Channel]],
) -> None:
    proc, _ = live
    assert health_status(proc.address) == "SERVING"
    assert proc.terminate() == 0
    db = sqlite3.connect(proc.data_dir / "coordinator.db")
    try:
        blobs = db.execute("SELECT sha256, size FROM blobs").fetchall()
        jobs = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        rounds = db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
    root = proc.data_dir / "blobs"
    on_disk = {p.name for p in root.glob("??/*") if p.is_file()}
    assert on_disk == {sha for sha, _ in blobs}
    for sha, size in blobs:
        body = (root / sha[:2] / sha).read_bytes()
        assert len(body) == size and hashlib.sha256(body).hexdigest() == sha
    assert jobs == 0 and rounds == 0
    proc.start()  # and the data dir opens again
    assert health_status(proc.address) == "SERVING"


# -- a node's PeerService --------------------------------------------------------------------


class _PeerServer:
    """node_agent.ring.service.PeerService on an mTLS grpc.aio server in a thread of its own."""

    def __init__(self, identity: idm.Identity) -> None:
        self.identity = identity
        self.address = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("peer server did not start")

    async def _main(self) -> None:
        from node_agent.ring.service import PeerService

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((PeerService(join_timeout_s=0.5).generic_handler(),))
        port = server.add_secure_port("127.0.0.1:0", idm.peer_server_credentials(self.identity))
        await server.start()
        self.address = f"127.0.0.1:{port}"
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_PeerServer, grpc.Channel]]:
    pytest.importorskip("node_agent.ring.service")
    from coordinator.trust.tokens import ensure_ca, issue_identity

    ca = ensure_ca(tmp_path_factory.mktemp("peer-ca"))
    server = _PeerServer(issue_identity(ca, "node", "n-00000000aa"))
    caller = issue_identity(ca, "node", "n-00000000bb")
    channel = grpc.secure_channel(
        server.address,
        idm.peer_channel_credentials(caller),
        options=idm.peer_channel_options("n-00000000aa"),
    )
    try:
        yield server, channel
    finally:
        channel.close()
        server.close()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_peer_service_survives_hostile_messages(
    peer: tuple[_PeerServer, grpc.Channel], data: Any
) -> None:
    server, channel = peer
    service, method = data.draw(st.sampled_from(PEER_METHODS), label="method")
    count = data.draw(
        st.integers(0 if method.client_streaming else 1, 3 if method.client_streaming else 1)
    )
    msgs = [data.draw(payloads(method), label="msg") for _ in range(count)]
    code = _call(channel, service, method, msgs)
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method.name, code)
    # Still serving.
    ping = channel.unary_unary(f"/{service}/Ping")
    ping(peer_pb2.PingRequest().SerializeToString(), timeout=5)


def test_peer_service_refuses_a_caller_without_a_certificate(
    peer: tuple[_PeerServer, grpc.Channel],
) -> None:
    server, _ = peer
    with grpc.secure_channel(
        server.address,
        idm.channel_credentials(server.identity.ca_pem),
        options=idm.peer_channel_options("n-00000000aa"),
    ) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.unary_unary(f"/{PEER_SERVICE.full_name}/Ping")(b"", timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails


@pytest.mark.parametrize("method", ["TransferState", "Ping"])
def test_peer_service_answers_unparsable_requests_invalid_argument(
    peer: tuple[_PeerServer, grpc.Channel], method: str
) -> None:
    _, channel = peer
    desc = PEER_SERVICE.methods_by_name[method]
    code = _call(channel, PEER_SERVICE.full_name, desc, [b"\x00"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
