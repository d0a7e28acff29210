"""Turn a job directory into the data a coordinator accepts (runs on the submitter's machine).

`build_job(load_spec("job.toml"))` imports model.py (in this process: this is the submitter's
own code on the submitter's own machine), builds the model with torch seeded by the spec's seed,
wraps it with its loss, exports the wrapper with torch.export, and packs the dataset into
safetensors shards. Agents receive only these bytes: they never run submitter Python.

The exported program is `LossWrapper`: `forward(*inputs, *targets)` returns the scalar mean
loss, `loss_fn(output, *targets)` from model.py when defined, else cross_entropy or mse (mean
reduction) per the spec. The model is the attribute `model`, so the program's state keys are
"model." + make_model().state_dict() keys (TrainableProgram strips the prefix). Tied weights
(one tensor under several state_dict keys) are recorded in the initial state's metadata, and
TrainableProgram ties them again: torch.export.load alone would untie them.

Batch size: the batch dimension (dimension 0 of every input and target) is exported as dynamic
with min=1, tracing with an example batch of at least 2 samples so that torch does not
specialize it to 1; the resulting single program runs any batch size from 1 up (packaging checks
batch sizes 1 and 2 on the exported program before returning).

Modes: the exported module cannot switch between train and eval (torch.export's module raises
NotImplementedError on .train()/.eval()), so the model is exported in train mode: dropout is
active and batch norm normalizes with batch statistics while updating its running statistics.

Trial runs: the eager run of model+loss on an example batch happens in a fresh Python process
(`eager_check_main`), at the same time as the export here, and the load-back check (the program
loaded as an agent loads it, batches of 1 and 2 samples run through it) in a confined one
(`epochmesh.program.inspection`), after the archive passed validation: a model that crashes
Python (a segmentation fault, an abort) fails with a one-line SpecError, not a dead process.

Export cache: `build_job(..., cache=ExportCache)` (the CLI's submit) first looks the program up
by a key of everything that decides it and the checks' verdict (`_cache_key`,
`epochmesh.export_cache`); a hit skips the export, the eager run and the load-back check (the
archive check agents run is still applied), and a successful build stores its program.

Errors are SpecError (ExportError for export failures) with a message saying what to change.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import safetensors
import torch
import torch.nn.functional as F
from torch import nn

from epochmesh.errors import ExportError, ProgramError, SpecError
from epochmesh.export_cache import ExportCache, cache_key, model_sources, safetensors_digest
from epochmesh.program.archive import initial_state_metadata, validate_program_archive
from epochmesh.program.inspection import (
    START_TIMEOUT_S,
    TEST_FAULT_ENV,
    ChildProcess,
    InspectionLimits,
    PendingInspection,
    TrialBatch,
    Verdict,
    answer_channel,
    encode_request,
    exit_description,
    one_line,
    read_answer,
    read_request,
    send_answer,
    send_ready,
    signal_description,
)
from epochmesh.spec import LoadedSpec
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import from_safetensors, to_safetensors

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 4 << 20
EXAMPLE_BATCH = 4  # samples traced by torch.export (at least 2 so the batch stays dynamic)
# The load-back check: the submitter's machine, a program of any size, two trial batches.
VERIFY_LIMITS = InspectionLimits(timeout_s=300.0)

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PackedJob:
    """Everything SubmitJob needs: the spec, blobs' bytes and the dataset shards."""

    spec: common_pb2.JobSpec  # loss is "custom" when model.py defines loss_fn
    program: bytes  # torch.export.save of LossWrapper
    initial_state: bytes  # safetensors of make_model().state_dict(), keys in order, with
    # metadata naming the trainable parameters and tied weights (program.read_initial_state)
    shards: list[tuple[int, int, bytes]]  # (start, count, safetensors bytes), contiguous
    num_samples: int
    spec_toml: str
    num_parameters: int = 0
    state_names: list[str] = field(default_factory=list)
    program_from_cache: bool = False  # build_job found the program in its ExportCache


class LossWrapper(nn.Module):
    """forward(*inputs, *targets) -> scalar mean loss of `model` (the exported program)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, num_inputs: int) -> None:
        super().__init__()
        self.model = model
        self.num_inputs = num_inputs
        self._loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args[: self.num_inputs])
        return self._loss_fn(out, *args[self.num_inputs :])


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": _cross_entropy, "mse": _mse}


def build_job(
    loaded: LoadedSpec,
    shard_samples: int | None = None,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    verify: bool = True,
    cache: ExportCache | None = None,
) -> PackedJob:
    """Import model.py, export model+loss, and shard the dataset.

    shard_samples: samples per shard; default so that a shard is about `shard_bytes` (at
    least one sample). verify: load the exported program back (as an agent does) and run
    batches of 1 and 2 samples through it. cache: where to look for the program first (same
    key: the export, the eager run and the load-back check are skipped; `_cache_key`) and to
    store it after a successful build; None (the default) always exports.
    """
    spec = common_pb2.JobSpec()
    spec.CopyFrom(loaded.spec)
    if shard_samples is not None and shard_samples < 1:
        raise SpecError(f"shard_samples must be >= 1 (got {shard_samples})")

    data = load_dataset(loaded.data_path, list(spec.inputs), list(spec.targets))
    num_samples = next(iter(data.values())).shape[0]

    if cache is not None and os.environ.get(TEST_FAULT_ENV):
        cache = None  # the load-back check is made to misbehave: it must run
    key = ""
    cached: bytes | None = None
    with contextlib.ExitStack() as children:
        pending: PendingInspection | None = None
        with importable(loaded.model_path.parent):
            modules_before = set(sys.modules)
            module = import_model_file(loaded.model_path)
            try:
                loss_fn = _pick_loss(module, spec, loaded.model_path.name)
                model = _make_model(module, spec.seed, loaded.model_path)
                state = model.state_dict()
                initial_state = to_safetensors(state, metadata=initial_state_metadata(model))
                state_names = list(state)
                num_parameters = sum(p.numel() for p in model.parameters())

                wrapper = LossWrapper(model, loss_fn, len(spec.inputs))
                example = _example_batch(data, list(spec.inputs) + list(spec.targets))
                if cache is not None:
                    imported = [sys.modules[m] for m in set(sys.modules) - modules_before]
                    try:
                        key = _cache_key(
                            loaded, spec, initial_state, example, num_samples, imported, verify
                        )
                    except Exception as e:  # the cache never fails a build: export instead
                        log.warning("export cache off for this build: %s", e)
                    cached = _cached_program(cache, key) if key else None
                if cached is None:
                    # Both children start now and import torch while this process exports.
                    eager = children.enter_context(EagerCheck(loaded.model_path, spec, example))
                    if verify:
                        pending = children.enter_context(PendingInspection())
                    program = _export_checked(wrapper, example, eager)
                else:
                    program = cached
            finally:
                sys.modules.pop(module.__name__, None)

        if pending is not None:
            _verify(pending, program, initial_state, data, spec)
    if cache is not None and key and cached is None:
        cache.put(key, program)  # exported and checked: the next build of this model reuses it

    names = list(dict.fromkeys([*spec.inputs, *spec.targets]))
    if shard_samples is None:
        per_sample = sum(data[n][0].numel() * data[n].element_size() for n in names)
        shard_samples = max(1, shard_bytes // max(1, per_sample))
    shards = []
    for start in range(0, num_samples, shard_samples):
        count = min(shard_samples, num_samples - start)
        blob = to_safetensors(
            {n: data[n][start : start + count] for n in names},
            metadata={"start": str(start), "count": str(count)},
        )
        shards.append((start, count, blob))
    log.info(
        "packed job %r: %d parameters, program %d bytes%s, %d samples in %d shards",
        spec.name,
        num_parameters,
        len(program),
        " (from the export cache)" if cached is not None else "",
        num_samples,
        len(shards),
    )
    return PackedJob(
        spec=spec,
        program=program,
        initial_state=initial_state,
        shards=shards,
        num_samples=num_samples,
        spec_toml=loaded.toml_text,
        num_parameters=num_parameters,
        state_names=state_names,
        program_from_cache=cached is not None,
    )


def load_dataset(path: Path, inputs: list[str], targets: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors dataset, checked to share their first dimension."""
    names = list(dict.fromkeys([*inputs, *targets]))
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            available = list(f.keys())
            missing = [n for n in names if n not in available]
            if missing:
                role = "[data].inputs" if missing[0] in inputs else "[data].targets"
                raise SpecError(
                    f"{path.name} has no tensor {missing[0]!r} named in {role}; it has: "
                    f"{', '.join(sorted(available)) or 'no tensors'}"
                )
            data = {n: f.get_tensor(n) for n in names}
    except FileNotFoundError:
        raise SpecError(f"dataset file not found: {path}") from None
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"{path} is not a valid safetensors file: {e}") from None
    sizes = {n: (tuple(t.shape)[0] if t.dim() else None) for n, t in data.items()}
    if any(s is None for s in sizes.values()) or len(set(sizes.values())) != 1:
        listing = ", ".join(f"{n}: {list(data[n].shape)}" for n in names)
        raise SpecError(
            f"the tensors of {path.name} must share their first dimension (the samples); "
            f"got {listing}"
        )
    if next(iter(sizes.values())) == 0:
        raise SpecError(f"{path.name} holds no samples (first dimension is 0)")
    return data


@contextlib.contextmanager
def importable(directory: Path) -> Iterator[None]:
    """Put `directory` first on sys.path (model.py may import its sibling modules)."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        try:
            sys.path.remove(entry)
        except ValueError:
            pass


def import_model_file(path: Path) -> ModuleType:
    """Import model.py by path, in this process (the submitter's own code, on their machine)."""
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    name = f"epochmesh_user_model_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with importable(path.parent):
            spec.loader.exec_module(module)
    except FileNotFoundError:
        sys.modules.pop(name, None)
        raise SpecError(f"model file not found: {path}") from None
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise SpecError(f"{path.name} raised: {_summary(e, path)}") from e
    return module


def _summary(e: BaseException, path: Path) -> str:
    """'ZeroDivisionError: division by zero (model.py line 7)'."""
    text = e.msg if isinstance(e, SyntaxError) and e.msg else str(e).strip()
    msg = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    line = None
    if isinstance(e, SyntaxError) and e.lineno is not None:
        line = e.lineno
    else:
        for frame in traceback.extract_tb(e.__traceback__):
            if Path(frame.filename).resolve() == path.resolve():
                line = frame.lineno
    return f"{msg} ({path.name} line {line})" if line else msg


def _pick_loss(module: ModuleType, spec: common_pb2.JobSpec, fname: str) -> LossFn:
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None:
        if not callable(loss_fn) or isinstance(loss_fn, nn.Module):
            raise SpecError(
                f"{fname}: loss_fn must be a function loss_fn(output, *targets) returning the "
                "mean loss (not an nn.Module or other object)"
            )
        if spec.loss != "custom":
            log.info("%s defines loss_fn; it replaces loss = %r", fname, spec.loss)
        spec.loss = "custom"
        return cast(Callable[..., torch.Tensor], loss_fn)
    if spec.loss == "custom":
        raise SpecError(
            f'{fname} defines no loss_fn but job.toml says loss = "custom": define '
            'loss_fn(output, *targets) in it, or set loss = "cross_entropy" or "mse"'
        )
    return BUILTIN_LOSSES[spec.loss]


def _make_model(module: ModuleType, seed: int, path: Path) -> nn.Module:
    make_model = getattr(module, "make_model", None)
    if make_model is None or not callable(make_model):
        raise SpecError(
            f"{path.name} defines no make_model(); add def make_model() -> torch.nn.Module"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = make_model()
        except Exception as e:
            raise SpecError(f"{path.name} raised: {_summary(e, path)}") from e
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"{path.name}: make_model() returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _example_batch(data: dict[str, torch.Tensor], order: list[str]) -> tuple[torch.Tensor, ...]:
    n = next(iter(data.values())).shape[0]
    take = min(n, EXAMPLE_BATCH)
    out = []
    for name in order:
        t = data[name][:take]
        if take < 2:
            t = t.repeat(2, *([1] * (t.dim() - 1)))
        out.append(t.clone())
    return tuple(out)


def _cache_key(
    loaded: LoadedSpec,
    spec: common_pb2.JobSpec,
    initial_state: bytes,
    example: tuple[torch.Tensor, ...],
    num_samples: int,
    imported: list[ModuleType],
    verify: bool,
) -> str:
    """The export cache's key of this build ("" when the model's folder is too big to key):
    the model's sources and what it imported, the loss, the initial state (make_model() with
    the seed), and the example batch (dtypes, shapes and values: the export traces it, the
    eager run and the load-back check run it), with the environment (`cache_key`)."""
    sources = model_sources(
        loaded.model_path.parent,
        exclude=[loaded.data_path, *_spec_files(loaded)],
        modules=imported,
    )
    if sources is None:
        return ""
    return cache_key(
        {
            "model_file": loaded.model_path.name,
            "sources": sources,
            "loss": spec.loss,
            "num_inputs": len(spec.inputs),
            "num_targets": len(spec.targets),
            "initial_state": safetensors_digest(initial_state),
            "example": safetensors_digest(
                to_safetensors({str(i): t for i, t in enumerate(example)})
            ),
            "trial_samples": min(num_samples, EXAMPLE_BATCH),
            "verify": verify,
            "torch": [torch.__version__, torch.version.git_version, str(torch.get_default_dtype())],
        }
    )


def _spec_files(loaded: LoadedSpec) -> list[Path]:
    """The job.toml of `loaded` (its folder's .toml files holding exactly its text): the key
    has the fields of it that matter, not its name, epochs or learning rate."""
    out = []
    for path in loaded.base_dir.glob("*.toml"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if path.stat().st_size <= 1 << 20 and path.read_text("utf-8") == loaded.toml_text:
                out.append(path)
    return out


def _cached_program(cache: ExportCache, key: str) -> bytes | None:
    """The cached program of `key` if it still passes the archive check agents run."""
    program = cache.get(key)
    if program is None:
        log.debug("export cache: no entry %s", key[:16])
        return None
    try:
        validate_program_archive(program)
    except ProgramError as e:
        log.info("export cache: entry %s is refused now (%s); exporting again", key[:16], e)
        return None
    log.info("export cache: reusing the program of entry %s", key[:16])
    return program


class EagerCheck:
    """model.py's model and loss run once on the example batch in a fresh Python process
    (the submitter's own code on their machine: isolated, not confined), so that a crash there
    becomes an error message. Started at construction; close it (context manager) when done."""

    def __init__(
        self, model_path: Path, spec: common_pb2.JobSpec, example: tuple[torch.Tensor, ...]
    ) -> None:
        self.batch = int(example[0].shape[0])
        env = dict(os.environ)
        model_dir = str(model_path.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and p != model_dir)
        self.child = ChildProcess(_eager_check_argv(), env=env, cwd=None)
        header = {
            "model_path": str(model_path.resolve()),
            "seed": spec.seed,
            "loss": spec.loss,
            "num_inputs": len(spec.inputs),
        }
        tensors = {str(i): t for i, t in enumerate(example)}
        self.child.send(encode_request(header, [to_safetensors(tensors)]))

    def outcome(self) -> tuple[str, str]:
        """(error, crash): the run's error message (SpecError's), or the message of its crash;
        both empty when it ran and the loss was fine."""
        ended = self.child.finish(None)
        answer = read_answer(ended.answer)
        if answer is not None and answer["ok"] and ended.returncode == 0:
            return "", ""
        if answer is not None and not answer["ok"]:
            return str(answer.get("error") or "the eager run failed"), ""
        what = f"running the model and loss on a batch of {self.batch} samples"
        if ended.timed_out:
            return "", f"{what}: its Python process did not start within {START_TIMEOUT_S:g} s"
        if ended.returncode < 0:
            why = signal_description(-ended.returncode)
            return "", f"{what} crashed the Python process ({why})"
        lines = ended.stderr_tail.decode(errors="replace").strip().splitlines()
        detail = f": {one_line(lines[-1])}" if lines else ""
        return "", (
            f"{what} ended the Python process without an answer "
            f"({exit_description(ended.returncode)}{detail})"
        )

    def close(self) -> None:
        self.child.close()

    def __enter__(self) -> EagerCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _eager_check_argv() -> list[str]:
    code = "import epochmesh.packaging as p; raise SystemExit(p.eager_check_main())"
    return [sys.executable, "-c", code]


def eager_check_main() -> int:
    """The eager check's child: reads its request (`EagerCheck`), answers one line."""
    channel = answer_channel()
    send_ready(channel)
    header, blobs = read_request(sys.stdin.buffer)
    path = Path(header["model_path"])
    example = tuple(from_safetensors(blobs[0]).values())
    spec = common_pb2.JobSpec(loss=header["loss"], seed=header["seed"])
    try:
        with importable(path.parent):
            module = import_model_file(path)
            loss_fn = _pick_loss(module, spec, path.name)
            model = _make_model(module, spec.seed, path)
            _check_eager(LossWrapper(model, loss_fn, int(header["num_inputs"])), example, path)
        reply: dict[str, Any] = {"ok": True}
    except SpecError as e:
        reply = {"ok": False, "error": str(e)}
    except BaseException as e:  # SystemExit, KeyboardInterrupt from model.py: its error too
        reply = {
            "ok": False,
            "error": f"running the model and loss on a batch of {example[0].shape[0]} samples "
            f"raised {_summary(e, path)}",
        }
    send_answer(channel, reply)
    os._exit(0)


def _export_checked(
    wrapper: LossWrapper, example: tuple[torch.Tensor, ...], eager: EagerCheck
) -> bytes:
    """Export while the eager run goes on. Its error is the clearest message: it wins over
    export's, and export's (a refused operator, say) over the eager run's crash."""
    export_error: ExportError | None = None
    try:
        program = export_program(wrapper, example)
    except ExportError as e:
        export_error = e
    error, crash = eager.outcome()
    if error:
        raise SpecError(error)
    if export_error is not None:
        raise export_error
    if crash:
        raise SpecError(crash)
    return program


def _check_eager(wrapper: LossWrapper, example: tuple[torch.Tensor, ...], path: Path) -> None:
    """Run the wrapper once eagerly: clearer errors than torch.export's for plain bugs."""
    buffers = {k: v.clone() for k, v in wrapper.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            loss = wrapper(*example)
        with torch.no_grad():  # undo batch-norm statistics updates of this trial run
            for k, v in wrapper.named_buffers():
                v.copy_(buffers[k])
    except Exception as e:
        raise SpecError(
            f"running the model and loss on a batch of {example[0].shape[0]} samples raised "
            f"{_summary(e, path)}"
        ) from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise SpecError(
            f"the loss must be a scalar floating tensor (the mean over the batch); got {shape}"
        )


def export_program(wrapper: nn.Module, example: tuple[torch.Tensor, ...]) -> bytes:
    """torch.export the wrapper with a dynamic batch dimension; bytes of torch.export.save."""
    batch = torch.export.Dim("batch", min=1)
    dynamic = (tuple({0: batch} for _ in example),)
    try:
        ep = torch.export.export(wrapper, example, dynamic_shapes=dynamic)
    except Exception as e:
        raise ExportError(
            f"torch.export could not export model.py: {_first_line(e)}. {_export_hint(e)}"
        ) from e
    ep.example_inputs = None  # agents refuse pickled sample inputs
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    program = buf.getvalue()
    try:
        validate_program_archive(program)
    except ProgramError as e:
        raise ExportError(f"the exported program would be refused by agents: {e}") from e
    return program


def _export_hint(e: BaseException) -> str:
    text = str(e)
    if any(s in text for s in ("Constraints violated", "specializ", "batch", "Dim(")):
        return (
            "The model must work for any batch size: avoid hard-coded batch sizes (use "
            "x.shape[0] or -1 in view/reshape) and batch-size-dependent Python branches."
        )
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        return (
            "Avoid Python control flow on tensor values (if x.sum() > 0, .item(), .tolist()); "
            "use torch.where or masks instead."
        )
    return "Keep forward() and loss_fn to torch operations on tensors (no numpy, I/O or .item())."


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        line = line.split("For more information")[0].strip().rstrip(".")
        if line:
            return f"{type(e).__name__}: {line}"
    return type(e).__name__


def _verify(
    pending: PendingInspection,
    program: bytes,
    initial_state: bytes,
    data: dict[str, torch.Tensor],
    spec: common_pb2.JobSpec,
) -> None:
    """Load the program back as an agent does and run batches of 1 and 2 samples through it,
    in the confined inspection child `pending`."""
    n = next(iter(data.values())).shape[0]
    sizes = tuple(sorted({1, min(2, n)}))
    trial = TrialBatch(
        inputs=[data[k][: sizes[-1]] for k in spec.inputs],
        targets=[data[k][: sizes[-1]] for k in spec.targets],
        sizes=sizes,
    )
    task = "loading it and running batches of " + " and ".join(map(str, sizes)) + " samples"
    result = pending.run(program, initial_state, VERIFY_LIMITS, trial=trial, task=task)
    if result.verdict is Verdict.BATCH_FAILED:
        hint = _export_hint(ValueError(result.reason))
        raise ExportError(
            f"the exported program fails on a batch of {result.batch_size}: {result.reason}. {hint}"
        )
    if not result.ok:
        raise ExportError(f"the exported program does not load back: {result.reason}")
    for size, loss in zip(sizes, result.losses, strict=False):
        if not math.isfinite(loss):
            log.warning("the initial loss on a batch of %d samples is %s", size, loss)


def describe(job: PackedJob) -> dict[str, Any]:
    """A short summary for CLI output."""
    return {
        "name": job.spec.name,
        "parameters": job.num_parameters,
        "program_bytes": len(job.program),
        "initial_state_bytes": len(job.initial_state),
        "samples": job.num_samples,
        "shards": len(job.shards),
        "dataset_bytes": sum(len(b) for _, _, b in job.shards),
    }
