"""The exported training program (model + loss) as an agent or a reference runs it.

`TrainableProgram.from_bytes(program, initial_state, device)` checks the archive with
`validate_program_archive`, loads it with torch.export.load, replaces its weights with the
safetensors `initial_state` (the parameters and buffers of make_model().state_dict()), and
exposes named parameters, gradients of the mean loss, and the state dict, all keyed exactly like
make_model().state_dict() (no wrapper prefix)::

    prog = TrainableProgram.from_bytes(program, initial_state, torch.device("cpu"))
    opt = build_optimizer(spec, prog.parameters())
    loss, grads = prog.loss_and_grads([x], [y])   # grads: float32, on prog.device

The program runs in training mode (dropout active, batch norm using batch statistics and
updating its running statistics): torch.export's module cannot switch modes (`.train()` /
`.eval()` raise NotImplementedError), so packaging exports the training behaviour only.

Tied weights (one tensor under several state_dict keys) come untied out of torch.export.load;
packaging records them in the initial state's metadata and `from_bytes` ties them again, so
`param_names` lists each trainable tensor once (like make_model().named_parameters()).

Donor safety. torch.export.load trusts its input: it falls back to full unpickling for some
payloads, loads native AOTInductor code when present, evaluates guard code with `exec`, parses
symbolic shapes with sympy (which `eval`s and computes exactly: a crafted expression runs
arbitrary Python, or `9**9**9**9` for ever, at load time), imports modules named in pytree
specs, and resolves graph targets by attribute lookup on `torch`; and an ATen kernel trusts some
of its inputs (a sparse tensor built without its invariant checks writes out of bounds).
`validate_program_archive` therefore accepts only the layout torch.export.save writes for one
training graph: stored (uncompressed) entries; no pickled or custom objects, native code or
extra files; empty sample inputs; graph targets limited to the reviewed ATen operators of
`epochmesh.program.op_allowlist` (core ATen and what torch.export emits for ordinary layers, less
sparse, nested and quantized tensors, raw storage and stride access and file operators), a few
arithmetic helpers on sizes, and no_grad/autocast regions whose subgraphs are checked the same
way; strided tensors of plain dtypes only; identifier-like names; guards and symbolic shapes
limited to the arithmetic torch.export writes for a dynamic batch size (no powers, bounded
constants, length and nesting); declared weight sizes bounded by the archive size. Packaging
runs the same check, so a model that would be refused fails on the submitter's machine with an
ExportError. (Runtime resource limits, e.g. a graph that allocates huge tensors, are the
agent's business: run programs in a process with memory limits.)
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from epochmesh.errors import CodecError, ProgramError
from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS
from epochmesh.program.shape_check import ShapeCheck, batch_ranges
from epochmesh.program.zero_fill import zero_fill_uninitialised
from epochmesh.wire.tensors import from_safetensors, safetensors_metadata, to_safetensors

WRAPPER_PREFIX = "model."
# initial_state metadata written by packaging:
ALIASES_METADATA_KEY = "epochmesh.aliases"  # {alias: canonical} of tied weights
PARAMS_METADATA_KEY = "epochmesh.params"  # trainable parameter names, in state_dict order
MAX_PROGRAM_BYTES = 2 << 30
MAX_MODEL_JSON_BYTES = 256 << 20

# ---------------------------------------------------------------------------------------------
# Archive validation


_FQN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SYMBOL = re.compile(r"^[a-z]+[0-9]+$")
_ATEN_TARGET = re.compile(r"^torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")
_FIXED_FILES = {
    "archive_format",
    "archive_version",
    ".data/version",
    "byteorder",
    ".data/serialization_id",
    "models/model.json",
    "data/sample_inputs/model.pt",
    "data/weights/model_weights_config.json",
    "data/constants/model_constants_config.json",
}
_WEIGHT_FILE = re.compile(r"^data/weights/(weight_[0-9]+)$")
_CONSTANT_FILE = re.compile(r"^data/constants/(tensor_[0-9]+)$")

# Python operators on symbolic sizes. No `pow`: export emits it only for a power of the batch
# size, whose shape expression (Pow, FloatPow) is refused anyway, and a crafted power node runs
# for ever.
_OPERATOR_TARGETS = {
    f"_operator.{n}"
    for n in (
        "getitem add sub mul truediv floordiv mod neg pos abs eq ne lt le gt ge "
        "and_ or_ xor not_ invert"
    ).split()
}
_OTHER_TARGETS = {
    "torch.sym_not",
    "torch.sym_max",
    "torch.sym_min",
    "torch.sym_float",
    "torch.sym_int",
    "torch.sym_ite",
    "torch.sym_sqrt",
    "torch.sym_sum",
    "torch._sym_sqrt",
    "math.floor",
    "math.ceil",
    "math.trunc",
    "math.sqrt",
}
# Higher-order operators whose subgraphs are checked like the main graph (torch.no_grad() /
# torch.autocast regions inside forward).
_HOP_TARGETS = {
    "torch.ops.higher_order.wrap_with_set_grad_enabled",
    "torch.ops.higher_order.wrap_with_autocast",
}
# Only to say why an operator off the list is refused (the list alone decides).
_ATEN_FILE_ARG = re.compile(r"file|path", re.IGNORECASE)
_ALLOW_LIST_REFUSAL = (
    "not on epochmesh's operator allow-list: sparse, nested and quantized tensors, raw "
    "storage/stride access and file operators are refused"
)

# Tensor layouts and dtypes as the archive numbers them (torch._export.serde.schema Layout and
# ScalarType): strided tensors only; every dtype but UNKNOWN (quantized dtypes have no number).
_STRIDED = 7
_LAYOUTS = {0: "Unknown", 1: "SparseCoo", 2: "SparseCsr", 3: "SparseCsc", 4: "SparseBsr",
            5: "SparseBsc", 6: "_mkldnn", 7: "Strided"}  # fmt: skip
_DTYPES = frozenset(range(1, 14)) | frozenset(range(28, 36))

# Symbolic shape expressions (sympy.sympify evaluates them exactly) and guards (exec'd when the
# module runs): the arithmetic torch.export writes for a dynamic batch size, e.g.
# "Mul(Integer(4), Symbol('s33', positive=True, integer=True))" or
# "L['args'][0].size()[0] == L['args'][1].size()[0]". No powers or shifts (exact big-number
# arithmetic), integers within int64 (sizes, strides and offsets are), bounded length and depth.
_SYM_FUNCS = {
    "Symbol", "Integer", "Add", "Mul", "Max", "Min", "FloorDiv", "CeilDiv", "Mod", "PythonMod",
    "IntTrueDiv", "ToFloat", "FloatTrueDiv", "Eq", "Ne", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not",
}  # fmt: skip
_SYM_NAMES = {"true", "false"}
_POW_NAMES = {"Pow", "PowByNatural", "FloatPow"}
_POW_REFUSAL = "powers are refused (**, Pow, PowByNatural, FloatPow)"
_SYMBOL_KEYWORDS = {"positive", "integer", "real", "nonnegative", "finite", "negative"}
_GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_FUNCS = {"Max", "Min", "Abs", "FloorDiv", "Mod", "PythonMod", "CeilDiv", "IntTrueDiv"}
_MAX_EXPR_CHARS = 1000
_MAX_EXPR_DEPTH = 20
_MAX_INT = 2**63  # |constant| below it: a size, stride or offset is an int64

_BIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
_UNARY_OPS = (ast.USub, ast.UAdd, ast.Not)
_CMP_OPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def validate_program_archive(program: bytes | bytearray | memoryview) -> None:
    """Raise ProgramError unless `program` is a plain torch.export.save archive safe to load."""
    data = bytes(program)
    if len(data) > MAX_PROGRAM_BYTES:
        raise ProgramError(f"program of {len(data)} bytes exceeds {MAX_PROGRAM_BYTES}")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ProgramError(f"program is not a torch.export archive (zip): {e}") from None
    if not infos:
        raise ProgramError("program archive is empty")
    root = infos[0].filename.split("/", 1)[0]
    files: dict[str, zipfile.ZipInfo] = {}
    weights: set[str] = set()
    constants: set[str] = set()
    for info in infos:
        name = info.filename
        if not name.startswith(root + "/") or not _IDENT.match(root):
            raise ProgramError(f"program archive entry {name!r} is outside its root folder")
        rel = name[len(root) + 1 :]
        if info.compress_type != zipfile.ZIP_STORED:
            raise ProgramError(f"program archive entry {rel!r} is compressed")
        if rel in files:
            raise ProgramError(f"program archive has {rel!r} twice")
        if m := _WEIGHT_FILE.match(rel):
            weights.add(m.group(1))
        elif m := _CONSTANT_FILE.match(rel):
            constants.add(m.group(1))
        elif rel not in _FIXED_FILES:
            raise ProgramError(
                f"program archive contains {rel!r}, which agents do not load (only one "
                "exported graph with its weights is accepted: no native code, pickles or "
                "extra files)"
            )
        files[rel] = info
    for required in ("archive_version", "models/model.json", "data/sample_inputs/model.pt"):
        if required not in files:
            raise ProgramError(f"program archive lacks {required!r}")
    if files["data/sample_inputs/model.pt"].file_size != 0:
        raise ProgramError(
            "program archive carries pickled sample inputs; export with example_inputs = None"
        )
    if "byteorder" in files and zf.read(files["byteorder"]).decode(errors="replace") != "little":
        raise ProgramError("program archive is not little-endian")

    def read_json(rel: str) -> Any:
        info = files[rel]
        if info.file_size > MAX_MODEL_JSON_BYTES:
            raise ProgramError(f"{rel} is too large ({info.file_size} bytes)")
        try:
            return json.loads(zf.read(info))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProgramError(f"{rel} is not JSON: {e}") from None

    declared = 0
    for rel, allowed_paths, prefix in (
        ("data/weights/model_weights_config.json", weights, "weight_"),
        ("data/constants/model_constants_config.json", constants, "tensor_"),
    ):
        if rel not in files:
            if allowed_paths:
                raise ProgramError(f"program archive lacks {rel!r}")
            continue
        cfg = read_json(rel)
        declared += _check_payload_config(rel, cfg, allowed_paths, prefix)
        for fqn, meta in cfg["config"].items():
            _check_tensor_meta(f"{rel}: tensor {fqn!r}", meta["tensor_meta"])
    # torch.export.load allocates zeros for empty weight records of any declared size: bound it.
    if declared * 8 > 16 * len(data) + (1 << 20):
        raise ProgramError(
            f"program declares {declared} weight elements, far more than its {len(data)} bytes hold"
        )

    model = read_json("models/model.json")
    _check_model(model)


def _check_payload_config(rel: str, cfg: Any, files: set[str], prefix: str) -> int:
    """Checks names, files and no-pickle; returns the number of elements declared."""
    config = cfg.get("config") if isinstance(cfg, dict) else None
    if not isinstance(config, dict):
        raise ProgramError(f"{rel}: expected an object with a 'config' object")
    declared = 0
    for fqn, meta in config.items():
        if not isinstance(fqn, str) or not _FQN.match(fqn):
            raise ProgramError(f"{rel}: invalid tensor name {fqn!r}")
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise ProgramError(f"{rel}: {fqn!r} is stored with pickle; agents refuse pickles")
        path = meta.get("path_name")
        if not isinstance(path, str) or not path.startswith(prefix) or path not in files:
            raise ProgramError(f"{rel}: {fqn!r} points to a missing or foreign file {path!r}")
        sizes = (meta.get("tensor_meta") or {}).get("sizes")
        if not isinstance(sizes, list):
            raise ProgramError(f"{rel}: {fqn!r} has no sizes")
        numel = 1
        for d in sizes:
            v = d.get("as_int") if isinstance(d, dict) else None
            if type(v) is not int or v < 0:
                raise ProgramError(f"{rel}: {fqn!r} has a non-constant or negative size")
            numel *= v
        declared += numel
    return declared


def _check_model(model: Any) -> None:
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise ProgramError("models/model.json: not an exported program")
    gm = model["graph_module"]
    if model.get("verifiers") not in ([], ["TRAINING"], None):
        raise ProgramError(f"unsupported verifiers {model.get('verifiers')!r}")
    for guard in model.get("guards_code") or []:
        if not isinstance(guard, str):
            raise ProgramError("guards_code entries must be strings")
        _check_guard(guard)
    rc = model.get("range_constraints") or {}
    if not isinstance(rc, dict):
        raise ProgramError("range_constraints must be an object")
    for sym in rc:
        _check_sym_expr(sym)
    if gm.get("treespec_namedtuple_fields"):
        raise ProgramError("programs with namedtuple inputs or outputs are not supported")
    subgraphs: set[int] = set()
    _check_graph(gm.get("graph"), subgraphs, depth=0)
    _check_signature(gm.get("signature"))
    for entry in gm.get("module_call_graph") or []:
        if not isinstance(entry, dict):
            raise ProgramError("module_call_graph entry is not an object")
        fqn = entry.get("fqn", "")
        if fqn and (not isinstance(fqn, str) or not _FQN.match(fqn)):
            raise ProgramError(f"invalid module name {fqn!r}")
        sig = entry.get("signature")
        if sig:
            for key in ("in_spec", "out_spec"):
                _check_treespec(sig.get(key))
            for arg in sig.get("forward_arg_names") or []:
                if not isinstance(arg, str) or not _IDENT.match(arg):
                    raise ProgramError(f"invalid forward argument name {arg!r}")
    _walk(model, subgraphs)


def _check_graph(graph: Any, subgraphs: set[int], depth: int) -> None:
    """Every node's target and enum arguments, recursively into the subgraphs of allowed
    higher-order ops, then the graph's tensors."""
    if not isinstance(graph, dict):
        raise ProgramError("models/model.json: missing graph")
    if depth > 8:
        raise ProgramError("program graphs are nested too deeply")
    if graph.get("custom_obj_values"):
        raise ProgramError("programs with custom (script) objects are not supported")
    for node in graph.get("nodes") or []:
        if not isinstance(node, dict):
            raise ProgramError("graph node is not an object")
        target = _check_target(node.get("target"))
        for inp in node.get("inputs") or []:
            arg = inp.get("arg") if isinstance(inp, dict) else None
            if not isinstance(arg, dict):
                continue
            _check_enum_arg(arg, f"operator {target.removeprefix('torch.ops.')}")
            if "as_graph" in arg:
                sub = arg["as_graph"]
                if target not in _HOP_TARGETS or not isinstance(sub, dict):
                    raise ProgramError(
                        f"nested graphs are only accepted for {', '.join(sorted(_HOP_TARGETS))}"
                    )
                name = sub.get("name")
                if not isinstance(name, str) or not _IDENT.match(name):
                    raise ProgramError(f"invalid subgraph name {name!r}")
                subgraphs.add(id(sub))
                _check_graph(sub.get("graph"), subgraphs, depth + 1)
    values = graph.get("tensor_values") or {}
    if not isinstance(values, dict):
        raise ProgramError("models/model.json: tensor_values must be an object")
    for name, meta in values.items():
        _check_tensor_meta(f"tensor {_excerpt(name)}", meta)


def _check_tensor_meta(what: str, meta: Any) -> None:
    """A tensor the archive describes: strided, of a plain dtype."""
    if not isinstance(meta, dict):
        raise ProgramError(f"{what}: malformed tensor metadata")
    _check_layout(meta.get("layout"), f"{what} has")
    _check_dtype(meta.get("dtype"), f"{what} has")


def _check_enum_arg(arg: Mapping[str, Any], who: str) -> None:
    """A layout or dtype passed to an operator (layout=, dtype= of a factory or a copy)."""
    if "as_layout" in arg:
        _check_layout(arg["as_layout"], f"{who} is given")
    if "as_scalar_type" in arg:
        _check_dtype(arg["as_scalar_type"], f"{who} is given")


def _check_layout(layout: Any, prefix: str) -> None:
    if type(layout) is not int or layout != _STRIDED:
        name = _LAYOUTS.get(layout, repr(layout)) if type(layout) is int else repr(layout)
        raise ProgramError(
            f"{prefix} layout {name} (only strided tensors are accepted: sparse, mkldnn and "
            "other layouts are refused)"
        )


def _check_dtype(dtype: Any, prefix: str) -> None:
    if type(dtype) is not int or dtype not in _DTYPES:
        raise ProgramError(
            f"{prefix} dtype {dtype!r}, not a plain dtype (quantized and unknown dtypes are "
            "refused)"
        )


def _check_signature(sig: Any) -> None:
    if not isinstance(sig, dict):
        raise ProgramError("models/model.json: missing graph signature")
    allowed_inputs = {"parameter", "buffer", "tensor_constant", "user_input"}
    for spec in sig.get("input_specs") or []:
        kinds = set(spec) if isinstance(spec, dict) else set()
        if len(kinds) != 1 or not kinds <= allowed_inputs:
            raise ProgramError(f"unsupported program input kind {sorted(kinds)}")
        if "user_input" in kinds and "as_tensor" not in (spec["user_input"].get("arg") or {}):
            raise ProgramError("program inputs must all be tensors")
    _strings_match(sig, _FQN, "signature name")


def _strings_match(obj: Any, pattern: re.Pattern[str], what: str) -> None:
    if isinstance(obj, str):
        if not pattern.match(obj):
            raise ProgramError(f"invalid {what} {obj!r}")
    elif isinstance(obj, dict):
        for v in obj.values():
            _strings_match(v, pattern, what)
    elif isinstance(obj, list):
        for v in obj:
            _strings_match(v, pattern, what)


def _walk(obj: Any, subgraphs: set[int]) -> None:
    """Checks every symbolic expression, layout and dtype anywhere in the JSON, and that the
    only nested graphs are the checked subgraphs of allowed higher-order ops."""
    if isinstance(obj, dict):
        _check_enum_arg(obj, "the program")
        for k, v in obj.items():
            if k == "expr_str":
                if not isinstance(v, str):
                    raise ProgramError("expr_str must be a string")
                _check_sym_expr(v)
            elif k == "as_graph" and id(v) not in subgraphs:
                raise ProgramError(
                    "programs with nested graphs (torch.cond, torch.while_loop, ...) are not "
                    "supported"
                )
            elif k in ("as_custom_obj", "as_custom_objs", "as_graphs"):
                raise ProgramError("programs with custom objects are not supported")
            elif isinstance(k, str) and "__enum__" in k:
                raise ProgramError("programs with enum objects are not supported")
            _walk(v, subgraphs)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, subgraphs)


def _check_target(target: Any) -> str:
    """``target`` when the program may call it; ProgramError otherwise."""
    if not isinstance(target, str):
        raise ProgramError("graph node without a target")
    if target in _OPERATOR_TARGETS or target in _OTHER_TARGETS or target in _HOP_TARGETS:
        return target
    m = _ATEN_TARGET.match(target)
    if not m:
        raise ProgramError(
            f"the program calls {_excerpt(target)}; agents only run ATen operators (avoid custom "
            "ops, torch.cond and other control-flow operators in the model)"
        )
    op = f"aten.{m.group(1)}.{m.group(2)}"
    if op in ALLOWED_ATEN_OPS:
        return target
    try:
        schema = getattr(getattr(torch.ops.aten, m.group(1)), m.group(2))._schema
        why = _ALLOW_LIST_REFUSAL
        if any(_ATEN_FILE_ARG.search(a.name) for a in schema.arguments):
            why = "it accesses files"
    except (AttributeError, RuntimeError):
        why = "unknown operator"
    raise ProgramError(f"operator {op} is not allowed ({why})")


def _check_treespec(spec: Any) -> None:
    if spec is None:
        return
    if not isinstance(spec, str):
        raise ProgramError("treespec must be a JSON string")
    try:
        version, tree = json.loads(spec)
    except (json.JSONDecodeError, TypeError, ValueError):
        raise ProgramError("treespec is not valid JSON") from None

    def node(n: Any) -> None:
        if not isinstance(n, dict):
            raise ProgramError("malformed treespec")
        t = n.get("type")
        if t not in (None, "builtins.tuple", "builtins.list", "builtins.dict"):
            raise ProgramError(f"program inputs/outputs use unsupported container {t!r}")
        ctx = n.get("context")
        if ctx is not None:
            if not isinstance(ctx, str) or "__enum__" in ctx:
                raise ProgramError("malformed treespec context")
            try:
                parsed = json.loads(ctx)
            except json.JSONDecodeError:
                raise ProgramError("malformed treespec context") from None
            if parsed is not None and not (
                isinstance(parsed, list) and all(isinstance(x, str | int) for x in parsed)
            ):
                raise ProgramError("malformed treespec context")
        for child in n.get("children_spec") or []:
            node(child)

    if not isinstance(version, int):
        raise ProgramError("malformed treespec")
    node(tree)


def _excerpt(text: Any, limit: int = 80) -> str:
    """`text` quoted on one line, cut to about `limit` characters."""
    text = str(text)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _parse(expr: str, what: str) -> ast.expr:
    if len(expr) > _MAX_EXPR_CHARS:
        raise _refusal(what, expr, f"longer than {_MAX_EXPR_CHARS} characters")
    try:
        return ast.parse(expr, mode="eval").body
    except (SyntaxError, ValueError):  # ValueError: null bytes
        raise _refusal(what, expr, "not a Python expression") from None


def _refusal(what: str, expr: str, why: str) -> ProgramError:
    return ProgramError(f"unsupported {what} {_excerpt(expr)}: {why}")


def _constant_problem(value: Any) -> str | None:
    """Why a literal may not appear in an expression, or None."""
    if type(value) not in (int, float, bool):
        return f"constant {_excerpt(value, 20)} is not a number"
    if type(value) is int and abs(value) >= _MAX_INT:
        return "integer constants are limited to the int64 range"
    return None


def _check_sym_expr(expr: str) -> None:
    """A symbolic shape expression (sympy.sympify evaluates it): the arithmetic torch.export
    writes for a dynamic batch size only."""
    what = "symbolic expression"

    def check(n: ast.AST, depth: int) -> None:
        if depth > _MAX_EXPR_DEPTH:
            raise _refusal(what, expr, f"nested deeper than {_MAX_EXPR_DEPTH} levels")
        if isinstance(n, ast.Constant):
            if problem := _constant_problem(n.value):
                raise _refusal(what, expr, problem)
        elif isinstance(n, ast.Name):
            if not (_SYMBOL.match(n.id) or n.id in _SYM_NAMES):
                raise _refusal(what, expr, f"unknown name {n.id!r}")
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
            raise _refusal(what, expr, _POW_REFUSAL)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, _BIN_OPS):
            check(n.left, depth + 1)
            check(n.right, depth + 1)
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, _UNARY_OPS):
            check(n.operand, depth + 1)
        elif isinstance(n, ast.Compare) and all(isinstance(o, _CMP_OPS) for o in n.ops):
            for c in [n.left, *n.comparators]:
                check(c, depth + 1)
        elif isinstance(n, ast.BoolOp):
            for v in n.values:
                check(v, depth + 1)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            name = n.func.id
            if name in _POW_NAMES:
                raise _refusal(what, expr, _POW_REFUSAL)
            if name not in _SYM_FUNCS:
                raise _refusal(what, expr, f"unknown function {name!r}")
            if name == "Symbol":
                check_symbol(n)
                return
            if n.keywords:
                raise _refusal(what, expr, f"{name}() takes no keywords")
            if name == "Integer" and not (len(n.args) == 1 and is_int(n.args[0])):
                raise _refusal(what, expr, "Integer() takes one integer")
            for a in n.args:
                check(a, depth + 1)
        else:
            raise _refusal(
                what, expr, "only the arithmetic torch.export writes for a batch size is accepted"
            )

    def is_int(n: ast.AST) -> bool:
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            n = n.operand
        return isinstance(n, ast.Constant) and type(n.value) is int

    def check_symbol(n: ast.Call) -> None:
        if not (
            len(n.args) == 1
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
            and _SYMBOL.match(n.args[0].value)
        ):
            raise _refusal(what, expr, "unsupported Symbol(...)")
        for kw in n.keywords:
            if kw.arg not in _SYMBOL_KEYWORDS or not (
                isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool)
            ):
                raise _refusal(what, expr, "unsupported keyword of Symbol(...)")

    check(_parse(expr, what), 0)


def _check_guard(guard: str) -> None:
    """A guard (exec'd when the module runs): arithmetic over input sizes only."""
    what = "guard"

    def is_input_ref(n: ast.AST) -> bool:
        # L['args'][0] / L['x'] / L['args'][0][1] ...
        if isinstance(n, ast.Name):
            return n.id == "L"
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            v = n.slice.value
            ok = (isinstance(v, int) and not isinstance(v, bool) and abs(v) < _MAX_INT) or (
                isinstance(v, str) and _IDENT.match(v) is not None
            )
            return ok and is_input_ref(n.value)
        return False

    def unsupported() -> ProgramError:
        return _refusal(what, guard, "only comparisons of input sizes are accepted")

    def check(n: ast.AST, depth: int) -> None:
        if depth > _MAX_EXPR_DEPTH:
            raise _refusal(what, guard, f"nested deeper than {_MAX_EXPR_DEPTH} levels")
        if isinstance(n, ast.Constant):
            if problem := _constant_problem(n.value):
                raise _refusal(what, guard, problem)
        elif isinstance(n, ast.Subscript):
            # <input>.size()[i]
            if not (
                isinstance(n.slice, ast.Constant)
                and type(n.slice.value) is int
                and abs(n.slice.value) < _MAX_INT
                and isinstance(n.value, ast.Call)
            ):
                raise unsupported()
            check(n.value, depth + 1)
        elif isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS and is_input_ref(f.value):
                for a in n.args:
                    if not (
                        isinstance(a, ast.Constant) and type(a.value) is int and abs(a.value) < 64
                    ):
                        raise unsupported()
            elif isinstance(f, ast.Name) and f.id in _GUARD_FUNCS:
                for a in n.args:
                    check(a, depth + 1)
            else:
                raise unsupported()
            if n.keywords:
                raise unsupported()
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow):
            raise _refusal(what, guard, _POW_REFUSAL)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, _BIN_OPS):
            check(n.left, depth + 1)
            check(n.right, depth + 1)
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, _UNARY_OPS):
            check(n.operand, depth + 1)
        elif isinstance(n, ast.Compare) and all(isinstance(o, _CMP_OPS) for o in n.ops):
            for c in [n.left, *n.comparators]:
                check(c, depth + 1)
        elif isinstance(n, ast.BoolOp):
            for v in n.values:
                check(v, depth + 1)
        else:
            raise unsupported()

    check(_parse(guard, what), 0)


# ---------------------------------------------------------------------------------------------
# The initial state


@dataclass(frozen=True)
class InitialState:
    """A job's initial_state blob, read without the program (e.g. by the parameter server)."""

    state: dict[str, torch.Tensor]  # make_model().state_dict(), keys in order
    param_names: list[str] | None  # trainable parameters (tied weights once), state_dict
    # order; None when the blob has no such metadata (require_params=False)
    aliases: dict[str, str]  # {alias: canonical} of tied weights

    @property
    def buffer_names(self) -> list[str]:
        params = set(self.param_names or ()) | set(self.aliases)
        return [k for k in self.state if k not in params]

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: self.state[k] for k in self.param_names or ()}


def read_initial_state(
    data: bytes | bytearray | memoryview, *, require_params: bool = True
) -> InitialState:
    """Parse initial-state (or checkpoint) safetensors; finite values required.

    The parameter list comes from the metadata packaging (and `TrainableProgram.state_bytes`)
    writes; without it: ProgramError, or param_names None when not `require_params`.
    """
    try:
        state = from_safetensors(data, allow_nonfinite=False)
        meta = safetensors_metadata(data)
        aliases = _aliases(meta, state)
    except CodecError as e:
        raise ProgramError(f"initial state: {e}") from None
    raw = meta.get(PARAMS_METADATA_KEY)
    if raw is None:
        if not require_params:
            return InitialState(state=state, param_names=None, aliases=aliases)
        raise ProgramError(
            f"initial state lacks the {PARAMS_METADATA_KEY!r} metadata written by packaging"
        )
    try:
        params = json.loads(raw)
    except json.JSONDecodeError:
        params = None
    if (
        not isinstance(params, list)
        or not all(isinstance(p, str) and p in state and p not in aliases for p in params)
        or len(set(params)) != len(params)
    ):
        raise ProgramError("initial state: parameter list metadata does not match its tensors")
    order = [k for k in state if k in set(params)]
    if order != params:
        raise ProgramError("initial state: parameters are not listed in state_dict order")
    return InitialState(state=state, param_names=params, aliases=aliases)


def initial_state_metadata(model: torch.nn.Module) -> dict[str, str]:
    """Metadata packaging stores with make_model().state_dict(): parameter names, tied weights."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    keys = list(model.state_dict())
    aliases = {a: c for a, c in aliases.items() if a in keys and c in keys}
    param_ids = {id(p) for p in model.parameters()}
    state = model.state_dict(keep_vars=True)
    params = [k for k in keys if id(state[k]) in param_ids and k not in aliases]
    meta = {PARAMS_METADATA_KEY: json.dumps(params)}
    if aliases:
        meta[ALIASES_METADATA_KEY] = json.dumps(aliases)
    return meta


# ---------------------------------------------------------------------------------------------
# The trainable program


class TrainableProgram:
    """An exported model+loss with its state, keyed like make_model().state_dict()."""

    def __init__(
        self,
        module: torch.nn.Module,
        state_order: Sequence[str],
        num_user_inputs: int,
        device: torch.device,
    ) -> None:
        self._module = module
        self._shapes = self.shapes = ShapeCheck(module)  # shapes: zeros of its inputs (FLOPs)
        self.device = device
        self.num_user_inputs = num_user_inputs
        live = module.state_dict(keep_vars=True)
        params_by_id: dict[int, str] = {}
        named_params = dict(module.named_parameters(remove_duplicate=False))
        self.state_names: list[str] = list(state_order)
        self.param_names: list[str] = []
        self.buffer_names: list[str] = []
        self._tensors: dict[str, torch.Tensor] = {}
        for key in self.state_names:
            t = live[WRAPPER_PREFIX + key]
            self._tensors[key] = t
            if WRAPPER_PREFIX + key in named_params:
                if id(t) not in params_by_id:  # tied weights: optimize once
                    params_by_id[id(t)] = key
                    self.param_names.append(key)
            else:
                self.buffer_names.append(key)

    @classmethod
    def from_bytes(
        cls,
        program: bytes | bytearray | memoryview,
        initial_state: bytes | bytearray | memoryview,
        device: torch.device | str = "cpu",
        *,
        validate: bool = True,
    ) -> TrainableProgram:
        """Load a program (never unpickling) and set its state from safetensors bytes.

        Raises ProgramError for a refused or inconsistent program/state.
        """
        dev = torch.device(device)
        if validate:
            validate_program_archive(program)
        try:
            ep = torch.export.load(io.BytesIO(bytes(program)))
        except Exception as e:
            raise ProgramError(f"cannot load the exported program: {_first_line(e)}") from None
        init = read_initial_state(initial_state, require_params=False)
        state, aliases = init.state, init.aliases
        user_inputs = len(ep.graph_signature.user_inputs)
        if dev.type != "cpu":
            from torch.export.passes import move_to_device_pass

            ep = move_to_device_pass(ep, dev)
        try:
            module = ep.module()
        except Exception as e:
            raise ProgramError(f"cannot build the exported module: {_first_line(e)}") from None
        zero_fill_uninitialised(module)  # no uninitialised memory in its results
        module.to(dev)
        for alias, canonical in aliases.items():
            _tie(module, WRAPPER_PREFIX + alias, WRAPPER_PREFIX + canonical)
        module_keys = list(module.state_dict().keys())
        stripped = [k.removeprefix(WRAPPER_PREFIX) for k in module_keys]
        if any(not k.startswith(WRAPPER_PREFIX) for k in module_keys):
            raise ProgramError("program state is not under the wrapper's 'model.' prefix")
        if set(stripped) != set(state):
            missing = sorted(set(stripped) - set(state))
            extra = sorted(set(state) - set(stripped))
            raise ProgramError(
                f"initial state does not match the program: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        prog = cls(module, list(state), user_inputs, dev)
        if init.param_names is not None and prog.param_names != init.param_names:
            raise ProgramError(
                f"the program's parameters {prog.param_names[:5]} differ from the initial "
                f"state's {init.param_names[:5]}"
            )
        try:
            prog.load_state_dict(state)
        except ValueError as e:
            raise ProgramError(f"initial state does not fit the program: {e}") from None
        prog._shapes.check_declared(batch_ranges(ep))
        return prog

    # -- state -----------------------------------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        """The live trainable parameters, in `param_names` order (for an optimizer)."""
        return [self._tensors[k] for k in self.param_names]

    def get_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters, on `device`."""
        return {k: self._tensors[k].detach().clone() for k in self.param_names}

    def set_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every parameter (exactly `param_names`; shapes and dtypes must match)."""
        self._assign(params, self.param_names, "parameters")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of parameters and buffers with make_model().state_dict() keys and order."""
        return {k: self._tensors[k].detach().clone() for k in self.state_names}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """The live parameters and buffers by state name (tied weights: one tensor, several
        names); for a host that places them in memory of its own (`tensor.data = ...`)."""
        return dict(self._tensors)

    def state_bytes(self) -> bytes:
        """state_dict() as safetensors with the initial-state metadata (a loadable checkpoint)."""
        meta = {PARAMS_METADATA_KEY: json.dumps(self.param_names)}
        aliases = {
            k: next(p for p in self.param_names if self._tensors[p] is self._tensors[k])
            for k in self.state_names
            if k not in self.param_names and k not in self.buffer_names
        }
        if aliases:
            meta[ALIASES_METADATA_KEY] = json.dumps(aliases)
        return to_safetensors(self.state_dict(), metadata=meta)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite parameters and buffers (exactly `state_names`)."""
        self._assign(state, self.state_names, "state")

    def _assign(self, values: Mapping[str, torch.Tensor], names: list[str], what: str) -> None:
        assign_tensors(self._tensors, values, names, what)

    # -- compute ---------------------------------------------------------------------------

    def _run(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        args = [*inputs, *targets]
        if len(args) != self.num_user_inputs:
            raise ValueError(
                f"the program takes {self.num_user_inputs} tensors (inputs then targets), "
                f"got {len(inputs)} + {len(targets)}"
            )
        args = [a.to(self.device, non_blocking=True) for a in args]
        try:
            self._shapes.check_inputs(args)
        except ProgramError as e:
            raise ValueError(f"the program rejected the batch: {e}") from None
        try:
            loss = self._module(*args)
        except (RuntimeError, AssertionError, ValueError, TypeError) as e:
            raise ValueError(f"the program rejected the batch: {_first_line(e)}") from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the program did not return a scalar loss")
        return loss.reshape(())

    def loss_and_grads(
        self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """Mean loss of the batch and its gradients: float32 tensors on `device`.

        A training step: batch norm running statistics are updated, dropout is active.
        Parameters the loss does not depend on get zero gradients.
        """
        for p in self.parameters():
            p.grad = None
        with torch.enable_grad():
            loss = self._run(inputs, targets)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        grads: dict[str, torch.Tensor] = {}
        for k, p in zip(self.param_names, self.parameters(), strict=True):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p, dtype=torch.float32)
            else:
                g = g.detach()
                if g.dtype != torch.float32:
                    g = g.to(torch.float32)
            grads[k] = g
            p.grad = None
        return float(loss.detach()), grads

    def loss(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        """Mean loss without gradients; buffers (batch norm statistics) are left unchanged."""
        saved = {k: self._tensors[k].detach().clone() for k in self.buffer_names}
        try:
            with torch.no_grad():
                return float(self._run(inputs, targets))
        finally:
            with torch.no_grad():
                for k, v in saved.items():
                    self._tensors[k].copy_(v)


def assign_tensors(
    tensors: Mapping[str, torch.Tensor],
    values: Mapping[str, torch.Tensor],
    names: Sequence[str],
    what: str,
    skip: Iterable[str] = (),
) -> None:
    """Copy `values` (exactly `names`, each of the same shape and dtype) into `tensors`, except
    the names in `skip` (tied weights, which share the tensor of another name); ValueError
    naming what differs, before anything is copied."""
    if set(values) != set(names):
        missing = [n for n in names if n not in values]
        extra = [n for n in values if n not in set(names)]
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {extra[:5]}")
    for k in names:
        dst, src = tensors[k], values[k]
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(
                f"{what}: {k!r} is {src.dtype} {list(src.shape)}, the program expects "
                f"{dst.dtype} {list(dst.shape)}"
            )
    skipped = set(skip)
    with torch.no_grad():
        for k in names:
            if k not in skipped:
                tensors[k].copy_(values[k])


def _aliases(meta: Mapping[str, str], state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    raw = meta.get(ALIASES_METADATA_KEY)
    if not raw:
        return {}
    try:
        aliases = json.loads(raw)
    except json.JSONDecodeError:
        raise CodecError("tied-weight metadata is not JSON") from None
    if not isinstance(aliases, dict) or not all(
        isinstance(a, str) and isinstance(c, str) and a in state and c in state and c not in aliases
        for a, c in aliases.items()
    ):
        raise CodecError("tied-weight metadata must map state keys to other, canonical keys")
    return aliases


def _tie(module: torch.nn.Module, alias: str, canonical: str) -> None:
    """Make `alias` the very tensor `canonical` is (torch.export.load unties tied weights); the
    two must have the program's same shape and dtype."""
    target = module.get_parameter(canonical) if _is_param(module, canonical) else None
    if target is None:
        target = module.get_buffer(canonical)  # type: ignore[assignment]  # a Tensor, not a Parameter
    parent_name, _, leaf = alias.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    slots = parent._parameters if leaf in parent._parameters else parent._buffers
    tied, name = slots.get(leaf), alias.removeprefix(WRAPPER_PREFIX)
    other = canonical.removeprefix(WRAPPER_PREFIX)
    if tied is None or target is None:
        raise ProgramError(f"tied weight {name!r} is not in the program")
    if tied.shape != target.shape or tied.dtype != target.dtype:
        raise ProgramError(f"tied weight {name!r} differs in shape or dtype from {other!r}")
    slots[leaf] = target


def _is_param(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return f"{type(e).__name__}: {line.strip()}"
    return type(e).__name__
