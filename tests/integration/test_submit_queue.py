"""SubmitJob under load from several tenants, against real coordinators (TLS, real SQLite, raw
gRPC, real inspection children): the coordinator's memory does not grow with the submissions
waiting for a program check (a coordinator process, its RSS read from /proc); a tenant's first
submission is not queued behind another tenant's many; a program submitted again is not
checked again; a tenant's submissions in progress are capped."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from coordinator.engine.submission import SubmitChecks
from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_mlp_job
from tests.procs import async_wait_until, create_token, in_process_coordinator, start_coordinator

pytestmark = pytest.mark.timeout(240)

S = grpc.StatusCode
MiB = 1 << 20


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), num_samples=64)
    return build_job(load_spec(job), verify=False, cache=ExportCache.default())


def junk_program(i: int, size: int = 4096) -> bytes:
    """Bytes that are no program (the check refuses them), a different blob per ``i``."""
    head = f"not a program {i}\n".encode()
    return head + b"\0" * (size - len(head))


async def upload(jobs: job_pb2_grpc.JobServiceStub, data: bytes) -> common_pb2.BlobRef:
    digest = hashlib.sha256(data).hexdigest()

    async def messages() -> AsyncIterator[job_pb2.UploadBlobRequest]:
        yield job_pb2.UploadBlobRequest(
            header=job_pb2.UploadBlobHeader(sha256=digest, size=len(data), offset=0)
        )
        for o in range(0, len(data), MAX_CHUNK_BYTES):
            chunk = common_pb2.DataChunk(offset=o, data=data[o : o + MAX_CHUNK_BYTES])
            yield job_pb2.UploadBlobRequest(chunk=chunk)

    resp = await jobs.UploadBlob(messages(), timeout=120)
    assert resp.blob.sha256 == digest
    return resp.blob


class Tenant:
    """A submitter with its own certificate and channel, its shards uploaded."""

    def __init__(self, name: str, ident: idm.Identity, channel: grpc.aio.Channel) -> None:
        self.name = name
        self.id = ident.principal.id
        self.jobs = job_pb2_grpc.JobServiceStub(channel)
        self.shards: list[common_pb2.Shard] = []

    async def prepare(self, packed: PackedJob) -> None:
        self.shards = [
            common_pb2.Shard(blob=await upload(self.jobs, data), start=start, count=count)
            for start, count, data in packed.shards
        ]

    async def request(
        self, packed: PackedJob, program: bytes | common_pb2.BlobRef, state: bytes
    ) -> job_pb2.SubmitJobRequest:
        ref = (
            program if isinstance(program, common_pb2.BlobRef) else await upload(self.jobs, program)
        )
        return job_pb2.SubmitJobRequest(
            spec=packed.spec,
            program=ref,
            initial_state=await upload(self.jobs, state),
            shards=self.shards,
        )

    async def submit(self, req: job_pb2.SubmitJobRequest) -> tuple[S, str, common_pb2.Job]:
        """The answer's code and details, and the job (when OK)."""
        try:
            job = await self.jobs.SubmitJob(req, timeout=180)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or "", common_pb2.Job()
        return S.OK, "", job


@asynccontextmanager
async def tenants(
    coord: Coordinator, packed: PackedJob, *names: str
) -> AsyncIterator[list[Tenant]]:
    channels = []
    try:
        out = []
        for name in names:
            ident = coord.issue_identity("submitter")
            channel = idm.secure_aio_channel(coord.address, ident)
            channels.append(channel)
            tenant = Tenant(name, ident, channel)
            await tenant.prepare(packed)
            out.append(tenant)
        yield out
    finally:
        for channel in channels:
            await channel.close()


def checks_of(coord: Coordinator) -> SubmitChecks:
    engine = coord.engine
    assert isinstance(engine, Engine)
    return engine.submit_checks


@asynccontextmanager
async def slot_held(checks: SubmitChecks) -> AsyncIterator[asyncio.Event]:
    """The coordinator's only check slot taken (as by a check in progress) until the event
    is set."""
    release = asyncio.Event()

    async def hold() -> None:
        async with checks.gate.slot("test-holder"):
            await release.wait()

    holder = asyncio.create_task(hold())
    await async_wait_until(lambda: checks.gate.busy == checks.gate.slots, timeout=10)
    try:
        yield release
    finally:
        release.set()
        await holder


async def test_a_tenants_first_submission_is_not_queued_behind_anothers_many(
    tmp_path: Path, packed: PackedJob
) -> None:
    async with (
        in_process_coordinator(
            tmp_path / "c",
            engine_factory=Engine,
            program_check_cache_root=tmp_path / "checks",
            program_check_concurrency=1,
        ) as coord,
        tenants(coord, packed, "alice", "bob") as (alice, bob),
    ):
        checks = checks_of(coord)
        checks.gate.per_principal = 8
        alice_reqs = [
            await alice.request(packed, junk_program(i), packed.initial_state) for i in range(6)
        ]
        bob_req = await bob.request(packed, packed.program, packed.initial_state)
        done: list[str] = []

        async def submit(tenant: Tenant, req: job_pb2.SubmitJobRequest, name: str) -> S:
            code, details, _ = await tenant.submit(req)
            done.append(name)
            if name == "bob":
                assert code == S.OK, details
            return code

        async with slot_held(checks):
            alice_calls = [
                asyncio.create_task(submit(alice, req, f"alice{i}"))
                for i, req in enumerate(alice_reqs)
            ]
            await async_wait_until(lambda: checks.gate.waiting(alice.id) == 6, timeout=30)
            bob_call = asyncio.create_task(submit(bob, bob_req, "bob"))
            await async_wait_until(lambda: checks.gate.waiting(bob.id) == 1, timeout=30)
        assert await bob_call == S.OK
        assert await asyncio.gather(*alice_calls) == [S.INVALID_ARGUMENT] * 6
        # Served in turn: alice's first, then bob's, then the rest of alice's (in a queue over
        # all requests bob's would have been answered last).
        assert done.index("bob") < done.index("alice5"), done
        assert done[:2] == ["alice0", "bob"], done
        assert [n for n in done if n != "bob"] == [f"alice{i}" for i in range(6)], done
        assert checks.cache.checks == 7


async def test_a_program_submitted_again_is_not_checked_again(
    tmp_path: Path, packed: PackedJob
) -> None:
    async with (
        in_process_coordinator(
            tmp_path / "c", engine_factory=Engine, program_check_cache_root=tmp_path / "checks"
        ) as coord,
        tenants(coord, packed, "alice", "bob") as (alice, bob),
    ):
        checks = checks_of(coord)
        req = await alice.request(packed, packed.program, packed.initial_state)
        jobs = []
        for tenant, request in ((alice, req), (alice, req)):
            code, details, job = await tenant.submit(request)
            assert code == S.OK, details
            jobs.append(job)
        # Another tenant with the same bytes (uploaded by it: its proof of holding them).
        code, details, job = await bob.submit(
            await bob.request(packed, packed.program, packed.initial_state)
        )
        assert code == S.OK, details
        jobs.append(job)
        assert checks.cache.checks == 1

        async def how_checked(tenant: Tenant, job: common_pb2.Job) -> str:
            events = await tenant.jobs.GetJobEvents(
                job_pb2.GetJobEventsRequest(job_id=job.job_id), timeout=10
            )
            (submitted,) = [e for e in events.events if e.kind == "job.submitted"]
            return submitted.attrs["program_check"]

        assert [
            await how_checked(t, j) for t, j in zip((alice, alice, bob), jobs, strict=True)
        ] == [
            "checked",
            "cached",
            "cached",
        ]

        # A refusal is remembered too, and answered the same.
        junk = await alice.request(packed, junk_program(0), packed.initial_state)
        answers = [await alice.submit(junk) for _ in range(2)]
        assert answers[0][0] == S.INVALID_ARGUMENT
        assert answers[0][1].startswith("program refused: "), answers[0][1]
        assert answers[1][:2] == answers[0][:2]
        # Another initial state is another check: the state is loaded with the program.
        code, details, _ = await alice.submit(
            await alice.request(packed, junk_program(0), packed.initial_state + b" ")
        )
        assert code == S.INVALID_ARGUMENT
        assert checks.cache.checks == 3


async def test_a_tenants_submissions_in_progress_are_capped(
    tmp_path: Path, packed: PackedJob
) -> None:
    async with (
        in_process_coordinator(
            tmp_path / "c",
            engine_factory=Engine,
            program_check_cache_root=tmp_path / "checks",
            program_check_concurrency=1,
        ) as coord,
        tenants(coord, packed, "alice", "bob") as (alice, bob),
    ):
        checks = checks_of(coord)
        cap = checks.gate.per_principal
        req = await alice.request(packed, junk_program(0), packed.initial_state)
        async with slot_held(checks):
            waiting = [asyncio.create_task(alice.submit(req)) for _ in range(cap)]
            await async_wait_until(lambda: checks.gate.in_progress(alice.id) == cap, timeout=30)
            code, details, _ = await alice.submit(req)
            assert code == S.RESOURCE_EXHAUSTED
            assert details == (
                f"tenant {alice.id} has {cap} job submissions in progress (waiting for or in "
                f"the program check), the most one tenant may have at once ({cap}): wait for "
                "one to be answered, then submit again"
            )
            # Another tenant is not refused.
            bob_call = asyncio.create_task(
                bob.submit(await bob.request(packed, packed.program, packed.initial_state))
            )
            await async_wait_until(lambda: checks.gate.in_progress(bob.id) == 1, timeout=30)
        assert [a[0] for a in await asyncio.gather(*waiting)] == [S.INVALID_ARGUMENT] * cap
        assert (await bob_call)[0] == S.OK
        assert checks.cache.checks == 2  # alice's waiting submissions shared one check
        # Room again once answered.
        assert (await alice.submit(req))[0] == S.INVALID_ARGUMENT


# -- memory of a coordinator process ---------------------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@contextmanager
def peak_rss(pid: int) -> Iterator[dict[str, int]]:
    """The process's peak resident memory (bytes) over the block, as ``out["peak"]``, and its
    resident memory before it, as ``out["before"]``: the kernel's high-water mark reset
    (/proc/PID/clear_refs), and the resident size sampled as well."""
    out = {"before": _status_kib(pid, "VmRSS") << 10}
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    stop = threading.Event()
    sampled = [out["before"]]

    def sample() -> None:
        while not stop.wait(0.02):
            sampled.append(_status_kib(pid, "VmRSS") << 10)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        stop.set()
        sampler.join()
        out["peak"] = max(sampled)
        if reset:
            out["peak"] = max(out["peak"], _status_kib(pid, "VmHWM") << 10)


async def test_submissions_waiting_for_a_check_do_not_grow_the_coordinators_memory(
    tmp_path: Path, packed: PackedJob
) -> None:
    program = os.urandom(64 * MiB)  # no program: each check reads it all, then refuses it
    per_tenant = 4  # the cap of submissions in progress per tenant
    with start_coordinator(tmp_path / "c", timeout=60) as proc:
        channels = []
        try:
            mine: list[Tenant] = []
            for name in ("alice", "bob"):
                token = create_token(proc.data_dir, "submitter")
                ident = await asyncio.to_thread(idm.enroll_with_token, proc.address, token)
                channel = idm.secure_aio_channel(proc.address, ident)
                channels.append(channel)
                tenant = Tenant(name, ident, channel)
                await tenant.prepare(packed)
                mine.append(tenant)
            requests = []
            for t, tenant in enumerate(mine):
                ref = await upload(tenant.jobs, program)
                for i in range(per_tenant):  # another state each: no verdict to share
                    state = packed.initial_state + b" " * (t * per_tenant + i)
                    requests.append((tenant, await tenant.request(packed, ref, state)))
            with peak_rss(proc.pid) as rss:
                answers = await asyncio.gather(*(t.submit(r) for t, r in requests))
            for code, details, _ in answers:
                assert code == S.INVALID_ARGUMENT and details.startswith("program refused: "), (
                    code,
                    details,
                )
        finally:
            for channel in channels:
                await channel.close()
    growth = rss["peak"] - rss["before"]
    # Before, each submission read its program before waiting: 8 x 64 MiB. Now each check
    # streams it from the blob file, 1 MiB at a time.
    assert growth < 2 * len(program), f"the coordinator grew by {growth / MiB:.0f} MiB"
