"""The job spec: job.toml on the submitter's machine, the JobSpec proto everywhere else.

`load_spec(path)` / `parse_spec(text, base_dir)` read a job.toml, reject anything unknown or
out of range with a `SpecError` that names the line and says what to change, fill in defaults
and return a `LoadedSpec` holding the `epochmesh.v1.JobSpec` proto. `validate_job_spec(spec)`
checks a JobSpec that arrived over the network (the coordinator calls it on SubmitJob), and
`spec_to_dict(spec)` renders one for display.

A job.toml, with every field and its default (``-`` = required)::

    name = "digits-mlp"            # -       1..100 printable characters
    [model]
    file = "model.py"              # model.py  defines make_model(), maybe loss_fn(out, *targets)
    loss = "cross_entropy"         # cross_entropy | mse | custom (custom: model.py must define
                                   # loss_fn; a model.py that defines loss_fn always uses it)
    [data]
    train = "train.safetensors"    # -       tensors sharing their first dimension (the samples)
    inputs = ["x"]                 # -       tensors passed to the model, in order
    targets = ["y"]                # []      tensors passed to the loss; exactly one for a
                                   #         built-in loss
    [train]
    epochs = 1                     # >= 1
    global_batch = 32              # >= 1    samples per round, summed over all nodes
    micro_batch = 0                # >= 0    samples per forward/backward pass on a node: its
                                   #         local batch (or inner step) in chunks of at most
                                   #         this many, gradients accumulated; 0 = one pass
    optimizer = "sgd"              # sgd | adamw (torch.optim.SGD / torch.optim.AdamW)
    lr = 0.001                     # > 0     torch.optim's default
    momentum = 0.0                 # sgd only, in [0, 1]
    dampening = 0.0                # sgd only, in [0, 1]
    nesterov = false               # sgd only; needs momentum > 0 and dampening = 0
    weight_decay = 0.0             # >= 0;   0.0 for sgd, 0.01 for adamw (torch's defaults)
    betas = [0.9, 0.999]           # adamw only, each in [0, 1)
    eps = 1e-8                     # adamw only, > 0
    seed = 0                       # >= 0    seeds make_model() and the epoch order
    compression = "none"           # none | fp16 | bf16 | int8 | topk (gradients on the wire)
    topk_ratio = 0.01              # topk only, in (0, 1]
    aggregation_rule = "mean"      # mean | trimmed_mean | centered_clip (parameter server:
                                   #   robust rules bound one bad update between checks)
    sync = "sync"                  # sync | local_sgd
    inner_steps = 10               # local_sgd only, >= 1 (sync mode is always 1)
    inner_optimizer = "sgd"        # local_sgd only: another name for `optimizer`
    outer_optimizer = "nesterov"   # local_sgd only: nesterov (SGD, momentum, nesterov=True)
    outer_lr = 0.7                 # local_sgd only, > 0
    outer_momentum = 0.9           # local_sgd only, in [0, 1)
    [cluster]
    aggregation = "ps"             # ps | ring
    min_nodes = 1                  # >= 1
    max_nodes = 8                  # >= min_nodes
    checkpoint_every = 20          # >= 1, rounds
    priority = "normal"            # high | normal | low (the cluster scheduler's tiers)
    [market]                       # optional; credits are decimal, at most 6 decimals
    max_price = 2.5                # credits per node-hour: a node asking more never trains
                                   #         the job (absent: no cap)
    budget = 100                   # credits moved from your account into the job's escrow
                                   #         at submit; the job pauses ("budget") when it
                                   #         runs out (absent: 0, only donated nodes)
    deadline = "2h"                # done within this long of submission (s, m, h, d, or
                                   #         seconds): prefer the fastest nodes within
                                   #         max_price, else the most samples/s per credit

In the proto, fields that do not apply (betas with sgd, outer_lr with sync, ...) stay zero or
empty; `inner_steps` is 1 in sync mode; `inner_optimizer` equals `optimizer` with local_sgd.
`loss` becomes "custom" once packaging finds a loss_fn in model.py.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochmesh.errors import SpecError
from epochmesh.money import MAX_CREDITS, MICRO, format_credits, parse_credits
from epochmesh.timeutil import duration_seconds
from epochmesh.v1 import common_pb2

LOSSES = ("cross_entropy", "mse", "custom")
OPTIMIZERS = ("sgd", "adamw")
AGGREGATIONS = ("ps", "ring")
AGGREGATION_RULES = ("mean", "trimmed_mean", "centered_clip")
# The cluster scheduler's tiers, highest first (coordinator.scheduling.cluster_scheduler.Tier).
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk")
SYNC_MODES = ("sync", "local_sgd")
OUTER_OPTIMIZERS = ("nesterov",)

MAX_NAME_CHARS = 100
MAX_TENSOR_NAME_CHARS = 256
MAX_EPOCHS = 1_000_000
MAX_GLOBAL_BATCH = 2**31 - 1
MAX_NODES = 10_000
MAX_INNER_STEPS = 1_000_000
MAX_CHECKPOINT_EVERY = 1_000_000
MAX_SEED = 2**63 - 1
MAX_DEADLINE_S = 365 * 86400.0

ADAMW_DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_LOCAL_SGD_INNER_STEPS = 10

SGD_ONLY = ("momentum", "dampening", "nesterov")
ADAMW_ONLY = ("betas", "eps")
LOCAL_SGD_ONLY = ("inner_steps", "inner_optimizer", "outer_optimizer", "outer_lr", "outer_momentum")


@dataclass(frozen=True)
class _Field:
    kind: str  # "str" | "int" | "float" | "bool" | "str_list" | "float_pair"
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] | None = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo is exclusive
    hi_open: bool = False  # hi is exclusive


_TOP: dict[str, _Field] = {"name": _Field("str", required=True)}

_SECTIONS: dict[str, dict[str, _Field]] = {
    "model": {
        "file": _Field("str", default="model.py"),
        "loss": _Field("str", default="cross_entropy", choices=LOSSES),
    },
    "data": {
        "train": _Field("str", required=True),
        "inputs": _Field("str_list", required=True),
        "targets": _Field("str_list", default=[]),
    },
    "train": {
        "epochs": _Field("int", default=1, lo=1, hi=MAX_EPOCHS),
        "global_batch": _Field("int", default=32, lo=1, hi=MAX_GLOBAL_BATCH),
        "micro_batch": _Field("int", default=0, lo=0, hi=MAX_GLOBAL_BATCH),
        "optimizer": _Field("str", default="sgd", choices=OPTIMIZERS),
        "lr": _Field("float", default=1e-3, lo=0.0, lo_open=True),
        "momentum": _Field("float", default=0.0, lo=0.0, hi=1.0),
        "dampening": _Field("float", default=0.0, lo=0.0, hi=1.0),
        "nesterov": _Field("bool", default=False),
        "weight_decay": _Field("float", default=None, lo=0.0),
        "betas": _Field("float_pair", default=[0.9, 0.999], lo=0.0, hi=1.0, hi_open=True),
        "eps": _Field("float", default=1e-8, lo=0.0, lo_open=True),
        "seed": _Field("int", default=0, lo=0, hi=MAX_SEED),
        "compression": _Field("str", default="none", choices=COMPRESSIONS),
        "topk_ratio": _Field("float", default=0.01, lo=0.0, lo_open=True, hi=1.0),
        "aggregation_rule": _Field("str", default="mean", choices=AGGREGATION_RULES),
        "sync": _Field("str", default="sync", choices=SYNC_MODES),
        "inner_steps": _Field("int", default=None, lo=1, hi=MAX_INNER_STEPS),
        "inner_optimizer": _Field("str", default=None, choices=OPTIMIZERS),
        "outer_optimizer": _Field("str", default="nesterov", choices=OUTER_OPTIMIZERS),
        "outer_lr": _Field("float", default=0.7, lo=0.0, lo_open=True),
        "outer_momentum": _Field("float", default=0.9, lo=0.0, hi=1.0, hi_open=True),
    },
    "cluster": {
        "aggregation": _Field("str", default="ps", choices=AGGREGATIONS),
        "min_nodes": _Field("int", default=1, lo=1, hi=MAX_NODES),
        "max_nodes": _Field("int", default=8, lo=1, hi=MAX_NODES),
        "checkpoint_every": _Field("int", default=20, lo=1, hi=MAX_CHECKPOINT_EVERY),
        "priority": _Field("str", default=DEFAULT_PRIORITY, choices=PRIORITIES),
    },
    "market": {
        "max_price": _Field("credits"),
        "budget": _Field("credits"),
        "deadline": _Field("duration"),
    },
}


@dataclass(frozen=True)
class LoadedSpec:
    """A parsed job.toml: the proto plus what only the submitter's machine needs."""

    spec: common_pb2.JobSpec
    base_dir: Path  # directory of job.toml; relative paths resolve against it
    model_path: Path  # [model].file, resolved
    data_path: Path  # [data].train, resolved
    toml_text: str  # the original text (sent as SubmitJobRequest.spec_toml)


def load_spec(path: str | Path, *, check_files: bool = True) -> LoadedSpec:
    """Read and validate a job.toml; relative file names resolve against its directory."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"job file not found: {p}") from None
    except IsADirectoryError:
        raise SpecError(f"{p} is a directory; pass the path of the job.toml file") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{p} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise SpecError(f"cannot read job file {p}: {e.strerror or e}") from None
    return parse_spec(text, p.resolve().parent, source=p.name, check_files=check_files)


def parse_spec(
    text: str,
    base_dir: str | Path,
    *,
    source: str = "job.toml",
    check_files: bool = True,
) -> LoadedSpec:
    """Parse job.toml text. With check_files, the model and data files must exist."""
    base = Path(base_dir)
    where = _Locator(text, source)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            reason = msg[: m.start()].strip()
            raise SpecError(
                f"{source} line {m.group(1)}, column {m.group(2)}: not valid TOML: {reason}"
            ) from None
        raise SpecError(f"{source}: not valid TOML: {msg}") from None

    values = _read_document(doc, where)
    spec = _build_spec(values, where)
    validate_job_spec(spec)

    model_path = _resolve(base, values["model"]["file"])
    data_path = _resolve(base, values["data"]["train"])
    if check_files:
        if not model_path.is_file():
            raise SpecError(
                f"{where.at('model', 'file')}model file not found: {model_path} "
                "(set [model].file to a Python file that defines make_model())"
            )
        if not data_path.is_file():
            raise SpecError(
                f"{where.at('data', 'train')}dataset file not found: {data_path} "
                "(set [data].train to a .safetensors file)"
                + (
                    f"; run make_data.py in {base} first"
                    if (base / "make_data.py").is_file()
                    else ""
                )
            )
    return LoadedSpec(
        spec=spec, base_dir=base, model_path=model_path, data_path=data_path, toml_text=text
    )


def _resolve(base: Path, name: str) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else base / p


class _Locator:
    """Finds the line of `key` in `[section]` of the original text, for error messages."""

    _HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.lines = text.splitlines()

    def line_of(self, section: str | None, key: str | None) -> int | None:
        current: str | None = None
        section_line: int | None = None
        key_re = re.compile(r"^\s*[\"']?" + re.escape(key) + r"[\"']?\s*=") if key else None
        for i, line in enumerate(self.lines, start=1):
            h = self._HEADER.match(line)
            if h:
                current = h.group(1).strip().strip("\"'")
                if section is not None and current == section:
                    section_line = i
                continue
            if key_re is not None and current == section and key_re.match(line):
                return i
        return section_line

    def at(self, section: str | None, key: str | None = None) -> str:
        line = self.line_of(section, key)
        return f"{self.source} line {line}: " if line else f"{self.source}: "


def _label(section: str | None, key: str) -> str:
    return f"[{section}].{key}" if section else key


def _suggest(word: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    return "valid keys: " + ", ".join(valid)


def _read_document(doc: Mapping[str, Any], where: _Locator) -> dict[str, dict[str, Any]]:
    """Type- and range-check every key; returns {section: {key: value}} with "" = top level.

    Values of keys that were not given are None unless the field has a static default.
    The set of keys given explicitly is kept under values[section]["__given__"].
    """
    valid_top = list(_TOP) + list(_SECTIONS)
    for key, value in doc.items():
        if key in _TOP:
            continue
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise SpecError(
                    f"{where.at(None, key)}{key} must be a table: write [{key}] on its own "
                    "line followed by its keys"
                )
            continue
        hint = _suggest(key, valid_top)
        if isinstance(value, dict):
            raise SpecError(f"{where.at(key)}unknown section [{key}]; {_bracket_hint(hint)}")
        raise SpecError(f"{where.at(None, key)}unknown key {key}; {hint}")

    out: dict[str, dict[str, Any]] = {"": _read_table(doc, None, _TOP, where)}
    for section, fields in _SECTIONS.items():
        table = doc.get(section, {})
        for key in table:
            if key not in fields:
                hint = _suggest(key, list(fields))
                raise SpecError(
                    f"{where.at(section, key)}unknown key {_label(section, key)}; {hint}"
                )
        out[section] = _read_table(table, section, fields, where)
    return out


def _bracket_hint(hint: str) -> str:
    if hint.startswith("did you mean "):
        return f"did you mean [{hint[len('did you mean ') : -1]}]?"
    return "valid sections: " + ", ".join(f"[{s}]" for s in _SECTIONS)


def _read_table(
    table: Mapping[str, Any], section: str | None, fields: Mapping[str, _Field], where: _Locator
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    given: set[str] = set()
    for key, field in fields.items():
        if key in table:
            out[key] = _check_value(table[key], section, key, field, where)
            given.add(key)
        elif field.required:
            raise SpecError(
                f"{where.at(section)}missing required key {_label(section, key)}"
                + (f" in [{section}]" if section else "")
            )
        else:
            default = field.default
            out[key] = list(default) if isinstance(default, list) else default
    out["__given__"] = given
    return out


_TYPE_NAMES = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str_list": "a list of strings",
    "float_pair": "a list of two numbers",
    "credits": "an amount of credits (a number, e.g. 2.5)",
    "duration": 'a duration (seconds, or text like "30m", "2h")',
}


def _check_value(value: Any, section: str | None, key: str, field: _Field, where: _Locator) -> Any:
    label = _label(section, key)
    prefix = where.at(section, key)

    def bad_type() -> SpecError:
        return SpecError(f"{prefix}{label} must be {_TYPE_NAMES[field.kind]} (got {_show(value)})")

    if field.kind == "str":
        if not isinstance(value, str):
            raise bad_type()
        if field.choices is not None and value not in field.choices:
            raise SpecError(
                f"{prefix}{label} must be one of {', '.join(field.choices)} (got {value!r})"
                + _close_choice(value, field.choices)
            )
        if not value.strip():
            raise SpecError(f"{prefix}{label} must not be empty")
        return value
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise bad_type()
        return value
    if field.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                raise SpecError(f"{prefix}{label} must be an integer: write {int(value)}")
            raise bad_type()
        _check_range(value, field, f"{prefix}{label}")
        return value
    if field.kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_type()
        v = float(value)
        if not math.isfinite(v):
            raise SpecError(f"{prefix}{label} must be a finite number (got {value})")
        _check_range(v, field, f"{prefix}{label}")
        return v
    if field.kind == "credits":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise bad_type()
        try:
            return parse_credits(str(value), f"{prefix}{label}")
        except ValueError as exc:
            raise SpecError(str(exc)) from None
    if field.kind == "duration":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise bad_type()
        seconds = duration_seconds(value)
        if seconds is None or not 0 < seconds <= MAX_DEADLINE_S:
            raise SpecError(
                f"{prefix}{label} must be a duration above 0 and at most 365d, e.g. 90, "
                f'"30m", "2h" or "1d" (got {_show(value)})'
            )
        return seconds
    if field.kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad_type()
        return list(value)
    if field.kind == "float_pair":
        if (
            not isinstance(value, list)
            or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value)
        ):
            raise bad_type()
        pair = [float(v) for v in value]
        for i, v in enumerate(pair):
            if not math.isfinite(v):
                raise SpecError(f"{prefix}{label}[{i}] must be a finite number (got {v})")
            _check_range(v, field, f"{prefix}{label}[{i}]")
        return pair
    raise AssertionError(field.kind)


def _close_choice(value: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return repr(value)


def _check_range(v: float, field: _Field, what: str) -> None:
    if field.lo is not None and (v <= field.lo if field.lo_open else v < field.lo):
        raise SpecError(
            f"{what} must be {'>' if field.lo_open else '>='} {_num(field.lo)} (got {v})"
        )
    if field.hi is not None and (v >= field.hi if field.hi_open else v > field.hi):
        raise SpecError(
            f"{what} must be {'<' if field.hi_open else '<='} {_num(field.hi)} (got {v})"
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _build_spec(values: dict[str, dict[str, Any]], where: _Locator) -> common_pb2.JobSpec:
    top, model, data, train, cluster = (
        values[""],
        values["model"],
        values["data"],
        values["train"],
        values["cluster"],
    )
    given = train["__given__"]

    def err(section: str | None, key: str, msg: str) -> SpecError:
        return SpecError(f"{where.at(section, key)}{msg}")

    # Names.
    name = top["name"].strip()
    _check_name(name, lambda m: err(None, "name", m))
    _check_tensor_names(data["inputs"], "inputs", lambda m: err("data", "inputs", m))
    _check_tensor_names(data["targets"], "targets", lambda m: err("data", "targets", m))
    if not data["inputs"]:
        raise err("data", "inputs", "[data].inputs must name at least one tensor")
    loss = model["loss"]
    if loss != "custom" and len(data["targets"]) != 1:
        raise err(
            "data",
            "targets",
            f"[model].loss = {loss!r} takes exactly one target tensor; set [data].targets "
            f'= ["y"] (got {data["targets"]}) or define loss_fn in model.py and set '
            'loss = "custom"',
        )

    # Optimizer (in local_sgd mode: the inner optimizer).
    sync = train["sync"]
    optimizer = train["optimizer"]
    if train["inner_optimizer"] is not None:
        if sync != "local_sgd":
            raise err(
                "train", "inner_optimizer", _only_with("inner_optimizer", "sync", "local_sgd")
            )
        if "optimizer" in given and optimizer != train["inner_optimizer"]:
            raise err(
                "train",
                "inner_optimizer",
                f"[train].inner_optimizer = {train['inner_optimizer']!r} contradicts "
                f"[train].optimizer = {optimizer!r}; set only one of them",
            )
        optimizer = train["inner_optimizer"]
    for key in SGD_ONLY:
        if key in given and optimizer != "sgd":
            raise err(
                "train", key, _only_with(key, "optimizer", "sgd") + " (AdamW uses betas and eps)"
            )
    for key in ADAMW_ONLY:
        if key in given and optimizer != "adamw":
            raise err("train", key, _only_with(key, "optimizer", "adamw"))
    for key in LOCAL_SGD_ONLY:
        if key in given and sync != "local_sgd":
            raise err("train", key, _only_with(key, "sync", "local_sgd"))
    if "topk_ratio" in given and train["compression"] != "topk":
        raise err("train", "topk_ratio", _only_with("topk_ratio", "compression", "topk"))
    if (
        optimizer == "sgd"
        and train["nesterov"]
        and (train["momentum"] <= 0 or train["dampening"] != 0)
    ):
        raise err(
            "train",
            "nesterov",
            "[train].nesterov = true needs momentum > 0 and dampening = 0 (as in torch.optim.SGD)",
        )
    weight_decay = train["weight_decay"]
    if weight_decay is None:
        weight_decay = ADAMW_DEFAULT_WEIGHT_DECAY if optimizer == "adamw" else 0.0

    if cluster["min_nodes"] > cluster["max_nodes"]:
        raise err(
            "cluster",
            "min_nodes",
            f"[cluster].min_nodes ({cluster['min_nodes']}) must be <= max_nodes "
            f"({cluster['max_nodes']})",
        )
    if train["global_batch"] < cluster["min_nodes"]:
        raise err(
            "train",
            "global_batch",
            f"[train].global_batch ({train['global_batch']}) is smaller than [cluster].min_nodes "
            f"({cluster['min_nodes']}): every node needs at least one sample per round; raise "
            "global_batch or lower min_nodes",
        )

    spec = common_pb2.JobSpec(
        name=name,
        loss=loss,
        inputs=data["inputs"],
        targets=data["targets"],
        epochs=train["epochs"],
        global_batch=train["global_batch"],
        micro_batch=train["micro_batch"],
        optimizer=optimizer,
        lr=train["lr"],
        weight_decay=weight_decay,
        seed=train["seed"],
        sync=sync,
        compression=train["compression"],
        aggregation_rule="" if train["aggregation_rule"] == "mean" else train["aggregation_rule"],
        aggregation=cluster["aggregation"],
        min_nodes=cluster["min_nodes"],
        max_nodes=cluster["max_nodes"],
        checkpoint_every=cluster["checkpoint_every"],
        priority=cluster["priority"],
    )
    if optimizer == "sgd":
        spec.momentum = train["momentum"]
        spec.dampening = train["dampening"]
        spec.nesterov = train["nesterov"]
    else:
        spec.beta1, spec.beta2 = train["betas"]
        spec.eps = train["eps"]
    if train["compression"] == "topk":
        spec.topk_ratio = train["topk_ratio"]
    if sync == "local_sgd":
        spec.inner_steps = (
            train["inner_steps"]
            if train["inner_steps"] is not None
            else DEFAULT_LOCAL_SGD_INNER_STEPS
        )
        spec.inner_optimizer = optimizer
        spec.outer_optimizer = train["outer_optimizer"]
        spec.outer_lr = train["outer_lr"]
        spec.outer_momentum = train["outer_momentum"]
    else:
        spec.inner_steps = 1
    market = values["market"]
    if market["max_price"] is not None:
        spec.max_price_micro_per_hour = market["max_price"]
    if market["budget"] is not None:
        spec.budget_micro = market["budget"]
    if market["deadline"] is not None:
        spec.deadline_seconds = market["deadline"]
    return spec


def _only_with(key: str, switch: str, value: str) -> str:
    return (
        f"[train].{key} applies only with {switch} = {value!r}; "
        f"remove it or set {switch} = {value!r}"
    )


def _check_name(name: str, err: Callable[[str], SpecError]) -> None:
    if not name:
        raise err("name must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise err(f"name must be at most {MAX_NAME_CHARS} characters (got {len(name)})")
    if not name.isprintable():
        raise err("name must contain printable characters only")


def _check_tensor_names(names: list[str], what: str, err: Callable[[str], SpecError]) -> None:
    seen: set[str] = set()
    for n in names:
        if not n or len(n) > MAX_TENSOR_NAME_CHARS or not n.isprintable():
            raise err(
                f"[data].{what}: {n!r} is not a valid tensor name (1..{MAX_TENSOR_NAME_CHARS} "
                "printable characters)"
            )
        if n in seen:
            raise err(f"[data].{what} names {n!r} twice")
        seen.add(n)


def validate_job_spec(spec: common_pb2.JobSpec) -> None:
    """Check a JobSpec (e.g. from SubmitJob) field by field; raises SpecError.

    Fields that do not apply to the chosen optimizer / sync mode / compression are ignored.
    """

    def err(msg: str) -> SpecError:
        return SpecError(f"invalid job spec: {msg}")

    _check_name(spec.name.strip(), err)
    if spec.loss not in LOSSES:
        raise err(f"loss must be one of {', '.join(LOSSES)} (got {spec.loss!r})")
    if not spec.inputs:
        raise err("inputs must name at least one tensor")
    _check_tensor_names(list(spec.inputs), "inputs", err)
    _check_tensor_names(list(spec.targets), "targets", err)
    if spec.loss != "custom" and len(spec.targets) != 1:
        raise err(f"loss {spec.loss!r} takes exactly one target (got {len(spec.targets)})")

    def rng(
        name: str,
        v: float,
        lo: float,
        hi: float | None,
        lo_open: bool = False,
        hi_open: bool = False,
    ) -> None:
        if not math.isfinite(v):
            raise err(f"{name} must be finite (got {v})")
        if (v <= lo) if lo_open else (v < lo):
            raise err(f"{name} must be {'>' if lo_open else '>='} {_num(lo)} (got {v})")
        if hi is not None and ((v >= hi) if hi_open else (v > hi)):
            raise err(f"{name} must be {'<' if hi_open else '<='} {_num(hi)} (got {v})")

    rng("epochs", spec.epochs, 1, MAX_EPOCHS)
    rng("global_batch", spec.global_batch, 1, MAX_GLOBAL_BATCH)
    rng("micro_batch", spec.micro_batch, 0, MAX_GLOBAL_BATCH)
    if spec.optimizer not in OPTIMIZERS:
        raise err(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {spec.optimizer!r})")
    rng("lr", spec.lr, 0.0, None, lo_open=True)
    rng("weight_decay", spec.weight_decay, 0.0, None)
    rng("seed", spec.seed, 0, MAX_SEED)
    if spec.optimizer == "sgd":
        rng("momentum", spec.momentum, 0.0, 1.0)
        rng("dampening", spec.dampening, 0.0, 1.0)
        if spec.nesterov and (spec.momentum <= 0 or spec.dampening != 0):
            raise err("nesterov needs momentum > 0 and dampening = 0")
    else:
        rng("beta1", spec.beta1, 0.0, 1.0, hi_open=True)
        rng("beta2", spec.beta2, 0.0, 1.0, hi_open=True)
        rng("eps", spec.eps, 0.0, None, lo_open=True)
    if spec.compression not in COMPRESSIONS:
        raise err(
            f"compression must be one of {', '.join(COMPRESSIONS)} (got {spec.compression!r})"
        )
    if spec.compression == "topk":
        rng("topk_ratio", spec.topk_ratio, 0.0, 1.0, lo_open=True)
    if spec.aggregation_rule not in ("", *AGGREGATION_RULES):
        raise err(
            f"aggregation_rule must be one of {', '.join(AGGREGATION_RULES)} "
            f"(got {spec.aggregation_rule!r})"
        )
    if spec.aggregation_rule not in ("", "mean") and spec.aggregation == "ring":
        raise err('aggregation_rule applies to the parameter server (aggregation = "ps")')
    if spec.sync not in SYNC_MODES:
        raise err(f"sync must be one of {', '.join(SYNC_MODES)} (got {spec.sync!r})")
    if spec.sync == "local_sgd":
        rng("inner_steps", spec.inner_steps, 1, MAX_INNER_STEPS)
        if spec.inner_optimizer not in ("", spec.optimizer):
            raise err(
                f"inner_optimizer ({spec.inner_optimizer!r}) must equal optimizer "
                f"({spec.optimizer!r})"
            )
        if spec.outer_optimizer not in OUTER_OPTIMIZERS:
            raise err(
                f"outer_optimizer must be one of {', '.join(OUTER_OPTIMIZERS)} "
                f"(got {spec.outer_optimizer!r})"
            )
        rng("outer_lr", spec.outer_lr, 0.0, None, lo_open=True)
        rng("outer_momentum", spec.outer_momentum, 0.0, 1.0, hi_open=True)
    elif spec.inner_steps not in (0, 1):
        raise err(f"inner_steps must be 1 with sync = 'sync' (got {spec.inner_steps})")
    if spec.aggregation not in AGGREGATIONS:
        raise err(
            f"aggregation must be one of {', '.join(AGGREGATIONS)} (got {spec.aggregation!r})"
        )
    rng("min_nodes", spec.min_nodes, 1, MAX_NODES)
    rng("max_nodes", spec.max_nodes, 1, MAX_NODES)
    if spec.min_nodes > spec.max_nodes:
        raise err(f"min_nodes ({spec.min_nodes}) must be <= max_nodes ({spec.max_nodes})")
    if spec.global_batch < spec.min_nodes:
        raise err(
            f"global_batch ({spec.global_batch}) is smaller than min_nodes ({spec.min_nodes}): "
            "every node needs at least one sample per round"
        )
    rng("checkpoint_every", spec.checkpoint_every, 1, MAX_CHECKPOINT_EVERY)
    if spec.priority and spec.priority not in PRIORITIES:  # empty: a job from before priorities
        raise err(f"priority must be one of {', '.join(PRIORITIES)} (got {spec.priority!r})")
    for name in ("max_price_micro_per_hour", "budget_micro"):
        if spec.HasField(name) and not 0 <= getattr(spec, name) <= MAX_CREDITS * MICRO:
            raise err(f"{name} must be within 0..{MAX_CREDITS * MICRO} micro-credits")
    if spec.HasField("deadline_seconds") and not 0 < spec.deadline_seconds <= MAX_DEADLINE_S:
        raise err(f"deadline_seconds must be above 0 and at most {MAX_DEADLINE_S:g}")


def spec_to_dict(spec: common_pb2.JobSpec) -> dict[str, Any]:
    """The spec as nested sections like job.toml, listing only the fields that apply."""
    market: dict[str, Any] = {}
    if spec.HasField("max_price_micro_per_hour"):
        market["max_price"] = format_credits(spec.max_price_micro_per_hour)
    if spec.HasField("budget_micro"):
        market["budget"] = format_credits(spec.budget_micro)
    if spec.HasField("deadline_seconds"):
        market["deadline"] = spec.deadline_seconds
    train: dict[str, Any] = {
        "epochs": spec.epochs,
        "global_batch": spec.global_batch,
        "optimizer": spec.optimizer,
        "lr": spec.lr,
    }
    if spec.optimizer == "sgd":
        train.update(momentum=spec.momentum, dampening=spec.dampening, nesterov=spec.nesterov)
    else:
        train.update(betas=[spec.beta1, spec.beta2], eps=spec.eps)
    train["weight_decay"] = spec.weight_decay
    if spec.micro_batch:
        train["micro_batch"] = spec.micro_batch
    train["seed"] = spec.seed
    train["compression"] = spec.compression
    if spec.compression == "topk":
        train["topk_ratio"] = spec.topk_ratio
    if spec.aggregation_rule not in ("", "mean"):
        train["aggregation_rule"] = spec.aggregation_rule
    train["sync"] = spec.sync
    if spec.sync == "local_sgd":
        train.update(
            inner_steps=spec.inner_steps,
            inner_optimizer=spec.inner_optimizer or spec.optimizer,
            outer_optimizer=spec.outer_optimizer,
            outer_lr=spec.outer_lr,
            outer_momentum=spec.outer_momentum,
        )
    return {
        "name": spec.name,
        "model": {"loss": spec.loss},
        "data": {"inputs": list(spec.inputs), "targets": list(spec.targets)},
        "train": train,
        "cluster": {
            "aggregation": spec.aggregation,
            "min_nodes": spec.min_nodes,
            "max_nodes": spec.max_nodes,
            "checkpoint_every": spec.checkpoint_every,
            "priority": spec.priority or DEFAULT_PRIORITY,
        },
        **({"market": market} if market else {}),
    }
