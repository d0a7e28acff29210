"""A ring job preempted by a higher tier (issue 18), with real processes: a coordinator with a
short --scheduler-hold, four agents with PeerServices (mutual TLS), jobs submitted with the
`epochmesh` CLI.

- Cut below min_nodes: a ring job (normal, min_nodes 4) on the four nodes; a high-priority
  parameter-server job (min_nodes 3) takes three of them at a round boundary. The ring job
  waits (PAUSED with the scheduler's reason), its state kept: the coordinator holds a
  checkpoint of the last round before its nodes left (no member of the job holds it then).
  When the high job ends it resumes by itself on the four nodes, never rolled back.
- Shrink: a high-priority ring job (one node) takes one of the ring job's (min_nodes 3) four
  nodes; the ring job goes on with the other three (never paused) and grows back to four when
  the high job ends.

Timing: the ring jobs' rounds take a few hundredths of a second, the submission of the high
job seconds (the CLI exports the model, the coordinator checks it). So the agents are slowed
down (--slowdown changed at run time) while the high job is submitted, and in the shrink test
the ring job's nodes stay slow while the high job runs: the ring job is then still running
at each step, with few rounds, whatever the host's load.

Both jobs of each test succeed; every epoch of each covers every sample exactly once; each
downloaded result equals the plain PyTorch replay of its own recorded rounds (1e-5).
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from epochmesh.v1 import common_pb2
from tests.procs import CoordinatorProc, start_coordinator, wait_until
from tests.system.test_agent import AgentProc
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_ring_training import (
    applied,
    check_exactly_once,
    finish,
    replay_diff,
    ring_job,
    wait_benchmarked,
)
from tests.system.test_training import submit

log = logging.getLogger(__name__)
JS = common_pb2.JobState

HOLD_S = 1.0  # the coordinator's --scheduler-hold
HEARTBEAT_S = 1.0  # four agents, a coordinator and the CLI on a small host: no false silences
AGENTS = 4
SLOW = 200  # slowdown while waiting (see above): ring rounds of about half a second
# Ring job: 6 rounds per epoch. No periodic checkpoints: the one kept before its nodes leave
# is the preemption's own (epoch ends still push the state).
RING_N, RING_EPOCHS = 384, 20
HIGH_N, HIGH_EPOCHS = 192, 1
NO_PERIODIC_CHECKPOINT = 10_000


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProc, list[AgentProc]]]:
    root = tmp_path_factory.mktemp("ring-preemption")
    with start_coordinator(
        root / "coord",
        "--heartbeat-interval",
        str(HEARTBEAT_S),
        "--scheduler-hold",
        str(HOLD_S),
    ) as coord:
        agents = [
            AgentProc(
                coord.address,
                root / f"agent-p{i}",
                "--name",
                f"p{i}",
                "--slowdown",
                "1",
                "--peer-listen",
                "127.0.0.1:0",
            )
            for i in range(AGENTS)
        ]
        try:
            wait_benchmarked(coord.address, AGENTS)
            yield coord, agents
        finally:
            for a in agents:
                a.kill9()


def set_slowdown(agents: list[AgentProc], factor: float) -> None:
    """Change the agents' slowdown at run time: the watch file, then SIGUSR1 to reload it."""
    for a in agents:
        (a.data_dir / "slowdown").write_text(f"{factor:g}\n")
        a.send(signal.SIGUSR1)


def kinds(events: list[common_pb2.Event]) -> list[str]:
    return [e.kind for e in events]


def checkpoint_rounds(coord: CoordinatorProc, job_id: str) -> list[int]:
    """The rounds of the job's checkpoints, read from the coordinator's own SQLite file."""
    db = coord.data_dir / "coordinator.db"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
        rows = conn.execute("SELECT round FROM checkpoints WHERE job_id = ?", (job_id,)).fetchall()
    return sorted(int(r[0]) for r in rows)


def check_result(
    address: str, job_id: str, job_dir: Path, n: int, epochs: int, data: dict, timeout: float
) -> tuple[list[common_pb2.RoundRecord], list[common_pb2.Event]]:
    """Wait for SUCCEEDED; exactly once per epoch; the result equals the replay of the rounds."""
    rounds, events, trained = finish(address, job_id, timeout=timeout)
    check_exactly_once(rounds, n, epochs)
    diff = replay_diff(job_dir, data, rounds, trained)
    assert diff <= 1e-5, f"job {job_id}: the result is {diff} off the replay of its rounds"
    assert "job.diverged" not in kinds(events)
    log.info("job %s: %d rounds, replay max abs diff %.2e", job_id, len(rounds), diff)
    return rounds, events


class Scenario:
    """A ring job on the four nodes, then a high-priority job submitted while the agents are
    slow; `cut` is the ring job's job.preempted event."""

    def __init__(
        self,
        coord: CoordinatorProc,
        agents: list[AgentProc],
        tmp_path: Path,
        ring_min_nodes: int,
        **high_cluster: Any,
    ) -> None:
        self.address = coord.address
        self.agents = agents
        self.tmp_path = tmp_path
        self.jobs = Jobs(self.address)
        t0 = time.monotonic()
        ring_toml, self.ring_data = ring_job(
            tmp_path / "ring",
            RING_N,
            train={"epochs": RING_EPOCHS},
            min_nodes=ring_min_nodes,
            max_nodes=AGENTS,
            checkpoint_every=NO_PERIODIC_CHECKPOINT,
        )
        self.ring = submit(self.address, ring_toml)
        wait_until(
            lambda: any(len(applied(r)) == AGENTS for r in self.jobs.rounds(self.ring)),
            timeout=60,
            interval=0.1,
            message="the ring job on the four nodes",
        )
        t_ring = time.monotonic()
        high_toml, self.high_data = ring_job(
            tmp_path / "high",
            HIGH_N,
            train={"epochs": HIGH_EPOCHS},
            priority="high",
            **high_cluster,
        )
        set_slowdown(agents, SLOW)
        try:
            self._submit_high(high_toml, t0, t_ring)
        except BaseException:
            self.close()
            raise

    def _submit_high(self, high_toml: Path, t0: float, t_ring: float) -> None:
        self.high = submit(self.address, high_toml)
        t_high = time.monotonic()
        state = self.jobs.job(self.ring).state
        assert state in (JS.JOB_STATE_RUNNING, JS.JOB_STATE_PAUSED), "the ring job ended"

        def preempted() -> common_pb2.Event | None:
            events = self.jobs.events(self.ring)
            return next((e for e in events if e.kind == "job.preempted"), None)

        cut = wait_until(preempted, timeout=30, interval=0.05, message="no preemption")
        assert isinstance(cut, common_pb2.Event)
        self.cut = cut
        assert "priority high" in cut.message, cut.message
        self.taken = set(cut.attrs["nodes"].split(","))
        log.info(
            "ring job on the four nodes %.1fs after its submission; the high job submitted in "
            "%.1fs, preempting %s",
            t_ring - t0,
            t_high - t_ring,
            sorted(self.taken),
        )

    def results(self) -> tuple[list, list, list, list]:
        """Both jobs' rounds and events, checked (exactly once, replay)."""
        high_rounds, high_events = check_result(
            self.address,
            self.high,
            self.tmp_path / "high" / "job",
            HIGH_N,
            HIGH_EPOCHS,
            self.high_data,
            timeout=60,
        )
        set_slowdown(self.agents, 1)
        ring_rounds, ring_events = check_result(
            self.address,
            self.ring,
            self.tmp_path / "ring" / "job",
            RING_N,
            RING_EPOCHS,
            self.ring_data,
            timeout=90,
        )
        # The high job got nodes preempted from the ring job.
        reassigned = [e for e in high_events if e.kind == "node.reassigned"]
        assert reassigned and all(e.attrs["from_job"] == self.ring for e in reassigned), [
            (e.kind, e.node_id, e.message) for e in high_events
        ]
        # Every node the high job trained on came from the ring job, said so in an event (once
        # one node is free, the scheduler may give the taker that one instead of one announced).
        high_nodes = {p.node_id for r in high_rounds for p in applied(r)}
        assert high_nodes <= {e.node_id for e in reassigned}, [e.message for e in reassigned]
        assert "job.rolled_back" not in kinds(ring_events), [e.message for e in ring_events]
        return high_rounds, high_events, ring_rounds, ring_events

    def close(self) -> None:
        set_slowdown(self.agents, 1)
        self.jobs.channel.close()


@pytest.mark.timeout(150)
def test_a_ring_job_cut_below_min_nodes_waits_with_its_state_kept_and_resumes(
    cluster: tuple[CoordinatorProc, list[AgentProc]], tmp_path: Path
) -> None:
    coord, agents = cluster
    t0 = time.monotonic()
    run = Scenario(coord, agents, tmp_path, AGENTS, aggregation="ps", min_nodes=3, max_nodes=3)
    try:
        set_slowdown(agents, 1)  # the ring job waits now: the high job at full speed
        assert len(run.taken) == 3, run.cut.attrs["nodes"]

        def paused() -> common_pb2.Event | None:
            events = run.jobs.events(run.ring)
            return next((e for e in events if e.kind == "job.paused" and e.id > run.cut.id), None)

        pause = wait_until(paused, timeout=30, interval=0.1, message="the ring job did not pause")
        assert isinstance(pause, common_pb2.Event)
        # the scheduler's reason: the higher tier holds the nodes it would need
        assert "min_nodes" in pause.message and "higher priorit" in pause.message, pause.message
        high_rounds, _, ring_rounds, ring_events = run.results()

        # The high job ran on three nodes; the ring job resumed by itself after it, with no
        # round in between.
        high_done = [r for r in high_rounds if applied(r)]
        assert all(len(applied(r)) == 3 for r in high_done)
        resumed = next(
            (e for e in ring_events if e.kind == "job.resumed" and e.id > pause.id), None
        )
        assert resumed is not None, kinds(ring_events)
        assert resumed.time_ms >= high_done[-1].finished_ms
        assert not [
            r.round
            for r in ring_rounds
            if applied(r) and pause.time_ms < r.finished_ms < resumed.time_ms
        ]
        # Its state was kept before its nodes left: a checkpoint of its last round then.
        before = [r for r in ring_rounds if applied(r) and r.finished_ms <= pause.time_ms]
        assert any(len(applied(r)) == AGENTS for r in before)
        saved = checkpoint_rounds(coord, run.ring)
        assert before[-1].round in saved, (
            f"no checkpoint of round {before[-1].round}, the last before the pause: {saved}"
        )
        # It resumed on the four nodes.
        after = [r for r in ring_rounds if applied(r) and r.finished_ms > resumed.time_ms]
        assert any(len(applied(r)) == AGENTS for r in after), [len(applied(r)) for r in after]
        log.info(
            "cut below min_nodes: paused %.1fs; %d ring rounds; test %.1fs",
            (resumed.time_ms - pause.time_ms) / 1000,
            len(ring_rounds),
            time.monotonic() - t0,
        )
    finally:
        run.close()


@pytest.mark.timeout(150)
def test_a_ring_job_shrinks_for_a_high_priority_ring_job_and_grows_back(
    cluster: tuple[CoordinatorProc, list[AgentProc]], tmp_path: Path
) -> None:
    coord, agents = cluster
    t0 = time.monotonic()
    run = Scenario(coord, agents, tmp_path, 3, min_nodes=1, max_nodes=1)
    try:
        assert len(run.taken) == 1, run.cut.attrs["nodes"]
        # The high job at full speed, the ring job's own nodes slow while it runs.
        set_slowdown([a for a in agents if a.node_id() in run.taken], 1)
        high_rounds, _, ring_rounds, ring_events = run.results()

        # It shrank and went on: never paused after the preemption.
        later = [e for e in ring_events if e.id > run.cut.id]
        assert "job.paused" not in kinds(later), [e.message for e in later]
        # While the high job trained on the node it took, the ring job went on with the other
        # three; it got its four nodes back once the high job ended.
        high_done = [r for r in high_rounds if applied(r)]
        assert all({p.node_id for p in applied(r)} == run.taken for r in high_done)
        start, end = high_done[0].started_ms, high_done[-1].finished_ms
        during = [
            r for r in ring_rounds if applied(r) and r.started_ms <= end and r.finished_ms >= start
        ]
        assert during, "no ring round while the high job ran"
        assert all(not run.taken & {p.node_id for p in applied(r)} for r in during)
        assert any(len(applied(r)) == AGENTS - 1 for r in during)
        after = [r for r in ring_rounds if applied(r) and r.started_ms > end]
        assert any(len(applied(r)) == AGENTS for r in after), [len(applied(r)) for r in after]
        log.info(
            "shrink: %d ring rounds on three nodes while the high job ran; test %.1fs",
            len(during),
            time.monotonic() - t0,
        )
    finally:
        run.close()
