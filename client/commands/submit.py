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

The coordinator counts the program's FLOPs per training sample in its own program check (the
figure its quotes use); nothing of the kind is sent from here.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from client.commands.context import Context
from client.commands.output import to_dict
from client.commands.watch import watch_job
from client.render import ProgressLine, fmt_bytes, fmt_duration
from client.rpc import CliError, ExitCode
from client.upload import Uploader
from epochmesh.v1 import common_pb2, job_pb2

log = logging.getLogger(__name__)


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
