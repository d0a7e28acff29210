"""A renewed node certificate (node_agent/core/identity.py writes it to DATA_DIR/cert.pem) is served
by the running PeerServer at once, on its gRPC port and on its bulk socket, read off real TLS
handshakes; a ring between renewed and not yet renewed nodes still sums right.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import pytest

from coordinator.trust.tokens import ensure_ca, issue_identity
from epochmesh import identity as idm
from epochmesh.fsutil import write_private
from node_agent.ring.service import PeerServer
from node_agent.ring.transport import RingTransport
from tests.integration.test_ring_allreduce import Peers, _allreduce_all, _data, _expected
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(60)


def _served_certificate(port: int, client: ssl.SSLContext, node_id: str) -> bytes:
    """The leaf certificate (DER) a peer socket presents in a mutual TLS handshake with
    `client`, checked to name `node_id` (blocking: run it off the event loop)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with client.wrap_socket(sock, server_hostname=node_id) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der
    return der


def _client_context(identity: idm.Identity, directory: Path, alpn: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=identity.ca_pem.decode())
    ctx.load_cert_chain(str(directory / idm.CERT_FILE), str(directory / idm.KEY_FILE))
    if alpn:
        ctx.set_alpn_protocols(["h2"])  # gRPC's TLS speaks HTTP/2 only
    return ctx


def _der(cert_pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert_pem.decode())


async def test_a_renewed_certificate_is_served_on_the_grpc_port_and_the_bulk_socket(
    tmp_path: Path,
) -> None:
    ca = ensure_ca(tmp_path / "ca")
    ids = [issue_identity(ca, "node", f"node-{i}") for i in range(3)]
    for i, ident in enumerate(ids):  # as an agent's DATA_DIR: followed there
        ident.save(tmp_path / f"node-{i}")
    loaded = [idm.Identity.load(tmp_path / f"node-{i}") for i in range(3)]
    servers = [PeerServer("127.0.0.1:0", identity=loaded[i]) for i in range(3)]
    for s in servers:
        await s.start()
    names = [f"node-{i}" for i in range(3)]
    transports = [
        RingTransport.for_server(names[i], servers[i], identity=loaded[i]) for i in range(3)
    ]
    peers = Peers(servers, transports, names)
    try:
        node0 = servers[0]
        assert node0.bulk is not None
        old = _der(ids[0].cert_pem)
        grpc_client = _client_context(ids[1], tmp_path / "node-1", alpn=True)
        bulk_client = _client_context(ids[1], tmp_path / "node-1", alpn=False)

        async def served() -> tuple[bytes, bytes]:
            assert node0.bulk is not None
            grpc_cert = await asyncio.to_thread(
                _served_certificate, node0.port, grpc_client, "node-0"
            )
            bulk_cert = await asyncio.to_thread(
                _served_certificate, node0.bulk.port, bulk_client, "node-0"
            )
            return grpc_cert, bulk_cert

        assert await served() == (old, old)
        inputs = [_data(r, 50_001) for r in range(3)]
        bufs = [x.clone() for x in inputs]
        await _allreduce_all(peers, bufs, round_=1)
        assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)

        # The renewal (node_agent.core.identity.renew_now): same key, a new certificate in cert.pem.
        renewed = idm.sign_csr(
            idm.create_csr(ids[0].key_pem),
            ca.cert_pem,
            ca.key_pem,
            principal="node-0",
            role="node",
            lifetime_s=7200,
        )
        assert _der(renewed) != old
        write_private(tmp_path / "node-0" / idm.CERT_FILE, renewed)

        async def renewed_served() -> bool:
            return await served() == (_der(renewed), _der(renewed))

        await async_wait_until(
            renewed_served, timeout=15, interval=0.2, message="the old certificate is served"
        )
        # node-0's own side of the ring (its PeerService channels and bulk connections as a
        # sender) uses the renewed certificate too, and the ring sums as before.
        bufs = [x.clone() for x in inputs]
        await _allreduce_all(peers, bufs, round_=2)
        assert all(b.numpy().tobytes() == _expected(inputs) for b in bufs)
        assert transports[0]._identity is not None
        assert transports[0]._identity.cert_pem == renewed
        assert transports[0].bulk_streams == 2  # every attempt over the bulk socket
    finally:
        for t in transports:
            await t.close()
        for s in servers:
            await s.stop(None)
