"""The coordinator's ids (jobs, nodes, users, blobs) and the checks of text it is handed.

Every check raises `InvalidArgumentError` (INVALID_ARGUMENT to the caller) with a message naming
the field; each returns the value it accepted.
"""

from __future__ import annotations

import secrets

from coordinator.core.errors import InvalidArgumentError

# -- text -------------------------------------------------------------------------------------


def check_text(value: str, field: str, max_len: int = 256, required: bool = False) -> str:
    """InvalidArgumentError unless ``value`` is a short, printable string (non-empty if
    ``required``)."""
    if not value:
        if required:
            raise InvalidArgumentError(f"{field} is required")
        return value
    if len(value) > max_len:
        raise InvalidArgumentError(f"{field} is too long ({len(value)} > {max_len} characters)")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidArgumentError(f"{field} must not contain control characters")
    return value


def require_job_id(value: str, field: str = "job_id") -> str:
    if not value:
        raise InvalidArgumentError(f"{field} is required")
    if not is_job_id(value):
        raise InvalidArgumentError(f"malformed {field} {value[:80]!r} (expected j- and 10 hex)")
    return value


# -- jobs ---------------------------------------------------------------------------------------

JOB_ID_PREFIX = "j-"
ID_HEX_CHARS = 10


def new_job_id() -> str:
    return JOB_ID_PREFIX + secrets.token_hex(ID_HEX_CHARS // 2)


def is_job_id(value: str) -> bool:
    return _is_prefixed_hex(value, JOB_ID_PREFIX)


def _is_prefixed_hex(value: str, prefix: str) -> bool:
    if len(value) != len(prefix) + ID_HEX_CHARS or not value.startswith(prefix):
        return False
    return all(c in "0123456789abcdef" for c in value[len(prefix) :])


# -- tasks --------------------------------------------------------------------------------------

# This process's tag in the ids of the tasks it hands out ("t-" a round or benchmark task, "c-"
# a check; then the tag and 12 random hex). A node still running a task whose id carries
# another tag got it before the coordinator restarted, or from another coordinator of the
# cluster before a takeover: nothing waits for that task any more.
TASK_TAG = secrets.token_hex(2)
TASK_RANDOM_HEX = 12


def new_task_id(prefix: str) -> str:
    return f"{prefix}{TASK_TAG}{secrets.token_hex(TASK_RANDOM_HEX // 2)}"


def from_another_process(task_id: str) -> bool:
    """Whether ``task_id`` was handed out by another coordinator process than this one."""
    tagged = len(task_id) == 2 + len(TASK_TAG) + TASK_RANDOM_HEX and task_id[1] == "-"
    return not tagged or task_id[2 : 2 + len(TASK_TAG)] != TASK_TAG


# -- nodes --------------------------------------------------------------------------------------

NODE_ID_PREFIX = "n-"
NODE_ID_HEX = 10


def new_node_id() -> str:
    return NODE_ID_PREFIX + secrets.token_hex(NODE_ID_HEX // 2)


def is_node_id(value: str) -> bool:
    if len(value) != len(NODE_ID_PREFIX) + NODE_ID_HEX or not value.startswith(NODE_ID_PREFIX):
        return False
    return all(c in "0123456789abcdef" for c in value[len(NODE_ID_PREFIX) :])


def require_node_id(value: str, field: str = "node_id") -> str:
    if not value:
        raise InvalidArgumentError(f"{field} is required")
    if not is_node_id(value):
        raise InvalidArgumentError(f"malformed {field} {value[:80]!r} (expected n- and 10 hex)")
    return value


# -- users --------------------------------------------------------------------------------------

USER_ID_PREFIX = "u-"


def new_user_id() -> str:
    return USER_ID_PREFIX + secrets.token_hex(5)


# -- blobs --------------------------------------------------------------------------------------

_HEX = frozenset("0123456789abcdef")


def is_sha256(value: str) -> bool:
    """Lowercase hex sha256 (64 characters)."""
    return len(value) == 64 and all(c in _HEX for c in value)


def require_sha256(value: str, field: str = "sha256") -> str:
    if not value:
        raise InvalidArgumentError(f"{field} is required")
    if not is_sha256(value):
        raise InvalidArgumentError(
            f"{field} must be 64 lowercase hex characters, got {value[:80]!r}"
        )
    return value
