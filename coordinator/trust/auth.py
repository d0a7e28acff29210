"""Who is calling, and may they: the coordinator's per-RPC role and ownership checks.

Every RPC of AgentService, JobService and SchedulerService goes through `Authorizer.check`
(called by the handler wrapper in coordinator/api/handlers.py) before its handler runs:

- no certificate in the call credentials (epochmesh.identity.CertificateAuth), one not issued
  by the coordinator's CA, an expired one, a bad or stale call signature, or a certificate
  whose principal was revoked: UNAUTHENTICATED;
- a role the method does not admit (`POLICY`): PERMISSION_DENIED, saying in a user's words what
  the caller tried and who may (`ACTIONS`, `refusal`).

The caller's `Principal` is then available to the handler and everything it calls (the engine
included) through `current_principal()` (coordinator/core/principal.py: a contextvar set for
the handler's task). Ownership helpers used by the services: `require_self(node_id)` (a node
acts only as itself), `require_job_access(job)` (a submitter sees only its own jobs) and
`require_priority_change(job, priority)` (a submitter may lower its own job's priority, never
raise it). With ``--insecure`` there is no certificate and no check: `current_principal()` is
None and the helpers allow everything.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from cryptography import x509

from coordinator.core.errors import PermissionDeniedError, UnauthenticatedError
from coordinator.core.principal import current_principal
from coordinator.scheduling.cluster_scheduler import tier_of
from epochmesh.identity import (
    AUTH_CERT_KEY,
    AUTH_MAX_SKEW_MS,
    AUTH_SIG_KEY,
    AUTH_TS_KEY,
    ROLE_NODE,
    ROLE_OPERATOR,
    ROLE_SUBMITTER,
    IdentityError,
    Principal,
    load_certificate,
    principal_of,
    verify_call_signature,
)
from epochmesh.spec import DEFAULT_PRIORITY
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


# Operators administer the cluster: every RPC admits them (acting as a node included, e.g.
# for tooling and tests); nodes and submitters get only their own services.
NODE = frozenset({ROLE_NODE, ROLE_OPERATOR})
USERS = frozenset({ROLE_SUBMITTER, ROLE_OPERATOR})
OPERATOR = frozenset({ROLE_OPERATOR})

_AGENT = "epochmesh.v1.AgentService"
_JOB = "epochmesh.v1.JobService"
_SCHED = "epochmesh.v1.SchedulerService"
_MARKET = "epochmesh.v1.MarketService"

# Roles admitted by each RPC ("Service/Method"). A method missing here is refused to everyone.
POLICY: dict[str, frozenset[str]] = {
    **{
        f"{_AGENT}/{m}": NODE
        for m in (
            "Register",
            "Heartbeat",
            "Leave",
            "ReportBenchmark",
            "NextTask",
            "FetchBlob",
            "PushUpdate",
            "PullParameters",
            "ReportProgress",
            "Probe",
            "AuthorizeStateTransfer",
            "CommitSketches",
            "ReportCheck",
        )
    },
    **{
        f"{_JOB}/{m}": USERS
        for m in (
            "UploadBlob",
            "GetBlobStatus",
            "DeleteBlob",
            "SubmitJob",
            "GetJob",
            "ListJobs",
            "WatchJob",
            "CancelJob",
            "DownloadResult",
            "GetRounds",
            "GetJobEvents",
            "GetQueue",
            "SetJobPriority",
        )
    },
    # Cluster views a submitter may read (its own job's allocation only).
    **{
        f"{_SCHED}/{m}": USERS
        for m in (
            "ListNodes",
            "GetNode",
            "ClusterStats",
            "PreviewAllocation",
            "GetAllocation",
            "QuoteJob",
        )
    },
    **{
        f"{_SCHED}/{m}": OPERATOR
        for m in (
            "ListJobs",
            "GetJob",
            "WatchEvents",
            "Cordon",
            "Uncordon",
            "Drain",
            "Revoke",
            "GetQueue",
            "SetTenantWeight",
        )
    },
    # Balances and statements: a submitter its own (coordinator.api.market_service checks).
    **{f"{_MARKET}/{m}": USERS for m in ("GetBalance", "GetStatement", "AddBudget")},
    f"{_MARKET}/GrantCredits": OPERATOR,
}


# What each RPC does, in the words of a user who was refused it: "only operators can <phrase>".
ACTIONS: dict[str, str] = {
    **{
        f"{_AGENT}/{m}": phrase
        for m, phrase in (
            ("Register", "register a node"),
            ("Heartbeat", "send a node's heartbeats"),
            ("Leave", "take a node out of the cluster"),
            ("ReportBenchmark", "report a node's benchmark"),
            ("NextTask", "take training tasks"),
            ("FetchBlob", "fetch a job's blobs as a node"),
            ("PushUpdate", "push a node's updates"),
            ("PullParameters", "pull a job's parameters as a node"),
            ("ReportProgress", "report a node's progress"),
            ("Probe", "probe the coordinator's link as a node"),
            ("AuthorizeStateTransfer", "authorize a state transfer between nodes"),
            ("CommitSketches", "commit a node's work sketches"),
            ("ReportCheck", "report a verification check"),
        )
    },
    **{
        f"{_JOB}/{m}": phrase
        for m, phrase in (
            ("UploadBlob", "upload job files"),
            ("GetBlobStatus", "look up uploaded files"),
            ("DeleteBlob", "delete uploaded files"),
            ("SubmitJob", "submit jobs"),
            ("GetJob", "see jobs"),
            ("ListJobs", "list jobs"),
            ("WatchJob", "watch jobs"),
            ("CancelJob", "cancel jobs"),
            ("DownloadResult", "download a job's model"),
            ("GetRounds", "see a job's rounds"),
            ("GetJobEvents", "see a job's events"),
            ("GetQueue", "see the queue"),
            ("SetJobPriority", "change a job's priority"),
        )
    },
    **{
        f"{_SCHED}/{m}": phrase
        for m, phrase in (
            ("ListNodes", "list the nodes"),
            ("GetNode", "see a node"),
            ("ClusterStats", "see the cluster's statistics"),
            ("PreviewAllocation", "preview a job's allocation"),
            ("GetAllocation", "see a job's allocation"),
            ("ListJobs", "list every tenant's jobs"),
            ("GetJob", "see any tenant's job"),
            ("WatchEvents", "see the cluster's events"),
            ("Cordon", "cordon a node"),
            ("Uncordon", "uncordon a node"),
            ("Drain", "drain a node"),
            ("Revoke", "revoke a certificate"),
            ("GetQueue", "see the whole queue and the tenants' weights"),
            ("SetTenantWeight", "set a tenant's weight"),
            ("QuoteJob", "quote a job"),
        )
    },
    **{
        f"{_MARKET}/{m}": phrase
        for m, phrase in (
            ("GetBalance", "see credit balances"),
            ("GetStatement", "see ledger statements"),
            ("AddBudget", "add to a job's budget"),
            ("GrantCredits", "grant credits"),
        )
    },
}

# The callers a role set names in a refusal ("only operators can ...").
_WHO = {
    NODE: "nodes (agents) and operators",
    USERS: "submitters and operators",
    OPERATOR: "operators",
}


def _a(role: str) -> str:
    return f"an {role}" if role[:1] in "aeiou" else f"a {role}"


def refusal(method: str, role: str) -> str:
    """Why ``role`` may not call ``method`` ("Service/Method"), in a user's words: "only
    operators can grant credits (you are logged in as a submitter; GrantCredits needs the
    operator role)"."""
    allowed = POLICY.get(method, frozenset())
    name = method.rsplit("/", 1)[-1]
    if not allowed:
        return f"{name} is not offered to anyone (you are logged in as {_a(role)})"
    who = _WHO.get(allowed, " and ".join(f"{r}s" for r in sorted(allowed)))
    action = ACTIONS.get(method, f"call {name}")
    roles = " or ".join(sorted(allowed))
    return (
        f"only {who} can {action} (you are logged in as {_a(role)}; {name} needs the {roles} role)"
    )


def require_self(node_id: str) -> None:
    """PERMISSION_DENIED unless the calling node is ``node_id`` (operators and insecure mode
    pass)."""
    principal = current_principal()
    if principal is None or principal.role != ROLE_NODE:
        return
    if node_id and node_id != principal.id:
        raise PermissionDeniedError(
            f"node {principal.id} may not act as node {node_id[:64]!r}: its certificate "
            "names only itself"
        )


def owner_filter() -> str | None:
    """The owner a job listing is restricted to: the submitter's id, else None (all)."""
    principal = current_principal()
    if principal is not None and principal.role == ROLE_SUBMITTER:
        return principal.id
    return None


def require_job_access(job: common_pb2.Job) -> None:
    """PERMISSION_DENIED when a submitter reaches for another submitter's job."""
    principal = current_principal()
    if principal is None or principal.role != ROLE_SUBMITTER:
        return
    if job.owner != principal.id:
        raise PermissionDeniedError(f"job {job.job_id} belongs to another submitter")


def require_priority_change(job: common_pb2.Job, priority: str) -> None:
    """PERMISSION_DENIED when a submitter reaches for another submitter's job, or would raise
    its own job's priority tier (only operators raise; ``priority`` must be a known tier)."""
    require_job_access(job)
    principal = current_principal()
    if principal is None or principal.role != ROLE_SUBMITTER:
        return
    before = job.spec.priority or DEFAULT_PRIORITY
    if tier_of(priority) > tier_of(before):
        raise PermissionDeniedError(
            f"only an operator may raise a job's priority ({before} -> {priority} for job "
            f"{job.job_id}); its owner may only lower it"
        )


@dataclass(frozen=True)
class _Verified:
    """A certificate that chains to the CA, with what every call needs of it."""

    cert: x509.Certificate
    principal: Principal
    not_before_s: float
    not_after_s: float


class Authorizer:
    """Authenticates callers by the certificate in their call credentials; checks `POLICY`.

    Cost per call: a certificate is verified against the CA once (cached by its DER), and a
    call signature once per (certificate, method, timestamp, signature): clients reuse a
    method's signature for `AUTH_SIGNATURE_REUSE_MS` (epochmesh/identity/), so the ECDSA
    verification (about 70 us) is paid once per client and method per minute and every other
    call costs a dictionary lookup. Validity, the timestamp window and revocation are checked
    on every call."""

    CACHE_SIZE = 1024
    SIGNATURE_CACHE_SIZE = 16384
    MAX_CERT_BYTES = 8192

    def __init__(self, ca_pem: bytes, revoked: Iterable[str] = ()) -> None:
        self._ca = load_certificate(ca_pem)
        self._revoked: set[str] = set(revoked)
        # DER -> the verified certificate, or the reason it is refused.
        self._cache: OrderedDict[bytes, _Verified | str] = OrderedDict()
        # (DER, method, timestamp, signature) of call signatures that verified.
        self._signatures: OrderedDict[tuple[bytes, str, str, bytes], None] = OrderedDict()

    def revoke(self, principal_id: str) -> None:
        self._revoked.add(principal_id)

    def is_revoked(self, principal_id: str) -> bool:
        return principal_id in self._revoked

    def _verify_der(self, der: bytes) -> _Verified | str:
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            return f"malformed certificate: {exc}"
        try:
            cert.verify_directly_issued_by(self._ca)
        except Exception:  # noqa: BLE001 - InvalidSignature, wrong issuer, bad algorithm
            return "certificate not issued by this coordinator's CA"
        try:
            principal = principal_of(cert)
        except IdentityError as exc:
            return str(exc)
        return _Verified(
            cert,
            principal,
            cert.not_valid_before_utc.timestamp(),
            cert.not_valid_after_utc.timestamp(),
        )

    def _lookup(self, der: bytes) -> _Verified | str:
        cached = self._cache.get(der)
        if cached is None:
            cached = self._verify_der(der)
            self._cache[der] = cached
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(der)
        return cached

    def authenticate(self, method: str, ctx: grpc.aio.ServicerContext) -> Principal:
        """The verified caller of ``method`` ("Service/Method"); UnauthenticatedError."""
        return self.authenticate_certificate(method, ctx)[0]

    def authenticate_certificate(
        self, method: str, ctx: grpc.aio.ServicerContext
    ) -> tuple[Principal, x509.Certificate]:
        """The verified caller of ``method`` and the certificate it called with (what
        RenewCertificate renews); UnauthenticatedError."""
        metadata = ctx.invocation_metadata() or ()
        values = {k: v for k, v in metadata if k in (AUTH_CERT_KEY, AUTH_SIG_KEY, AUTH_TS_KEY)}
        der, sig, ts = values.get(AUTH_CERT_KEY), values.get(AUTH_SIG_KEY), values.get(AUTH_TS_KEY)
        if not der:
            raise UnauthenticatedError(
                "a certificate is required: enroll with a join token "
                "(epochmesh-agent --token, epochmesh login --token)"
            )
        if not isinstance(der, bytes) or len(der) > self.MAX_CERT_BYTES:
            raise UnauthenticatedError("malformed certificate in the call credentials")
        if not isinstance(sig, bytes) or not isinstance(ts, str):
            raise UnauthenticatedError("the call credentials lack a signature")
        name = method.rsplit("/", 1)[-1]
        return self.verify_signed(der, name, ts, sig)

    def verify_signed(
        self, der: bytes, name: str, ts: str, sig: bytes
    ) -> tuple[Principal, x509.Certificate]:
        """The principal whose certificate ``der`` (issued by this CA, valid now, not revoked)
        signed ``name`` at ``ts`` (within AUTH_MAX_SKEW_MS of now) with ``sig``; the
        certificate. UnauthenticatedError otherwise. Calls use it (``name``: the method), and
        dashboard login codes (epochmesh.identity.make_login_code)."""
        found = self._lookup(der)
        if isinstance(found, str):
            raise UnauthenticatedError(f"certificate refused: {found}")
        principal = found.principal
        now = time.time()
        if now > found.not_after_s:
            raise UnauthenticatedError(
                f"certificate expired or not yet valid: {principal}'s expired at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(found.not_after_s))} UTC "
                "(certificates are renewed before they expire; enroll again with a new join "
                "token)"
            )
        if now < found.not_before_s:
            raise UnauthenticatedError(
                "certificate expired or not yet valid: not valid before "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(found.not_before_s))} UTC "
                "(is this machine's clock right?)"
            )
        key = (der, name, ts, sig)
        if key in self._signatures:
            # Verified before; only its age is new (verify_call_signature's window check).
            try:
                fresh = abs(now * 1000 - int(ts)) <= AUTH_MAX_SKEW_MS
            except ValueError:  # pragma: no cover - it parsed when it was verified
                fresh = False
            if not fresh:
                del self._signatures[key]
                raise UnauthenticatedError(
                    "call credentials refused: call timestamp too far from the coordinator's clock"
                )
            self._signatures.move_to_end(key)
        else:
            try:
                verify_call_signature(found.cert, name, ts, sig)
            except IdentityError as exc:
                raise UnauthenticatedError(f"call credentials refused: {exc}") from None
            self._signatures[key] = None
            while len(self._signatures) > self.SIGNATURE_CACHE_SIZE:
                self._signatures.popitem(last=False)
        if principal.id in self._revoked:
            raise UnauthenticatedError(f"the certificate of {principal} has been revoked")
        return principal, found.cert

    def check(self, method: str, ctx: grpc.aio.ServicerContext) -> Principal:
        """The caller's principal if it may call ``method``; raises UnauthenticatedError or
        PermissionDeniedError."""
        principal = self.authenticate(method, ctx)
        allowed = POLICY.get(method, frozenset())
        if principal.role not in allowed:
            raise PermissionDeniedError(refusal(method, principal.role))
        return principal
