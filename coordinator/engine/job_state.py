"""A job's state as its runner reads and writes it: initial state, ledger, benchmarks, checkpoints.

Functions of the job's record and the coordinator's stores, for `JobRunner`
(coordinator/engine/job_runner.py), which calls them on its task: on restore (the parameter
names and initial state, the stored benchmarks, a fresh ledger, the job's record set back to a
checkpoint's), while it runs (the benchmarks stored as they come) and at a checkpoint (the state
copied for it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import torch

from coordinator.aggregation.param_server import ParameterServer
from coordinator.engine.api import CoordinatorContext
from coordinator.rounds.ledger import EpochLedger
from coordinator.store.base import Store
from coordinator.store.checkpoint import CheckpointManifest
from epochmesh.errors import ProgramError
from epochmesh.program.archive import read_initial_state
from epochmesh.program.inspection import inspect_program_async
from epochmesh.v1 import common_pb2

BENCHMARKS_KEY = "benchmarks"  # the job state key of its nodes' benchmarks


async def load_job_state(
    ctx: CoordinatorContext, job: common_pb2.Job
) -> tuple[list[str], dict[str, torch.Tensor], dict[str, str]]:
    """Parameter names, initial state and tied-weight aliases of the job.

    They come from the initial state's metadata (written by packaging; the program was
    checked against them at submission), which spares a restarted coordinator the first
    torch.export load (about two seconds). A state without that metadata (a client other
    than the CLI) has its program loaded for the names, in a confined child process
    (epochmesh.program.inspection), never in this process."""
    state_bytes = await ctx.blobs.read_bytes(job.initial_state.sha256)
    init = await asyncio.to_thread(read_initial_state, state_bytes, require_params=False)
    if init.param_names is not None:
        return list(init.param_names), dict(init.state), dict(init.aliases)
    program = await ctx.blobs.read_bytes(job.program.sha256)
    inspection = await inspect_program_async(program, state_bytes)
    if not inspection.ok or not inspection.param_names:
        reason = inspection.reason or "it lists no parameters"
        raise ProgramError(f"the job's program could not be loaded again: {reason}")
    return list(inspection.param_names), dict(init.state), dict(init.aliases)


def new_ledger(job: common_pb2.Job, epoch: int) -> EpochLedger:
    block = job.shards[0].count if job.shards else None
    return EpochLedger(job.num_samples, epoch, job.spec.seed, block_size=block)


async def load_benchmarks(store: Store, job_id: str) -> dict[str, common_pb2.BenchmarkResult]:
    out: dict[str, common_pb2.BenchmarkResult] = {}
    raw = await store.get_job_state(job_id, BENCHMARKS_KEY)
    if raw:
        for node_id, data in json.loads(raw.decode()).items():
            out[node_id] = common_pb2.BenchmarkResult.FromString(bytes.fromhex(data))
    return out


async def save_benchmarks(
    store: Store, job_id: str, bench: Mapping[str, common_pb2.BenchmarkResult]
) -> None:
    data = {n: r.SerializeToString().hex() for n, r in bench.items()}
    await store.put_job_state(job_id, BENCHMARKS_KEY, json.dumps(data).encode())


def checkpoint_state(
    ps: ParameterServer,
    ledger: EpochLedger,
    job: common_pb2.Job,
    rounds_applied: int,
    last_round: int,
) -> tuple[dict[str, torch.Tensor], CheckpointManifest]:
    """A copy of the state now (parameters and optimizer state) and its manifest, for a
    checkpoint after round ``last_round`` (or a verification rollback's snapshot)."""
    tensors = {k: v.clone() for k, v in ps.state_tensors().items()}
    manifest = CheckpointManifest(
        round=last_round,
        epoch=ledger.epoch,
        params_version=ps.version,
        rounds_applied=rounds_applied,
        samples_done=job.samples_done,
        tensors_sha256="",
        ledger=ledger.to_state(),
        last_loss=job.last_loss,
    )
    return tensors, manifest


def restore_job_record(job: common_pb2.Job, manifest: CheckpointManifest, version: int) -> None:
    """Set the job's record back to the state of ``manifest`` (a restore, or a verification
    rollback), its parameters now at ``version``."""
    job.epoch = manifest.epoch
    job.round = manifest.rounds_applied
    job.params_version = version
    job.samples_done = manifest.samples_done
    job.last_loss = manifest.last_loss
