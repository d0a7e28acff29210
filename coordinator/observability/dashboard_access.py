"""Who may use the dashboard and metrics port, and as whom.

- Listening on a loopback address (the default), every caller is trusted as an operator, like
  a shell on the coordinator's machine; so is everyone with ``--insecure`` (the gRPC port
  checks nobody either).
- Listening elsewhere (or with ``--http-login``), every request needs a session: a login with a
  join token from ``epochmesh-coordinator token create --role submitter|operator`` redeems it
  (single use unless ``--reusable``, like an enrollment) for a new user principal of that role,
  and the session carries the gRPC role's rights (a submitter sees only its own jobs). Node
  tokens are refused without being spent. A revoked principal's sessions end at once.
- A user already logged in with the CLI opens the dashboard as itself: ``epochmesh dashboard``
  prints a login URL with a code its certificate's key signed (epochmesh.identity
  make_login_code); the dashboard checks it as it checks a call (issued by this CA, valid, not
  revoked, signed within AUTH_MAX_SKEW_MS of now) and takes it once: the session is that
  principal's, with its role. Only the code exactly as the CLI wrote it is taken (its parts in
  their canonical encoding), and "once" is per principal and signing time, so a replay with
  characters appended or a re-encoded signature opens nothing.
- Sessions are never ended to make room for others: a principal holds at most
  `MAX_SESSIONS_PER_PRINCIPAL` (its own oldest goes), and when `MAX_SESSIONS` live sessions
  exist a new login is refused (503) until some expire or log out. A failed login touches no
  session.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from coordinator.core.errors import PermissionDeniedError, UnauthenticatedError
from coordinator.core.ids import new_user_id
from coordinator.observability.cluster_view import Viewer
from coordinator.store.base import Store
from coordinator.trust.auth import Authorizer
from coordinator.trust.tokens import CertificateAuthority, join_token_hash
from epochmesh import identity
from epochmesh.timeutil import now_ms

SESSION_COOKIE = "epochmesh_session"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 10_000
MAX_SESSIONS_PER_PRINCIPAL = 32
MAX_TOKEN_CHARS = 256
MAX_CODE_CHARS = 4096  # a login code carries a certificate (DER, base64)


def is_loopback_host(host: str) -> bool:
    """True for a listen host only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def login_required(listen_host: str, force: bool, insecure: bool) -> bool:
    if insecure:
        return False
    return force or not is_loopback_host(listen_host)


@dataclass(frozen=True)
class Session:
    principal: str
    role: str
    expires_s: float

    @property
    def viewer(self) -> Viewer:
        return Viewer(role=self.role, principal=self.principal)


class SessionsFull(Exception):
    """`MAX_SESSIONS` live sessions exist: no new one until some end."""


class Sessions:
    """Session secrets -> `Session`, in memory (a coordinator restart logs everyone out).
    Thread-safe: the HTTP threads read and write it."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
        per_principal: int = MAX_SESSIONS_PER_PRINCIPAL,
    ) -> None:
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._per_principal = per_principal
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._of: dict[str, list[str]] = {}  # principal -> its secrets, oldest first

    def _drop(self, secret: str) -> None:
        session = self._sessions.pop(secret, None)
        if session is None:
            return
        mine = self._of.get(session.principal, [])
        if secret in mine:
            mine.remove(secret)
        if not mine:
            self._of.pop(session.principal, None)

    def create(self, principal: str, role: str, now_s: float | None = None) -> str:
        """A new session's secret. The principal's own oldest session ends beyond
        ``per_principal``; SessionsFull when ``max_sessions`` live ones exist (no one else's
        session is ended to make room)."""
        now_s = time.time() if now_s is None else now_s
        secret = secrets.token_urlsafe(32)
        with self._lock:
            # Sessions are in order of creation and live alike: the expired ones come first.
            while self._sessions:
                oldest, session = next(iter(self._sessions.items()))
                if session.expires_s >= now_s:
                    break
                self._drop(oldest)
            mine = self._of.get(principal, [])
            while mine and len(mine) >= self._per_principal:
                self._drop(mine[0])
                mine = self._of.get(principal, [])
            if len(self._sessions) >= self._max:
                raise SessionsFull(
                    f"too many dashboard sessions ({self._max}): retry when some have ended"
                )
            self._sessions[secret] = Session(principal, role, now_s + self._ttl_s)
            self._of.setdefault(principal, []).append(secret)
        return secret

    def get(self, secret: str, now_s: float | None = None) -> Session | None:
        if not secret or len(secret) > 128:
            return None
        now_s = time.time() if now_s is None else now_s
        with self._lock:
            session = self._sessions.get(secret)
            if session is None:
                return None
            if session.expires_s < now_s:
                self._drop(secret)
                return None
            return session

    def end(self, secret: str) -> None:
        with self._lock:
            self._drop(secret)


async def redeem_login_token(store: Store, ca: CertificateAuthority, token: str) -> Session:
    """Redeems a submitter or operator join token for a new user principal (run on the
    coordinator's loop). UnauthenticatedError for a malformed, foreign, unknown, used or
    expired token; PermissionDeniedError for a node token (left unspent)."""
    token = token.strip()
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise UnauthenticatedError("a join token is required")
    token_hash = join_token_hash(ca, token)
    async with store.transaction():
        record = await store.redeem_token(token_hash, now_ms())
        if record is None:
            raise UnauthenticatedError("join token unknown, already used, or expired")
        if record.role not in (identity.ROLE_SUBMITTER, identity.ROLE_OPERATOR):
            # Raising inside the transaction rolls the redemption back: the token stays good.
            raise PermissionDeniedError(
                f"a {record.role} token does not open the dashboard: use a submitter or "
                "operator token"
            )
        role = record.role
    return Session(principal=new_user_id(), role=role, expires_s=0.0)


class UsedCodes:
    """Login codes already taken, by (certificate, signing time), kept while their timestamp
    is within the window a code is accepted in (a code opens one session)."""

    def __init__(self, window_ms: int = identity.AUTH_MAX_SKEW_MS) -> None:
        self.window_ms = window_ms
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, code: str, ts_ms: int, now: int | None = None) -> bool:
        """False if ``code`` (a key naming the signer and the signing time) was taken
        before."""
        now = now_ms() if now is None else now
        with self._lock:
            for c in [c for c, ts in self._used.items() if abs(now - ts) > self.window_ms]:
                del self._used[c]
            if code in self._used:
                return False
            self._used[code] = ts_ms
            return True


async def redeem_login_code(authorizer: Authorizer, code: str, used: UsedCodes) -> Session:
    """The session of the principal that signed the dashboard login ``code`` (run on the
    coordinator's loop). UnauthenticatedError for a malformed, foreign, expired, revoked or
    replayed code; PermissionDeniedError for a node's."""
    code = code.strip()
    if len(code) > MAX_CODE_CHARS:
        raise UnauthenticatedError("malformed dashboard login code")
    try:
        der, ts, sig = identity.parse_login_code(code)
    except identity.IdentityError as exc:
        raise UnauthenticatedError(str(exc)) from None
    if code != _canonical_code(der, ts, sig):  # junk appended, padding, other alphabets
        raise UnauthenticatedError("malformed dashboard login code")
    principal, _ = authorizer.verify_signed(der, identity.LOGIN_CODE_METHOD, ts, sig)
    if principal.role not in (identity.ROLE_SUBMITTER, identity.ROLE_OPERATOR):
        raise PermissionDeniedError(f"a {principal.role}'s certificate does not open the dashboard")
    # Once per certificate and signing time: another encoding of the same signature, or
    # another valid signature of the same payload (ECDSA's (r, n - s)), is the same code.
    key = f"{hashlib.sha256(der).hexdigest()}.{ts}"
    if not used.take(key, int(ts)):
        raise UnauthenticatedError(
            "this login code was used already: run `epochmesh dashboard` for a new one"
        )
    return Session(principal=principal.id, role=principal.role, expires_s=0.0)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _canonical_code(der: bytes, ts: str, sig: bytes) -> str:
    """The login code of these parts as `identity.make_login_code` writes it."""
    return f"{identity.LOGIN_CODE_PREFIX}{_b64(der)}.{ts}.{_b64(sig)}"
