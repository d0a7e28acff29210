"""The WAN emulator on real loopback sockets: latency, bandwidth, loss, gRPC through it, close
propagation, the thread runner and the scripts/wan.py process.

Timing bounds are one-sided where the machine's load can only add time (measured >= model),
and loose on the other side (2 shared cores)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epochmesh.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from epochmesh.testing.wan import Site, WanLink, WanThread
from tests.procs import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SLACK_S = 0.040  # allowed extra time on a loaded 2-core machine


# -- tiny servers ------------------------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Count bytes until EOF, answer the count and the sha256 of what arrived."""
    h = hashlib.sha256()
    n = 0
    while data := await reader.read(1 << 20):
        n += len(data)
        h.update(data)
    writer.write(f"{n} {h.hexdigest()}".encode())
    await writer.drain()
    writer.close()


@pytest.fixture
async def echo_addr() -> AsyncIterator[str]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


@pytest.fixture
async def sink_addr() -> AsyncIterator[str]:
    server = await asyncio.start_server(_sink, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def _connect(link: WanLink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", link.port)


async def _echo_time(r: asyncio.StreamReader, w: asyncio.StreamWriter, payload: bytes) -> float:
    t0 = time.perf_counter()
    w.write(payload)
    await w.drain()
    got = await r.readexactly(len(payload))
    dt = time.perf_counter() - t0
    assert got == payload
    return dt


# -- latency and bandwidth ----------------------------------------------------------------------


def _slack(direct: list[float]) -> float:
    """The upper bounds' allowance: SLACK_S plus twice what the same exchange took straight
    with the server (no link) just before, so that a loaded host, which delays every
    exchange, widens them, while on an idle one they stay at about SLACK_S."""
    return SLACK_S + 2 * statistics.median(direct)


async def test_echo_rtt_matches_configured_rtt(echo_addr: str) -> None:
    rtt = 0.050
    host, port = echo_addr.rsplit(":", 1)
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection(host, int(port))
    await _echo_time(r, w, b"hello")
    direct_first = time.perf_counter() - t0
    direct = [await _echo_time(r, w, b"x" * 100) for _ in range(8)]
    w.close()
    await w.wait_closed()
    async with WanLink(target=echo_addr, bandwidth_bps=100e6, rtt_ms=50) as link:
        t0 = time.perf_counter()
        r, w = await _connect(link)
        first = await _echo_time(r, w, b"hello")
        # a new connection costs the TCP handshake (1 RTT) before the first exchange
        assert 2 * rtt - 0.001 <= time.perf_counter() - t0 < 2 * rtt + _slack([direct_first])
        assert first >= 2 * rtt - 0.002
        times = [await _echo_time(r, w, b"x" * 100) for _ in range(8)]
        assert min(times) >= rtt - 0.001, times
        assert statistics.median(times) < rtt + _slack(direct), (times, direct)
        w.close()
        await w.wait_closed()
        stats = link.stats()
        assert stats.bytes_to_target == stats.bytes_to_client == 5 + 800
        assert stats.connections_total == 1


async def test_bulk_throughput_matches_bandwidth(sink_addr: str) -> None:
    bw = 20e6
    nbytes = int(bw / 8 * 2.0)  # 2 s at 20 Mbit/s
    payload = os.urandom(nbytes)
    async with WanLink(target=sink_addr, bandwidth_bps=bw, rtt_ms=50, handshake=False) as link:
        r, w = await _connect(link)
        t0 = time.perf_counter()
        w.write(payload)
        await w.drain()
        w.write_eof()  # half-close: the sink still answers
        answer = (await r.read()).decode()
        elapsed = time.perf_counter() - t0
        assert answer == f"{nbytes} {hashlib.sha256(payload).hexdigest()}"
        # elapsed = serialization + one-way out + one-way back for the answer
        rate = nbytes * 8 / (elapsed - 0.050)
        assert 0.75 * bw <= rate <= 1.25 * bw, f"{rate / 1e6:.2f} Mbit/s"
        assert rate <= 1.02 * bw  # never faster than the link
        w.close()
        stats = link.stats()
        assert stats.bytes_to_target == nbytes
        assert stats.bytes_to_client == len(answer)


async def test_connections_share_the_link_bandwidth(sink_addr: str) -> None:
    bw = 20e6
    each = int(bw / 8 * 0.6)  # two flows, 1.2 s of wire time together

    async def send(link: WanLink) -> None:
        r, w = await _connect(link)
        w.write(b"\0" * each)
        await w.drain()
        w.write_eof()
        assert (await r.read()).startswith(f"{each} ".encode())
        w.close()

    async with WanLink(target=sink_addr, bandwidth_bps=bw, rtt_ms=20, handshake=False) as link:
        t0 = time.perf_counter()
        await asyncio.gather(send(link), send(link))
        rate = 2 * each * 8 / (time.perf_counter() - t0 - 0.020)
    assert 0.75 * bw <= rate <= 1.02 * bw, f"{rate / 1e6:.2f} Mbit/s"


async def test_asymmetric_link(sink_addr: str) -> None:
    # a slow return path (1 Mbit/s) does not slow the upload, which runs at the forward rate
    bw = 40e6
    nbytes = int(bw / 8 * 0.5)
    async with WanLink(
        target=sink_addr, bandwidth_bps=bw, return_bandwidth_bps=1e6, rtt_ms=10, handshake=False
    ) as link:
        r, w = await _connect(link)
        t0 = time.perf_counter()
        w.write(b"\1" * nbytes)
        await w.drain()
        w.write_eof()
        await r.read()
        rate = nbytes * 8 / (time.perf_counter() - t0 - 0.010)
        w.close()
    assert 0.75 * bw <= rate <= 1.02 * bw, f"{rate / 1e6:.2f} Mbit/s"


async def test_shared_site_uplink(sink_addr: str) -> None:
    """Two relays built over one Site share its uplink (agent->coordinator and agent->peer)."""
    site = Site("donor", 20e6, 10)
    bw = 20e6
    each = int(bw / 8 * 0.5)
    a = WanLink.between("127.0.0.1:0", sink_addr, client=site, name="to-coord", handshake=False)
    b = WanLink.between("127.0.0.1:0", sink_addr, client=site, name="to-peer", handshake=False)

    async def send(link: WanLink) -> None:
        r, w = await _connect(link)
        w.write(b"\2" * each)
        await w.drain()
        w.write_eof()
        await r.read()
        w.close()

    async with a, b:
        t0 = time.perf_counter()
        await asyncio.gather(send(a), send(b))
        rate = 2 * each * 8 / (time.perf_counter() - t0 - 0.010)
        assert site.up.bytes == 2 * each
    assert 0.75 * bw <= rate <= 1.02 * bw, f"{rate / 1e6:.2f} Mbit/s"


# -- loss -------------------------------------------------------------------------------------


async def test_loss_adds_retransmission_delay_but_data_arrives_in_order(echo_addr: str) -> None:
    rtt, rto = 0.020, 0.060
    async with WanLink(
        target=echo_addr,
        bandwidth_bps=100e6,
        rtt_ms=20,
        loss=0.5,
        rto_ms=60,
        seed=5,
        handshake=False,
    ) as link:
        r, w = await _connect(link)
        times = []
        for i in range(8):
            # several writes per exchange, so order across chunks matters
            parts = [f"{i:04d}-{j}-".encode() + bytes([j]) * (200 * j) for j in range(1, 5)]
            t0 = time.perf_counter()
            for p in parts:
                w.write(p)
                await w.drain()
            expect = b"".join(parts)
            assert await r.readexactly(len(expect)) == expect
            times.append(time.perf_counter() - t0)
        w.close()
        stats = link.stats()
    assert stats.loss_events > 0
    assert min(times) >= rtt - 0.001
    assert max(times) >= rtt + rto - 0.001, times  # at least one exchange hit a "loss"


# -- gRPC through the relay ---------------------------------------------------------------------


def _echo_handler() -> grpc.GenericRpcHandler:
    async def bidi(request_iterator: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for msg in request_iterator:
            yield msg

    return grpc.method_handlers_generic_handler(
        "test.Echo", {"Bidi": grpc.stream_stream_rpc_method_handler(bidi)}
    )


@pytest.fixture
async def grpc_server() -> AsyncIterator[tuple[str, health.aio.HealthServicer]]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_echo_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", servicer
    await server.stop(grace=None)


async def _direct_checks(address: str) -> list[float]:
    """Times of health checks straight to the server (no link), after a first one."""
    async with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            times.append(time.perf_counter() - t0)
    return times


def _channel(address: str) -> grpc.aio.Channel:
    # a private subchannel pool: each channel gets its own TCP connection through the relay
    return grpc.aio.insecure_channel(
        address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    )


async def test_grpc_unary_and_streaming_through_the_link(
    grpc_server: tuple[str, health.aio.HealthServicer],
) -> None:
    address, servicer = grpc_server
    direct = await _direct_checks(address)
    async with WanLink(target=address, bandwidth_bps=200e6, rtt_ms=20) as link:
        async with _channel(link.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            assert 0.019 <= time.perf_counter() - t0 < 0.020 + _slack(direct)

            # server streaming: status changes arrive through the relay
            call = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            it = call.__aiter__()
            assert (await it.__anext__()).status == health_pb2.HealthCheckResponse.SERVING
            await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await it.__anext__()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            call.cancel()

            # bidirectional streaming of 1 MiB messages, in order and intact
            bidi = channel.stream_stream("/test.Echo/Bidi")
            msgs = [os.urandom(1 << 20) for _ in range(6)]

            async def requests() -> AsyncIterator[bytes]:
                for m in msgs:
                    yield m

            got = [m async for m in bidi(requests(), timeout=20)]
            assert got == msgs
        stats = link.stats()
        assert stats.bytes_to_target > 6 << 20
        assert stats.bytes_to_client > 6 << 20


async def test_many_concurrent_grpc_connections(
    grpc_server: tuple[str, health.aio.HealthServicer],
) -> None:
    address, _ = grpc_server
    n = 24
    async with WanLink(target=address, bandwidth_bps=50e6, rtt_ms=30) as link:
        channels = [_channel(link.address) for _ in range(n)]
        try:
            stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]
            req = health_pb2.HealthCheckRequest(service="svc")
            for _ in range(3):
                resps = await asyncio.gather(*(s.Check(req, timeout=15) for s in stubs))
                assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in resps)
            assert link.stats().connections_total == n
            assert link.stats().connections_active == n
        finally:
            await asyncio.gather(*(ch.close() for ch in channels))
        # closing the channels closes every relayed connection
        await async_wait_until(
            lambda: link.stats().connections_active == 0,
            timeout=10,
            message="relayed connections were not closed",
        )


# -- closing ----------------------------------------------------------------------------------


async def test_client_close_reaches_the_server() -> None:
    seen_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.read() == b"bye"
        seen_eof.set()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with WanLink(target=target, bandwidth_bps=10e6, rtt_ms=20) as link:
            r, w = await _connect(link)
            w.write(b"bye")
            w.close()
            await asyncio.wait_for(seen_eof.wait(), 5)
            await async_wait_until(lambda: link.stats().connections_active == 0, timeout=5)
    finally:
        server.close()


async def test_server_close_reaches_the_client() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"welcome")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with WanLink(target=target, bandwidth_bps=10e6, rtt_ms=20) as link:
            r, w = await _connect(link)
            assert await asyncio.wait_for(r.read(), 5) == b"welcome"  # then EOF
            w.close()
            await async_wait_until(lambda: link.stats().connections_active == 0, timeout=5)
    finally:
        server.close()


async def test_stop_closes_open_connections(echo_addr: str) -> None:
    link = WanLink(target=echo_addr, bandwidth_bps=10e6, rtt_ms=10)
    await link.start()
    r, w = await _connect(link)
    await _echo_time(r, w, b"ping")
    await asyncio.wait_for(link.stop(), 5)
    assert link.stats().connections_active == 0
    try:
        rest = await asyncio.wait_for(r.read(), 5)
    except ConnectionError:
        rest = b""
    assert rest == b""
    w.close()
    with pytest.raises(OSError):
        await _connect(link)  # no longer listening


async def test_refused_target_closes_the_client() -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with WanLink(target=dead, bandwidth_bps=10e6, rtt_ms=10) as link:
        r, w = await _connect(link)
        try:
            rest = await asyncio.wait_for(r.read(), 5)
        except ConnectionError:
            rest = b""
        assert rest == b""
        w.close()
        await async_wait_until(lambda: link.stats().connect_failures == 1, timeout=5)


# -- synchronous use: the thread runner and the script ------------------------------------------


@pytest.fixture
def thread_echo_addr() -> Iterator[str]:
    """A blocking echo server in a thread (for the synchronous tests)."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(5)
    srv.close()


def _sync_echo(address: str, payload: bytes, rounds: int) -> list[float]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = s.recv(1 << 16)
                assert chunk, "relay closed the connection"
                got += chunk
            times.append(time.perf_counter() - t0)
            assert got == payload
    return times


def test_wan_thread_runs_links_for_synchronous_callers(thread_echo_addr: str) -> None:
    links = [
        WanLink(target=thread_echo_addr, bandwidth_bps=100e6, rtt_ms=30, name="a"),
        WanLink(target=thread_echo_addr, bandwidth_bps=100e6, rtt_ms=60, name="b"),
    ]
    direct = _sync_echo(thread_echo_addr, b"abc", 4)[1:]
    with WanThread(*links) as wan:
        ta = _sync_echo(wan.links[0].address, b"abc", 4)[1:]
        tb = _sync_echo(wan.links[1].address, b"abc", 4)[1:]
        assert min(ta) >= 0.029 and statistics.median(ta) < 0.030 + _slack(direct), (ta, direct)
        assert min(tb) >= 0.059 and statistics.median(tb) < 0.060 + _slack(direct), (tb, direct)
        wait_until(lambda: all(s.connections_active == 0 for s in wan.stats()), timeout=5)
        assert [s.bytes_to_target for s in wan.stats()] == [12, 12]
        # A link added to the running thread relays too, and is counted and stopped with it.
        site = Site("c", 100e6, 40)
        added = wan.add(WanLink.between("127.0.0.1:0", thread_echo_addr, client=site, name="c"))
        tc = _sync_echo(added.address, b"abc", 4)[1:]
        assert min(tc) >= 0.039 and statistics.median(tc) < 0.040 + _slack(direct), (tc, direct)
        wait_until(lambda: all(s.connections_active == 0 for s in wan.stats()), timeout=5)
        assert [s.bytes_to_target for s in wan.stats()] == [12, 12, 12]
    with pytest.raises(RuntimeError, match="not started"):
        wan.add(WanLink(target=thread_echo_addr, name="d"))


def _start_script(*args: str) -> tuple[subprocess.Popen[str], dict[str, dict[str, str]]]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "wan.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test timeout; the script prints it at once
    if not line:
        proc.wait(5)
        raise AssertionError(f"wan.py exited {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
    ready = json.loads(line)
    assert ready["event"] == "ready"
    return proc, ready["links"]


def _stop_script(proc: subprocess.Popen[str]) -> dict[str, dict[str, int]]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["event"] == "stats"
    assert "bytes to target" in err  # logged on exit too
    return stats["links"]


@pytest.mark.timeout(60)
def test_script_runs_several_links_until_sigterm(thread_echo_addr: str, tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.json"
    proc, links = _start_script(
        "--link",
        f"fast=127.0.0.1:0,{thread_echo_addr},100mbit,20ms",
        "--link",
        f"slow=127.0.0.1:0,{thread_echo_addr},10mbit,80ms,loss=0.1%,jitter=1ms",
        "--ready-file",
        str(ready_file),
    )
    try:
        assert set(links) == {"fast", "slow"}
        assert json.loads(ready_file.read_text())["links"] == links
        direct = _sync_echo(thread_echo_addr, b"x" * 10, 3)[1:]
        fast = _sync_echo(links["fast"]["listen"], b"x" * 10, 3)[1:]
        slow = _sync_echo(links["slow"]["listen"], b"y" * 100, 3)[1:]
        assert min(fast) >= 0.019 and min(slow) >= 0.079
        assert statistics.median(fast) < 0.020 + _slack(direct), (fast, direct)
    finally:
        stats = _stop_script(proc)
    assert stats["fast"]["bytes_to_target"] == stats["fast"]["bytes_to_client"] == 30
    assert stats["slow"]["bytes_to_target"] == stats["slow"]["bytes_to_client"] == 300


@pytest.mark.timeout(60)
def test_script_single_link_flags(thread_echo_addr: str) -> None:
    proc, links = _start_script(
        "--listen", "127.0.0.1:0", "--target", thread_echo_addr, "--bandwidth", "50mbit",
        "--rtt", "0.03s", "--loss", "0", "--name", "donor",
    )  # fmt: skip
    try:
        times = _sync_echo(links["donor"]["listen"], b"z" * 50, 3)[1:]
        assert min(times) >= 0.029
    finally:
        stats = _stop_script(proc)
    assert stats["donor"]["bytes_to_target"] == 150


def test_script_rejects_bad_arguments() -> None:
    for args in (
        ["--listen", "127.0.0.1:0"],
        ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--bandwidth", "fast"],
        ["--link", "a=127.0.0.1:0,127.0.0.1:1,1mbit"],
        [],
    ):
        res = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "wan.py"), *args],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert res.returncode == 2, args
        assert "error" in res.stderr
