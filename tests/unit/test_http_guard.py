"""The HTTP port's admission rules without a server (coordinator/observability/http_guard.py):
client keys, the connection caps, the Host names served without a login, the origin check, and
the deadline reaper on a real socket pair."""

from __future__ import annotations

import socket

import pytest

from coordinator.observability.http_guard import (
    ConnectionGuard,
    Deadlines,
    HostNames,
    client_key,
    same_origin,
    split_host,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.2", "127.0.0.2"),
        ("::ffff:10.0.0.1", "10.0.0.1"),
        ("2001:db8:1:2:aaaa::7", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
    ],
)
def test_client_key(host: str, key: str) -> None:
    assert client_key(host) == key


def test_connection_caps_per_client_and_in_all() -> None:
    guard = ConnectionGuard(per_client=2, total=3)
    assert guard.admit("10.0.0.1") == "" and guard.admit("10.0.0.1") == ""
    assert "per client address" in guard.admit("10.0.0.1")
    assert guard.admit("2001:db8::1") == ""
    assert "too many connections (3 open)" in guard.admit("10.0.0.2")
    guard.release("10.0.0.1")
    assert guard.admit("10.0.0.2") == "" and guard.open == 3
    for host in ("10.0.0.1", "2001:db8::1", "10.0.0.2", "10.0.0.9"):  # one unknown
        guard.release(host)
    assert guard.open == 0


def test_host_names_served_without_a_login() -> None:
    loopback = HostNames("127.0.0.1", ("coord.example.org",))
    for ok in (
        None,
        "127.0.0.1:7080",
        "127.9.9.9",
        "[::1]:7080",
        "localhost",
        "LocalHost.:7080",
        "coord.example.org:7080",
    ):
        assert loopback.allows(ok), ok
    for bad in (
        "attacker.example",
        "attacker.example:7080",
        "localhost.attacker.example",
        "10.0.0.5:7080",
        "",
        "127.0.0.1:x",
        "[::1",
    ):
        assert not loopback.allows(bad), bad
    everywhere = HostNames("0.0.0.0")  # --insecure on every address: any address, no names
    assert everywhere.allows("192.0.2.7:7080") and not everywhere.allows("attacker.example")
    named = HostNames("coord.lan")
    assert named.allows("coord.lan:7080") and not named.allows("other.lan")
    assert split_host("[2001:db8::1]:80") == "2001:db8::1"


def test_same_origin() -> None:
    host = "127.0.0.1:7080"
    assert same_origin(None, None, host)  # not a browser
    assert same_origin("http://127.0.0.1:7080", None, host)
    assert same_origin(None, "http://127.0.0.1:7080/login", host)
    assert not same_origin("http://attacker.example", None, host)
    assert not same_origin("null", None, host)
    assert not same_origin(None, "http://attacker.example/x", host)
    assert not same_origin("http://127.0.0.1:7080", None, None)
    assert not same_origin("file:///x", None, host)
    # The Origin wins over the Referer.
    assert not same_origin("http://attacker.example", "http://127.0.0.1:7080/", host)


def test_deadlines_shut_down_late_connections_only() -> None:
    deadlines = Deadlines()
    late_server, late_client = socket.socketpair()
    on_time_server, on_time_client = socket.socketpair()
    try:
        deadlines.arm(late_server, 1.0)
        deadlines.arm(on_time_server, 1.0)
        assert deadlines.finish(on_time_server)  # its request arrived in time
        assert deadlines.reap(now=float("inf")) == 1
        assert late_server.recv(1) == b""  # shut down: a blocked read ends
        assert not deadlines.finish(late_server)  # ... and its handler learns why
        assert deadlines.reap(now=float("inf")) == 0
        on_time_client.sendall(b"x")
        assert on_time_server.recv(1) == b"x"
    finally:
        for sock in (late_server, late_client, on_time_server, on_time_client):
            sock.close()
