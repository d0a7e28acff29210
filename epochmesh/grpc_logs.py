"""gRPC's own log lines (its C core writes them to stderr, outside Python's logging).

A user sees lines such as ``I1128 ... ssl_transport_security.cc:2563] Handshake failed with
error SSL_ERROR_SSL: ... WRONG_VERSION_NUMBER`` whenever a plaintext client knocks on a TLS
port or the other way round; the programs already say what went wrong in their own words, so
these lines are noise unless one debugs gRPC itself.

The C core reads ``GRPC_VERBOSITY`` (and ``GRPC_TRACE``) once, when ``grpc`` is imported:
`quiet_grpc_core` must run before that import, which is why the console scripts parse their
arguments first and import grpc afterwards. This module imports nothing of grpc.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

VERBOSITY_ENV = "GRPC_VERBOSITY"
TRACE_ENV = "GRPC_TRACE"


def quiet_grpc_core(debug: bool, environ: MutableMapping[str, str] | None = None) -> bool:
    """Silence gRPC's C-core log lines unless ``debug``: ``GRPC_VERBOSITY=NONE``, unless the
    user set ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` (an explicit setting is honoured). Returns
    whether it silenced them. Too late (no effect) once grpc is imported; call it first."""
    env = os.environ if environ is None else environ
    if debug or VERBOSITY_ENV in env or TRACE_ENV in env:
        return False
    env[VERBOSITY_ENV] = "NONE"
    return True


def grpc_imported() -> bool:
    """Whether grpc is imported already (then `quiet_grpc_core` comes too late)."""
    return "grpc" in sys.modules
