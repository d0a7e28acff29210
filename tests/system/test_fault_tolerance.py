"""Fault tolerance and elasticity with real processes: one coordinator (fixed port, heartbeat
every 0.5 s), agents started through `epochmesh-agent`, jobs submitted with the `epochmesh` CLI.

- An agent killed with kill -9 mid-round: the round closes without it (silence or deadline,
  never later than the deadline), the node goes OFFLINE, its slices are trained later in the
  same epoch; below min_nodes the job is PAUSED and an event says why; the agent restarted on
  the same data dir is the same node, is benchmarked again (blobs come from its cache) and
  trains again; a new agent joins mid-job.
- A straggler (slowdown raised at run time through DATA_DIR/slowdown) has its share cut
  within a few rounds and is not waited for beyond the deadline, and gets it back when it is
  fast again; a hung agent (SIGSTOP) and an agent whose network is cut (its TCP relay to the
  coordinator stops) are dropped from the round, go OFFLINE, and re-join by themselves when
  they wake up / the network is back.
- The coordinator killed with kill -9 and restarted on the same data dir: agents reconnect by
  themselves, the job resumes from its last checkpoint with the later rounds rolled back, and
  the live rounds replay (plain PyTorch) to the downloaded parameters.

Every job must succeed with each epoch covered exactly once by the applied parts of its live
rounds, and its loss must fall.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import signal
import sqlite3
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

from epochmesh.testing.wan import WanLink, WanThread
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_job
from tests.procs import CoordinatorProc, console_script, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes

try:  # TLS-aware helpers (operator channels, join tokens, a logged-in CLI)
    from tests.procs import sync_channel_for, token_for
    from tests.system.test_cli_support import logged_in_env
except ImportError:  # a tree without TLS: plaintext
    from epochmesh.grpc_util import sync_channel

    def sync_channel_for(address: str, role: str = "operator", options: Any = ()) -> grpc.Channel:
        return sync_channel(address)

    def token_for(address: str, role: str = "node") -> str | None:
        return None

    def logged_in_env(address: str) -> dict[str, str] | None:
        return None


log = logging.getLogger(__name__)

JS = common_pb2.JobState
NS = common_pb2.NodeState
HEARTBEAT_S = 0.5
LR = 0.01
JOB_SEED = 11  # job_doc's default seed
LEASE_TTL_S = 3 * HEARTBEAT_S
# The test's polling channel reconnects within a second after a coordinator restart.
FAST_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
CONVERGED_WINDOW = 10  # rounds at the end of a job whose median loss check_converged judges

# Small and learnable (labels are a linear function of the pixels). Rounds take tens of ms, so a
# test job has a couple of hundred of them: faults land while the job runs.
MODEL = """
import torch
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 32, 3, padding=1), nn.Tanh(),
        nn.Flatten(), nn.Linear(32 * 12 * 12, 4),
    )
"""


def make_dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, 12, 12, generator=g)
    w = torch.randn(12 * 12, 4, generator=g)
    return {"x": x, "y": (x.flatten(1) @ w).argmax(dim=1)}


def job_doc(name: str, **overrides: Any) -> dict[str, Any]:
    train = {"epochs": 3, "global_batch": 24, "optimizer": "sgd", "lr": LR, "momentum": 0.9}
    cluster = {"aggregation": "ps", "min_nodes": 1, "max_nodes": 4, "checkpoint_every": 4}
    for key, value in overrides.items():
        (train if key in ("epochs", "global_batch", "lr", "seed") else cluster)[key] = value
    train.setdefault("seed", JOB_SEED)
    return {
        "name": name,
        "model": {"file": "model.py", "loss": "cross_entropy"},
        "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": train,
        "cluster": cluster,
    }


class Relay:
    """A plain TCP relay to the coordinator (epochmesh.testing.wan, no emulated delay) on a fixed port,
    which can be cut (every connection reset, nothing listening) and restored."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.address = f"127.0.0.1:{free_port()}"
        self._wan: WanThread | None = None
        self.restore()

    def restore(self) -> None:
        if self._wan is None:
            link = WanLink(
                self.address, self.target, bandwidth_bps=None, rtt_ms=0.0, handshake=False
            )
            self._wan = WanThread(link).start()

    def cut(self) -> None:
        wan, self._wan = self._wan, None
        if wan is not None:
            wan.stop()

    def stop(self) -> None:
        self.cut()


def cli(address: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(console_script("epochmesh")), "--coordinator", address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=logged_in_env(address),
    )


# -- the cluster --------------------------------------------------------------------------------


class Cluster:
    """A coordinator on a fixed port (so that it can be restarted at the same address) and
    named agents with their own data dirs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.address = f"127.0.0.1:{free_port()}"
        # Parameters through PullParameters, as for big models (the other system tests get
        # their small models' parameters inline with the task).
        self.coord: CoordinatorProc = start_coordinator(
            root / "coord",
            "--listen",
            self.address,
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--inline-params-max-bytes",
            "0",
        )
        self.agents: dict[str, AgentProc] = {}
        self.slowdowns: dict[str, float] = {}
        self._channel: grpc.Channel | None = None
        self._stub: job_pb2_grpc.JobServiceStub | None = None

    def start_agent(self, name: str, slowdown: float, address: str = "") -> AgentProc:
        """Start (or restart, on the same data dir) agent ``name``; ``address``: reach the
        coordinator there (a relay) instead of directly."""
        old = self.agents.get(name)
        if old is not None and old.running():
            raise RuntimeError(f"agent {name} is already running")
        args = ["--name", name, "--slowdown", f"{slowdown:g}"]
        if address:
            token = token_for(self.address, "node")  # the relay's address is not the
            if token and not (self.root / f"agent-{name}" / "cert.pem").exists():
                args += ["--token", token]  # coordinator's: the helpers cannot tell its CA
        agent = AgentProc(address or self.address, self.root / f"agent-{name}", *args)
        self.agents[name] = agent
        self.slowdowns[name] = slowdown
        return agent

    def node_id(self, name: str) -> str:
        agent = self.agents[name]
        return agent.wait_node_id() if agent.running() else agent.node_id()

    def wait_ready(self, names: list[str], timeout: float = 60.0) -> None:
        """Until the named agents are leased (ONLINE or BUSY) with a reference benchmark."""
        ids = {self.node_id(n) for n in names}

        def ready() -> bool:
            nodes = {n.node_id: n for n in list_nodes(self.address)}
            return all(
                i in nodes
                and nodes[i].state in (NS.NODE_STATE_ONLINE, NS.NODE_STATE_BUSY)
                and nodes[i].benchmark.samples_per_second > 0
                for i in ids
            )

        wait_until(ready, timeout=timeout, interval=0.2, message=f"agents {names} not ready")

    def node_state(self, name: str) -> int:
        node_id = self.node_id(name)
        return next(n.state for n in list_nodes(self.address) if n.node_id == node_id)

    def names(self) -> dict[str, str]:
        return {a.node_id(): name for name, a in self.agents.items()}

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.kill9()
        self.coord.kill9()
        if self._channel is not None:
            self._channel.close()

    # -- gRPC reads (fast enough to poll between rounds) --------------------------------------
    # One channel for all of them, kept across coordinator restarts (it reconnects, quickly:
    # short reconnect backoff, and calls wait up to their timeout for it). A channel per poll
    # (20 a second for minutes) once left a sync channel's close() hanging with the GIL held,
    # which froze this process, its WAN relay included.

    def _jobs(self) -> job_pb2_grpc.JobServiceStub:
        if self._stub is None:
            self._channel = sync_channel_for(self.address, options=FAST_RECONNECT)
            self._stub = job_pb2_grpc.JobServiceStub(self._channel)
        return self._stub

    def job(self, job_id: str) -> common_pb2.Job:
        return self._jobs().GetJob(
            job_pb2.GetJobRequest(job_id=job_id), timeout=5, wait_for_ready=True
        )

    def rounds(self, job_id: str, rolled_back: bool = False) -> list[common_pb2.RoundRecord]:
        """The job's live rounds (``rolled_back``: and those a rollback undid)."""
        reply = self._jobs().GetRounds(
            job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=rolled_back),
            timeout=5,
            wait_for_ready=True,
        )
        return list(reply.rounds)

    def newest_checkpoint_round(self, job_id: str) -> int:
        """The round of the job's newest checkpoint, read from the coordinator's own SQLite
        file (read-only), -1 when none is written yet."""
        db = self.root / "coord" / "coordinator.db"
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
            row = conn.execute(
                "SELECT MAX(round) FROM checkpoints WHERE job_id = ?", (job_id,)
            ).fetchone()
        return -1 if row is None or row[0] is None else int(row[0])

    def events(self, job_id: str) -> list[common_pb2.Event]:
        reply = self._jobs().GetJobEvents(
            job_pb2.GetJobEventsRequest(job_id=job_id), timeout=5, wait_for_ready=True
        )
        return list(reply.events)

    def wait_rounds(self, job_id: str, pred: Any, timeout: float, what: str) -> Any:
        def check() -> Any:
            job = self.job(job_id)
            assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job
            return pred(self.rounds(job_id))

        return wait_until(check, timeout=timeout, interval=0.05, message=what)

    def wait_state(self, job_id: str, state: int, timeout: float) -> common_pb2.Job:
        def check() -> common_pb2.Job | None:
            job = self.job(job_id)
            if state != JS.JOB_STATE_FAILED:
                assert job.state != JS.JOB_STATE_FAILED, job.message
            return job if job.state == state else None

        return wait_until(  # type: ignore[return-value]
            check, timeout=timeout, interval=0.1, message=f"job {job_id} never {JS.Name(state)}"
        )

    # -- jobs --------------------------------------------------------------------------------

    def submit(self, directory: Path, doc: dict[str, Any], n: int) -> str:
        job_toml = write_job(directory, MODEL, make_dataset(n), doc)
        out = cli(self.address, "submit", str(job_toml), "--output", "json")
        assert out.returncode == 0, out.stderr
        return str(json.loads(out.stdout)["job_id"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("ft"))
    try:
        for name, slowdown in (("a", 2.0), ("b", 2.0), ("c", 3.0)):
            c.start_agent(name, slowdown)
        c.wait_ready(["a", "b", "c"])
        yield c
    finally:
        c.stop()


# -- checks on the recorded rounds -------------------------------------------------------------


def applied(rnd: common_pb2.RoundRecord) -> list[common_pb2.RoundPart]:
    return [p for p in rnd.parts if p.status == "applied"]


def part_indices(part: common_pb2.RoundPart) -> list[int]:
    return [i for r in part.ranges for i in range(r.start, r.stop)]


def check_exactly_once(rounds: list[common_pb2.RoundRecord], n: int, epochs: int) -> None:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in applied(rnd):
            by_epoch[rnd.epoch].extend(part_indices(part))
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, seen in by_epoch.items():
        counts: dict[int, int] = defaultdict(int)
        for i in seen:
            counts[i] += 1
        lost = [i for i in range(n) if counts[i] == 0]
        twice = [i for i, c in counts.items() if c > 1]
        assert not lost and not twice and len(seen) == n, (
            f"epoch {epoch}: {len(lost)} samples lost, {len(twice)} trained more than once"
        )


def check_converged(rounds: list[common_pb2.RoundRecord]) -> tuple[float, float]:
    """The loss fell: the median round loss of the last CONVERGED_WINDOW rounds is below 0.6 x
    the mean of the first two. A median, not the mean of the last few: this small-batch
    momentum SGD (batch 24) has brief loss spikes of a few rounds now and then (seen: four
    rounds at 1.0-1.4 late in epoch 4, all nodes alike, which a plain PyTorch replay of the
    recorded rounds reproduces exactly), and one at the very end would fail a mean of 3."""
    losses = [r.loss for r in rounds if applied(r)]
    first = statistics.mean(losses[:2])
    last = statistics.median(losses[-CONVERGED_WINDOW:])
    tail = ", ".join(f"{x:.2f}" for x in losses[-CONVERGED_WINDOW:])
    assert last < 0.6 * first, f"loss went from {first:.3f} to {last:.3f} (last rounds: {tail})"
    return first, last


def check_cli_rounds(address: str, job_id: str, rounds: list[common_pb2.RoundRecord]) -> None:
    """`epochmesh rounds --output json` shows exactly the live rounds."""
    out = cli(address, "rounds", job_id, "--output", "json")
    assert out.returncode == 0, out.stderr
    listed = [json.loads(line)["round"] for line in out.stdout.splitlines() if line.strip()]
    assert listed == [r.round for r in rounds]


def events_of(events: list[common_pb2.Event], kind: str) -> list[common_pb2.Event]:
    return [e for e in events if e.kind == kind]


def check_deadlines(events: list[common_pb2.Event], slack_s: float = 0.5) -> int:
    """No round waited for a missing part beyond its deadline. Returns the incomplete rounds."""
    incomplete = events_of(events, "round.incomplete")
    for e in incomplete:
        assert float(e.attrs["waited_s"]) <= float(e.attrs["deadline_s"]) + slack_s, e.message
    return len(incomplete)


def round_without(
    rounds: list[common_pb2.RoundRecord], node_id: str, t_ms: int
) -> common_pb2.RoundRecord | None:
    """The first round completed after ``t_ms`` without an applied part of ``node_id``: the
    round that had to do without it (it closed early, at the deadline, or left it out)."""
    later = [
        r
        for r in rounds
        if r.finished_ms > t_ms and applied(r) and all(p.node_id != node_id for p in applied(r))
    ]
    return min(later, key=lambda r: r.finished_ms, default=None)


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_agent_kill9_pauses_the_job_a_new_agent_joins_and_it_rejoins_with_its_cache(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Long enough that the restarted b (process start, program load, job benchmark: 5-15 s on a
    # loaded host) still finds rounds to train: rounds take 40-100 ms here, and while b
    # restarts the others' rounds are slowed down ten times (sleeps: few rounds, little CPU,
    # however long the restart takes).
    n, epochs = 1152, 6
    job_id = cluster.submit(
        tmp_path / "job",
        job_doc("kill-agent", epochs=epochs, min_nodes=3, max_nodes=4),
        n,
    )
    b_id = cluster.node_id("b")
    program_sha = cluster.job(job_id).program.sha256
    # Three rounds with all three nodes, then kill b (rounds follow each other back to back, so
    # b is in a round or about to get one).
    cluster.wait_rounds(
        job_id,
        lambda rs: sum(1 for r in rs if len(applied(r)) == 3) >= 3,
        timeout=60,
        what="three full rounds",
    )
    kill_ms = int(time.time() * 1000)
    cluster.agents["b"].kill9()
    t_kill = time.monotonic()

    # A round completes without b soon (its silence closes the round before the deadline);
    # b goes OFFLINE when its lease lapses.
    without = cluster.wait_rounds(
        job_id,
        lambda rs: round_without(rs, b_id, kill_ms),
        timeout=20,
        what="a round completed without the killed agent",
    )
    next_round_s = (without.finished_ms - kill_ms) / 1000
    log.info(f"round {without.round} completed without b {next_round_s:.2f}s after its kill -9")
    assert next_round_s <= 2 * HEARTBEAT_S + 1.0  # target 2 intervals; slack for a loaded host
    wait_until(
        lambda: cluster.node_state("b") == NS.NODE_STATE_OFFLINE,
        timeout=LEASE_TTL_S + 5,
        message="b never went OFFLINE",
    )
    log.info(f"b OFFLINE {time.monotonic() - t_kill:.2f}s after kill -9 (ttl {LEASE_TTL_S}s)")

    # Two nodes < min_nodes 3: PAUSED, and an event says why.
    cluster.wait_state(job_id, JS.JOB_STATE_PAUSED, timeout=10)
    paused = events_of(cluster.events(job_id), "job.paused")
    assert paused and "min_nodes 3" in paused[-1].message, paused
    paused_round = max(r.round for r in cluster.rounds(job_id))

    # A new agent joins: it is benchmarked, the job runs again, it trains from its next round.
    cluster.start_agent("d", 2.0)
    d_id = cluster.node_id("d")
    cluster.wait_state(job_id, JS.JOB_STATE_RUNNING, timeout=60)
    cluster.wait_rounds(
        job_id,
        lambda rs: any(
            r.round > paused_round and any(p.node_id == d_id for p in applied(r)) for r in rs
        ),
        timeout=30,
        what="the new agent trains",
    )

    # b comes back on the same data dir: the same node, benchmarked again (the job's blobs come
    # from its cache), and it trains again.
    others = ("a", "c", "d")
    for name in others:
        set_slowdown(cluster, name, 10 * cluster.slowdowns[name])
    try:
        restart_ms = int(time.time() * 1000)
        cluster.start_agent("b", cluster.slowdowns["b"])
        assert cluster.node_id("b") == b_id
        cluster.wait_rounds(
            job_id,
            lambda rs: any(
                r.finished_ms > restart_ms and any(p.node_id == b_id for p in applied(r))
                for r in rs
            ),
            timeout=60,
            what="b trains again after its restart",
        )
    finally:
        for name in others:
            set_slowdown(cluster, name, cluster.slowdowns[name])
    events = cluster.events(job_id)
    assert any(
        e.node_id == b_id and e.time_ms > restart_ms for e in events_of(events, "node.benchmark")
    ), "b was not benchmarked again on the job"
    assert cluster.agents["b"].log_text().count(f"cached blob {program_sha}") == 1, (
        "the restarted agent downloaded the program again instead of using its cache"
    )

    job = cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=90)
    rounds = cluster.rounds(job_id)
    check_exactly_once(rounds, n, epochs)
    first, last = check_converged(rounds)
    check_cli_rounds(cluster.address, job_id, rounds)
    events = cluster.events(job_id)
    check_deadlines(events)
    # Dead, b contributed nothing: no round handed out between its kill and its restart
    # applied a part of it (the round it was killed in, if it had a part there, failed it or
    # closed without it; on a busy host it may have been between rounds or in a check).
    while_dead = [
        r.round
        for r in rounds
        if kill_ms < r.started_ms and r.finished_ms < restart_ms
        for p in applied(r)
        if p.node_id == b_id
    ]
    assert not while_dead, f"rounds {while_dead} applied a part of the killed node"
    # The job ran while b was dead. Those rounds may have been undone since: b killed between
    # its update and its sketch commitment leaves that update unverifiable, and verification
    # undoes it with every round after it (a node could dodge its checks by going away).
    ran = cluster.rounds(job_id, rolled_back=True)
    assert any(kill_ms < r.started_ms and r.finished_ms < restart_ms for r in ran)
    assert events_of(events, "job.running"), "no event says the job resumed"
    # The live rounds, replayed in plain PyTorch, give the result: through the kill, the pause,
    # the new node and the rejoin (its program loaded again or kept from its benchmark) every
    # applied update was computed from its round's parameters and weighed right.
    diff = check_replay(cluster, job_id, tmp_path, rounds, n, JOB_SEED)
    log.info(
        f"loss {first:.3f} -> {last:.3f} (final {job.last_loss:.3f}), {len(rounds)} rounds, "
        f"{sum(1 for r in rounds if len(applied(r)) < len(r.parts))} incomplete; result vs "
        f"replay {diff:.1e}"
    )


@pytest.mark.timeout(180)
def test_a_straggler_loses_share_and_hung_or_cut_off_agents_are_dropped_then_rejoin(
    cluster: Cluster, tmp_path: Path
) -> None:
    for name in ("a", "b", "c"):
        if not cluster.agents[name].running():
            cluster.start_agent(name, cluster.slowdowns[name])
    if "d" in cluster.agents:
        cluster.agents["d"].kill9()
    # e reaches the coordinator through a TCP relay that the test cuts (a network partition).
    relay = Relay(cluster.address)
    try:
        cluster.start_agent("e", 2.0, address=relay.address)
        cluster.wait_ready(["a", "b", "c", "e"])
        straggler_then_partition(cluster, relay, tmp_path)
    finally:
        relay.stop()
        cluster.agents["e"].kill9()


def straggler_then_partition(cluster: Cluster, relay: Relay, tmp_path: Path) -> None:
    # Long enough for a and e to re-join and train again (rounds ~30 ms; while they re-join,
    # ten times slower: sleeps, few rounds, however long e's reconnection backoff takes).
    n, epochs = 1536, 4
    job_id = cluster.submit(
        # min_nodes 3: while a and e are gone the job waits for them (PAUSED), so they re-join
        # before it ends
        tmp_path / "job",
        job_doc("straggler", epochs=epochs, min_nodes=3, max_nodes=4),
        n,
    )
    c_id, a_id = cluster.node_id("c"), cluster.node_id("a")

    def c_batches(rs: list[common_pb2.RoundRecord]) -> list[int]:
        return [p.local_batch for r in rs for p in applied(r) if p.node_id == c_id]

    # c trains at its normal speed for a few rounds, then becomes 300x slower: its part of a
    # round takes longer than the deadline, which does not wait for it.
    cluster.wait_rounds(
        job_id, lambda rs: len(c_batches(rs)) >= 4, timeout=60, what="four rounds of c"
    )
    before = statistics.mean(c_batches(cluster.rounds(job_id))[-3:])
    # Rounds are counted from the first one handed out after the change (GetRounds shows a
    # round once its record is stored, a round or so after it closed).
    change_ms = int(time.time() * 1000)
    set_slowdown(cluster, "c", 300 * cluster.slowdowns["c"])

    def c_parts_after(rs: list[common_pb2.RoundRecord], ms: int) -> list[common_pb2.RoundPart]:
        return [p for r in rs if r.started_ms >= ms for p in r.parts if p.node_id == c_id]

    # A straggler keeps one sample per round (best effort): c at a sample or two before the
    # change (a busy host) cannot go below that.
    small = max(1.0, before / 3)

    def c_shrunk(rs: list[common_pb2.RoundRecord]) -> list[int] | None:
        later = [p.local_batch for p in c_parts_after(rs, change_ms)]
        return later if later and later[-1] <= small else None

    try:
        later = cluster.wait_rounds(job_id, c_shrunk, timeout=30, what="c's share shrinks")
    finally:
        set_slowdown(cluster, "c", cluster.slowdowns["c"])  # also when the test fails here
    log.info(f"straggler c: batch {before:.1f} before, then {later} after a 300x slowdown")
    took = next(i for i, b in enumerate(later) if b <= small) + 1
    assert took <= 4, f"c's share took {took} rounds to shrink: {later}"

    # Back to its speed, c trains again: its parts are applied, no longer late (it kept one
    # sample per round, best effort, the rounds not waiting for it). Its share does not
    # always grow back: at one sample a round's compute is mostly the step's fixed cost, so c
    # measures slow there and sync rounds, planned on samples/s, keep it at one or two (the
    # bad equilibrium the exact per-request CPU clock of session 11 exposed; the tiny steps
    # read 0 before, which made c look fast). Planning sync rounds on the per-step model, as
    # local SGD rounds are, is the fix: a follow-up, see the README.
    recover_ms = int(time.time() * 1000)

    def c_recovered(rs: list[common_pb2.RoundRecord]) -> list[int] | None:
        again = [p for p in c_parts_after(rs, recover_ms)]
        tail = again[-3:]
        ok = len(tail) == 3 and all(p.status == "applied" for p in tail)
        return [p.local_batch for p in again] if ok else None

    again = cluster.wait_rounds(job_id, c_recovered, timeout=30, what="c trains again")
    log.info(f"straggler c back to normal: batches {again}")

    # a hangs (SIGSTOP) and e's network is cut. A round they are part of closes without them
    # (silence, before its deadline); no later round waits for them: with two usable nodes
    # left, fewer than min_nodes 3, the job PAUSES once their leases lapse. When a wakes up and
    # e's network is back, both re-join by themselves and the job goes on.
    e_id = cluster.node_id("e")
    cut_ms = int(time.time() * 1000)
    cluster.agents["a"].send(signal.SIGSTOP)
    relay.cut()
    try:
        for name in ("a", "e"):
            wait_until(
                lambda name=name: cluster.node_state(name) == NS.NODE_STATE_OFFLINE,
                timeout=LEASE_TTL_S + 5,
                message=f"{name} never went OFFLINE",
            )
        cluster.wait_state(job_id, JS.JOB_STATE_PAUSED, timeout=10)
        rounds = cluster.rounds(job_id)
        for name, node in (("a", a_id), ("e", e_id)):
            without = round_without(rounds, node, cut_ms)
            if without is not None:  # else its last part was done before the fault
                took = (without.finished_ms - cut_ms) / 1000
                log.info(f"round {without.round} completed without {name} {took:.2f}s after")
                assert took <= 2 * HEARTBEAT_S + 1.0
        offline_round = max(r.round for r in rounds)
    finally:
        for name in ("b", "c"):
            set_slowdown(cluster, name, 10 * cluster.slowdowns[name])
        cluster.agents["a"].send(signal.SIGCONT)
        relay.restore()
    try:
        for name, node in (("a", a_id), ("e", e_id)):
            cluster.wait_rounds(
                job_id,
                lambda rs, node=node: any(
                    r.round > offline_round and any(p.node_id == node for p in applied(r))
                    for r in rs
                ),
                timeout=60,
                what=f"{name} trains again",
            )
    finally:
        for name in ("b", "c"):
            set_slowdown(cluster, name, cluster.slowdowns[name])
    assert cluster.node_id("e") == e_id and cluster.agents["e"].running()

    cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=90)
    rounds = cluster.rounds(job_id)
    check_exactly_once(rounds, n, epochs)
    check_converged(rounds)
    incomplete = check_deadlines(cluster.events(job_id))
    log.info(f"{len(rounds)} rounds, {incomplete} closed without some part")


def set_slowdown(cluster: Cluster, name: str, factor: float) -> None:
    """Change an agent's slowdown at run time: its watch file, then SIGUSR1 to reload it."""
    (cluster.root / f"agent-{name}" / "slowdown").write_text(f"{factor:g}\n")
    cluster.agents[name].send(signal.SIGUSR1)


def import_model(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("ft_replay_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(
    job_dir: Path, rounds: list[common_pb2.RoundRecord], data: dict[str, torch.Tensor], seed: int
) -> dict[str, torch.Tensor]:
    """The live rounds in a plain single-process PyTorch loop (the submitter's model.py).

    On one torch thread, as the agents train (--threads 1): these convolutions on a few
    samples are tiny, and a second thread only waits for a core. On this 2-core host, busy
    with the agents and other processes, two threads made a round's replay 5-10 times slower
    (tens of ms instead of ~5 ms: minutes for the hundreds of rounds of these jobs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(job_dir, rounds, data, seed)
    finally:
        torch.set_num_threads(threads)


def _replay(
    job_dir: Path, rounds: list[common_pb2.RoundRecord], data: dict[str, torch.Tensor], seed: int
) -> dict[str, torch.Tensor]:
    module = import_model(job_dir / "model.py")
    torch.manual_seed(seed)
    model = module.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for rnd in rounds:
        parts = sorted(applied(rnd), key=lambda p: p.node_id)
        if not parts:
            continue
        total = sum(p.local_batch for p in parts)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for part in parts:
            idx = torch.tensor(part_indices(part))
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(data["x"][idx]), data["y"][idx]).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g.add_(p.grad, alpha=part.local_batch / total)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def check_replay(
    cluster: Cluster,
    job_id: str,
    tmp_path: Path,
    rounds: list[common_pb2.RoundRecord],
    n: int,
    seed: int,
) -> float:
    """The downloaded result equals the live rounds replayed in plain PyTorch (<= 1e-5): every
    applied update was computed from its round's parameters and weighed right. Returns the
    largest difference."""
    out = cli(cluster.address, "download", job_id, "-o", str(tmp_path / "result"))
    assert out.returncode == 0, out.stderr
    trained = load_file(str(tmp_path / "result" / "model.safetensors"))
    expected = replay(tmp_path / "job", rounds, make_dataset(n), seed)
    diff = max((trained[k] - v).abs().max().item() for k, v in expected.items())
    assert diff <= 1e-5, f"max abs difference {diff} between the result and the replay"
    return diff


@pytest.mark.timeout(180)
@pytest.mark.parametrize("aggregation", ["ps", "ring"])
def test_coordinator_kill9_resumes_from_its_checkpoint(
    cluster: Cluster, tmp_path: Path, aggregation: str
) -> None:
    """Ring mode too: the checkpoint there is a member's pushed state; after the restart the
    version jumps past every one handed out, so no member holds it and all of them fetch the
    restored parameters and optimizer state from the coordinator."""
    for name in ("a", "b", "c"):
        if not cluster.agents[name].running():
            cluster.start_agent(name, cluster.slowdowns[name])
        set_slowdown(cluster, name, cluster.slowdowns[name])
    cluster.wait_ready(["a", "b", "c"])
    n, epochs, every, seed = 576, 3, 5, 5
    job_id = cluster.submit(
        tmp_path / "job",
        job_doc(
            "kill-coordinator",
            epochs=epochs,
            checkpoint_every=every,
            seed=seed,
            aggregation=aggregation,
        ),
        n,
    )
    ids_before = {cluster.node_id(x) for x in ("a", "b", "c")}

    def mid_interval(rs: list[common_pb2.RoundRecord]) -> bool:
        # Two or three rounds past a periodic checkpoint, at least two recorded rounds past the
        # newest checkpoint of any kind (a ring job also checkpoints in rounds with a lone
        # member, and a pushed state is written after the round it names), and far from the
        # end of an epoch (which checkpoints too): the kill then has rounds to roll back.
        done = sum(1 for r in rs if applied(r))
        if done < 10 or done % every not in (1, 2, 3):
            return False
        newest = max(r.round for r in rs if applied(r))
        if newest < cluster.newest_checkpoint_round(job_id) + 2:
            return False
        epoch = rs[-1].epoch
        trained = sum(p.local_batch for r in rs if r.epoch == epoch for p in applied(r))
        return trained < n - every * 24

    cluster.wait_rounds(job_id, mid_interval, timeout=90, what="a round between checkpoints")
    cluster.coord.kill9()
    restart_t = time.monotonic()
    restart_ms = int(time.time() * 1000)
    cluster.coord.start()  # same data dir, same address
    started_s = time.monotonic() - restart_t
    rounds = cluster.wait_rounds(
        job_id,
        lambda rs: [r for r in rs if r.finished_ms > restart_ms] or None,
        timeout=30,
        what="a round after the coordinator restart",
    )
    resume_s = (
        min(r.finished_ms for r in rounds if r.finished_ms > restart_ms) - restart_ms
    ) / 1000
    log.info(
        f"coordinator serving {started_s:.2f}s after restart, next round after {resume_s:.2f}s"
    )
    # The time to resume is a benchmark's figure (scripts/bench_recovery.py, target 15 s), not
    # a test's: here it is only bounded by the wait above.

    restored = events_of(cluster.events(job_id), "job.restored")
    assert len(restored) == 1, restored
    assert int(restored[0].attrs["rolled_back"]) >= 1, restored[0].message

    cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=90)
    rounds = cluster.rounds(job_id)
    check_exactly_once(rounds, n, epochs)
    check_converged(rounds)
    check_cli_rounds(cluster.address, job_id, rounds)
    numbers = [r.round for r in rounds]
    assert numbers == sorted(set(numbers))
    after = [r for r in rounds if r.finished_ms > restart_ms]
    assert after[0].round > int(restored[0].attrs["checkpoint_round"]) + int(
        restored[0].attrs["rolled_back"]
    ), "round numbers must continue after the highest one ever recorded"
    # The agents reconnected by themselves (same processes, same node ids) and trained. Not
    # necessarily all three before the job ends: each is benchmarked again first, in a new
    # program child (seconds), and a fast node may finish the job meanwhile.
    trained_after = {p.node_id for r in after for p in applied(r)}
    assert trained_after and trained_after <= ids_before, (trained_after, ids_before)

    # The live rounds, replayed in plain PyTorch, give the downloaded parameters: the restored
    # parameters, optimizer state and ledger were consistent with them.
    check_replay(cluster, job_id, tmp_path, rounds, n, seed)
