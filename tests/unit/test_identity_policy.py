"""The pure parts of identity policy: Enroll's token buckets (per address and in all, the clock
passed in), how a gRPC peer is keyed, when a certificate's renewal opens and falls due, the
bounds of certificate lifetimes and use limits, and atomic private writes."""

from __future__ import annotations

import datetime as dt
import stat
from pathlib import Path

import pytest

from coordinator.trust.tokens import (
    MAX_CERT_TTL_S,
    CertificateAuthority,
    EnrollLimits,
    EnrollRateLimiter,
    RateLimit,
    check_uses,
    issue_identity,
    parse_cert_ttl,
    peer_key,
)
from epochmesh import identity as idm
from epochmesh.fsutil import write_private

pytestmark = pytest.mark.timeout(30)


def test_per_peer_bucket_refills_and_refusals_take_nothing_from_the_total() -> None:
    limiter = EnrollRateLimiter(EnrollLimits(RateLimit(2, 60.0), RateLimit(3, 6.0)))
    assert limiter.admit("a", 0.0) == "" and limiter.admit("a", 0.0) == ""
    reason = limiter.admit("a", 0.0)
    assert "limit per address is at most 2 at once, then 60 per minute" in reason
    assert "retry in 1 s" in reason
    for _ in range(5):  # refused calls of "a" use nothing of the total
        assert limiter.admit("a", 0.5)
    assert limiter.admit("b", 0.5) == ""  # the third of the total
    reason = limiter.admit("c", 0.5)
    assert "for all callers together is at most 3 at once, then 6 per minute" in reason
    assert "retry in 10 s" in reason
    assert limiter.admit("a", 1.0)  # "a" refilled one call, but the total has none
    assert limiter.admit("c", 10.5) == ""  # ten seconds refill one call of the total


def test_peer_table_is_bounded() -> None:
    limiter = EnrollRateLimiter(EnrollLimits(RateLimit(1, 1.0), RateLimit(10**9, 1.0)))
    limiter.MAX_PEERS = 3
    for i in range(10):
        assert limiter.admit(f"p{i}", 0.0) == ""
    assert len(limiter._peers) == 3


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv6:[::1]:5555", "::/64"),
        ("ipv6:[2001:db8:1:2:aaaa::7]:443", "2001:db8:1:2::/64"),
        ("ipv6:[::ffff:127.0.0.1]:80", "127.0.0.1"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_peer_key(peer: str, key: str) -> None:
    assert peer_key(peer) == key


def test_renewal_window_and_due_time() -> None:
    ca = CertificateAuthority(*idm.create_ca())
    issued = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    ident = issue_identity(ca, "node", lifetime_s=900, issued_at=issued)
    cert = idm.load_certificate(ident.cert_pem)
    start = issued.timestamp()
    assert idm.issued_and_expires_s(cert) == (start, start + 900)
    assert idm.renewal_opens_s(cert) == start + 450
    assert idm.renewal_due_s(ident.cert_pem) == pytest.approx(start + 600)
    # Back-dated for clock skew, as before.
    assert cert.not_valid_before_utc == issued - dt.timedelta(seconds=idm.CLOCK_SKEW_S)


def test_lifetime_and_use_bounds() -> None:
    assert parse_cert_ttl("7d") == 7 * 86400
    assert parse_cert_ttl("90d") == MAX_CERT_TTL_S
    for bad in ("91d", "5m", "0", "x"):
        with pytest.raises(ValueError):
            parse_cert_ttl(bad)
    assert check_uses(1) == 1
    for bad in (0, -1, 100_001):
        with pytest.raises(ValueError, match="use limit"):
            check_uses(bad)


def test_write_private_is_atomic_and_private(tmp_path: Path) -> None:
    target = tmp_path / "new" / "key.pem"
    write_private(target, b"secret")
    write_private(target, b"secret 2")
    assert target.read_bytes() == b"secret 2"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert [p.name for p in target.parent.iterdir()] == ["key.pem"]  # no temporary left
