"""The coordinator's CA on disk, with real coordinator processes: a fresh data dir (0700) gets
a CA and a server certificate of its own key; a data dir missing one of the two CA files is
refused (non-zero exit, a message naming the file, no new trust root) by the coordinator and
by `token create`; a data dir of an older version (the CA alone, which was also the server
certificate) gets a server certificate and its enrolled parties keep working."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import grpc
import pytest

from coordinator.trust.tokens import CertificateAuthority, issue_identity
from epochmesh import identity as idm
from epochmesh.fsutil import write_private
from epochmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.procs import console_script, start_coordinator

pytestmark = pytest.mark.timeout(90)


def run_coordinator(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The coordinator (or a subcommand) run to its exit (it must refuse to start)."""
    return subprocess.run(
        [str(console_script("epochmesh-coordinator")), *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def cluster_stats(address: str, ident: idm.Identity) -> int:
    """The number of nodes the coordinator knows, asked as ``ident``."""
    with idm.secure_sync_channel(address, ident) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        reply = stub.ClusterStats(scheduler_pb2.ClusterStatsRequest(), timeout=10)
        return sum(reply.nodes_by_state.values())


def test_a_fresh_data_dir_and_a_lost_ca_file(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    data.mkdir(mode=0o700)
    with start_coordinator(data) as coord:
        ca_pem = (data / "ca.pem").read_bytes()
        for name in ("ca.key", "server.key"):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600
        server_pem = (data / "server.pem").read_bytes()
        assert (data / "server.key").read_bytes() != (data / "ca.key").read_bytes()
        idm.verify_issued_by(server_pem, ca_pem)
        # The handshake presents the server certificate and the CA behind it; the token's
        # fingerprint picks the CA, and enrollment works as before.
        chain = idm.fetch_server_chain(coord.address)
        assert [idm.fingerprint(c) for c in chain] == [
            idm.fingerprint(server_pem),
            idm.fingerprint(ca_pem),
        ]
        operator = idm.enroll_with_token(coord.address, coord.create_token("operator"))
        assert operator.ca_pem == ca_pem
        assert cluster_stats(coord.address, operator) == 0

    for lost, kept in (("ca.key", "ca.pem"), ("ca.pem", "ca.key")):
        moved = data / f"{lost}.bak"
        (data / lost).rename(moved)
        kept_bytes = (data / kept).read_bytes()
        for args in ((), ("token", "create", "--role", "node")):
            result = run_coordinator(data, *args)
            assert result.returncode != 0, result.stderr
            assert f"{kept} is there but {lost} is missing" in result.stderr, result.stderr
            assert "Restore" in result.stderr and "Traceback" not in result.stderr
            assert not (data / lost).exists() and (data / kept).read_bytes() == kept_bytes
        moved.rename(data / lost)
    # A lost server key costs nothing: a new one, and the enrolled operator carries on.
    (data / "server.key").unlink()
    with start_coordinator(data) as coord:
        assert (data / "server.pem").read_bytes() != server_pem
        assert cluster_stats(coord.address, operator) == 0


def test_a_new_data_dir_is_private(tmp_path: Path) -> None:
    data = tmp_path / "deep" / "coord"
    result = run_coordinator(data, "token", "create", "--role", "node")
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert {"ca.pem", "ca.key"} <= {p.name for p in data.iterdir()}


def test_an_older_data_dir_with_the_ca_alone_keeps_working(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    data.mkdir(mode=0o700)
    # What an older coordinator made: the CA, served as the server certificate itself, and
    # a node enrolled with a 365-day certificate.
    ca_pem, ca_key = idm.create_ca()
    write_private(data / "ca.key", ca_key)
    write_private(data / "ca.pem", ca_pem, mode=0o644)
    old_operator = issue_identity(
        CertificateAuthority(ca_pem, ca_key), "operator", lifetime_s=365 * 86400
    )
    with start_coordinator(data, "--advertise", "coord.example.org") as coord:
        assert (data / "ca.pem").read_bytes() == ca_pem  # the same trust root
        server_pem = (data / "server.pem").read_bytes()
        idm.verify_issued_by(server_pem, ca_pem)
        assert "coord.example.org" in idm.certificate_hosts(server_pem)
        assert cluster_stats(coord.address, old_operator) == 0
        # A certificate of another CA is still refused.
        other_ca = CertificateAuthority(*idm.create_ca())
        stranger = issue_identity(other_ca, "operator")
        stranger = idm.Identity(ca_pem, stranger.cert_pem, stranger.key_pem)
        with pytest.raises(grpc.RpcError) as err:
            cluster_stats(coord.address, stranger)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
