"""Node agents played by the test itself over real gRPC + TLS, against an in-process coordinator
with the real training engine.

A `FakeAgent` registers with its own node certificate, heartbeats, answers BENCHMARK tasks with
a given throughput, and hands every TRAIN task to the test's `on_train(agent, task)`: the test
decides what the "agent" pushes or reports (honest pseudo-gradients, wrong codecs, divergent
checksums, ...). Helpers pull parameters, push updates and report progress as an agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from epochmesh import identity as idm
from epochmesh.optim import state_tensors
from epochmesh.sketch import sketch
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, job_pb2, job_pb2_grpc
from epochmesh.verification import (
    chunk_bounds,
    local_sgd_chunk_samples,
    state_digest,
    with_round_start,
)
from epochmesh.wire.tensors import BundleAssembler, decode_bundle, encode_bundle, iter_chunks
from tests.procs import async_wait_until

if TYPE_CHECKING:
    from coordinator.app import Coordinator
    from epochmesh.packaging import PackedJob

log = logging.getLogger(__name__)

TrainHandler = Callable[["FakeAgent", agent_pb2.Task], Awaitable[None]]

# The coordinator's wait for a checker (`check_wait_s`) in tests of fake agents: they answer a
# check at once (they never recompute), so the wait only runs out for a checker that died or
# was ejected, and need not be the default 15 s.
CHECK_WAIT_S = 4.0


class FakeAgent:
    def __init__(
        self,
        coord: Coordinator,
        name: str,
        samples_per_second: float,
        on_train: TrainHandler,
        *,
        peer_address: str = "",
        max_batch_size: int = 0,
        seal_digests: Sequence[str] = (),
        ring_features: Sequence[str] = (),
    ) -> None:
        self.coord = coord
        self.seal_digests = list(seal_digests)  # declared at registration (none: an older agent)
        self.ring_features = list(ring_features)  # idem
        self.max_batch_size = max_batch_size  # what its benchmark says fits one pass (0: any)
        self.name = name
        self.rate = samples_per_second
        self.on_train = on_train
        self.peer_address = peer_address
        self.price = 0  # micro-credits per hour its heartbeats ask
        self.snapshots_taken = 0  # start states uploaded and taken (verification)
        self.node_id = ""
        self.lease_id = ""
        self.tasks: list[agent_pb2.Task] = []
        self.errors: list[str] = []  # status code names (or reprs) of failed tasks
        self._identity = coord.issue_identity("node")
        self._stack = contextlib.AsyncExitStack()
        self._loops: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.stub: agent_pb2_grpc.AgentServiceStub

    async def start(self) -> FakeAgent:
        channel = await self._stack.enter_async_context(
            idm.secure_aio_channel(self.coord.address, self._identity)
        )
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)
        reg = await self.stub.Register(
            agent_pb2.RegisterRequest(
                name=self.name,
                peer_address=self.peer_address,
                ring_seal_digests=self.seal_digests,
                ring_features=self.ring_features,
            ),
            timeout=10,
        )
        self.node_id, self.lease_id = reg.node_id, reg.lease_id
        self._loops = [
            asyncio.create_task(self._heartbeats(reg.heartbeat_interval_ms / 1000.0)),
            asyncio.create_task(self._work()),
        ]
        return self

    async def stop(self) -> None:
        for t in [*self._loops, *self._background]:
            t.cancel()
        for t in [*self._loops, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._stack.aclose()

    def kill(self) -> None:
        """Stop heartbeating and polling at once (a dead process, as the coordinator sees it)."""
        for t in self._loops:
            t.cancel()

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await self.stub.Heartbeat(
                agent_pb2.HeartbeatRequest(
                    node_id=self.node_id, lease_id=self.lease_id, price_micro_per_hour=self.price
                ),
                timeout=5,
            )
            await asyncio.sleep(interval / 3)

    async def _work(self) -> None:
        while True:
            task = await self.stub.NextTask(
                agent_pb2.NextTaskRequest(
                    node_id=self.node_id, lease_id=self.lease_id, wait_ms=500
                ),
                timeout=10,
            )
            if task.kind == agent_pb2.TASK_KIND_BENCHMARK:
                await self.stub.ReportBenchmark(
                    agent_pb2.ReportBenchmarkRequest(
                        node_id=self.node_id,
                        lease_id=self.lease_id,
                        task_id=task.task_id,
                        result=common_pb2.BenchmarkResult(
                            job_id=task.job_id,
                            samples_per_second=self.rate,
                            rtt_ms=1.0,
                            bandwidth_bytes_per_second=1e9,
                            max_batch_size=self.max_batch_size,
                        ),
                    ),
                    timeout=10,
                )
            elif task.kind == agent_pb2.TASK_KIND_CHECK:
                try:
                    await self.stub.ReportCheck(
                        agent_pb2.ReportCheckRequest(
                            node_id=self.node_id,
                            lease_id=self.lease_id,
                            task_id=task.task_id,
                            failed=True,
                            error="a fake agent does not recompute",
                        ),
                        timeout=10,
                    )
                except grpc.RpcError as exc:  # e.g. the check was settled meanwhile
                    log.info("%s: check %s: %s", self.name, task.task_id, exc)
            elif task.kind == agent_pb2.TASK_KIND_TRAIN:
                self.tasks.append(task)
                try:
                    await self.on_train(self, task)
                except grpc.RpcError as exc:
                    log.info("%s: task %s: %s", self.name, task.task_id, exc)
                    self.errors.append(exc.code().name if hasattr(exc, "code") else repr(exc))
                except Exception as exc:  # the test's handler is broken: keep it visible
                    log.exception("%s: task %s", self.name, task.task_id)
                    self.errors.append(repr(exc))

    # -- what an agent does ---------------------------------------------------------------------

    async def pull(
        self, job_id: str, version: int = 0, *, external_round: int = 0, optimizer: bool = False
    ) -> tuple[int, dict[str, torch.Tensor]]:
        header = None
        assembler = None
        async for msg in self.stub.PullParameters(
            agent_pb2.PullParametersRequest(
                node_id=self.node_id,
                lease_id=self.lease_id,
                job_id=job_id,
                version=version,
                external_round=external_round,
                include_optimizer_state=optimizer,
            ),
            timeout=30,
        ):
            if msg.WhichOneof("part") == "header":
                header = msg.header
                assembler = BundleAssembler(header.bundle)
            else:
                assert assembler is not None
                assembler.add(msg.chunk)
        assert header is not None and assembler is not None
        return header.version, {k: v.clone() for k, v in assembler.finish().items()}

    async def push(
        self,
        task: agent_pb2.Task,
        tensors: dict[str, torch.Tensor],
        *,
        kind: str,
        num_samples: int,
        mean_loss: float = 1.0,
        compute_seconds: float = 0.01,
        codec: str = "none",
        bundle: tuple[common_pb2.TensorBundle, bytes] | None = None,
        params_version: int = 0,
        chunks: list[agent_pb2.ChunkCommitment] | None = None,
        sketches: bool = True,
        sketch_of: dict[str, torch.Tensor] | None = None,
        start: dict[str, torch.Tensor] | None = None,
    ) -> agent_pb2.PushUpdateResponse:
        """Push an update. Where the task asks for chunk commitments (verification) and
        ``chunks`` is None, they are the honest ones of an update whose every chunk has the
        same gradient and loss; when the coordinator asks for sketches they follow, every
        chunk's the sketch of ``sketch_of`` (default: the update; ``sketches`` False: none,
        the caller sends its own). A local SGD part's chunks are honest ones of an update made
        in its first chunk (the later ones change nothing), and the start state drawn is
        uploaded when the coordinator asks for it; a ring job's external node uploads
        ``start`` (the parameters it started from) when asked."""
        header, payload = bundle or encode_bundle(tensors, codec)
        local = task.spec.sync == "local_sgd" and task.verify_chunks > 0
        starts: list[dict[str, torch.Tensor]] = []
        if chunks is None and local:
            chunks, starts = await self.local_chunks(task, tensors, num_samples, mean_loss)
        elif chunks is None:
            chunks = [
                agent_pb2.ChunkCommitment(samples=end - start, loss=mean_loss)
                for start, end in chunk_bounds(num_samples, task.verify_chunks)
            ]
        response = await self._push(
            task,
            payload,
            num_samples=num_samples,
            mean_loss=mean_loss,
            compute_seconds=compute_seconds,
            bundle=header,
            kind=kind,
            params_version=params_version or task.params_version,
            chunks=chunks,
        )
        if sketches and response.accepted and response.sketch.buckets > 0:
            chunk = tensors if sketch_of is None else sketch_of
            one = sketch(chunk, response.sketch.seed, response.sketch.buckets).tolist()
            values = one * len(chunks)
            if starts:  # local SGD: all of it in the first chunk
                values = one + [0.0] * (len(one) * (len(chunks) - 1))
            commit = self._commit(task, response.sketch.seed, values, starts, start)
            if starts:  # beside its next task (a local SGD round's box is not held up)
                job = asyncio.create_task(commit)
                self._background.add(job)
                job.add_done_callback(self._background.discard)
            else:
                await commit
        return response

    async def _commit(
        self,
        task: agent_pb2.Task,
        seed: int,
        values: list[float],
        starts: list[dict[str, torch.Tensor]],
        start: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """CommitSketches, then the start state of the chunk drawn (local SGD: ``starts``; a
        ring job's external: its parameters ``start``)."""
        try:
            drawn = await self.stub.CommitSketches(
                agent_pb2.CommitSketchesRequest(
                    node_id=self.node_id,
                    lease_id=self.lease_id,
                    job_id=task.job_id,
                    task_id=task.task_id,
                    seed=seed,
                    sketches=values,
                ),
                timeout=10,
            )
            if starts and drawn.snapshot_wanted:
                state = starts[drawn.snapshot_chunk]
                if task.spec.aggregation == "ring":  # with the round's start parameters
                    state = with_round_start(state, starts[0])
                await self.push_snapshot(task, state, drawn.snapshot_chunk)
            elif start is not None and drawn.snapshot_wanted:
                state = {f"param/{n}": t for n, t in start.items()}
                await self.push_snapshot(task, state, drawn.snapshot_chunk)
        except grpc.RpcError as exc:
            if not starts:
                raise
            log.info("%s: sketches of task %s: %s", self.name, task.task_id, exc)

    async def local_chunks(
        self, task: agent_pb2.Task, tensors: dict[str, torch.Tensor], num_samples: int, loss: float
    ) -> tuple[list[agent_pb2.ChunkCommitment], list[dict[str, torch.Tensor]]]:
        """Honest commitments of a local SGD update ``tensors`` made in its first chunk (the
        later ones change nothing), and the chunks' start states."""
        sizes = local_sgd_chunk_samples(
            len(task_indices(task)), task.local_batch, task.verify_chunks, num_samples
        )
        if task.HasField("params_bundle"):
            params = decode_bundle(task.params_bundle, task.params_data)
        else:
            _, params = await self.pull(task.job_id, task.params_version)
        moved = {n: t - tensors[n].to(t.dtype) for n, t in params.items()}
        starts = [state_tensors(params if i == 0 else moved, {}) for i in range(len(sizes))]
        chunks = [
            agent_pb2.ChunkCommitment(samples=n, loss=loss, start_digest=state_digest(x))
            for n, x in zip(sizes, starts, strict=True)
        ]
        return chunks, starts

    async def push_snapshot(
        self, task: agent_pb2.Task, state: dict[str, torch.Tensor], index: int
    ) -> agent_pb2.PushUpdateResponse:
        """Upload a local SGD chunk's start state (PushUpdate kind "snapshot")."""
        header, payload = encode_bundle(state)
        reply = await self._push(
            task,
            payload,
            kind="snapshot",
            params_version=task.params_version,
            bundle=header,
            snapshot_chunk=index,
        )
        self.snapshots_taken += reply.accepted
        return reply

    async def _push(
        self, task: agent_pb2.Task, payload: bytes, **header: object
    ) -> agent_pb2.PushUpdateResponse:
        """PushUpdate of ``task``: a header of these fields (and the node's, the task's), then
        ``payload`` in chunks."""
        first = agent_pb2.UpdateHeader(
            node_id=self.node_id,
            lease_id=self.lease_id,
            task_id=task.task_id,
            job_id=task.job_id,
            round=task.round,
            **header,  # type: ignore[arg-type]
        )
        msgs = [
            agent_pb2.PushUpdateRequest(header=first),
            *(agent_pb2.PushUpdateRequest(chunk=c) for c in iter_chunks(payload)),
        ]
        return await self.stub.PushUpdate(iter(msgs), timeout=30)

    async def report(
        self, task: agent_pb2.Task, **fields: object
    ) -> agent_pb2.ReportProgressResponse:
        return await self.stub.ReportProgress(
            agent_pb2.ReportProgressRequest(
                node_id=self.node_id, lease_id=self.lease_id, task_id=task.task_id, **fields
            ),
            timeout=10,
        )


async def submit_packed(coord: Coordinator, packed: PackedJob) -> common_pb2.Job:
    """Put the job's blobs into the coordinator's blob store (owned by a new submitter) and
    submit it over gRPC as that submitter."""
    submitter = coord.issue_identity("submitter")
    owner = submitter.principal.id
    program = await coord.blobs.put_bytes(packed.program, owner=owner)
    state = await coord.blobs.put_bytes(packed.initial_state, owner=owner)
    shards = []
    for start, count, data in packed.shards:
        ref = await coord.blobs.put_bytes(data, owner=owner)
        shards.append(common_pb2.Shard(blob=ref, start=start, count=count))
    async with idm.secure_aio_channel(coord.address, submitter) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        return await jobs.SubmitJob(
            job_pb2.SubmitJobRequest(
                spec=packed.spec, program=program, initial_state=state, shards=shards
            ),
            timeout=60,
        )


async def wait_for_job_state(
    coord: Coordinator, job_id: str, state: int, timeout: float = 60.0
) -> common_pb2.Job:
    """Poll GetJob, as an operator, until the job is in `state` (a JobState); the job. A job
    that fails while the test waits for another state fails the test with its message."""
    async with idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)

        async def reached() -> common_pb2.Job | None:
            j = await jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
            if state != common_pb2.JOB_STATE_FAILED:
                assert j.state != common_pb2.JOB_STATE_FAILED, j.message
            return j if j.state == state else None

        name = common_pb2.JobState.Name(state)
        job = await async_wait_until(reached, timeout=timeout, message=f"job never {name}")
        assert isinstance(job, common_pb2.Job)
        return job


async def job_events(coord: Coordinator, job_id: str) -> list[common_pb2.Event]:
    """The job's events, read over gRPC as an operator."""
    async with idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        reply = await jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=job_id), timeout=10)
    return list(reply.events)


def task_indices(task: agent_pb2.Task) -> list[int]:
    return [i for r in task.ranges for i in range(r.start, r.stop)]
