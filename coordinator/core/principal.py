"""Who is calling: the caller's `Principal`, held for the RPC being handled.

The gRPC layer (coordinator/api/handlers.py) sets it for each handler's task, once
coordinator/trust/auth.py `Authorizer.check` has admitted the call; the handler and everything
it calls read it with `current_principal()`. It is None with ``--insecure`` and outside an RPC.
The store never reads it: its callers name the owner or the caller they act for.
"""

from __future__ import annotations

import contextvars

from epochmesh.identity import Principal

_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "epochmesh_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the RPC being handled (None: insecure mode, or outside an RPC)."""
    return _PRINCIPAL.get()


def current_principal_id() -> str:
    principal = _PRINCIPAL.get()
    return principal.id if principal is not None else ""


def set_principal(principal: Principal | None) -> contextvars.Token[Principal | None]:
    return _PRINCIPAL.set(principal)
