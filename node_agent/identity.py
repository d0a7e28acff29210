"""The node's persisted identity: DATA_DIR/node.json and its certificate.

The coordinator assigns the node id (on enrollment with a join token, or on the first
registration of an --insecure agent); the agent keeps it so that a restarted agent, or one
whose lease lapsed, registers again as the same node.

With TLS (the default) DATA_DIR holds ``key.pem`` (made here, 0600, never sent anywhere),
``cert.pem`` (issued by the coordinator's CA: CN = node id) and ``ca.pem`` (the coordinator's
CA, checked against the join token's fingerprint). `ensure_identity` enrolls on the first
start; `transport_identity` is what the coordinator connection (and the PeerService) use.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from epochmesh.identity import ROLE_NODE, Identity, IdentityError, enroll_with_token

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


_insecure = False


def set_insecure(insecure: bool) -> None:
    """Process-wide: talk plaintext to the coordinator (``--insecure``)."""
    global _insecure
    _insecure = insecure


def transport_identity(data_dir: Path) -> Identity | None:
    """The identity to dial the coordinator with; None in --insecure mode. IdentityError when
    DATA_DIR holds none (the agent must enroll first)."""
    if _insecure:
        return None
    if not Identity.exists(data_dir):
        raise IdentityError(
            f"no certificate in {data_dir}: start the agent once with --token TOKEN "
            "(epochmesh-coordinator token create --role node), or use --insecure"
        )
    return Identity.load(data_dir)


def ensure_identity(data_dir: Path, coordinator: str, token: str, name: str) -> Identity:
    """The agent's identity in DATA_DIR, enrolling with ``token`` when there is none yet.
    Saves the certificate's node id as the node id."""
    if Identity.exists(data_dir):
        identity = Identity.load(data_dir)
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
