"""Ring members that disagree on the parameters after a step, against the real engine over real
gRPC + TLS (members played by tests/integration/fake_agent.py, as in test_ring_coordinator.py):
the majority's checksum wins, the minority is ejected with a strike and the round retried
without it; with no majority the round is retried once, then the job waits for a member outside the
disputed ones whose checksum decides (or, with no room for one, stops saying why).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.rounds.ring_verdicts import Agreement, checksum_verdict
from epochmesh import identity as idm
from epochmesh.v1 import agent_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.fake_agent import FakeAgent, submit_packed
from tests.integration.test_ring_coordinator import (
    FakeMember,
    check_exactly_once,
    new_world,
    ring_coordinator,
    ring_job,
    run_job,
)
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(240)

A, B, C = "a" * 64, "b" * 64, "c" * 64


class Member(FakeMember):
    """A FakeMember that, like a real agent, goes back to the state of the round's version it
    kept (the pre-step snapshot) when a round it stepped is retried."""

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        v = task.params_version
        held = self.world["states"].get((agent.node_id, v))
        if task.ring.node_ids and not task.state_source_node_id and held is not None:
            self.params, self.version = dict(held), v
        await super().__call__(agent, task)


@pytest.mark.parametrize(
    ("checksums", "retried", "agreement", "minority"),
    [
        ({"m1": A, "m2": A, "m3": A}, False, Agreement.AGREED, ()),
        ({"m1": A, "m2": A, "m3": B}, False, Agreement.EJECT, ("m3",)),
        ({"m1": A, "m2": B, "m3": A, "m4": A, "m5": C}, True, Agreement.EJECT, ("m2", "m5")),
        ({"m1": A, "m2": B}, False, Agreement.RETRY, ()),
        ({"m1": A, "m2": B}, True, Agreement.FAIL, ()),
        ({"m1": A, "m2": A, "m3": B, "m4": B}, False, Agreement.RETRY, ()),
        ({"m1": A, "m2": B, "m3": C}, True, Agreement.FAIL, ()),
        ({"m1": A}, True, Agreement.AGREED, ()),
    ],
)
def test_checksum_verdict(
    checksums: dict[str, str], retried: bool, agreement: Agreement, minority: tuple[str, ...]
) -> None:
    verdict = checksum_verdict(checksums, retried)
    assert verdict.agreement is agreement, verdict.reason
    assert verdict.minority == minority
    if agreement is Agreement.EJECT:
        assert verdict.agreed == A and all(m in verdict.reason for m in minority)
    if agreement is Agreement.FAIL:
        assert "no majority" in verdict.reason and "after a retry" in verdict.reason


async def test_a_member_with_a_wrong_checksum_is_ejected_with_a_strike(tmp_path: Path) -> None:
    """Four members, one reports another checksum every round: each time the others win, it
    leaves the round with a strike, the round is retried without it (quarantined at three);
    the job succeeds with every sample once per epoch."""
    packed = ring_job(tmp_path, min_nodes=3, max_nodes=4)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        liar = Member(world)
        liar.checksum_salt = "a forged step"
        agents = [
            await FakeAgent(
                coord, f"m{i}", 200.0, Member(world), peer_address=f"127.0.0.1:{i}"
            ).start()
            for i in (1, 2, 4)
        ]
        agents.insert(
            2, await FakeAgent(coord, "m3", 200.0, liar, peer_address="127.0.0.1:3").start()
        )
        try:
            final, rounds, events = await run_job(coord, packed)
            m1, m2, m3, m4 = (a.node_id for a in agents)
            strikes = {n: coord.registry.get(n).strikes for n in (m1, m2, m3, m4)}
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    assert strikes[m3] >= 1 and strikes[m1] == strikes[m2] == strikes[m4] == 0, strikes
    diverged = [e for e in events if e.kind == "round.diverged"]
    assert diverged and all(e.attrs["ejected"] == m3 for e in diverged)
    assert "members agree on checksum" in diverged[0].message
    struck = [e for e in events if e.kind == "node.strike"]
    assert struck and {e.node_id for e in struck} == {m3}
    assert "differs from the majority" in struck[0].message
    rnd = next(r for r in rounds if r.round == int(diverged[0].attrs["round"]))
    status = {p.node_id: p.status for p in rnd.parts}
    assert status[m3] != "applied"
    assert all(s == "applied" for n, s in status.items() if n != m3), status
    assert rnd.attempts == 2
    assert not [e for e in events if e.kind == "job.diverged"]


class _FlakyOnce(Member):
    """Reports a wrong checksum in the first attempt of the first round it runs only."""

    def __init__(self, world: dict) -> None:
        super().__init__(world)
        self.first: tuple[int, int] | None = None
        self.key: tuple[int, int] = (0, 0)

    @property  # type: ignore[override]
    def checksum_salt(self) -> str:
        return "cosmic ray" if self.key == self.first else ""

    @checksum_salt.setter
    def checksum_salt(self, value: str) -> None:
        del value

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        self.key = (task.round, task.ring.attempt)
        if self.first is None and task.ring.node_ids:
            self.first = self.key
        await super().__call__(agent, task)


async def test_two_members_that_disagree_once_retry_the_round(tmp_path: Path) -> None:
    """Two members have no majority: a disagreement retries the round once with both (nobody
    struck); a transient one clears and the job succeeds. (A lasting one stops the job:
    test_ring_coordinator.py::test_a_checksum_mismatch_stops_the_job.)"""
    packed = ring_job(tmp_path, min_nodes=2, max_nodes=2)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        agents = [
            await FakeAgent(
                coord, "m1", 200.0, FakeMember(world), peer_address="127.0.0.1:1"
            ).start(),
            await FakeAgent(
                coord, "m2", 200.0, _FlakyOnce(world), peer_address="127.0.0.1:2"
            ).start(),
        ]
        try:
            final, rounds, events = await run_job(coord, packed)
            strikes = [coord.registry.get(a.node_id).strikes for a in agents]
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    assert strikes == [0, 0]
    retried = [e for e in events if e.kind == "round.retried"]
    assert len(retried) == 1 and "no majority" in retried[0].message, retried
    assert retried[0].attrs["failed"] == ""
    rnd = next(r for r in rounds if r.round == int(retried[0].attrs["round"]))
    assert rnd.attempts == 2 and all(p.status == "applied" for p in rnd.parts)


async def test_two_members_that_keep_disagreeing_wait_for_a_third_who_decides(
    tmp_path: Path,
) -> None:
    """Two members, one of them reporting another checksum every round: after the retry nobody
    can be blamed, so nobody is struck; the round's samples go back to pending and the job
    waits (PAUSED, saying for what) for a member outside the two, since max_nodes leaves room
    for one. A third member joins: the majority's checksum wins, the liar is ejected with a
    strike, and the job succeeds with every sample once per epoch."""
    packed = ring_job(tmp_path, min_nodes=2, max_nodes=3)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        liar = Member(world)
        liar.checksum_salt = "a forged step"
        agents = [
            await FakeAgent(coord, "m1", 200.0, Member(world), peer_address="127.0.0.1:1").start(),
            await FakeAgent(coord, "m2", 200.0, liar, peer_address="127.0.0.1:2").start(),
        ]
        try:
            job = await submit_packed(coord, packed)

            async def waiting() -> common_pb2.Job | None:
                j = await coord.store.get_job(job.job_id)
                assert j is not None and j.state != common_pb2.JOB_STATE_FAILED, j.message
                paused = j.state == common_pb2.JOB_STATE_PAUSED
                return j if paused and "ring member other than" in j.message else None

            paused = await async_wait_until(waiting, timeout=30, message="the job never waited")
            assert all(a.node_id in paused.message for a in agents), paused.message
            assert [coord.registry.get(a.node_id).strikes for a in agents] == [0, 0]
            agents.append(
                await FakeAgent(
                    coord, "m3", 200.0, Member(world), peer_address="127.0.0.1:3"
                ).start()
            )
            final, rounds, events = await run_job(coord, packed, job=job)
            m1, m2, m3 = (a.node_id for a in agents)
            strikes = {n: coord.registry.get(n).strikes for n in (m1, m2, m3)}
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    assert strikes[m2] >= 1 and strikes[m1] == strikes[m3] == 0, strikes
    disputed = [e for e in events if e.kind == "round.disputed"]
    assert disputed and disputed[0].attrs["disputed"] == ",".join(sorted((m1, m2)))
    # On a busy host a later ring may form of the liar and m3 alone (m1 between tasks): that
    # round is disputed too. Every dispute has the liar in it, never two honest members.
    assert all(m2 in e.attrs["disputed"].split(",") for e in disputed), [
        dict(e.attrs) for e in disputed
    ]
    assert all("no majority" in e.message and "nobody is struck" in e.message for e in disputed)
    assert not [e for e in events if e.kind == "job.diverged"]
    ejected = [e for e in events if e.kind == "round.diverged"]
    assert ejected and all(e.attrs["ejected"] == m2 for e in ejected)


async def test_ring_tasks_carry_the_revocation_list(tmp_path: Path) -> None:
    """A revoked node's certificate still passes the CA check on peers: every ring task tells
    the members which node ids the coordinator revoked (their PeerServices refuse them:
    test_ring_peer_attacks.py)."""
    packed = ring_job(tmp_path, min_nodes=2, max_nodes=2)
    world = new_world(packed)
    async with ring_coordinator(tmp_path) as coord:
        gone = await FakeAgent(
            coord, "gone", 200.0, Member(world), peer_address="127.0.0.1:9"
        ).start()
        await gone.stop()
        async with idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as ch:
            await scheduler_pb2_grpc.SchedulerServiceStub(ch).Revoke(
                scheduler_pb2.RevokeRequest(principal=gone.node_id, reason="stolen key"),
                timeout=10,
            )
        agents = [
            await FakeAgent(
                coord, f"m{i}", 200.0, Member(world), peer_address=f"127.0.0.1:{i}"
            ).start()
            for i in (1, 2)
        ]
        try:
            final, _, _ = await run_job(coord, packed)
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    assert world["tasks"] and all(
        list(t.revoked_node_ids) == [gone.node_id] for t in world["tasks"]
    )
