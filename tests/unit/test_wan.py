"""The WAN emulator's pure parts: unit parsing, link specs, and the timing model (no sockets)."""

from __future__ import annotations

import math
import random

import pytest

from epochmesh.testing.wan import (
    MSS_BYTES,
    FlowShaper,
    LinkSpec,
    Site,
    WanLink,
    Wire,
    format_bandwidth,
    mathis_rate_bps,
    parse_bandwidth,
    parse_duration_ms,
    parse_link_spec,
    parse_loss,
    split_hostport,
)

pytestmark = pytest.mark.timeout(10)


# -- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100mbit", 100e6),
        ("100Mbit", 100e6),
        ("1.5gbit", 1.5e9),
        ("500kbit", 500e3),
        ("20mbps", 20e6),
        ("100mbit/s", 100e6),
        ("64000", 64e3),
        ("2e6", 2e6),
        ("10 mbit", 10e6),
    ],
)
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["0", "inf", "unlimited", "none", "0mbit"])
def test_parse_bandwidth_unlimited(text: str) -> None:
    assert parse_bandwidth(text) is None


@pytest.mark.parametrize("text", ["", "fast", "100m", "-1mbit", "100mbyte", "1xbit"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    ("text", "ms"),
    [("50ms", 50.0), ("0.2s", 200.0), ("500us", 0.5), ("50", 50.0), ("1.5 s", 1500.0)],
)
def test_parse_duration(text: str, ms: float) -> None:
    assert parse_duration_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", ["", "fast", "-5ms", "5 hours"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration_ms(text)


def test_parse_loss() -> None:
    assert parse_loss("0.01") == pytest.approx(0.01)
    assert parse_loss("1%") == pytest.approx(0.01)
    assert parse_loss("0") == 0.0
    for bad in ("1", "1.5", "-0.1", "abc", "%"):
        with pytest.raises(ValueError, match="loss"):
            parse_loss(bad)


def test_format_bandwidth_round_trips() -> None:
    for bps in (100e6, 1.5e9, 500e3, 300.0):
        assert parse_bandwidth(format_bandwidth(bps)) == pytest.approx(bps)
    assert format_bandwidth(None) == "unlimited"


def test_split_hostport() -> None:
    assert split_hostport("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert split_hostport("[::1]:0") == ("::1", 0)
    for bad in ("7070", "host:", ":80", "host:port"):
        with pytest.raises(ValueError, match="address"):
            split_hostport(bad)


def test_parse_link_spec() -> None:
    spec = parse_link_spec("agent1=127.0.0.1:0,127.0.0.1:7070,100mbit,50ms")
    assert spec == LinkSpec("agent1", "127.0.0.1:0", "127.0.0.1:7070", 100e6, 50.0)
    spec = parse_link_spec(
        "a-2=127.0.0.1:7071,127.0.0.1:7070,10mbit,0.2s,loss=1%,jitter=5ms,"
        "return_bandwidth=2mbit,queue=100ms"
    )
    assert (spec.name, spec.rtt_ms, spec.loss, spec.jitter_ms) == ("a-2", 200.0, 0.01, 5.0)
    assert spec.return_bandwidth_bps == 2e6
    assert spec.queue_ms == 100.0
    link = spec.build(seed=1)
    assert isinstance(link, WanLink)
    assert link.name == "a-2"
    assert [w.bandwidth_bps for w in link.to_target] == [10e6]
    assert [w.bandwidth_bps for w in link.to_client] == [2e6]


@pytest.mark.parametrize(
    "text",
    [
        "no-equals",
        "=127.0.0.1:0,127.0.0.1:1,1mbit,1ms",
        "a b=127.0.0.1:0,127.0.0.1:1,1mbit,1ms",
        "a=127.0.0.1:0,127.0.0.1:1,1mbit",
        "a=127.0.0.1:0,nohost,1mbit,1ms",
        "a=127.0.0.1:0,127.0.0.1:1,fast,1ms",
        "a=127.0.0.1:0,127.0.0.1:1,1mbit,1ms,color=red",
        "a=127.0.0.1:0,127.0.0.1:1,1mbit,1ms,loss=2",
    ],
)
def test_parse_link_spec_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_link_spec(text)


# -- the model --------------------------------------------------------------------------------


def test_wire_serializes_chunks_back_to_back() -> None:
    w = Wire(1e6)  # 1250 bytes take 10 ms
    assert w.reserve(0.0, 1250, now=0.0) == pytest.approx(0.010)
    assert w.reserve(0.0, 1250, now=0.0) == pytest.approx(0.020)
    assert w.backlog_s(0.005) == pytest.approx(0.015)
    # after an idle gap the wire is free again
    assert w.reserve(1.0, 1250, now=1.0) == pytest.approx(1.010)
    assert w.backlog_s(2.0) == 0.0
    assert w.bytes == 3750


def test_wire_fills_earlier_gaps() -> None:
    w = Wire(1e6)
    assert w.reserve(0.100, 1250, now=0.0) == pytest.approx(0.110)  # reserved for later
    assert w.reserve(0.0, 1250, now=0.0) == pytest.approx(0.010)  # fits in the gap before
    assert w.reserve(0.095, 1250, now=0.0) == pytest.approx(0.120)  # no room: after the block
    assert w.reserve(0.050, 1250, now=0.0) == pytest.approx(0.060)


def test_unlimited_wire_adds_only_delay() -> None:
    w = Wire(None, 0.025)
    f = FlowShaper([w], 0.05, rng=random.Random(0))
    assert f.schedule(1.0, 10 << 20) == (pytest.approx(1.025), False)


def test_flow_delivery_is_serialization_plus_one_way_delay() -> None:
    w = Wire(8e6, 0.025)  # 1 MB/s: 10 kB take 10 ms
    f = FlowShaper([w], 0.05, rng=random.Random(0))
    t1, lost1 = f.schedule(0.0, 10_000)
    t2, lost2 = f.schedule(0.0, 10_000)
    assert (t1, t2) == (pytest.approx(0.035), pytest.approx(0.045))
    assert not lost1 and not lost2
    assert f.schedule_eof(0.0) == pytest.approx(0.045)  # FIN right after the data


def test_flows_share_a_wire() -> None:
    w = Wire(8e6, 0.0)
    rng = random.Random(0)
    a, b = FlowShaper([w], 0.0, rng=rng), FlowShaper([w], 0.0, rng=rng)
    ends = [f.schedule(0.0, 10_000)[0] for f in (a, b, a, b)]
    assert ends == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_two_wires_in_series() -> None:
    up, down = Wire(8e6, 0.010), Wire(4e6, 0.015)
    f = FlowShaper([up, down], 0.05, rng=random.Random(0))
    # up: 10 ms serialization + 10 ms; down: 20 ms serialization + 15 ms
    assert f.schedule(0.0, 10_000)[0] == pytest.approx(0.055)
    # the second chunk leaves `up` at 20 ms, reaches `down` at 30 ms, waits until it is free
    # at 40 ms, and arrives 20 + 15 ms later
    assert f.schedule(0.0, 10_000)[0] == pytest.approx(0.075)


def test_jitter_never_reorders() -> None:
    w = Wire(None, 0.010, jitter_s=0.050)
    f = FlowShaper([w], 0.02, rng=random.Random(3))
    times = [f.schedule(i * 0.001, 100)[0] for i in range(500)]
    assert times == sorted(times)
    extra = [t - i * 0.001 - 0.010 for i, t in enumerate(times)]
    assert min(extra) >= 0.0
    assert max(extra) <= 0.050 + 0.001 * 500


def test_loss_delays_by_rto_and_keeps_order() -> None:
    w = Wire(None, 0.025, loss=0.2)
    f = FlowShaper([w], 0.05, rng=random.Random(7), loss_caps_rate=False)
    assert f.rto_s == pytest.approx(0.2)  # max(200 ms, 2 * rtt)
    results = [f.schedule(i * 0.01, 1000) for i in range(400)]
    times = [t for t, _ in results]
    assert times == sorted(times)
    hit = [i for i, (_, lost) in enumerate(results) if lost]
    assert f.loss_events == len(hit)
    assert 40 < len(hit) < 120  # ~80 expected
    for i in hit:
        assert times[i] >= i * 0.01 + 0.025 + 0.2 - 1e-9


def test_loss_probability_grows_with_segments() -> None:
    w = Wire(None, 0.0, loss=0.01)
    f = FlowShaper([w], 0.05, rng=random.Random(11), loss_caps_rate=False)
    n = 2000
    small = sum(f.schedule(0.0, 100)[1] for _ in range(n)) / n
    big = sum(f.schedule(0.0, 64 * MSS_BYTES)[1] for _ in range(n)) / n
    assert small < 0.03
    assert big == pytest.approx(1 - 0.99**64, abs=0.06)


def test_rto_scales_with_long_rtt() -> None:
    f = FlowShaper([Wire(None, 0.15, loss=0.01)], 0.3, rng=random.Random(0))
    assert f.rto_s == pytest.approx(0.6)


def test_mathis_cap_limits_a_lossy_flow() -> None:
    rate = mathis_rate_bps(0.05, 0.01)
    assert rate == pytest.approx(MSS_BYTES * 8 * math.sqrt(1.5) / (0.05 * 0.1))
    assert 2.5e6 < rate < 3.0e6
    assert mathis_rate_bps(0.05, 0.0) is None
    w = Wire(100e6, 0.025, loss=0.01)
    f = FlowShaper([w], 0.05, rng=random.Random(0), rto_s=0.0)
    nbytes = 1_000_000
    end = max(f.schedule(0.0, 10_000)[0] for _ in range(nbytes // 10_000))
    assert nbytes * 8 / end == pytest.approx(rate, rel=0.05)


def test_path_loss_combines_wires() -> None:
    f = FlowShaper([Wire(None, loss=0.1), Wire(None, loss=0.2)], 0.05, rng=random.Random(0))
    assert f.path_loss == pytest.approx(1 - 0.9 * 0.8)


def test_handshake_floor_holds_early_bytes() -> None:
    f = FlowShaper([Wire(None, 0.025)], 0.05, rng=random.Random(0), not_before=0.075)
    assert f.schedule(0.0, 10)[0] == pytest.approx(0.075)
    assert f.schedule(0.1, 10)[0] == pytest.approx(0.125)


def test_sites_compose_paths() -> None:
    a = Site("a", 100e6, 50, down_bandwidth_bps=200e6)
    b = Site("b", 10e6, 30)
    link = WanLink.between("127.0.0.1:0", "127.0.0.1:1", client=a, server=b, name="a-b")
    assert link.to_target == [a.up, b.down]
    assert link.to_client == [b.up, a.down]
    assert link.rtt_s == pytest.approx(0.080)
    assert a.down.bandwidth_bps == 200e6 and a.up.delay_s == pytest.approx(0.025)
    to_coord = WanLink.between("127.0.0.1:0", "127.0.0.1:1", client=a)
    assert to_coord.to_target == [a.up] and to_coord.rtt_s == pytest.approx(0.050)


def test_wanlink_validates() -> None:
    with pytest.raises(ValueError, match="target"):
        WanLink(target="")
    with pytest.raises(ValueError, match="bandwidth"):
        WanLink(target="127.0.0.1:1", bandwidth_bps=-5)
    with pytest.raises(ValueError, match="loss"):
        WanLink(target="127.0.0.1:1", loss=1.0)
    with pytest.raises(RuntimeError, match="not started"):
        _ = WanLink(target="127.0.0.1:1").address
