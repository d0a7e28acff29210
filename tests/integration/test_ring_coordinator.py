"""The coordinator side of ring rounds, with the real engine over real gRPC + TLS; the agents are
played by the test (tests/integration/fake_agent.py), so that failures and reports are exact.

The fake members do not train (their "step" keeps the parameters as they are) and do not run
the ring all-reduce between themselves: what is under test is the coordinator's round logic
(tasks, retries, external contributions, checksums, state sources, checkpoints, records).
Ring training with real agents is tests/system/test_ring_training.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import defaultdict
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.optim import state_tensors
from epochmesh.packaging import PackedJob, build_job
from epochmesh.ring.schedule import REDUCE_SCATTER, RingSchedule
from epochmesh.ring.seal import BLAKE3, SEAL_DIGESTS
from epochmesh.ring.weights import RING_FEATURES, weight_of, weighted_contribution
from epochmesh.spec import load_spec
from epochmesh.v1 import (
    agent_pb2,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from epochmesh.verification import (
    chunk_bounds,
    local_sgd_chunk_samples,
    state_digest,
    with_round_start,
)
from epochmesh.wire.tensors import encode_bundle, params_checksum
from node_agent.training.ring_round import AuditCopies, ring_evidence
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import (
    CHECK_WAIT_S,
    FakeAgent,
    submit_packed,
    task_indices,
    wait_for_job_state,
)
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(240)

NUM_SAMPLES = 96
GLOBAL_BATCH = 16


def ring_job(
    tmp_path: Path, train: dict[str, object] | None = None, **cluster: object
) -> PackedJob:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={
            "train": {"epochs": 2, "global_batch": GLOBAL_BATCH, **(train or {})},
            "cluster": {"aggregation": "ring", "checkpoint_every": 2, **cluster},
        },
    )
    return build_job(load_spec(job_toml), verify=False, cache=ExportCache.default())


# The fake members' optimizer state: none (the checksum of no tensors).
OPTIM_CHECKSUM = params_checksum({})


class FakeMember:
    """A ring member (or, without task.ring, an external node) that "trains" to the same
    parameters it started from, so that every replica agrees."""

    def __init__(self, world: dict) -> None:
        self.world = world  # shared by the test's agents: killed ids, who reported what
        self.params: dict[str, torch.Tensor] | None = None
        self.version = -1
        self.kill_at_round = 0
        # Whether to wait for the attempt's other members (the fake "all-reduce"); a member
        # whose all-reduce is real has had its barrier already.
        self.barrier = True
        self.checksum_salt = ""
        # Verification input to get wrong (tests/integration/test_ring_verification_input.py):
        # "" none, "commitments" (a chunk short), "update_sketch" (a value short), "start" (the
        # uploaded start parameters moved), "digests" (local SGD: no start digests).
        self.wrong = ""
        # Time-boxed (weighted) rounds: the inner steps it gets through in its box (0: all).
        self.box_steps = 0

    def trained(self, task: agent_pb2.Task) -> int:
        """The samples it "trains": all of its part, or in a weighted round the prefix of
        ``box_steps`` steps."""
        samples = len(task_indices(task))
        if task.ring_weighted and self.box_steps:
            return min(samples, self.box_steps * task.local_batch)
        return samples

    async def ask_source(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        """What the state source's agent asks the coordinator when this node calls its
        TransferState (AuthorizeStateTransfer), and the same for a node not sent there."""
        source = self.world["agents"].get(task.state_source_node_id)
        if source is None:
            return
        for requester in (agent.node_id, source.node_id):
            reply = await source.stub.AuthorizeStateTransfer(
                agent_pb2.AuthorizeStateTransferRequest(
                    node_id=source.node_id,
                    lease_id=source.lease_id,
                    job_id=task.job_id,
                    requester_node_id=requester,
                ),
                timeout=10,
            )
            self.world["authorized"].append((requester == agent.node_id, reply.allowed))

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        if task.state_source_node_id:  # what the fetched state must hash to
            self.world["expected"].append(
                (
                    task.state_source_node_id,
                    task.params_version,
                    task.state_params_checksum,
                    task.state_optim_checksum,
                )
            )
        if not task.ring.node_ids:  # external: a zero gradient through the coordinator
            if task.state_source_node_id:
                self.world["sourced"].append((agent.node_id, task.state_source_node_id))
                await self.ask_source(agent, task)
                state = self.world["states"].get((task.state_source_node_id, task.params_version))
                params = dict(state) if state is not None else None
            else:
                _, params = await agent.pull(task.job_id, task.params_version)
            names = list(params) if params is not None else self.world["names"]
            zeros = {n: torch.zeros(self.world["shapes"][n]) for n in names}
            kind = "pseudo_gradient" if task.spec.sync == "local_sgd" else "gradient"
            await agent.push(
                task, zeros, kind=kind, num_samples=len(task_indices(task)), start=params
            )
            return
        if self.kill_at_round and task.round >= self.kill_at_round:
            self.world["killed"].add(agent.node_id)
            agent.kill()  # as a kill -9: no report, no heartbeat from now on
            return
        v = task.params_version
        kept = self.world["states"].get((agent.node_id, v))
        if self.version != v:
            if task.state_source_node_id:
                self.world["sourced"].append((agent.node_id, task.state_source_node_id))
                self.params = dict(self.world["states"][(task.state_source_node_id, v)])
            elif kept is not None:  # its pre-step state: a retried attempt of its last round
                self.params = dict(kept)
            else:
                got, state = await agent.pull(task.job_id, v, optimizer=True)
                assert got == v
                self.params = {
                    k.removeprefix("param/"): t for k, t in state.items() if k.startswith("param/")
                }
            self.version = v
        assert self.params is not None
        if task.ring_gateway:
            _, ext = await agent.pull(task.job_id, external_round=task.round)
            assert all(float(t.abs().max()) == 0.0 for t in ext.values())
        self.world["tasks"].append(task)
        # The "all-reduce": a barrier of the attempt's members; a member that died breaks it.
        key = (task.round, task.ring.attempt)
        trained = self.trained(task)
        if task.ring_weighted:  # its weight, for the members' evidence of the weighted ring
            weight = weight_of(trained, int(task.ring_total_samples))
            self.world["weights"][key][int(task.ring.rank)] = weight
        self.world["present"][key].add(agent.node_id)

        def ring_done() -> bool:
            ring = set(task.ring.node_ids)
            return ring <= self.world["present"][key] or bool(ring & self.world["killed"])

        if self.barrier:
            await async_wait_until(ring_done, timeout=10, message="fake ring never formed")
        dead = [n for n in task.ring.node_ids if n in self.world["killed"]]
        if dead:  # the ring broke: the dead member's stream ended
            await agent.report(
                task,
                failed=True,
                error=f"peer {dead[0]} stopped sending",
                failed_peer_node_id=dead[0],
                ring_attempt=task.ring.attempt,
            )
            return
        fields: dict[str, object] = {}
        self.world["states"][(agent.node_id, v)] = dict(self.params)
        self.world["states"][(agent.node_id, v + 1)] = dict(self.params)
        self.version = v + 1
        links = self.world.get("links")
        if links is not None:  # this member's measured links to the others of its ring
            fields["peer_links"] = [
                agent_pb2.PeerLink(node_id=n, rtt_ms=rtt, bandwidth_bytes_per_second=bw)
                for n in task.ring.node_ids
                if n != agent.node_id
                for rtt, bw in [links(agent.node_id, n)]
            ]
        start = dict(self.params)
        chunks = self.commitments(task, trained)
        fields["chunks"] = chunks[: -1 if self.wrong == "commitments" else None]
        samples = trained
        checksum = params_checksum(self.params)
        if self.checksum_salt:
            checksum = hashlib.sha256((checksum + self.checksum_salt).encode()).hexdigest()
        answer = await agent.report(
            task,
            samples_done=samples,
            mean_loss=1.0,
            compute_seconds=0.01,
            communicate_seconds=0.01,
            params_checksum=checksum,
            optim_checksum=OPTIM_CHECKSUM,
            ring_attempt=task.ring.attempt,
            params_version=v + 1,
            **fields,
        )
        if task.push_state:
            state = {f"param/{n}": t for n, t in self.params.items()}
            reply = await agent.push(
                task,
                state,
                kind="checkpoint",
                chunks=[],  # a state, not an update: nothing to commit
                num_samples=len(task_indices(task)),
                bundle=encode_bundle(state),
                params_version=v + 1,
            )
            self.world["checkpoints"].append((task.round, reply.accepted, reply.reason))
        if answer.sketch.buckets > 0 or answer.ring_audit.buckets > 0:
            await self.send_check_evidence(agent, task, answer, start, len(chunks))

    def commitments(self, task: agent_pb2.Task, trained: int) -> list[agent_pb2.ChunkCommitment]:
        """Verification: a zero gradient in every chunk of the ``trained`` samples (local SGD:
        every chunk starts from the round's parameters, no optimizer state; ``wrong``
        "digests": none committed)."""
        samples = len(task_indices(task))
        if task.spec.sync != "local_sgd":
            return [
                agent_pb2.ChunkCommitment(samples=end - begin, loss=1.0)
                for begin, end in chunk_bounds(samples, task.verify_chunks)
            ]
        assert self.params is not None
        digest = b"" if self.wrong == "digests" else state_digest(state_tensors(self.params, {}))
        return [
            agent_pb2.ChunkCommitment(samples=n, loss=1.0, start_digest=digest)
            for n in local_sgd_chunk_samples(samples, task.local_batch, task.verify_chunks, trained)
        ]

    async def send_check_evidence(
        self,
        agent: FakeAgent,
        task: agent_pb2.Task,
        answer: agent_pb2.ReportProgressResponse,
        start: dict[str, torch.Tensor],
        chunks: int,
    ) -> None:
        """What a member sends after its report when its part is checked or the round audited:
        the sketches of its (zero) chunks and update, its evidence of the all-reduce (zero:
        nothing moved; in a weighted round that of the weights' all-reduce,
        `weighted_evidence`), then the parameters its round started from when a chunk is
        drawn."""
        wanted, audit = answer.sketch, answer.ring_audit
        request = agent_pb2.CommitSketchesRequest(
            node_id=agent.node_id,
            lease_id=agent.lease_id,
            job_id=task.job_id,
            task_id=task.task_id,
            seed=wanted.seed or audit.seed,
        )
        if wanted.buckets > 0:
            request.sketches.extend([0.0] * (chunks * wanted.buckets))
            n = wanted.buckets - (self.wrong == "update_sketch")
            request.update_sketch.extend([0.0] * n)
        if audit.buckets > 0 and task.ring_weighted:
            key = (task.round, task.ring.attempt)
            weights = self.world["weights"][key]
            await async_wait_until(
                lambda: len(weights) == len(task.ring.node_ids),
                timeout=10,
                message="the other members' weights",
            )
            request.ring.CopyFrom(
                weighted_evidence(
                    task, [weights[r] for r in range(len(weights))], self.world, audit
                )
            )
        elif audit.buckets > 0:
            zeros = [0.0] * (len(task.ring.node_ids) * audit.buckets)
            request.ring.CopyFrom(
                agent_pb2.RingEvidence(
                    seed=audit.seed,
                    buckets=audit.buckets,
                    sent=zeros,
                    received=zeros,
                    own=zeros,
                    result=zeros,
                )
            )
        drawn = await agent.stub.CommitSketches(request, timeout=10)
        self.world["checked"].append((agent.node_id, task.round, drawn.snapshot_wanted))
        self.world["audited"].append((agent.node_id, task.round, audit.buckets > 0))
        if drawn.snapshot_wanted:
            state = {f"param/{n}": t.clone() for n, t in start.items()}
            if self.wrong == "start":
                first = next(iter(state.values()))
                first.view(-1)[0] += 1e-3
            if task.spec.sync == "local_sgd":  # the chunk's start state: the same parameters
                state = with_round_start({f"param/{n}": t for n, t in start.items()}, state)
            await agent.push_snapshot(task, state, drawn.snapshot_chunk)


def weighted_evidence(
    task: agent_pb2.Task, weights: list[float], world: dict, audit: agent_pb2.CheckSpec
) -> agent_pb2.RingEvidence:
    """A member's evidence of a weighted ring's all-reduce of zero updates (every member's
    contribution a weight's tail, epochmesh.ring.weights): the schedule run on the members'
    buffers (tests hold them all), what this rank received in the reduce-scatter kept."""
    n, rank = len(task.ring.node_ids), int(task.ring.rank)
    sizes = {name: math.prod(shape) for name, shape in world["shapes"].items()}
    numel = sum(sizes.values())
    buffers = [weighted_contribution(torch.zeros(numel), w, n).numpy() for w in weights]
    schedule = RingSchedule.build(n, buffers[0].size)
    results = [b.copy() for b in buffers]
    received = np.zeros_like(buffers[0])
    for t in range(schedule.num_steps):
        sent = [
            [
                results[r][lo:hi].copy()
                for lo, hi in schedule.segment_chunks(schedule.send_segment(r, t))
            ]
            for r in range(n)
        ]
        for r in range(n):
            chunks = schedule.segment_chunks(schedule.recv_segment(r, t))
            for (lo, hi), data in zip(chunks, sent[(r - 1) % n], strict=True):
                if schedule.phase(t) == REDUCE_SCATTER:
                    if r == rank:
                        received[lo:hi] = data
                    results[r][lo:hi] += data
                else:
                    results[r][lo:hi] = data
    # The agent's own evidence code; the parameters are zeros, so their order in the flat
    # buffer does not change the sketches.
    copies = AuditCopies(
        torch.from_numpy(buffers[rank]),
        torch.from_numpy(received),
        torch.from_numpy(results[rank]),
    )
    return ring_evidence(task, {name: (k,) for name, k in sizes.items()}, copies, audit)


def ring_coordinator(tmp_path: Path) -> AbstractAsyncContextManager[Coordinator]:
    """The in-process coordinator of these tests: the real engine, short heartbeats and
    check waits."""
    return in_process_coordinator(
        tmp_path / "coord",
        engine_factory=Engine,
        heartbeat_interval_s=0.5,
        check_wait_s=CHECK_WAIT_S,
    )


def new_world(packed: PackedJob) -> dict:
    from safetensors.torch import load as st_load

    initial = st_load(packed.initial_state)
    return {
        "killed": set(),
        "present": defaultdict(set),
        "tasks": [],
        "states": {},
        "sourced": [],
        "expected": [],  # (state source, version, params checksum, optim checksum) of tasks
        "authorized": [],  # (sent there, allowed) of AuthorizeStateTransfer asks
        "agents": {},  # node id -> FakeAgent, for asks made as another agent
        "checkpoints": [],
        "checked": [],  # (member, round, its start state asked for) of checked parts
        "audited": [],  # (member, round, evidence asked for) of checked or audited parts
        "weights": defaultdict(dict),  # (round, attempt) -> rank -> weight (weighted rounds)
        "names": list(packed.state_names),
        "shapes": {n: t.shape for n, t in initial.items()},
    }


async def run_job(
    coord, packed: PackedJob, terminal_ok: bool = False, job: common_pb2.Job | None = None
) -> tuple:
    """Submit ``packed`` (or follow ``job``, submitted already) to its end: (the job, its
    rounds, its events)."""
    if job is None:
        job = await submit_packed(coord, packed)
    async with idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)

        async def finished() -> common_pb2.Job | None:
            j = await jobs.GetJob(job_pb2.GetJobRequest(job_id=job.job_id))
            if j.state == common_pb2.JOB_STATE_FAILED and not terminal_ok:
                raise AssertionError(j.message)
            done = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED)
            return j if j.state in done else None

        final = await async_wait_until(finished, timeout=180, message="job did not end")
        rounds = list((await jobs.GetRounds(job_pb2.GetRoundsRequest(job_id=job.job_id))).rounds)
        events = [
            e
            async for e in sched.WatchEvents(
                scheduler_pb2.WatchEventsRequest(job_id=job.job_id), timeout=10
            )
        ]
    return final, rounds, events


def check_exactly_once(rounds: list[common_pb2.RoundRecord], epochs: int = 2) -> None:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in rnd.parts:
            if part.status == "applied":
                by_epoch[rnd.epoch].extend(i for r in part.ranges for i in range(r.start, r.stop))
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(NUM_SAMPLES)), f"epoch {epoch} is not covered once"


async def test_a_dead_member_is_retried_without_and_externals_go_through_the_gateway(
    tmp_path: Path,
) -> None:
    packed = ring_job(tmp_path, min_nodes=3, max_nodes=4)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        doomed = FakeMember(world)
        doomed.kill_at_round = 3
        # m3 declares no seal digests (an older agent): rings with it seal with SHA-256.
        agents = [
            await FakeAgent(
                coord,
                "m1",
                200.0,
                FakeMember(world),
                peer_address="127.0.0.1:1",
                seal_digests=SEAL_DIGESTS,
            ).start(),
            await FakeAgent(
                coord,
                "m2",
                200.0,
                FakeMember(world),
                peer_address="127.0.0.1:2",
                seal_digests=SEAL_DIGESTS,
            ).start(),
            await FakeAgent(coord, "m3", 200.0, doomed, peer_address="127.0.0.1:3").start(),
            await FakeAgent(coord, "ext", 200.0, FakeMember(world)).start(),
        ]
        world["agents"].update({a.node_id: a for a in agents})
        try:
            final, rounds, events = await run_job(coord, packed)
        finally:
            for a in agents:
                await a.stop()
    m1, m2, m3, ext = (a.node_id for a in agents)
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED
    check_exactly_once(rounds)

    # The round with the dead member: attempt 2 without it, its slice back to pending.
    retried = [e for e in events if e.kind == "round.retried"]
    assert retried and retried[0].attrs["failed"] == m3, [e.message for e in retried]
    assert "reported failed by" in retried[0].message
    rnd = next(r for r in rounds if r.round == int(retried[0].attrs["round"]))
    assert rnd.attempts == 2
    status = {p.node_id: p.status for p in rnd.parts}
    assert status[m3] == "failed" and status[m1] == status[m2] == status[ext] == "applied"
    assert all(r.attempts == 1 for r in rounds if r.round != rnd.round)
    assert [r.params_version for r in rounds] == list(range(1, len(rounds) + 1))

    # Tasks: B is the attempt's batch, the gateway is rank 0 and only with externals.
    for task in world["tasks"]:
        assert task.ring.node_ids[task.ring.rank] in (m1, m2, m3)
        assert not task.ring_gateway or task.ring.rank == 0
        assert task.ring.deadline_seconds >= 1.0
        assert task.ring_total_samples <= GLOBAL_BATCH
        assert task.ring.seal_digest == ("" if m3 in task.ring.node_ids else BLAKE3)
    assert any(t.ring_gateway for t in world["tasks"])
    late = [t for t in world["tasks"] if t.round == rnd.round and t.ring.attempt == 1]
    assert sorted(t.ring.node_ids[t.ring.rank] for t in late) == sorted([m1, m2])
    # Members hold each version after the first round: the external gets it from one of them.
    assert any(node == ext and source in (m1, m2, m3) for node, source in world["sourced"])
    # Each such task says what the state must hash to: what its ring agreed on for the version.
    assert world["expected"]
    for source, v, params_sum, optim_sum in world["expected"]:
        assert params_sum == params_checksum(world["states"][(source, v)]), (source, v)
        assert optim_sum == OPTIM_CHECKSUM
    # A source serves the state only to the node sent there (AuthorizeStateTransfer).
    assert world["authorized"] and all(sent == ok for sent, ok in world["authorized"])
    assert {sent for sent, _ in world["authorized"]} == {True, False}
    # Checkpoints were pushed by rank 0 and taken (every 2 rounds, epoch ends, the end), and
    # only then.
    assert world["checkpoints"] and all(ok for _, ok, _ in world["checkpoints"])
    asked = {t.round for t in world["tasks"] if t.push_state}
    assert len(asked) < len(rounds), asked
    assert rounds[-1].round in asked


async def test_a_checksum_mismatch_stops_the_job(tmp_path: Path) -> None:
    packed = ring_job(tmp_path, min_nodes=2, max_nodes=2)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        odd = FakeMember(world)
        odd.checksum_salt = "bit flip"
        agents = [
            await FakeAgent(
                coord, "m1", 200.0, FakeMember(world), peer_address="127.0.0.1:1"
            ).start(),
            await FakeAgent(coord, "m2", 200.0, odd, peer_address="127.0.0.1:2").start(),
        ]
        try:
            final, rounds, events = await run_job(coord, packed, terminal_ok=True)
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_FAILED
    assert "diverged" in final.message
    # Two members have no majority: retried once with both, then the job stops (max_nodes 2
    # leaves no room for a third member whose checksum would decide).
    assert "no majority" in final.message and "after a retry" in final.message
    assert len([e for e in events if e.kind == "round.retried"]) == 1
    diverged = [e for e in events if e.kind == "job.diverged"]
    assert len(diverged) == 1
    checksums = {k: v for k, v in diverged[0].attrs.items() if k.startswith("checksum.")}
    assert set(checksums) == {f"checksum.{a.node_id}" for a in agents}
    assert len(set(checksums.values())) == 2
    assert rounds == []  # nothing was recorded as trained


async def test_topk_with_a_ring_is_refused(tmp_path: Path) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={"train": {"compression": "topk"}, "cluster": {"aggregation": "ring"}},
    )
    packed = build_job(load_spec(job_toml), verify=False, cache=ExportCache.default())
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await submit_packed(coord, packed)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "topk" in err.value.details() and "int8" in err.value.details()


async def test_a_ring_job_without_members_waits_and_says_why(tmp_path: Path) -> None:
    packed = ring_job(tmp_path, min_nodes=1, max_nodes=2)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        agent = await FakeAgent(coord, "ext", 200.0, FakeMember(world)).start()
        try:
            job = await submit_packed(coord, packed)
            j = await wait_for_job_state(coord, job.job_id, common_pb2.JOB_STATE_PAUSED, 20)
        finally:
            await agent.stop()
    assert "PeerService" in j.message and "ring" in j.message
    assert world["tasks"] == []


async def test_when_every_holder_of_the_state_dies_the_job_rolls_back_to_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Both members die in round 4 (the last checkpoint is older: every 5 rounds): nobody holds
    the ring's version and the coordinator's is older, so when a new member comes the job goes
    back to its checkpoint (later rounds rolled back, their samples pending again) and ends
    with every epoch covered exactly once by the live rounds."""
    packed = ring_job(tmp_path, min_nodes=1, max_nodes=2, checkpoint_every=5)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        doomed = [FakeMember(world), FakeMember(world)]
        for m in doomed:
            m.kill_at_round = 4
        agents = [
            await FakeAgent(coord, f"m{i}", 200.0, m, peer_address=f"127.0.0.1:{i}").start()
            for i, m in enumerate(doomed, start=1)
        ]

        async def late_joiner() -> None:
            await async_wait_until(lambda: len(world["killed"]) == 2, timeout=30)
            agents.append(
                await FakeAgent(
                    coord, "m3", 200.0, FakeMember(world), peer_address="127.0.0.1:3"
                ).start()
            )

        joiner = asyncio.ensure_future(late_joiner())
        try:
            final, rounds, events = await run_job(coord, packed)
        finally:
            await joiner
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED
    check_exactly_once(rounds)
    kinds = [e.kind for e in events]
    assert "job.rolled_back" in kinds and "job.restored" in kinds, kinds
    restored = next(e for e in events if e.kind == "job.restored")
    assert int(restored.attrs["rolled_back"]) >= 1
    m3 = agents[2].node_id
    assert all(p.node_id == m3 for r in rounds if r.round > 4 for p in r.parts)


def _adjacent(order: list[str], a: str, b: str) -> bool:
    return any({order[i], order[(i + 1) % len(order)]} == {a, b} for i in range(len(order)))


async def test_the_ring_is_ordered_by_the_members_measured_links(tmp_path: Path) -> None:
    """Round 1 is ordered by the figures towards the coordinator (all alike here: by node id);
    once the members reported their links, the ring avoids the one slow link. Malformed link
    reports are refused with INVALID_ARGUMENT."""
    packed = ring_job(tmp_path, min_nodes=4, max_nodes=4)
    world = new_world(packed)
    slow: set[str] = set()

    def links(a: str, b: str) -> tuple[float, float]:
        return (400.0, 1e5) if {a, b} == slow else (1.0, 1e9)

    world["links"] = links
    async with ring_coordinator(tmp_path) as coord:
        agents = [
            await FakeAgent(
                coord, f"m{i}", 200.0, FakeMember(world), peer_address=f"127.0.0.1:{i + 1}"
            ).start()
            for i in range(4)
        ]
        # The link between the two smallest node ids is the slow one: they sit next to each
        # other in the order by node id.
        ids = sorted(a.node_id for a in agents)
        slow.update(ids[:2])
        try:
            final, rounds, _ = await run_job(coord, packed)
            agent = next(a for a in agents if a.node_id == ids[0])
            task = world["tasks"][-1]
            bad_reports = [
                [agent_pb2.PeerLink(node_id=ids[0], rtt_ms=1.0, bandwidth_bytes_per_second=1e9)],
                [agent_pb2.PeerLink(node_id=ids[1], rtt_ms=math.nan, bandwidth_bytes_per_second=1)],
                [agent_pb2.PeerLink(node_id=ids[1], rtt_ms=1.0, bandwidth_bytes_per_second=0)],
                [
                    agent_pb2.PeerLink(
                        node_id="not-a-node", rtt_ms=1.0, bandwidth_bytes_per_second=1
                    )
                ],
                [agent_pb2.PeerLink(node_id=ids[1], rtt_ms=1.0, bandwidth_bytes_per_second=1)] * 2,
            ]
            for bad in bad_reports:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await agent.report(task, peer_links=bad)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED
    check_exactly_once(rounds)
    orders = {t.round: list(t.ring.node_ids) for t in world["tasks"]}
    first, *later = sorted(orders)
    assert _adjacent(orders[first], *ids[:2]), orders[first]
    assert later and not any(_adjacent(orders[r], *ids[:2]) for r in later), orders


LOCAL_SGD = {"sync": "local_sgd", "inner_steps": 4, "outer_lr": 0.7, "outer_momentum": 0.5}


async def run_local_sgd_ring(
    tmp_path: Path, features: list[list[str]], box_steps: list[int]
) -> tuple[common_pb2.Job, list[common_pb2.RoundRecord], dict, list[FakeAgent]]:
    """A local SGD ring job on fake members (each declaring ``features[i]`` and getting
    through ``box_steps[i]`` steps of a boxed round): its end, rounds and world."""
    packed = ring_job(tmp_path, train=LOCAL_SGD, min_nodes=3, max_nodes=len(features))
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        members = [FakeMember(world) for _ in features]
        for member, steps in zip(members, box_steps, strict=True):
            member.box_steps = steps
        agents = [
            await FakeAgent(
                coord,
                f"m{i}",
                200.0,
                member,
                peer_address=f"127.0.0.1:{i + 1}",
                ring_features=declared,
            ).start()
            for i, (member, declared) in enumerate(zip(members, features, strict=True))
        ]
        try:
            final, rounds, _ = await run_job(coord, packed)
            nodes = {n.node_id: n for n in coord.registry.list()}
        finally:
            for a in agents:
                await a.stop()
    world["nodes"] = nodes
    return final, rounds, world, agents


async def test_a_time_boxed_ring_commits_the_prefix_each_member_trained(tmp_path: Path) -> None:
    """Every member declares weighted contributions: local SGD rounds are time-boxed (the epoch's
    last round aside), each task says so with its box and T (the samples handed out) as
    ring_total_samples. A member that gets through one step of its box reports that prefix:
    the round commits it, the rest is trained in a later round (every sample once), and the
    audits of the weighted all-reduce (the members' evidence of a real weighted ring) accuse
    nobody."""
    final, rounds, world, agents = await run_local_sgd_ring(
        tmp_path, [list(RING_FEATURES)] * 3, [1, 0, 0]
    )
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED
    check_exactly_once(rounds)
    weighted = [t for t in world["tasks"] if t.ring_weighted]
    assert weighted, "no round was time-boxed"
    by_key: dict[tuple[int, int], list[agent_pb2.Task]] = defaultdict(list)
    # Every member's task taken (the one that died in it too: world["tasks"] has the others').
    every = [t for a in agents for t in a.tasks if t.ring_weighted]
    for t in every:
        assert t.compute_budget_seconds > 0 and not t.ring_gateway
        by_key[(t.round, t.ring.attempt)].append(t)
    for tasks in by_key.values():
        if len(tasks) < len(tasks[0].ring.node_ids):
            continue  # a task the dead member never took (handed out before it was seen dead)
        # T: the samples the attempt handed out, all of its members' parts.
        total = sum(len(task_indices(t)) for t in tasks)
        assert all(t.ring_total_samples == total for t in tasks), [
            (t.round, t.ring.attempt, t.ring.rank, len(task_indices(t)), t.ring_total_samples)
            for t in tasks
        ]
    slow = agents[0].node_id
    records = {r.round: r for r in rounds}
    # Its boxed rounds (at an epoch's end the ledger may leave a member without a part).
    for rnd in {t.round for t in agents[0].tasks if t.ring_weighted}:
        part = next(p for p in records[rnd].parts if p.node_id == slow)
        assert part.status == "applied"
        # One step of its box: the prefix of local_batch samples, recorded as one step.
        assert sum(r.stop - r.start for r in part.ranges) == part.local_batch
        assert part.inner_steps == 1
    # Unboxed rounds (each epoch's last) train whole parts.
    assert any(not t.ring_weighted for t in world["tasks"])
    boxed_rounds = {t.round for t in weighted}
    audited = [a for a in world["audited"] if a[2] and a[1] in boxed_rounds]
    assert audited, "no weighted round was audited"
    for node in world["nodes"].values():
        assert node.strikes == 0, (node.node_id, node.strikes)
        assert node.reputation.failed_total == 0, node.reputation


async def test_a_ring_with_a_member_that_declared_nothing_is_not_time_boxed(
    tmp_path: Path,
) -> None:
    """One member is an older agent (no ring features): its rings of local SGD run unboxed,
    weighted as before (b_i / B), every part whole."""
    final, rounds, world, _ = await run_local_sgd_ring(
        tmp_path, [list(RING_FEATURES), list(RING_FEATURES), []], [1, 1, 1]
    )
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED
    check_exactly_once(rounds)
    assert world["tasks"]
    for t in world["tasks"]:
        assert not t.ring_weighted and t.compute_budget_seconds == 0
        assert t.ring_total_samples <= GLOBAL_BATCH
    for rnd in rounds:
        for p in rnd.parts:
            assert p.inner_steps == -(-sum(r.stop - r.start for r in p.ranges) // p.local_batch)
