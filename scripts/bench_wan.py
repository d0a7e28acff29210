"""Training over emulated WAN links: synchronous fp32 vs local SGD (DiLoCo) with int8.

Three agents (`epochmesh-agent` processes, TLS on, enrolled with join tokens, see
scripts/local_cluster.py) each dial the coordinator through their own emulated link
(epochmesh/testing/wan.py: a userspace TCP relay, 100 Mbit/s each way, 50 ms RTT). One coordinator,
the same agents, and one job trained twice, one run after the other:

  (b) sync = "local_sgd", compression = "int8": each round every node runs about H = 700 inner
      SGD steps (lr 0.1, momentum 0.9) on its b_i ~ 32-sample batches (time-boxed: it steps
      until the box the coordinator sized for H steps at its measured speed runs out; an
      epoch's last round is not boxed), pushes its int8 pseudo-gradient, and the coordinator
      applies outer Nesterov SGD (0.7, momentum 0.9);
  (a) sync = "sync", compression = "none": every step pulls the fp32 parameters and pushes an
      fp32 gradient (SGD lr 0.3, momentum 0.9: the best of 0.1 / 0.2 / 0.3 / 0.4 / 0.5 in a
      single-process sweep; 0.5 diverges). Global batch 96 in both.

  (c) with --modes ring (e.g. --modes ring,sync): (b) with aggregation = "ring": the agents
      all-reduce their int8 pseudo-gradients among themselves (time-boxed ring rounds, each
      member's update weighted by the samples it trained) instead of pushing them to the
      coordinator. Each agent's PeerService and bulk socket sit behind a relay on an address
      of its own (127.0.0.11, .12, .13) that crosses the agent's site: one access link per
      agent, 100 Mbit/s each way and 50 ms RTT, shared by its connection to the coordinator and
      what the other agents send it (see `add_peer_relays` for what is charged where).

The job: an MLP 128-640-640-10 (0.5 M parameters, 2.0 MB in fp32) regressing (MSE) a small
random tanh teacher network on 2 H x 96 Gaussian samples (see `dataset`; two rounds of (b) an
epoch: a time-boxed one and the epoch's last, which trains what the first left). Its loss sits
on a plateau near 0.2, then falls steadily for hundreds of steps with little batch-to-batch
noise, so "the first round at or below the target" marks real progress in both runs (a noisy
task lets the synchronous run cross a target by chance).

Every agent emulates a device `--slowdown` (default 2) times slower than one core of this
machine: compute is the agent's CPU time x F (node_agent/core/slowdown.py), so the three devices
fit on the two shared cores. On a loaded machine (other processes competing for the cores)
a step takes longer than F x its CPU time; that shows here as time neither computing nor
communicating, so `load_avg` is part of the output: trust figures taken at a low load.

Figures, all from the coordinator's round records and the relays' byte counters; each run's
clock starts when its first round starts (enrolment, benchmarks and blob downloads left out):
  - time_to_target_s: to the end of the first round whose recorded loss (the sample-weighted
    mean training loss of the round; for (b) the mean over its inner steps) is <= --target.
    (a) runs at most --sync-limit seconds of rounds; if it has not reached the target by then,
    `time_to_target_s` is null and `time_to_target_at_least_s` the limit;
  - utilisation: sum of the parts' compute seconds / (wall time x 3 nodes), over the rounds up
    to the target. A part's compute seconds are the time its node spent in its training loop
    (for (b) the wall time of the inner loop: the emulated device's steps, each padded to F x
    its CPU time, with the batch slicing between them; for (a) the step's device time): what
    is not compute is pulling parameters, pushing the update, and waiting for the round to
    close; device_utilisation (b only): the same with only the emulated devices' own compute
    (F x the steps' CPU time, from the agents' logs) counted, which leaves out the host's work
    between steps and steps that waited for one of the two shared cores longer than a device's
    padding hides; utilisation_after_round_1: the same over every round but the first (which
    includes loading the program and first-round deadlines), (b) running --extra-rounds more
    rounds after the target for it;
  - bytes_up_per_sample / bytes_down_per_sample: bytes the relays carried agent->coordinator /
    coordinator->agent during those rounds (sampled every 50 ms, interpolated at the rounds'
    start and end times), per sample trained;
  - time_to_loss_s: the same clock to the first round at or below 0.1, 0.05, 0.025, 0.015 and
    0.01 (null: not reached before the run stopped), to show how the ratio depends on the
    target;
  - check_share: the seconds the nodes' check tasks computed (recomputing chunks of each
    other's parts: a new node's every part, a trusted one's one round in five) / (wall time x
    3 nodes), checks ending in the same window; busy_share = utilisation + check_share;
    check_probabilities: each node's when the run's job was submitted (--trusted first runs a
    warm-up job until every agent is trusted: a long-lived cluster's figures);
  - bytes_between_agents_per_sample: (c)'s bytes through the agents' peer relays;
  - speedup: (a)'s time to target / (b)'s (speedup_at_least when (a) was stopped first);
    ring_speedup the same for (c).

Prints ONE JSON line (progress on stderr). Targets: utilisation >= 0.95 for (b) and (c),
speed-ups >= 10.

Choosing H is a trade-off between those two. Utilisation needs rounds much longer than their
fixed cost; the time to target grows with the round length (the first round starts from
scratch, and a round's recorded loss is the mean over its inner steps, so (b) reaches the
target at the end of round 2 at best). H = 700 (~6 s of compute per round) reaches it in 2
rounds. What a round of (b) costs besides compute (the agents log it per round: "params",
"steps [cpu, slowdown sleep]", "encode", "push"; the coordinator logs "round N closed ... last
update ... after the hand-out"): the parameter pull, 2 MB fp32 through the 100 Mbit/s link,
~0.22 s; the int8 push (0.5 MB), ~0.10 s; task hand-out and the coordinator's turn-around,
~0.05 s. Nodes no longer wait for each other: the time box ends every node's steps together
(round 1's box is sized on the job benchmarks, so round 1 runs anywhere from ~450 to ~1100
steps, and the epoch's last round trains the rest). Measured (load 0.6 -> 0.7): utilisation
0.931 for (b) (device_utilisation 0.901, 0.918 after round 1), 14.7 s to the target against
163.2 s for (a), an 11.1x speed-up; without time boxes (rounds of exactly H steps, planned on
the per-step times) it was 0.84 (round 1 0.81: the benchmarks of identical agents 5-10 %
apart).

About 4-5 minutes:

    .venv/bin/python scripts/bench_wan.py [--slowdown 2] [--inner-steps 700] [--keep DIR]
        [--modes local,ring,sync] [--trusted]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch
from local_cluster import LocalCluster, wait_for
from local_cluster import earn_trust as shared_earn_trust
from safetensors.torch import save_file

from epochmesh.testing.wan import Site, WanLink, WanThread, format_bandwidth, parse_bandwidth
from epochmesh.timeutil import now_ms
from epochmesh.v1 import (
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger("bench_wan")

NODES = 3
FEATURES = 128
HIDDEN = 640  # default of --hidden: 0.5 M parameters, 2.0 MB in fp32
OUTPUTS = 10
TEACHER_HIDDEN = 16
TEACHER_SCALE = 2.0

MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear({features}, {hidden}), nn.Tanh(),
        nn.Linear({hidden}, {hidden}), nn.Tanh(),
        nn.Linear({hidden}, {outputs}),
    )
"""


def model_source(hidden: int) -> str:
    return MODEL.format(features=FEATURES, hidden=hidden, outputs=OUTPUTS)


def num_parameters(hidden: int) -> int:
    return FEATURES * hidden + hidden + hidden * hidden + hidden + hidden * OUTPUTS + OUTPUTS


JOB = """name = "bench-wan-{mode}"
[model]
file = "model.py"
loss = "mse"
[data]
train = "train.safetensors"
inputs = ["x"]
targets = ["y"]
[train]
epochs = 1000
global_batch = {batch}
optimizer = "sgd"
lr = {lr}
momentum = {momentum}
seed = 0
compression = "{compression}"
sync = "{sync}"
{local_sgd}
[cluster]
aggregation = "{aggregation}"
min_nodes = {nodes}
max_nodes = {nodes}
checkpoint_every = 1000000
"""

# Ring mode: agent i's PeerService and bulk socket listen on 127.0.0.1 and are advertised as
# 127.0.0.<PEER_HOST_BASE + i>, where relays through agent i's site (PEER_LINKS names) forward to
# them; the coordinator's links are named "agent<i>".
PEER_HOST_BASE = 11
PEER_LINKS = ("peer", "bulk")
# What an agent logs once its PeerService listens: its bulk socket's port
# (node_agent/ring/service.py), then the address it advertises (node_agent/runtime/worker.py).
BULK_LISTENING = re.compile(r"PeerService listening on .*; bulk socket on port (\d+)\)")
PEER_ADVERTISED = re.compile(r"PeerService on \S+, advertised as ([0-9.]+):(\d+) ")

TERMINAL = {
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
}


def dataset(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Teacher/student regression: x ~ N(0, 1) (128 features), y = a small random tanh network
    of x (16 hidden units, 10 outputs), scaled to unit variance. The student (MSE loss) learns
    the linear part at once, sits on a plateau near 0.2, then descends steadily: the loss keeps
    falling over hundreds of steps with little batch-to-batch noise, so "first round at or
    below the target" means the same thing in both runs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w1 = torch.randn(FEATURES, TEACHER_HIDDEN, generator=g) * TEACHER_SCALE / math.sqrt(FEATURES)
    w2 = torch.randn(TEACHER_HIDDEN, OUTPUTS, generator=g) / math.sqrt(TEACHER_HIDDEN)
    y = torch.tanh(x @ w1) @ w2
    return {"x": x.contiguous(), "y": (y / y.std()).contiguous()}


@dataclass(frozen=True)
class Mode:
    name: str
    sync: str
    compression: str
    lr: float
    momentum: float = 0.9
    inner_steps: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "ps"

    def job_toml(self, batch: int) -> str:
        local = ""
        if self.sync == "local_sgd":
            local = (
                f'inner_steps = {self.inner_steps}\nouter_optimizer = "nesterov"\n'
                f"outer_lr = {self.outer_lr}\nouter_momentum = {self.outer_momentum}"
            )
        return JOB.format(
            mode=self.name,
            batch=batch,
            lr=self.lr,
            momentum=self.momentum,
            compression=self.compression,
            sync=self.sync,
            local_sgd=local,
            nodes=NODES,
            aggregation=self.aggregation,
        )


class ByteSampler:
    """Samples the relays' byte counters every `interval` seconds on a thread, so that bytes
    between two wall-clock instants (round records carry epoch milliseconds) can be read: up
    (agents -> coordinator), down (coordinator -> agents) and between the agents (the ring's
    relays, both directions)."""

    def __init__(self, wan: WanThread, interval: float = 0.05) -> None:
        self.wan = wan
        self.interval = interval
        self.times: list[int] = []
        self.series: dict[str, list[int]] = {"up": [], "down": [], "peer": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="byte-sampler", daemon=True)

    def _sample(self) -> None:
        stats = self.wan.stats()
        peer = [s for s in stats if s.name.startswith(PEER_LINKS)]
        coordinator = [s for s in stats if not s.name.startswith(PEER_LINKS)]
        self.times.append(now_ms())
        self.series["up"].append(sum(s.bytes_to_target for s in coordinator))
        self.series["down"].append(sum(s.bytes_to_client for s in coordinator))
        self.series["peer"].append(sum(s.bytes_to_target + s.bytes_to_client for s in peer))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def start(self) -> ByteSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def at(self, t_ms: int, series: str) -> float:
        """Bytes of ``series`` ("up", "down", "peer") carried by wall-clock time t_ms (linear
        between samples)."""
        values = self.series[series]
        i = bisect.bisect_right(self.times, t_ms)
        if i == 0:
            return float(values[0])
        if i >= len(self.times):
            return float(values[-1])
        t0, t1 = self.times[i - 1], self.times[i]
        f = (t_ms - t0) / (t1 - t0) if t1 > t0 else 1.0
        return values[i - 1] + f * (values[i] - values[i - 1])


@dataclass
class Run:
    mode: Mode
    records: list[common_pb2.RoundRecord] = field(default_factory=list)
    target_index: int | None = None
    stopped_after_s: float = 0.0
    allocation: list[dict[str, Any]] = field(default_factory=list)
    # Each node's check probability when the run's job was submitted (1: new, every part).
    check_probabilities: dict[str, float] = field(default_factory=dict)

    def window(self) -> list[common_pb2.RoundRecord]:
        """The rounds the figures are taken over: up to the target's (all, when not reached)."""
        end = self.target_index if self.target_index is not None else len(self.records) - 1
        return self.records[: end + 1]


def record_samples(r: common_pb2.RoundRecord) -> int:
    return sum(
        rg.stop - rg.start for p in r.parts if p.status in ("", "applied") for rg in p.ranges
    )


def wait_nodes(sched: scheduler_pb2_grpc.SchedulerServiceStub, n: int, timeout: float) -> None:
    def ready() -> bool:
        nodes = sched.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10).nodes
        ok = [
            x
            for x in nodes
            if x.state == common_pb2.NODE_STATE_ONLINE and x.benchmark.samples_per_second > 0
        ]
        return len(ok) >= n

    wait_for(ready, timeout, f"{n} agents registered and benchmarked", interval=0.5)


def run_all(
    work: Path, modes: list[Mode], args: argparse.Namespace
) -> list[tuple[Run, ByteSampler]]:
    """One coordinator, NODES agents behind their sites; the modes' jobs one after the other
    (each job is cancelled once its figures are in, before the next one is submitted)."""
    out: list[tuple[Run, ByteSampler]] = []
    ring = any(m.aggregation == "ring" for m in modes)
    with LocalCluster(work) as cluster:
        cluster.start_coordinator("--split", args.split)
        # One site (access link) per agent: its connection to the coordinator and, in ring
        # mode, what the other agents send it share the site's wires.
        sites = [Site(f"agent{i}", args.bandwidth, args.rtt) for i in range(NODES)]
        links = [
            WanLink.between(
                "127.0.0.1:0", cluster.address, client=sites[i], name=f"agent{i}", seed=i
            )
            for i in range(NODES)
        ]
        with WanThread(*links) as wan:
            for i, link in enumerate(links):
                peer = (
                    ["--peer-listen", "127.0.0.1:0", "--peer-advertise", peer_host(i)]
                    if ring
                    else ["--no-peer"]
                )
                cluster.start_agent(
                    f"agent{i}",
                    "--slowdown",
                    str(args.slowdown),
                    *peer,
                    "--drain-grace",
                    "1",
                    coordinator=link.address,
                )
            if ring:
                add_peer_relays(cluster, wan, sites, args)
            cluster.login()
            with cluster.operator_channel() as channel:
                jobs = job_pb2_grpc.JobServiceStub(channel)
                sched = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                wait_nodes(sched, NODES, 120)
                if args.trusted:
                    earn_trust(cluster, sched, work / "trust_warmup", args.trust_limit)
                data = dataset(args.samples)
                for mode in modes:
                    run = Run(mode, check_probabilities=check_probabilities(sched))
                    job_dir = work / mode.name
                    job_dir.mkdir(parents=True, exist_ok=True)
                    (job_dir / "model.py").write_text(model_source(args.hidden))
                    save_file(data, str(job_dir / "train.safetensors"))
                    (job_dir / "job.toml").write_text(mode.job_toml(args.batch))
                    out_json = cluster.cli("submit", str(job_dir / "job.toml"), "--output", "json")
                    job_id = json.loads(out_json)["job_id"]
                    log.info("%s: job %s submitted", mode.name, job_id)
                    sampler = ByteSampler(wan).start()
                    try:
                        follow(run, jobs, sched, job_id, args)
                    finally:
                        sampler.stop()
                        job = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
                        if job.state not in TERMINAL:
                            jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job_id), timeout=10)
                        wait_nodes(sched, NODES, 60)
                    out.append((run, sampler))
    return out


# --trusted: the warm-up job's model (tiny, so that its rounds are short) and its mode.
TRUST_HIDDEN = 16
TRUST_MODE = Mode("trust_warmup", "sync", "none", lr=0.05)


def check_probabilities(sched: scheduler_pb2_grpc.SchedulerServiceStub) -> dict[str, float]:
    """Each node's probability that its next round is checked (its verification record)."""
    nodes = sched.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10).nodes
    return {n.name: round(n.reputation.check_probability, 3) for n in nodes}


def earn_trust(
    cluster: LocalCluster,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
    job_dir: Path,
    limit_s: float,
) -> None:
    """--trusted: a warm-up job of short rounds (a tiny MLP, synchronous) until every agent is
    trusted (local_cluster.earn_trust)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "model.py").write_text(model_source(TRUST_HIDDEN))
    save_file(dataset(960, seed=1), str(job_dir / "train.safetensors"))
    (job_dir / "job.toml").write_text(TRUST_MODE.job_toml(96))
    shared_earn_trust(
        cluster, job_dir / "job.toml", partial(check_probabilities, sched), NODES, limit_s
    )
    wait_nodes(sched, NODES, 60)


def peer_host(i: int) -> str:
    return f"127.0.0.{PEER_HOST_BASE + i}"


def add_peer_relays(
    cluster: LocalCluster, wan: WanThread, sites: list[Site], args: argparse.Namespace
) -> None:
    """Ring mode: once each agent logged its PeerService and bulk ports, relays on its
    advertised host with those ports, forwarding to where it listens. A connection to agent i
    crosses agent i's site (its down-link carries what the others send it) and, on the sending
    side, a wire without a bandwidth limit and half the RTT: every connection comes from
    127.0.0.1, so a relay cannot tell which agent dialled it and whose up-link to charge. In a
    ring every agent sends and receives the same bytes per hop, so charging the receiver's
    down-link alone gives each hop its time; the RTT between two agents is 2 x --rtt."""
    senders = Site("sending agents", None, args.rtt)
    for i in range(NODES):
        name = f"agent{i}"
        log_file = cluster.logs[name]
        host, port, bulk = wait_for(
            partial(peer_ports, log_file), 120, f"{name}'s PeerService", interval=0.2
        )
        if host != peer_host(i):
            raise RuntimeError(f"{name} advertises {host}, not {peer_host(i)}")
        for k, (kind, p) in enumerate((("peer", port), ("bulk", bulk))):
            wan.add(
                WanLink.between(
                    f"{host}:{p}",
                    f"127.0.0.1:{p}",
                    client=senders,
                    server=sites[i],
                    name=f"{kind}{i}",
                    seed=100 * k + 10 + i,
                )
            )
        log.info(
            "%s: PeerService relayed at %s:%s, bulk socket at %s:%s", name, host, port, host, bulk
        )


def peer_ports(log_file: Path) -> tuple[str, str, str] | None:
    """(advertised host, PeerService port, bulk port) once the agent's log names them."""
    text = log_file.read_text(errors="replace")
    bulk, advertised = BULK_LISTENING.search(text), PEER_ADVERTISED.search(text)
    if bulk is None or advertised is None:
        return None
    return advertised.group(1), advertised.group(2), bulk.group(1)


def follow(
    run: Run,
    jobs: job_pb2_grpc.JobServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
    job_id: str,
    args: argparse.Namespace,
) -> None:
    """Poll the rounds until the target loss is reached (then --extra-rounds more for the
    steady-state figures), the time limit passes, or the job ends."""
    limit = args.sync_limit if run.mode.sync == "sync" else args.local_limit
    first_start: int | None = None
    deadline = time.monotonic() + args.setup_limit
    extra = 0
    while True:
        since = run.records[-1].round if run.records else 0
        reply = jobs.GetRounds(
            job_pb2.GetRoundsRequest(job_id=job_id, since_round=since, limit=0), timeout=10
        )
        for r in reply.rounds:
            run.records.append(r)
            if first_start is None:
                first_start = r.started_ms
                deadline = time.monotonic() - (now_ms() - first_start) / 1000.0 + limit
                log.info("%s: first round recorded; limit %.0fs of rounds", run.mode.name, limit)
            if run.target_index is None and r.loss <= args.target:
                run.target_index = len(run.records) - 1
                log.info(
                    "%s: target %.3f reached in round %d (loss %.4f, %.1fs)",
                    run.mode.name,
                    args.target,
                    r.round,
                    r.loss,
                    (r.finished_ms - first_start) / 1000.0,
                )
            elif run.target_index is not None:
                extra += 1
        if reply.rounds:
            last = run.records[-1]
            gap = (
                (last.started_ms - run.records[-2].finished_ms) / 1000.0
                if len(run.records) > 1
                else 0.0
            )
            log.info(
                "%s: round %d loss %.4f (%.2fs, %.2fs after the previous) parts %s",
                run.mode.name,
                last.round,
                last.loss,
                (last.finished_ms - last.started_ms) / 1000.0,
                gap,
                " ".join(
                    f"{p.status}:b{p.local_batch}x{p.inner_steps}"
                    f"/c{p.seconds:.2f}/m{p.communicate_seconds:.2f}"
                    for p in last.parts
                ),
            )
            if not run.allocation:
                alloc = sched.GetAllocation(
                    scheduler_pb2.GetAllocationRequest(job_id=job_id), timeout=10
                )
                run.allocation = [
                    {
                        "name": n.name,
                        "rtt_ms": round(n.rtt_ms, 1),
                        "bandwidth_mbit_s": round(n.bandwidth_bytes_per_second * 8 / 1e6, 1),
                        "local_batch": n.local_batch,
                    }
                    for n in alloc.nodes
                ]
        wanted = args.extra_rounds if run.mode.sync == "local_sgd" else 0
        if run.target_index is not None and extra >= wanted:
            return
        if time.monotonic() >= deadline:
            if first_start is None:
                raise RuntimeError(f"{run.mode.name}: no round within {args.setup_limit:.0f}s")
            run.stopped_after_s = limit
            log.info("%s: stopped after %.0fs of rounds", run.mode.name, limit)
            return
        job = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
        if job.state in TERMINAL:
            if job.state != common_pb2.JOB_STATE_SUCCEEDED:
                raise RuntimeError(f"{run.mode.name}: job {job_id} ended: {job.message}")
            return
        time.sleep(args.poll)


def finite(x: float, digits: int = 4) -> float | None:
    """Rounded, or None for NaN/inf (a round with no applied part records loss NaN)."""
    return round(x, digits) if math.isfinite(x) else None


def window_figures(recs: list[common_pb2.RoundRecord]) -> tuple[float, float, float, int, int]:
    """(wall s, compute s, communicate s, samples, node-steps) of consecutive rounds."""
    wall = (recs[-1].finished_ms - recs[0].started_ms) / 1000.0
    parts = [p for r in recs for p in r.parts if p.status in ("", "applied")]
    return (
        wall,
        sum(p.seconds for p in parts),
        sum(p.communicate_seconds for p in parts),
        sum(record_samples(r) for r in recs),
        sum(max(1, p.inner_steps) for p in parts),
    )


LOSS_MARKS = (0.1, 0.05, 0.025, 0.015, 0.01)


def time_to_losses(recs: list[common_pb2.RoundRecord]) -> dict[str, float | None]:
    """Seconds from the first round's start to the end of the first round at or below each
    of LOSS_MARKS (null: not reached in the rounds seen), to show how the speed-up depends on
    the target."""
    out: dict[str, float | None] = {}
    for mark in LOSS_MARKS:
        hit = next((r for r in recs if r.loss <= mark), None)
        out[f"{mark:g}"] = (
            round((hit.finished_ms - recs[0].started_ms) / 1000.0, 2) if hit is not None else None
        )
    return out


def figures(run: Run, sampler: ByteSampler) -> dict[str, Any]:
    recs = run.records
    if not recs:
        raise RuntimeError(f"{run.mode.name}: no rounds recorded")
    window = run.window()
    wall, compute, communicate, samples, steps = window_figures(window)
    carried = {
        name: sampler.at(window[-1].finished_ms, name) - sampler.at(window[0].started_ms, name)
        for name in sampler.series
    }
    losses = [r.loss for r in recs if math.isfinite(r.loss)]
    out: dict[str, Any] = {
        "aggregation": run.mode.aggregation,
        "sync": run.mode.sync,
        "compression": run.mode.compression,
        "lr": run.mode.lr,
        "inner_steps": run.mode.inner_steps,
        "rounds": len(window),
        "rounds_without_applied_part": sum(1 for r in window if not math.isfinite(r.loss)),
        "samples": samples,
        "time_to_target_s": round(wall, 2) if run.target_index is not None else None,
        "wall_s": round(wall, 2),
        "seconds_per_round": round(wall / len(window), 3),
        "utilisation": round(compute / (wall * NODES), 3) if wall > 0 else None,
        "compute_s": round(compute, 1),
        "communicate_s": round(communicate, 1),
        "compute_s_per_step": round(compute / steps, 4) if steps else None,
        "samples_per_s": round(samples / wall, 1) if wall > 0 else None,
        "bytes_up_per_sample": round(carried["up"] / samples, 1) if samples else None,
        "bytes_down_per_sample": round(carried["down"] / samples, 1) if samples else None,
        "bytes_between_agents_per_sample": round(carried["peer"] / samples, 1) if samples else None,
        "loss_first_round": finite(recs[0].loss),
        "loss_at_end": finite(window[-1].loss),
        "best_loss": round(min(losses), 4) if losses else None,
        "time_to_loss_s": time_to_losses(recs),
    }
    if run.target_index is None:
        out["time_to_target_at_least_s"] = round(run.stopped_after_s or wall, 1)
    if len(recs) > 2:
        # Without round 1 (program load, first parameter pull, unobserved deadlines): the
        # steady state, over every round seen (also those after the target).
        w, c, _, _, _ = window_figures(recs[1:])
        out["utilisation_after_round_1"] = round(c / (w * NODES), 3) if w > 0 else None
    out["nodes"] = run.allocation
    out["check_probabilities"] = run.check_probabilities
    return out


# An agent's round line (node_agent/training/ps_round.py): "round N: pseudo_gradient of ... [cpu C, ...".
AGENT_ROUND = re.compile(r"round (\d+): pseudo_gradient of \d+ samples .*?\[cpu ([0-9.]+),")


def device_utilisation(
    work: Path, recs: list[common_pb2.RoundRecord], factor: float
) -> float | None:
    """(b)'s utilisation counting only the emulated devices' own compute, F x the CPU time of
    the steps (what the agents log per round), over the same rounds as `utilisation`: it
    leaves out the host's work between steps and the steps that waited for one of the shared
    cores longer than a device's padding hides (an artifact of three emulated devices on this
    host's cores). None when the agents' logs do not cover those rounds."""
    rounds = {r.round for r in recs}
    device = 0.0
    seen = 0
    for log_file in sorted(work.glob("agent-*.log")):
        for m in AGENT_ROUND.finditer(log_file.read_text(errors="replace")):
            if int(m.group(1)) in rounds:
                device += factor * float(m.group(2))
                seen += 1
    applied = sum(1 for r in recs for p in r.parts if p.status in ("", "applied"))
    wall = (recs[-1].finished_ms - recs[0].started_ms) / 1000.0
    if seen != applied or wall <= 0:
        return None
    return round(device / (wall * NODES), 3)


# An agent's check line (node_agent/training/check_task.py), after its log line's time:
# "check of round N (version V): S samples, loss L, compute C s, total T s (... report R)".
AGENT_CHECK = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*?check of round \d+ .*?compute "
    r"([0-9.]+)s, total [0-9.]+s \(.*?report ([0-9.]+)\)",
    re.M,
)


def check_share(work: Path, recs: list[common_pb2.RoundRecord]) -> dict[str, Any]:
    """What the nodes' check tasks took of the same rounds' node-seconds as `utilisation`:
    `check_share`, the checks' device seconds (each node recomputes chunks of the others'
    parts: docs/verification-protocol.md; the agents log each check) / (wall x nodes), a
    check counted in the window when its compute ended inside it; `checks` how many (main
    adds `busy_share` = utilisation + check_share, the share the devices computed at all).
    A new node's every part is checked twice over 1/24 of it, so its checks cost ~1/12 of its
    training compute: utilisation cannot pass ~0.92 of what communication leaves while the
    nodes are new (every round of this benchmark)."""
    start, end = recs[0].started_ms / 1000.0, recs[-1].finished_ms / 1000.0
    seconds = 0.0
    count = 0
    for log_file in sorted(work.glob("agent-*.log")):
        for m in AGENT_CHECK.finditer(log_file.read_text(errors="replace")):
            logged = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            computed = logged + int(m.group(2)) / 1000.0 - float(m.group(4))
            if start <= computed <= end:
                seconds += float(m.group(3))
                count += 1
    wall = end - start
    share = round(seconds / (wall * NODES), 3) if wall > 0 else None
    return {"checks": count, "check_s": round(seconds, 1), "check_share": share}


def compare(a: dict[str, Any], b: dict[str, Any], prefix: str) -> dict[str, Any]:
    """(a)'s figures against a local SGD run's: the speed-up to the target and the ratio of
    bytes per sample through the agents' sites (to and from the coordinator and, in ring
    mode, between the agents, counted once: at the receiving site)."""
    out: dict[str, Any] = {}
    if b["time_to_target_s"]:
        if a["time_to_target_s"] is not None:
            out[f"{prefix}speedup"] = round(a["time_to_target_s"] / b["time_to_target_s"], 2)
        else:
            out[f"{prefix}speedup_at_least"] = round(
                a["time_to_target_at_least_s"] / b["time_to_target_s"], 2
            )
    keys = ("bytes_up_per_sample", "bytes_down_per_sample", "bytes_between_agents_per_sample")
    moved_a, moved_b = (sum(run[k] or 0.0 for k in keys) for run in (a, b))
    if moved_b > 0:
        out[f"{prefix}bytes_per_sample_ratio"] = round(moved_a / moved_b, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=parse_bandwidth, default=100e6, help="per link")
    parser.add_argument("--rtt", type=float, default=50.0, help="ms, per link")
    parser.add_argument("--slowdown", type=float, default=2.0, help="each agent's --slowdown")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="MLP width")
    parser.add_argument("--batch", type=int, default=96, help="global batch (both runs)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (both)")
    parser.add_argument("--sync-lr", type=float, default=0.3, help="(a): SGD lr")
    parser.add_argument("--inner-lr", type=float, default=0.1, help="(b): inner SGD lr")
    parser.add_argument("--inner-steps", type=int, default=700, help="(b): H")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="(b)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="(b)")
    parser.add_argument("--samples", type=int, default=0, help="dataset size (0: 2 H B)")
    parser.add_argument("--target", type=float, default=0.015, help="target round loss")
    parser.add_argument("--sync-limit", type=float, default=270.0, help="(a) at most, s")
    parser.add_argument("--local-limit", type=float, default=90.0, help="(b) at most, s")
    parser.add_argument("--setup-limit", type=float, default=120.0, help="until round 1, s")
    parser.add_argument("--extra-rounds", type=int, default=2, help="(b): rounds after the target")
    parser.add_argument(
        "--split",
        choices=("throughput", "equal"),
        default="throughput",
        help="coordinator --split (equal: every node gets B/3; the agents are identical)",
    )
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between polls")
    parser.add_argument("--modes", default="local,sync", help="which runs, in order")
    parser.add_argument("--keep", type=Path, help="keep the work directory (logs) here")
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="let every agent earn trust first (a warm-up job of short rounds until each is "
        "checked with the floor probability): the figures of a long-lived cluster",
    )
    parser.add_argument("--trust-limit", type=float, default=900.0, help="the warm-up at most, s")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    local = Mode(
        "local_sgd_int8",
        "local_sgd",
        "int8",
        args.inner_lr,
        args.momentum,
        args.inner_steps,
        args.outer_lr,
        args.outer_momentum,
    )
    modes = {
        "sync": Mode("sync_fp32", "sync", "none", args.sync_lr, args.momentum),
        "local": local,
        "ring": dataclasses.replace(local, name="ring_local_sgd_int8", aggregation="ring"),
    }
    if args.samples <= 0:
        args.samples = 2 * args.inner_steps * args.batch
    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in modes]
    if unknown or not chosen:
        parser.error(f"--modes: choose from sync, local, ring (got {args.modes!r})")
    work = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-bench-wan-"))
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, Any]] = {}
    try:
        for run, sampler in run_all(work, [modes[k] for k in chosen], args):
            figs = results[run.mode.name] = figures(run, sampler)  # raises without rounds
            window = run.window()
            figs.update(check_share(work, window))
            if figs["utilisation"] is not None and figs["check_share"] is not None:
                figs["busy_share"] = round(figs["utilisation"] + figs["check_share"], 3)
            if run.mode.name == "local_sgd_int8":
                figs["device_utilisation"] = device_utilisation(work, window, args.slowdown)
            log.info("%s: %s", run.mode.name, json.dumps(figs))
    except grpc.RpcError as exc:
        log.error("coordinator call failed: %s", exc)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {
        "link": {"bandwidth": format_bandwidth(args.bandwidth), "rtt_ms": args.rtt},
        "nodes": NODES,
        "agent_slowdown": args.slowdown,
        "split": args.split,
        "model": f"mlp {FEATURES}-{args.hidden}-{args.hidden}-{OUTPUTS}, mse",
        "parameters": num_parameters(args.hidden),
        "parameter_bytes_fp32": 4 * num_parameters(args.hidden),
        "global_batch": args.batch,
        "dataset_samples": args.samples,
        "target_loss": args.target,
        "cpu_cores": os.cpu_count(),
        "load_avg": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "trusted": args.trusted,
        **results,
    }
    a = results.get("sync_fp32")
    for name, prefix in (("local_sgd_int8", ""), ("ring_local_sgd_int8", "ring_")):
        b = results.get(name)
        if a and b:
            out.update(compare(a, b, prefix))
    out["script_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
