"""The CA that every coordinator on one PostgreSQL database shares, kept in the database.

Token secrets carry a MAC keyed by the CA key and certificates are checked against the CA
certificate, so one CA is one identity: an agent or user enrolled through any coordinator on
the database is trusted by all, and each coordinator's TLS server certificate is issued by it
(in its own data dir, `ensure_server_certificate`). Join tokens, revocations and node donors
already live in the database.

`ensure_shared_ca` loads the ``trust_root`` row; when there is none yet it stores the data
dir's CA (a coordinator moving from a single data dir keeps its agents) or a new one, with
``INSERT ... ON CONFLICT DO NOTHING`` so that coordinators starting together agree on the
first one stored. The row's CA is then written into the data dir (``ca.pem``, ``ca.key``), for
the tools that read it there; a data dir holding another CA is refused (TrustRootError) rather
than silently disowning what it enrolled. With SQLite the CA stays in the data dir alone
(`ensure_ca`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from coordinator.store.postgres import PostgresStore
from coordinator.trust.tokens import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    CertificateAuthority,
    TrustRootError,
    ensure_ca,
    ensure_data_dir,
)
from epochmesh import identity
from epochmesh.fsutil import write_private
from epochmesh.timeutil import now_ms

log = logging.getLogger(__name__)


async def ensure_shared_ca(store: PostgresStore, data_dir: Path) -> CertificateAuthority:
    """The database's CA, stored first when it has none (see the module docstring)."""
    ensure_data_dir(data_dir)
    cert_path, key_path = data_dir / CA_CERT_FILE, data_dir / CA_KEY_FILE
    async with store.acquire_connection() as conn:
        row = await conn.fetchrow("SELECT ca_cert, ca_key FROM trust_root WHERE id = 1")
        if row is None:
            # The data dir's CA (checked) as the candidate, or a new one (kept in memory
            # until the database says which one won).
            if cert_path.exists() or key_path.exists():
                local = ensure_ca(data_dir)
            else:
                local = CertificateAuthority(*identity.create_ca(()))
            await conn.execute(
                """INSERT INTO trust_root (id, ca_cert, ca_key, created_ms)
                   VALUES (1, $1, $2, $3) ON CONFLICT DO NOTHING""",
                local.cert_pem,
                local.key_pem,
                now_ms(),
            )
            row = await conn.fetchrow("SELECT ca_cert, ca_key FROM trust_root WHERE id = 1")
            if row is not None and bytes(row["ca_cert"]) == local.cert_pem:
                log.info(
                    "the database keeps this coordinator's CA (fingerprint %s) for every "
                    "coordinator on it",
                    local.fingerprint,
                )
    if row is None:  # pragma: no cover - the insert or another coordinator's is there
        raise TrustRootError(f"no CA in the database {store.url}")
    shared = CertificateAuthority(bytes(row["ca_cert"]), bytes(row["ca_key"]))
    if cert_path.exists() or key_path.exists():
        local = ensure_ca(data_dir)
        if local.cert_pem != shared.cert_pem:
            raise TrustRootError(
                f"the CA in {data_dir} (fingerprint {local.fingerprint}) is not the one the "
                f"database {store.url} keeps for its coordinators (fingerprint "
                f"{shared.fingerprint}): use another data dir, or remove {CA_CERT_FILE} and "
                f"{CA_KEY_FILE} from this one to take the database's"
            )
        return local
    identity_files = ((key_path, shared.key_pem, 0o600), (cert_path, shared.cert_pem, 0o644))
    for path, data, mode in identity_files:
        write_private(path, data, mode=mode)
    log.info("took the database's CA (fingerprint %s) into %s", shared.fingerprint, data_dir)
    return ensure_ca(data_dir)
