"""epochmesh.identity and coordinator.trust.tokens: CA, CSRs, certificates, tokens, call signatures."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from cryptography import x509

from coordinator.trust.tokens import ensure_ca, parse_ttl
from epochmesh import identity as idm

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return idm.create_ca(["coord.example.org", "10.0.0.7"])


def _issue(ca: tuple[bytes, bytes], principal: str, role: str) -> idm.Identity:
    key = idm.new_private_key()
    cert = idm.sign_csr(idm.create_csr(key), ca[0], ca[1], principal=principal, role=role)
    return idm.Identity(ca_pem=ca[0], cert_pem=cert, key_pem=key)


def test_ca_names_and_fingerprint(ca: tuple[bytes, bytes]) -> None:
    hosts = idm.certificate_hosts(ca[0])
    for name in (idm.COORDINATOR_NAME, "localhost", "127.0.0.1", "coord.example.org", "10.0.0.7"):
        assert name in hosts
    fp = idm.fingerprint(ca[0])
    assert len(fp) == 64 and fp == idm.fingerprint(ca[0])
    assert fp != idm.fingerprint(idm.create_ca()[0])


def test_issued_certificate_carries_principal_role_and_san(ca: tuple[bytes, bytes]) -> None:
    ident = _issue(ca, "n-0123456789", "node")
    assert ident.principal.id == "n-0123456789" and ident.principal.role == "node"
    cert = idm.load_certificate(ident.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["n-0123456789"]
    idm.verify_issued_by(ident.cert_pem, ca[0])
    with pytest.raises(idm.IdentityError, match="not issued"):
        idm.verify_issued_by(ident.cert_pem, idm.create_ca()[0])


def test_bad_inputs_are_identity_errors(ca: tuple[bytes, bytes]) -> None:
    key = idm.new_private_key()
    csr = idm.create_csr(key)
    with pytest.raises(idm.IdentityError, match="unknown role"):
        idm.sign_csr(csr, ca[0], ca[1], principal="u-0123456789", role="admin")
    with pytest.raises(idm.IdentityError, match="principal"):
        idm.sign_csr(csr, ca[0], ca[1], principal="Bad Name!", role="node")
    with pytest.raises(idm.IdentityError, match="signing request"):
        idm.check_csr(
            b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"
        )
    with pytest.raises(idm.IdentityError):
        idm.load_certificate(b"garbage")


def test_tokens_round_trip_and_reject_garbage(ca: tuple[bytes, bytes]) -> None:
    fp = idm.fingerprint(ca[0])
    token, token_hash = idm.new_token(fp)
    secret, got_fp = idm.parse_token(token)
    assert got_fp == fp and idm.hash_secret(secret) == token_hash
    assert secret not in token_hash
    for bad in ("", "emt1.x.y", token.replace("emt1", "emt2"), token + "0", token[:-1] + "g"):
        with pytest.raises(idm.IdentityError):
            idm.parse_token(bad)


def test_private_files_are_0600(tmp_path: Path, ca: tuple[bytes, bytes]) -> None:
    ident = _issue(ca, "u-0123456789", "submitter")
    ident.save(tmp_path / "creds")
    for name in (idm.KEY_FILE, idm.CERT_FILE, idm.CA_FILE):
        mode = stat.S_IMODE((tmp_path / "creds" / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    assert idm.Identity.load(tmp_path / "creds") == ident


def test_call_signatures(ca: tuple[bytes, bytes]) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    ident = _issue(ca, "n-0123456789", "node")
    cert = idm.load_certificate(ident.cert_pem)
    key = load_pem_private_key(ident.key_pem, None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    ts = str(int(time.time() * 1000))
    sig = key.sign(idm.auth_payload("Register", ts), ec.ECDSA(hashes.SHA256()))
    idm.verify_call_signature(cert, "Register", ts, sig)
    with pytest.raises(idm.IdentityError, match="does not verify"):
        idm.verify_call_signature(cert, "Heartbeat", ts, sig)
    old = str(int(time.time() * 1000) - 2 * idm.AUTH_MAX_SKEW_MS)
    old_sig = key.sign(idm.auth_payload("Register", old), ec.ECDSA(hashes.SHA256()))
    with pytest.raises(idm.IdentityError, match="timestamp"):
        idm.verify_call_signature(cert, "Register", old, old_sig)


def test_ensure_ca_is_created_once(tmp_path: Path) -> None:
    first = ensure_ca(tmp_path, ("a.example",))
    again = ensure_ca(tmp_path)
    assert first == again
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    assert "a.example" in idm.certificate_hosts(first.cert_pem)


def test_parse_ttl() -> None:
    assert parse_ttl("24h") == 86400
    assert parse_ttl("30m") == 1800
    assert parse_ttl("90") == 90
    assert parse_ttl("7d") == 7 * 86400
    for bad in ("", "0", "-1h", "1y", "400d"):
        with pytest.raises(ValueError):
            parse_ttl(bad)
