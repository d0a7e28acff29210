"""The node's persisted identity: DATA_DIR/node.json and its certificate.

The coordinator assigns the node id (on enrollment with a join token, or on the first
registration of an --insecure agent); the agent keeps it so that a restarted agent, or one
whose lease lapsed, registers again as the same node.

With TLS (the default) DATA_DIR holds ``key.pem`` (made here, 0600, never sent anywhere),
``cert.pem`` (issued by the coordinator's CA: CN = node id) and ``ca.pem`` (the coordinator's
CA, checked against the join token's fingerprint). `ensure_identity` enrolls on the first
start (and renews a certificate that is due); `transport_identity` is what the coordinator
connection (and the PeerService) use. `CertificateRenewer` renews the certificate while the
agent runs, at two thirds of its lifetime (`epochmesh.identity.renewal_due_s`), asking with the
current one; the coordinator connection follows the renewed ``cert.pem`` by itself
(`epochmesh.identity.CallSigner`).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from epochmesh.fsutil import write_private
from epochmesh.identity import (
    CERT_FILE,
    ROLE_NODE,
    Identity,
    IdentityError,
    enroll_with_token,
    issued_and_expires_s,
    load_certificate,
    renew_identity,
    renewal_due_s,
)

log = logging.getLogger(__name__)

IDENTITY_FILE = "node.json"


def load_node_id(data_dir: Path) -> str:
    """The node id stored in DATA_DIR/node.json, or "" when there is none (or it is unreadable)."""
    path = data_dir / IDENTITY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable identity file %s: %s", path, exc)
        return ""
    node_id = data.get("node_id", "") if isinstance(data, dict) else ""
    if not isinstance(node_id, str):
        log.warning("ignoring identity file %s: node_id is not a string", path)
        return ""
    return node_id


def save_node_id(data_dir: Path, node_id: str) -> None:
    """Atomically write DATA_DIR/node.json (write to a temporary file, fsync, rename)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / IDENTITY_FILE
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump({"node_id": node_id}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def transport_identity(data_dir: Path, insecure: bool) -> Identity | None:
    """The identity to dial the coordinator with; None when ``insecure`` (the agent's
    ``--insecure``: plaintext). IdentityError when DATA_DIR holds none (the agent must enroll
    first)."""
    if insecure:
        return None
    if not Identity.exists(data_dir):
        raise IdentityError(
            f"no certificate in {data_dir}: start the agent once with --token TOKEN "
            "(epochmesh-coordinator token create --role node), or use --insecure"
        )
    return Identity.load(data_dir)


def _expired_message(data_dir: Path, expires_s: float) -> str:
    return (
        f"the certificate in {data_dir} expired at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(expires_s))} UTC and can no longer "
        f"be renewed: enroll this agent again (remove {CERT_FILE}, key.pem and ca.pem from "
        f"{data_dir} and start it with --token TOKEN from `epochmesh-coordinator token create "
        "--role node`)"
    )


def renew_now(data_dir: Path, coordinator: str, timeout: float = 10.0) -> Identity:
    """Renew the certificate in DATA_DIR with the coordinator (asked with the current one) and
    store the new one in its place (atomically; the key stays). grpc.RpcError when refused,
    IdentityError for an unusable answer or an expired certificate."""
    identity = Identity.load(data_dir)
    _, expires = issued_and_expires_s(load_certificate(identity.cert_pem))
    if time.time() >= expires:
        raise IdentityError(_expired_message(data_dir, expires))
    renewed = renew_identity(coordinator, identity, timeout=timeout)
    write_private(data_dir / CERT_FILE, renewed.cert_pem)
    _, until = issued_and_expires_s(load_certificate(renewed.cert_pem))
    log.info(
        "renewed the certificate of node %s: valid until %s UTC",
        renewed.principal.id,
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(until)),
    )
    return renewed


def renew_if_due(data_dir: Path, coordinator: str) -> Identity:
    """The identity in DATA_DIR, its certificate renewed first when that is due. A failed
    renewal of a certificate still valid is logged and the current one kept (the agent's
    `CertificateRenewer` tries again); an expired one is an IdentityError saying what to do."""
    identity = Identity.load(data_dir)
    _, expires = issued_and_expires_s(load_certificate(identity.cert_pem))
    if time.time() >= expires:
        raise IdentityError(_expired_message(data_dir, expires))
    if time.time() < renewal_due_s(identity.cert_pem):
        return identity
    try:
        return renew_now(data_dir, coordinator)
    except (grpc.RpcError, IdentityError, OSError, ssl.SSLError) as exc:
        log.warning("could not renew the certificate in %s yet: %s", data_dir, _describe(exc))
        return identity


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class CertificateRenewer:
    """A daemon thread that renews DATA_DIR's certificate when it is due (`renew_now`),
    retrying a failure every ``retry_s`` (less when the expiry is near) until it expires. With
    several coordinator addresses (an active one and standbys) a failed attempt moves to the
    next address."""

    def __init__(
        self, data_dir: Path, coordinator: str | Sequence[str], retry_s: float = 60.0
    ) -> None:
        self.data_dir = data_dir
        self.coordinators = (coordinator,) if isinstance(coordinator, str) else tuple(coordinator)
        self._next = 0
        self.retry_s = retry_s
        self.renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cert-renewer", daemon=True)

    @property
    def coordinator(self) -> str:
        """The address the next renewal asks."""
        return self.coordinators[self._next]

    def start(self) -> CertificateRenewer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                cert_pem = (self.data_dir / CERT_FILE).read_bytes()
                due = renewal_due_s(cert_pem)
                _, expires = issued_and_expires_s(load_certificate(cert_pem))
            except (OSError, IdentityError) as exc:
                log.warning("cannot read the certificate in %s: %s", self.data_dir, exc)
                self._stop.wait(self.retry_s)
                continue
            now = time.time()
            if now >= expires:
                log.error("%s", _expired_message(self.data_dir, expires))
                return
            if now < due:
                # Look again at least hourly: the file may have been replaced meanwhile.
                self._stop.wait(min(due - now, 3600.0))
                continue
            try:
                renew_now(self.data_dir, self.coordinator)
                self.renewals += 1
            except (grpc.RpcError, IdentityError, OSError, ssl.SSLError) as exc:
                self._next = (self._next + 1) % len(self.coordinators)
                retry = max(1.0, min(self.retry_s, (expires - now) / 4))
                log.warning(
                    "could not renew the certificate in %s (%s); retrying in %.0f s",
                    self.data_dir,
                    _describe(exc),
                    retry,
                )
                self._stop.wait(retry)


def ensure_identity(data_dir: Path, coordinator: str, token: str, name: str) -> Identity:
    """The agent's identity in DATA_DIR, enrolling with ``token`` when there is none yet and
    renewing a certificate that is due. Saves the certificate's node id as the node id."""
    if Identity.exists(data_dir):
        identity = renew_if_due(data_dir, coordinator)
        if token:
            log.info("DATA_DIR already holds a certificate: --token is not needed and ignored")
    else:
        if not token:
            raise IdentityError(
                f"no certificate in {data_dir}: start the agent with --token TOKEN "
                "(epochmesh-coordinator token create --role node), or use --insecure"
            )
        identity = enroll_with_token(coordinator, token, name=name)
        identity.save(data_dir)
        log.info("enrolled with %s as node %s", coordinator, identity.principal.id)
    principal = identity.principal
    if principal.role != ROLE_NODE:
        raise IdentityError(f"the certificate in {data_dir} is for a {principal.role}, not a node")
    if load_node_id(data_dir) != principal.id:
        save_node_id(data_dir, principal.id)
    return identity
