"""``epochmesh submit JOB.toml [--watch]``.

Steps, each failing with a one-line message and a stable exit code:

1. read and check the spec (``epochmesh.spec.load_spec``): not TOML, unknown keys (with the
   closest valid key), bad values, missing model or dataset file -> exit 2;
2. connect to the coordinator (unreachable -> exit 4, within seconds);
3. run ``make_model()`` here, export model + loss with torch.export and pack the dataset into
   shards (``epochmesh.packaging.build_job``; a model that cannot be exported -> exit 2); a
   program exported and checked before with the same key comes from the export cache
   (``epochmesh.export_cache``; ``--no-cache`` exports anyway and refreshes the entry);
4. upload the program, the initial parameters and the shards, resumably, with progress on
   stderr (blobs the coordinator already holds are skipped);
5. SubmitJob; print the job id (or the job as JSON) on stdout; with ``--watch``, follow it.

After SubmitJob, the program's FLOPs per training sample go to the coordinator in a QuoteJob
of the same job, so that the job's measured speed calibrates later quotes; the answer is not
shown, and a failure of it is logged, never the submission's. The figure is remembered per
program sha256 in the export cache's folder (``flops/``), so a submit after ``epochmesh quote``
(or of a program submitted before) sends it at no cost; otherwise it is counted as the quote
counts it, on a few samples (loading the exported program once: seconds for a large one).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from client.commands.context import Context
from client.commands.output import to_dict
from client.commands.watch import watch_job
from client.render import ProgressLine, fmt_bytes, fmt_duration
from client.rpc import CliError, ExitCode
from client.upload import Uploader
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2

log = logging.getLogger(__name__)

FLOP_SAMPLES = 4  # samples the program's FLOPs are counted on


def _spec_error(err: Exception, path: Path) -> CliError:
    text = str(err).strip() or type(err).__name__
    lines = text.splitlines()
    hint = getattr(err, "hint", "") or (lines[1].strip() if len(lines) > 1 else "")
    return CliError(ExitCode.USAGE, lines[0], hint or f"fix {path} and submit again")


def load_checked(path: Path) -> Any:
    """Reads the spec and builds the job; spec or export problems become exit 2."""
    from epochmesh.errors import SpecError
    from epochmesh.spec import load_spec

    if not path.exists():
        raise CliError(
            ExitCode.USAGE, f"job spec {path} does not exist", "give the path of a JOB.toml"
        )
    if path.is_dir():
        raise CliError(ExitCode.USAGE, f"{path} is a directory", "give the path of a JOB.toml")
    try:
        loaded = load_spec(path)
    except SpecError as err:
        raise _spec_error(err, path) from None
    return loaded


def pack(loaded: Any, path: Path, ctx: Context) -> Any:
    from epochmesh.errors import SpecError
    from epochmesh.export_cache import ExportCache
    from epochmesh.packaging import build_job

    if not ctx.json:
        ctx.note("exporting the model and packing the dataset...")
    t0 = time.monotonic()
    cache = ExportCache.default(reuse=not getattr(ctx.args, "no_cache", False))
    try:
        packed = build_job(loaded, cache=cache)
    except SpecError as err:  # ExportError is a SpecError
        raise _spec_error(err, path) from None
    if not ctx.json:
        reused = "; the exported program came from the cache" if packed.program_from_cache else ""
        ctx.note(
            f"packed {packed.num_samples} samples into {len(packed.shards)} shards "
            f"in {fmt_duration(time.monotonic() - t0)}{reused}"
        )
    return packed


def _memo(sha: str) -> Path:
    from epochmesh.export_cache import default_root

    return default_root() / "flops" / sha


def _remembered(sha: str) -> float | None:
    try:
        value = float(_memo(sha).read_text())
    except (OSError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def _remember(sha: str, flops: float) -> None:
    path = _memo(sha)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(repr(flops))
        tmp.replace(path)
    except OSError as err:
        log.debug("the program's FLOPs were not remembered: %s", err)


def program_figures(packed: Any) -> tuple[float, str, int]:
    """(FLOPs of a training step per sample, the program's sha256, the parameters' bytes) of
    a packed job: remembered for its program, else counted on the first few samples of its
    dataset (and remembered)."""
    from safetensors.torch import load

    from epochmesh.program.flops import training_flops_per_sample

    sha = hashlib.sha256(packed.program).hexdigest()
    known = _remembered(sha)
    if known is not None:
        return known, sha, len(packed.initial_state)
    data = load(packed.shards[0][2]) if packed.shards else {}
    spec = packed.spec
    n = min(FLOP_SAMPLES, packed.num_samples)
    try:
        flops = training_flops_per_sample(
            packed.program,
            packed.initial_state,
            [data[k][:n] for k in spec.inputs],
            [data[k][:n] for k in spec.targets],
        )
    except (KeyError, ValueError, RuntimeError) as err:
        raise CliError(
            ExitCode.USAGE, f"cannot count the program's FLOPs: {err}", "check model.py"
        ) from None
    if flops > 0:
        _remember(sha, flops)
    return flops, sha, len(packed.initial_state)


def send_flops(ctx: Context, packed: Any) -> None:
    """Tell the coordinator the program's FLOPs per sample (a QuoteJob whose answer is
    dropped): best effort, a failure is logged."""
    try:
        flops, sha, state_bytes = program_figures(packed)
        coord = ctx.coordinator
        coord.call(
            "QuoteJob",
            coord.scheduler.QuoteJob,
            scheduler_pb2.QuoteJobRequest(
                spec=packed.spec,
                num_samples=packed.num_samples,
                flops_per_sample=flops,
                program_sha256=sha,
                state_bytes=state_bytes,
            ),
        )
    except Exception as err:  # noqa: BLE001 - the job is submitted whatever this does
        log.debug("the program's FLOPs were not sent: %s", err)


def cmd_submit(ctx: Context) -> int:
    path = Path(ctx.args.spec)
    loaded = load_checked(path)
    coord = ctx.coordinator  # fail fast when unreachable, before the (slow) export
    packed = pack(loaded, path, ctx)

    blobs: list[bytes] = [packed.program, packed.initial_state]
    blobs.extend(data for _, _, data in packed.shards)
    progress = ProgressLine(ctx.stderr)
    t0 = time.monotonic()

    def on_progress(done: int, total: int) -> None:
        if ctx.json:
            return
        frac = done / total if total else 1.0
        elapsed = time.monotonic() - t0
        rate = f"  {fmt_bytes(done / elapsed)}/s" if elapsed > 0.2 and done else ""
        progress.update(
            f"uploading {uploader.stats.blobs} blobs: {fmt_bytes(done)} / {fmt_bytes(total)} "
            f"({frac * 100:.0f}%){rate}",
            frac,
        )

    uploader = Uploader(coord, on_progress)
    try:
        refs = uploader.upload_all(blobs)
    except BaseException:
        progress.clear()
        raise
    stats = uploader.stats
    if not ctx.json:
        rate = f", {fmt_bytes(stats.bytes_per_second)}/s" if stats.sent_bytes else ""
        text = (
            f"uploaded {fmt_bytes(stats.sent_bytes)} of {fmt_bytes(stats.total_bytes)} "
            f"in {stats.seconds:.1f}s{rate}"
        )
        if stats.skipped_blobs:
            text += f"; {stats.skipped_blobs} of {stats.blobs} blobs already there"
        if stats.resumed_bytes:
            text += f"; resumed after {fmt_bytes(stats.resumed_bytes)}"
        progress.done(text)

    shards = [
        common_pb2.Shard(blob=ref, start=start, count=count)
        for ref, (start, count, _) in zip(refs[2:], packed.shards, strict=True)
    ]
    request = job_pb2.SubmitJobRequest(
        spec=packed.spec,
        program=refs[0],
        initial_state=refs[1],
        shards=shards,
        spec_toml=packed.spec_toml,
    )
    job = coord.call("SubmitJob", coord.jobs.SubmitJob, request)
    send_flops(ctx, packed)
    if ctx.json:
        if ctx.args.watch:
            ctx.emit_json_line(to_dict(job))
        else:
            ctx.emit_json(to_dict(job))
    else:
        ctx.emit(job.job_id)
        if not ctx.args.watch:
            ctx.note(
                f"submitted {job.job_id} ({job.name or path.stem}): "
                f"{job.spec.epochs} epochs over {job.num_samples or packed.num_samples} samples; "
                f"follow it with `epochmesh watch {job.job_id}`"
            )
    if ctx.args.watch:
        return watch_job(ctx, job.job_id)
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "submit",
        parents=common,
        help="export, upload and submit a job",
        description="Export the model of JOB.toml (on this machine), pack and upload its "
        "dataset (resumable), and submit the job. Prints the job id.",
    )
    p.add_argument("spec", metavar="JOB.toml", help="the job spec")
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow the job until it ends (exit 0 succeeded, 5 failed or cancelled)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="export and check the model even when the export cache ($EPOCHMESH_CACHE_DIR, "
        "else $XDG_CACHE_HOME/epochmesh or ~/.cache/epochmesh) holds its program, and store "
        "the fresh export in its place",
    )
    p.set_defaults(func=cmd_submit)
