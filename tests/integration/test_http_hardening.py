"""The HTTP port against hostile clients, with real sockets on loopback and an in-process
coordinator: a DNS-rebinding Host, slow senders from one address (headers and bodies that
trickle), the login's content type and origin (login CSRF), and dashboard login codes replayed
with junk appended or a re-encoded signature, while the operator's own session lives on.

Slow clients connect from 127.0.0.2 / 127.0.0.3 (Linux routes all of 127.0.0.0/8 to the
loopback interface), the honest requests come from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import utils as ec_utils

from coordinator.app import Coordinator
from coordinator.observability import http_server
from coordinator.trust.tokens import create_token
from epochmesh.identity import LOGIN_CODE_PREFIX, enroll_with_token, make_login_code
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)

# The order of the NIST P-256 group (ECDSA's s and n - s both verify).
P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def request(
    address: str,
    path: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """One request on a fresh connection (from 127.0.0.1): status, body, headers."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


async def call(address: str, path: str, **kwargs: object) -> tuple[int, bytes, dict[str, str]]:
    # In a thread: the server's reads run on the coordinator's loop, this test's loop.
    return await asyncio.to_thread(request, address, path, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", advertise=("coord.example",)
    ) as c:
        yield c


async def test_a_foreign_host_name_reads_nothing(coord: Coordinator) -> None:
    """A DNS-rebinding page reaches 127.0.0.1 under its own name: the trusted loopback
    dashboard refuses it; its own names and addresses are served."""
    port = coord.http_address.rsplit(":", 1)[1]
    for path in ("/api/overview", "/metrics", "/", "/api/events", "/api/whoami"):
        for host in (f"rebind.attacker.example:{port}", "attacker.example", "127.0.0.1.nip.io"):
            status, body, _ = await call(coord.http_address, path, headers={"Host": host})
            assert status == 421, (path, host, status, body[:200])
            assert b"tenant" not in body and b"epochmesh_" not in body
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"LOCALHOST.:{port}",
        f"[::1]:{port}",
        f"coord.example:{port}",
        "127.0.0.1",
    ):
        status, _, _ = await call(coord.http_address, "/api/overview", headers={"Host": host})
        assert status == 200, host


def _slow_clients(address: str, source: str, count: int, head: bytes) -> list[socket.socket]:
    """``count`` connections from ``source`` that send ``head`` and then nothing."""
    host, port = address.rsplit(":", 1)
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
        try:
            sock.sendall(head)
        except OSError:
            pass  # refused and reset already
        socks.append(sock)
    return socks


def _outcome(sock: socket.socket) -> str:
    """ "refused" (a 503 or a reset before any request was read), or "closed" (the server
    shut it down without an answer: its request was late)."""
    try:
        data = sock.recv(4096)
    except ConnectionResetError:
        return "refused"
    finally:
        sock.close()
    if data.startswith(b"HTTP/1.1 503"):
        return "refused"
    return "closed" if data == b"" else f"answered {data[:40]!r}"


async def test_slow_clients_from_one_address_do_not_starve_anyone(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "REQUEST_DEADLINE_S", 4.0)
    cap = http_server.MAX_CONNECTIONS_PER_CLIENT
    # Bodies that trickle: each has its headers in, so today's server would give it a slot.
    slow_bodies = await asyncio.to_thread(
        _slow_clients,
        coord.http_address,
        "127.0.0.2",
        40,
        b"POST /api/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{",
    )
    # Headers that never end.
    slow_heads = await asyncio.to_thread(
        _slow_clients, coord.http_address, "127.0.0.3", 40, b"GET / HTTP/1.1\r\nHost: 127"
    )
    # An honest client is served meanwhile, every time.
    for path in ("/api/overview", "/metrics", "/api/events"):
        status, body, _ = await call(coord.http_address, path)
        assert status == 200, (path, status, body[:200])
    # Each slow address got at most its cap of connections (threads); the others were refused
    # at once, and the admitted ones were closed at their deadline without an answer.
    for socks in (slow_bodies, slow_heads):
        outcomes = await asyncio.gather(*(asyncio.to_thread(_outcome, s) for s in socks))
        assert outcomes.count("closed") <= cap, outcomes
        assert outcomes.count("refused") >= len(socks) - cap, outcomes
        assert set(outcomes) <= {"closed", "refused"}, outcomes
    status, _, _ = await call(coord.http_address, "/api/overview")
    assert status == 200


async def test_the_login_takes_json_from_its_own_origin_only(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", http_login=True
    ) as coord:
        assert coord.ca is not None
        origin = f"http://{coord.http_address}"
        tokens = [await create_token(coord.store, coord.ca, "submitter", 3600) for _ in range(4)]
        form = json.dumps({"token": tokens[0]}).encode()
        # A cross-site form posts text/plain (no preflight): refused, the token not spent.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
            status, body, headers = await call(
                coord.http_address,
                "/api/login",
                method="POST",
                body=form,
                headers={"Content-Type": content_type, "Origin": origin},
            )
            assert status == 415, (content_type, status, body)
            assert "Set-Cookie" not in headers
        # JSON from another origin (or an opaque one, or named by the Referer only): refused.
        for extra in (
            {"Origin": "http://attacker.example"},
            {"Origin": "null"},
            {"Referer": "http://attacker.example/page"},
            {"Origin": f"http://{coord.http_address}.attacker.example"},
        ):
            status, body, headers = await call(
                coord.http_address,
                "/api/login",
                method="POST",
                body=form,
                headers={"Content-Type": "application/json", **extra},
            )
            assert status == 403, (extra, status, body)
            assert "Set-Cookie" not in headers
        # The dashboard's own page (and a client that is no browser) logs in.
        for extra in ({"Origin": origin}, {"Referer": f"{origin}/login"}, {}):
            status, body, headers = await call(
                coord.http_address,
                "/api/login",
                method="POST",
                body=json.dumps({"token": tokens.pop()}).encode(),
                headers={"Content-Type": "application/json; charset=utf-8", **extra},
            )
            assert status == 200, (extra, status, body)
            assert "Set-Cookie" in headers
        # The first token was never spent by the refused attempts.
        status, _, _ = await call(
            coord.http_address,
            "/api/login",
            method="POST",
            body=form,
            headers={"Content-Type": "application/json"},
        )
        assert status == 200
        # A cross-origin logout is refused too.
        status, _, _ = await call(
            coord.http_address,
            "/api/logout",
            method="POST",
            body=b"",
            headers={"Origin": "http://attacker.example"},
        )
        assert status == 403


def _resigned(code: str) -> str:
    """The same login code with its ECDSA signature (r, s) turned into (r, n - s): another
    valid signature of the same payload."""
    body = code[len(LOGIN_CODE_PREFIX) :]
    der64, ts, sig64 = body.split(".")
    sig = base64.urlsafe_b64decode(sig64 + "=" * (-len(sig64) % 4))
    r, s = ec_utils.decode_dss_signature(sig)
    other = ec_utils.encode_dss_signature(r, P256_N - s)
    other64 = base64.urlsafe_b64encode(other).decode().rstrip("=")
    return f"{LOGIN_CODE_PREFIX}{der64}.{ts}.{other64}"


async def test_login_code_replays_open_nothing_and_end_no_session(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", http_login=True
    ) as coord:
        assert coord.ca is not None
        token = await create_token(coord.store, coord.ca, "operator", 3600)
        operator = await asyncio.to_thread(enroll_with_token, coord.address, token)

        async def log_in(code: str) -> tuple[int, bytes, dict[str, str]]:
            return await call(
                coord.http_address,
                "/api/login",
                method="POST",
                body=json.dumps({"token": code}).encode(),
                headers={"Content-Type": "application/json"},
            )

        code = make_login_code(operator)
        status, body, headers = await log_in(code)
        assert status == 200, body
        cookie = {"Cookie": headers["Set-Cookie"].split(";", 1)[0]}
        # Replays: as it was, with junk appended anywhere base64 ignores it, re-signed.
        replays = [code, code + "!", code + "====", code + "\x00", _resigned(code)]
        replays += [code + "~" * n for n in range(1, 40)]
        for replay in replays:
            status, body, headers = await log_in(replay)
            assert status in (400, 401), (replay[-8:], status, body)
            assert "Set-Cookie" not in headers
        # The operator's session is still good.
        status, _, _ = await call(coord.http_address, "/metrics", headers=cookie)
        assert status == 200
