"""`epochmesh blobs delete`: give up uploaded blobs (a job's inputs, or blobs by hash), to free
the storage quota and the coordinator's disk."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from client.commands.context import Context
from client.rpc import CliError, ExitCode
from epochmesh.v1 import job_pb2


@dataclass
class Deleted:
    sha256: str
    released_bytes: int  # no longer counted against the caller's quota
    deleted: bool  # the bytes are gone from the coordinator
    note: str  # why nothing happened ("" when the caller held it)


def cmd_blobs_delete(ctx: Context) -> int:
    hashes = [h.strip().lower() for h in ctx.args.sha256]
    job_inputs: set[str] = set()
    if ctx.args.job:
        job = ctx.get_job(ctx.args.job)
        job_inputs = {
            job.program.sha256,
            job.initial_state.sha256,
            *(shard.blob.sha256 for shard in job.shards),
        } - {""}
        hashes += sorted(job_inputs)
    hashes = list(dict.fromkeys(hashes))
    if not hashes:
        raise CliError(
            ExitCode.USAGE,
            "nothing to delete",
            "name blobs by their SHA256, or a job whose inputs to delete with --job JOB",
        )
    coord = ctx.coordinator
    done: list[Deleted] = []
    for sha in hashes:
        try:
            reply = coord.call(
                "DeleteBlob", coord.jobs.DeleteBlob, job_pb2.DeleteBlobRequest(sha256=sha)
            )
        except CliError as err:
            # A job's input given up before (through another job that shares it) is no error.
            if err.code != ExitCode.NOT_FOUND or sha not in job_inputs:
                raise
            done.append(Deleted(sha, 0, False, "not yours (any more)"))
            continue
        done.append(Deleted(sha, reply.released_bytes, reply.deleted, ""))
    if ctx.json:
        ctx.emit_json({"blobs": [asdict(d) for d in done]})
        return ExitCode.OK
    for d in done:
        if d.note:
            ctx.emit(f"{d.sha256}  skipped: {d.note}")
        elif d.deleted:
            ctx.emit(f"{d.sha256}  deleted, {d.released_bytes} bytes released")
        else:
            ctx.emit(f"{d.sha256}  released {d.released_bytes} bytes (others still hold it)")
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "blobs",
        help="manage the blobs you uploaded",
        description="Blobs are the programs, initial states and data shards that `submit` "
        "uploads; they count against your storage quota on the coordinator.",
    )
    actions = p.add_subparsers(dest="blobs_command", metavar="ACTION", required=True)
    q = actions.add_parser(
        "delete",
        parents=common,
        help="give up blobs you uploaded",
        description="Give up blobs you uploaded, by SHA256 or all inputs of a job (--job): "
        "they stop counting against your quota, and their bytes are deleted once no other "
        "user holds them and no job in progress uses them. Refused while one of your jobs in "
        "progress uses one (nothing is deleted after the refused one). --output json: "
        "{'blobs': [{sha256, released_bytes, deleted, note}, ...]}.",
    )
    q.add_argument("sha256", nargs="*", metavar="SHA256", help="a blob's SHA256 (hex)")
    q.add_argument("--job", metavar="JOB", help="the inputs of this job (id, prefix or name)")
    q.set_defaults(func=cmd_blobs_delete)
