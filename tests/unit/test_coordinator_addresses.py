"""Coordinator address lists (epochmesh.coordinators): parsing, pure."""

from __future__ import annotations

import pytest

from epochmesh.coordinators import AddressError, Health, Probe, parse_addresses

pytestmark = pytest.mark.timeout(10)


def test_one_or_several_addresses_in_order_without_duplicates() -> None:
    assert parse_addresses("127.0.0.1:7070") == ("127.0.0.1:7070",)
    assert parse_addresses(" a:1, b:2 ,a:1,") == ("a:1", "b:2")
    assert parse_addresses("[::1]:7070,b:2") == ("[::1]:7070", "b:2")


@pytest.mark.parametrize("text", ["", ",", "a", "a:", ":1", "a:0", "a:65536", "a:x", "a:1,b"])
def test_a_malformed_address_is_refused_by_name(text: str) -> None:
    with pytest.raises(AddressError):
        parse_addresses(text)


def test_probes_describe_themselves() -> None:
    assert Probe("a:1", Health.SERVING).describe() == "a:1 active"
    assert "standby" in Probe("a:1", Health.STANDBY).describe()
    assert "refused" in Probe("a:1", Health.UNREACHABLE, "UNAVAILABLE: refused").describe()
