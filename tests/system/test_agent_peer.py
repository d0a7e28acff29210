"""The agent's PeerService as a real `epochmesh-agent` process against a real coordinator:
--peer-listen registers the advertised address (ListNodes shows it, with the bound port), the
service answers Ping and TransferState over mutual TLS to a node certificate of the same CA,
refuses callers without one (no certificate, another CA, a submitter certificate) and a
dialer expecting another node id; --no-peer registers an empty address; --insecure serves
plaintext."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import grpc
import pytest

from epochmesh import identity as idm
from epochmesh.grpc_util import CHANNEL_OPTIONS
from node_agent.ring.client import fetch_state, peer_channel, ping
from tests.fixtures import write_mlp_job
from tests.procs import identity_for, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, coordinator_args, list_nodes
from tests.system.test_training import applied_parts, indices, load_rounds, submit, wait_succeeded

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(90)


def _peer_address(coord: str, node_id: str) -> str:
    def find() -> str:
        for n in list_nodes(coord):
            if n.node_id == node_id and n.peer_address:
                return n.peer_address
        return ""

    return str(wait_until(find, timeout=30, interval=0.1, message="no peer address registered"))


def _other_ca_node_identity(node_id: str) -> idm.Identity:
    ca_cert, ca_key = idm.create_ca()
    key = idm.new_private_key()
    cert = idm.sign_csr(idm.create_csr(key), ca_cert, ca_key, principal=node_id, role="node")
    return idm.Identity(ca_pem=ca_cert, cert_pem=cert, key_pem=key)


async def _status_of(aw: object) -> grpc.StatusCode | None:
    try:
        await aw  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


async def _check_tls_peer(address: str, node_id: str, coord: str, data_dir: Path) -> None:
    member = identity_for(coord, "node")
    submitter = identity_for(coord, "submitter")
    assert member is not None and submitter is not None
    assert member.principal.id != node_id  # a second node of the same CA

    # A node certificate of the same CA, dialing the node the coordinator names: served.
    async with peer_channel(address, node_id, member) as ch:
        rtt = await ping(ch, timeout=5.0, payload=b"hello")
        log.info(f"Ping over mutual TLS: {rtt * 1e3:.2f} ms")
        assert rtt < 5.0
        # ... but state only to a node the coordinator sent here (the agent asks it).
        status = await _status_of(fetch_state(ch, "no-such-job", node_id=member.principal.id))
        assert status == grpc.StatusCode.PERMISSION_DENIED
        status = await _status_of(fetch_state(ch, "job-x", node_id=node_id))
        assert status == grpc.StatusCode.PERMISSION_DENIED  # asking as another node

    # The dialer checks the peer's certificate: the agent is not node "n-someoneelse".
    async with peer_channel(address, "n-someoneelse", member) as ch:
        assert await _status_of(ping(ch, timeout=3.0)) == grpc.StatusCode.UNAVAILABLE

    # No client certificate at all: the TLS handshake fails.
    ca_pem = (data_dir / "ca.pem").read_bytes()
    async with grpc.aio.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=ca_pem),
        options=idm.peer_channel_options(node_id),
    ) as ch:
        assert await _status_of(ping(ch, timeout=3.0)) == grpc.StatusCode.UNAVAILABLE

    # A node certificate from another CA (same node id even): refused.
    async with peer_channel(address, node_id, _other_ca_node_identity(member.principal.id)) as ch:
        assert await _status_of(ping(ch, timeout=3.0)) == grpc.StatusCode.UNAVAILABLE

    # Plaintext to a TLS peer: refused.
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        assert await _status_of(ping(ch, timeout=3.0)) == grpc.StatusCode.UNAVAILABLE

    # A submitter certificate of the same CA gets no state.
    async with peer_channel(address, node_id, submitter) as ch:
        status = await _status_of(fetch_state(ch, "no-such-job"))
        assert status == grpc.StatusCode.PERMISSION_DENIED


def test_insecure_agent_serves_plaintext_and_advertises_the_bound_port(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord", "--insecure", *coordinator_args(0.3, 3.0)) as coord:
        with AgentProc(
            coord.address,
            tmp_path / "a",
            "--insecure",
            "--peer-listen",
            "0.0.0.0:0",
            "--peer-advertise",
            "localhost",
            benchmark="off",
        ) as agent:
            node_id = agent.wait_node_id()
            address = _peer_address(coord.address, node_id)
            host, _, port = address.rpartition(":")
            assert host == "localhost" and int(port) > 0, address

            async def check() -> None:
                async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}", options=CHANNEL_OPTIONS
                ) as ch:
                    await ping(ch, timeout=5.0, payload=b"x")
                    status = await _status_of(fetch_state(ch, "no-such-job"))
                    assert status == grpc.StatusCode.NOT_FOUND

            asyncio.run(check())

            # The port is taken: a second agent on it says so and exits with a usage error.
            with AgentProc(
                coord.address,
                tmp_path / "b",
                "--insecure",
                "--peer-listen",
                f"127.0.0.1:{port}",
                benchmark="off",
            ) as clash:
                assert clash.proc.wait(timeout=60) == 2, clash
                assert f"cannot start the PeerService on --peer-listen 127.0.0.1:{port}" in (
                    clash.log_text()
                )
            assert agent.running()


# -- TLS, --no-peer, and an end-to-end ring job -------------------------------------------------

SMOKE_SAMPLES = 192
SMOKE_BATCH = 24
_ROUND_LINE = re.compile(r"round (\d+) attempt (\d+): (\w+) of (\d+) samples .* ring ([\d.]+)s")


@pytest.mark.timeout(150)
def test_peer_service_tls_no_peer_and_a_ring_job(tmp_path: Path) -> None:
    """Two members (--peer-listen) and one --no-peer node: the PeerService's trust rules, the
    registered addresses, then a ring job end to end (members all-reduce, the external node
    pushes to the coordinator and fetches each round's state from a member)."""
    with start_coordinator(tmp_path / "coord", *coordinator_args(0.3, 3.0)) as coord:
        agents = [
            AgentProc(
                coord.address, tmp_path / "m0", "--name", "m0", "--peer-listen", "127.0.0.1:0"
            ),
            AgentProc(coord.address, tmp_path / "m1", "--name", "m1"),  # the default listen
            AgentProc(coord.address, tmp_path / "ext", "--name", "ext", "--no-peer"),
        ]
        try:
            node_id = agents[0].wait_node_id()
            address = _peer_address(coord.address, node_id)
            host, _, port = address.rpartition(":")
            assert host == "127.0.0.1" and int(port) > 0, address
            assert f"advertised as {address}" in agents[0].log_text()
            asyncio.run(_check_tls_peer(address, node_id, coord.address, tmp_path / "m0"))

            wait_until(
                lambda: (
                    len([n for n in list_nodes(coord.address) if n.benchmark.samples_per_second])
                    == 3
                ),
                timeout=60,
                message="agents did not register and benchmark",
            )
            by_name = {n.name: n for n in list_nodes(coord.address)}
            assert by_name["m1"].peer_address.startswith("127.0.0.1:")
            assert by_name["ext"].peer_address == ""
            assert "--no-peer: no PeerService" in agents[2].log_text()

            _ring_job(coord.address, agents, tmp_path / "job")

            # The PeerService stops with the agent.
            assert agents[0].terminate() == 0

            async def gone() -> grpc.StatusCode | None:
                member = identity_for(coord.address, "node")
                async with peer_channel(address, node_id, member) as ch:
                    return await _status_of(ping(ch, timeout=2.0))

            assert asyncio.run(gone()) == grpc.StatusCode.UNAVAILABLE
        finally:
            for a in agents:
                a.kill9()


def _ring_job(coord: str, agents: list[AgentProc], directory: Path) -> None:
    toml = write_mlp_job(
        directory,
        SMOKE_SAMPLES,
        overrides={
            "name": "ring-smoke",
            "train": {"epochs": 1, "global_batch": SMOKE_BATCH, "seed": 1},
            "cluster": {
                "aggregation": "ring",
                "min_nodes": 3,
                "max_nodes": 3,
                "checkpoint_every": 3,
            },
        },
    )
    t0 = time.monotonic()
    job_id = submit(coord, toml)
    wait_succeeded(coord, job_id, timeout=100)
    log.info(f"ring smoke job done in {time.monotonic() - t0:.1f}s")
    records = load_rounds(coord, job_id)
    # A ring attempt that failed (a member's heartbeat late under load) is recorded with no
    # applied part and retried; one whose part was left out (a node cut off under load) applies
    # the others' parts and its samples come back in a later round: count the applied rounds
    # and require every sample exactly once, no round above the global batch.
    rounds = [r for r in records if applied_parts(r)]
    shape = [
        (r["round"], [(p["node_id"], len(indices(p))) for p in applied_parts(r)]) for r in rounds
    ]
    assert len(rounds) >= SMOKE_SAMPLES // SMOKE_BATCH, shape
    assert all(sum(n for _, n in parts) <= SMOKE_BATCH for _, parts in shape), shape
    covered = sorted(i for r in rounds for p in applied_parts(r) for i in indices(p))
    assert covered == list(range(SMOKE_SAMPLES)), shape  # exactly once
    ext_id = agents[2].node_id()
    with_ext = [r for r in rounds if ext_id in {p["node_id"] for p in applied_parts(r)}]
    assert len(with_ext) >= SMOKE_SAMPLES // SMOKE_BATCH - 1, shape

    members = agents[:2]
    recorded = {r["round"] for r in records}
    for a in members:
        lines = [m.groups() for m in _ROUND_LINE.finditer(a.log_text())]
        logged = {int(g[0]) for g in lines}
        # Every round its part was applied in (a member cut off under load, its round retried
        # without it, logs no ring line for that round).
        node_id = a.node_id()
        took_part = {
            r["round"] for r in rounds if node_id in {p["node_id"] for p in applied_parts(r)}
        }
        assert took_part and took_part <= logged <= recorded, (a.data_dir.name, took_part, logged)
        assert all(g[2] == "gradient" for g in lines)
    # The --no-peer node got each later round's state from a member (it dials out).
    served = sum(a.log_text().count(f"to node {ext_id}") for a in members)
    assert served >= len(with_ext) - 1
