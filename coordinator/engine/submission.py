"""What SubmitJob checks before a job is stored: the spec, the blobs it names (stored, and the
submitter's to name), the shards' safetensors headers, and the program with its initial state,
loaded in a confined child (epochmesh/program/inspection.py).

The program check is the costly part, and the coordinator holds nothing of the program while a
submission waits for it: the submission takes its turn for a check slot
(coordinator/engine/submit_gate.py: submissions capped per tenant, slots served round-robin
between tenants), and only then are the program's and the state's blob files opened and
streamed into the child, 1 MiB at a time. Verdicts are remembered by content
(coordinator/engine/program_check_cache.py): a program submitted again with the same state is not
checked again, and concurrent submissions of it share one check. The check counts the program's
FLOPs per training sample too, remembered by program (coordinator/market/program_flops.py)
for quotes: a quote of an uploaded program runs the same check (`program_flops`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from coordinator.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from coordinator.core.ids import require_sha256
from coordinator.core.principal import current_principal
from coordinator.engine.api import CoordinatorContext
from coordinator.engine.program_check_cache import CheckVerdict, VerdictCache, check_version
from coordinator.engine.submit_gate import SubmitGate
from coordinator.market.program_flops import known_flops, remember_flops
from coordinator.store.blobs import BlobCaller
from coordinator.trust.job_cap import LiveJobCap
from epochmesh.errors import CodecError, SpecError
from epochmesh.program.inspection import FilePart, Inspection, ProgramInspector, Verdict
from epochmesh.spec import validate_job_spec
from epochmesh.v1 import common_pb2, job_pb2
from epochmesh.wire.safetensors_file import read_safetensors_header

log = logging.getLogger(__name__)


class SubmitChecks:
    def __init__(self, ctx: CoordinatorContext, inspector: ProgramInspector) -> None:
        self.ctx = ctx
        self.inspector = inspector
        self.gate = SubmitGate(ctx.config.program_check_concurrency)
        config = ctx.config
        limits = f"{config.program_check_timeout_s:g}s {config.program_check_memory_bytes}B"
        self.cache = VerdictCache(
            version=check_version(limits), directory=config.program_check_cache
        )
        # Counted again when the job is stored, under the tenant's lock (JobService refuses a
        # tenant at its cap early, before the check; two submissions may both pass that).
        self.live_jobs = LiveJobCap(ctx.store, ctx.config.max_live_jobs)

    async def validate(self, req: job_pb2.SubmitJobRequest) -> int:
        """The request's number of samples, once its spec, blobs and shards are sound."""
        spec = req.spec
        try:
            validate_job_spec(spec)
        except SpecError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if spec.aggregation == "ring" and spec.compression == "topk":
            raise InvalidArgumentError(
                'compression "topk" cannot be used with aggregation = "ring": top-k keeps '
                "different indices on every node, so a ring cannot sum the chunks in place; "
                'use compression = "int8" (or fp16/bf16) with the ring, or topk with "ps"'
            )
        await self.require_blob(req.program, "program")
        await self.require_blob(req.initial_state, "initial_state")
        if not req.shards:
            raise InvalidArgumentError("the job has no dataset shards")
        expected_start = 0
        for i, shard in enumerate(req.shards):
            if shard.start != expected_start or shard.count <= 0:
                raise InvalidArgumentError(
                    f"shard {i} covers [{shard.start}, {shard.start + shard.count}); shards "
                    f"must be contiguous from 0 (expected start {expected_start}, count > 0)"
                )
            expected_start += shard.count
            await self.require_blob(shard.blob, f"shard {i}")
        await self.check_shards(req, spec)
        return expected_start

    async def require_blob(self, ref: common_pb2.BlobRef, what: str) -> None:
        """The blob is stored and the submitter may name it: it uploaded it or one of its jobs
        uses it (operators: any). A blob of others looks like one never uploaded."""
        if not ref.sha256:
            raise InvalidArgumentError(f"{what}: no blob given")
        require_sha256(ref.sha256, f"{what} sha256")
        record = await self.ctx.blobs.get(ref.sha256)
        if record is None or not await self.ctx.blobs.visible(
            ref.sha256, BlobCaller.of(current_principal())
        ):
            raise FailedPreconditionError(
                f"{what}: blob {ref.sha256} is not uploaded (a job names only blobs its "
                "submitter uploaded or its earlier jobs use)"
            )
        if ref.size and ref.size != record.size:
            raise InvalidArgumentError(
                f"{what}: blob {ref.sha256} has {record.size} bytes, not {ref.size}"
            )

    async def check_shards(self, req: job_pb2.SubmitJobRequest, spec: common_pb2.JobSpec) -> None:
        """Each shard's safetensors header (only the header is read) names the job's tensors
        with the samples the shard declares."""
        names = list(dict.fromkeys([*spec.inputs, *spec.targets]))
        for i, shard in enumerate(req.shards):
            path = self.ctx.blobs.path(shard.blob.sha256)
            try:
                header = await asyncio.to_thread(read_safetensors_header, path)
            except CodecError as exc:
                raise InvalidArgumentError(f"shard {i}: {exc}") from None
            for name in names:
                entry = header.get(name)
                if not isinstance(entry, dict) or not entry.get("shape"):
                    raise InvalidArgumentError(f"shard {i} has no tensor {name!r}")
                if entry["shape"][0] != shard.count:
                    raise InvalidArgumentError(
                        f"shard {i}: tensor {name!r} has {entry['shape'][0]} samples, the shard "
                        f"declares {shard.count}"
                    )

    async def check_program(self, req: job_pb2.SubmitJobRequest, owner: str) -> bool:
        """The program with its initial state passes the check (InvalidArgumentError naming
        why not; UnavailableError when no check could run); whether this submission ran the
        check (False: a remembered verdict, or another submission's check of the same)."""
        program, state = req.program.sha256, req.initial_state.sha256
        outcome = await self.cache.verdict(
            self.cache.key(program, state), lambda: self._inspect(program, state, owner)
        )
        verdict: CheckVerdict = outcome.verdict
        if not outcome.checked:
            log.info(
                "program %s with state %s: %s by an earlier check, not checked again",
                program,
                state,
                verdict.verdict,
            )
        if verdict.verdict is Verdict.UNAVAILABLE:
            raise UnavailableError(f"cannot check the program now: {verdict.reason}")
        if not verdict.ok:
            raise InvalidArgumentError(f"program refused: {verdict.reason}")
        await remember_flops(self.ctx.store, program, verdict.flops_per_sample)
        return outcome.checked

    async def program_flops(
        self, program: common_pb2.BlobRef, state: common_pb2.BlobRef, owner: str
    ) -> float:
        """The FLOPs per training sample of ``program`` (with ``state``), as this coordinator
        counts them: remembered, else by the program check (both blobs uploaded and the
        caller's to name; refused like a submission's). 0.0: not countable."""
        require_sha256(program.sha256, "program sha256")
        known = (await known_flops(self.ctx.store)).get(program.sha256)
        if known is not None:
            return known
        await self.require_blob(program, "program")
        await self.require_blob(state, "initial_state")
        with self.gate.admit(owner):
            outcome = await self.cache.verdict(
                self.cache.key(program.sha256, state.sha256),
                lambda: self._inspect(program.sha256, state.sha256, owner),
            )
        verdict: CheckVerdict = outcome.verdict
        if verdict.verdict is Verdict.UNAVAILABLE:
            raise UnavailableError(f"cannot check the program now: {verdict.reason}")
        if not verdict.ok:
            raise InvalidArgumentError(f"program refused: {verdict.reason}")
        await remember_flops(self.ctx.store, program.sha256, verdict.flops_per_sample)
        return verdict.flops_per_sample

    async def _inspect(self, program: str, state: str, owner: str) -> Inspection:
        """Check once a slot is ours, the blobs streamed from their files."""
        async with self.gate.slot(owner):
            with contextlib.ExitStack() as files:
                parts = []
                for sha in (program, state):
                    f = files.enter_context(await self.ctx.blobs.open(sha))
                    parts.append(FilePart(f, os.fstat(f.fileno()).st_size))
                return await self.inspector.inspect(parts[0], parts[1])
