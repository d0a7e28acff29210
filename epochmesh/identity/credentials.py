"""An identity and its files: the CA certificate to trust plus our own certificate and key
(`Identity`, kept in a directory as ``ca.pem`` / ``cert.pem`` / ``key.pem``), and
`IdentityFollower`, which picks up a certificate renewed in that directory."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from epochmesh.fsutil import write_private
from epochmesh.identity.x509 import (
    IdentityError,
    Principal,
    key_matches_certificate,
    load_certificate,
    principal_from_pem,
)

log = logging.getLogger(__name__)

# File names of an identity directory (agent data dir, CLI credentials dir).
CA_FILE = "ca.pem"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"


@dataclass(frozen=True)
class Identity:
    """A CA certificate to trust plus our own certificate and key (all PEM). ``source``: the
    directory it was loaded from, if any (`CallSigner` follows a renewed certificate there)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    source: Path | None = field(default=None, compare=False, repr=False)

    @property
    def principal(self) -> Principal:
        return principal_from_pem(self.cert_pem)

    @staticmethod
    def exists(directory: Path) -> bool:
        return all((directory / n).is_file() for n in (CA_FILE, CERT_FILE, KEY_FILE))

    @classmethod
    def load(cls, directory: Path) -> Identity:
        try:
            return cls(
                ca_pem=(directory / CA_FILE).read_bytes(),
                cert_pem=(directory / CERT_FILE).read_bytes(),
                key_pem=(directory / KEY_FILE).read_bytes(),
                source=directory,
            )
        except OSError as exc:
            raise IdentityError(f"cannot read identity in {directory}: {exc}") from None

    def save(self, directory: Path) -> None:
        write_private(directory / KEY_FILE, self.key_pem)
        write_private(directory / CERT_FILE, self.cert_pem)
        write_private(directory / CA_FILE, self.ca_pem)


class IdentityFollower:
    """The current state of an identity loaded from a directory: when its ``cert.pem`` changes
    there (a renewal), `current()` loads the directory again (checked at most every
    ``check_s``). A new certificate whose key does not match, or that does not load, is
    logged and the one in use kept. An identity without a ``source`` never changes.
    Thread-safe: gRPC calls a certificate fetcher on its own threads."""

    def __init__(self, identity: Identity, check_s: float = 1.0) -> None:
        self._identity = identity
        self._check_s = check_s
        self._lock = threading.Lock()
        self._stamp = self._cert_stamp()
        self._checked = time.monotonic()

    def _cert_stamp(self) -> tuple[int, int, int] | None:
        source = self._identity.source
        if source is None:
            return None
        try:
            st = os.stat(source / CERT_FILE)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def current(self) -> Identity:
        source = self._identity.source
        now = time.monotonic()
        if source is None or now - self._checked < self._check_s:
            return self._identity
        with self._lock:
            if now - self._checked < self._check_s:
                return self._identity
            self._checked = now
            stamp = self._cert_stamp()
            if stamp is None or stamp == self._stamp:
                return self._identity
            self._stamp = stamp
            try:
                fresh = Identity.load(source)
                if not key_matches_certificate(fresh.key_pem, fresh.cert_pem):
                    raise IdentityError("its key does not match its certificate")
                load_certificate(fresh.cert_pem)
            except IdentityError as exc:
                log.warning(
                    "keeping the certificate in use: the one now in %s is unusable (%s)",
                    source,
                    exc,
                )
                return self._identity
            if fresh != self._identity:
                log.info("now using the certificate renewed in %s", source)
                self._identity = fresh
            return self._identity
