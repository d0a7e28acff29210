"""Proto messages as JSON-able data for ``--output json``, and state-name helpers.

The JSON form of a message uses the proto field names, with these rules so that scripts do
not have to know protobuf's JSON mapping:

- every field is present (defaults included); 64-bit integers are JSON numbers, not strings;
- enums are short lowercase names: ``JOB_STATE_RUNNING`` -> ``"running"``;
- a ``SampleRange`` is a half-open ``[start, stop]`` pair;
- maps are objects; bytes fields are hex strings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

from client.rpc import CliError, ExitCode
from epochmesh.v1 import common_pb2

JOB_STATES = ("queued", "running", "paused", "succeeded", "failed", "cancelled")
NODE_STATES = ("online", "busy", "draining", "cordoned", "offline", "quarantined")
TERMINAL_JOB_STATES = frozenset(
    {
        common_pb2.JOB_STATE_SUCCEEDED,
        common_pb2.JOB_STATE_FAILED,
        common_pb2.JOB_STATE_CANCELLED,
    }
)


def _enum_prefix(enum: EnumDescriptor) -> str:
    # JobState -> "JOB_STATE_", NodeState -> "NODE_STATE_"
    out = ""
    for i, ch in enumerate(enum.name):
        if ch.isupper() and i > 0:
            out += "_"
        out += ch.upper()
    return out + "_"


def enum_short_name(enum: EnumDescriptor, number: int) -> str:
    value = enum.values_by_number.get(number)
    if value is None:
        return str(number)
    prefix = _enum_prefix(enum)
    name: str = value.name[len(prefix) :] if value.name.startswith(prefix) else value.name
    return name.lower()


def job_state_name(state: int) -> str:
    return enum_short_name(common_pb2.JobState.DESCRIPTOR, state)


def node_state_name(state: int) -> str:
    return enum_short_name(common_pb2.NodeState.DESCRIPTOR, state)


def node_status(node: common_pb2.NodeInfo) -> str:
    """A node's state as a user should read it: ``revoked`` for a node whose certificate was
    revoked (the coordinator also cordons it, but it can never be uncordoned back to work),
    else its state's short name."""
    return "revoked" if node.revoked else node_state_name(node.state)


def _parse_states(
    text: str, names: tuple[str, ...], enum: Any, prefix: str, what: str
) -> list[Any]:
    # protobuf's enum wrapper is untyped at run time: its numbers are the generated enum type.
    out: list[Any] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in names:
            close = closest(name, names)
            hint = f"did you mean {close}? " if close else ""
            raise CliError(
                ExitCode.USAGE,
                f"unknown {what} state {raw.strip()!r}",
                f"{hint}choose from: {', '.join(names)}",
            )
        out.append(enum.Value(prefix + name.upper()))
    return out


def parse_node_states(text: str) -> list[common_pb2.NodeState]:
    """``"online,busy"`` -> the NodeState numbers; a typo is a usage error with a suggestion."""
    return _parse_states(text, NODE_STATES, common_pb2.NodeState, "NODE_STATE_", "node")


def parse_job_states(text: str) -> list[common_pb2.JobState]:
    return _parse_states(text, JOB_STATES, common_pb2.JobState, "JOB_STATE_", "job")


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_short_name(field.enum_type, value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / Infinity
    return value


def to_dict(message: Message) -> Any:
    """A proto message as plain JSON-able data (see the module docstring)."""
    descriptor: Descriptor = message.DESCRIPTOR
    if descriptor.full_name == "epochmesh.v1.SampleRange":
        return [message.start, message.stop]
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and
    transpositions of adjacent characters each cost 1 (so "stauts" is 1 from "status")."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to ``word`` when it is plausibly a typo of it, else None (ties go
    to the choice of the closest length, then to the first)."""
    best: tuple[int, int, str] | None = None
    for choice in choices:
        dist = edit_distance(word.lower(), choice.lower())
        key = (dist, abs(len(choice) - len(word)), choice)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    limit = max(1, min(3, len(word) // 3))
    return best[2] if best[0] <= limit else None


def epoch_text(job: common_pb2.Job) -> str:
    """``3/8``: the current epoch counted from 1, capped at the total."""
    total = job.spec.epochs
    if total <= 0:
        return str(job.epoch + 1)
    current = total if job.state == common_pb2.JOB_STATE_SUCCEEDED else job.epoch + 1
    return f"{min(current, total)}/{total}"


def job_fraction(job: common_pb2.Job) -> float:
    if job.state == common_pb2.JOB_STATE_SUCCEEDED:
        return 1.0
    return job.samples_done / job.samples_total if job.samples_total > 0 else 0.0


def has_loss(job: common_pb2.Job) -> bool:
    return job.round > 0
