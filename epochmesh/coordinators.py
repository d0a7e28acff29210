"""Several coordinator addresses, one active: the address list and the health probe that finds it.

Coordinators sharing one database run as one active and any number of standbys. A standby
listens, answers grpc.health.v1 with NOT_SERVING and every other call with UNAVAILABLE (the
active one's address in the trailing metadata key `ACTIVE_METADATA_KEY`). Clients (the CLI and
the agent) take the addresses as ``HOST:PORT,HOST:PORT`` and ask each one's health: the one
that answers SERVING is the active coordinator. One address is used as it is, without a probe.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc is imported where a probe runs: parsing addresses stays light
    import grpc

ACTIVE_METADATA_KEY = "epochmesh-active"
PROBE_TIMEOUT_S = 3.0


class AddressError(ValueError):
    """A malformed coordinator address or address list (the message says which)."""


def check_address(address: str) -> str:
    """HOST:PORT (IPv6 as [::1]:PORT), stripped; AddressError otherwise."""
    address = address.strip()
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"bad coordinator address {address!r}")
    return address


def parse_addresses(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` as a tuple in the given order, duplicates dropped."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise AddressError("no coordinator address given")
    seen: dict[str, None] = {}
    for part in parts:
        if part:
            seen.setdefault(check_address(part), None)
    return tuple(seen)


class Health(enum.Enum):
    SERVING = "serving"
    STANDBY = "standby"  # answers, NOT_SERVING: a standby (or one starting or stopping)
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Probe:
    address: str
    health: Health
    detail: str = ""

    def describe(self) -> str:
        if self.health is Health.SERVING:
            return f"{self.address} active"
        if self.health is Health.STANDBY:
            return f"{self.address} standby (health NOT_SERVING)"
        return f"{self.address} unreachable ({self.detail})" if self.detail else self.address


def _verdict(address: str, status: int) -> Probe:
    from grpc_health.v1 import health_pb2

    if status == health_pb2.HealthCheckResponse.SERVING:
        return Probe(address, Health.SERVING)
    return Probe(address, Health.STANDBY)


def _failed(address: str, err: grpc.RpcError) -> Probe:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "error"
    first = (details or "").splitlines()[0] if details else ""
    return Probe(address, Health.UNREACHABLE, f"{name}: {first}" if first else name)


def probe_sync(address: str, channel: grpc.Channel, timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """Asks the overall health ("") of the coordinator behind ``channel`` (without waiting for a
    connection: an address nothing listens on answers at once)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as err:
        return _failed(address, err)
    return _verdict(address, reply.status)


def find_active_sync(
    addresses: Sequence[str],
    open_channel: Callable[[str], grpc.Channel],
    timeout: float = PROBE_TIMEOUT_S,
) -> tuple[str | None, list[Probe]]:
    """Probes every address at once; the first serving one in list order (None when none
    serves) and every address's probe."""

    def one(address: str) -> Probe:
        with open_channel(address) as channel:
            return probe_sync(address, channel, timeout)

    with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
        probes = list(pool.map(one, addresses))
    active = next((p.address for p in probes if p.health is Health.SERVING), None)
    return active, probes


async def probe_async(
    address: str, channel: grpc.aio.Channel, timeout: float = PROBE_TIMEOUT_S
) -> Probe:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as err:
        return _failed(address, err)
    return _verdict(address, reply.status)


async def find_active_async(
    addresses: Sequence[str],
    open_channel: Callable[[str], grpc.aio.Channel],
    timeout: float = PROBE_TIMEOUT_S,
) -> tuple[str | None, list[Probe]]:
    """`find_active_sync` for asyncio callers (the agent)."""

    async def one(address: str) -> Probe:
        channel = open_channel(address)
        try:
            return await probe_async(address, channel, timeout)
        finally:
            await channel.close(grace=None)

    # The first serving answer ends the search: a dead address must not hold it up.
    pending = {asyncio.ensure_future(one(a)) for a in addresses}
    probes: list[Probe] = []
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            probes.extend(task.result() for task in done)
            serving = [p for p in probes if p.health is Health.SERVING]
            if serving:
                order = {a: i for i, a in enumerate(addresses)}
                return min(serving, key=lambda p: order[p.address]).address, probes
    finally:
        for task in pending:
            task.cancel()
    return None, probes
