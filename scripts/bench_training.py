"""Training throughput with real processes: is the cluster as fast as its parts?

One coordinator and three agents (--slowdown 1, 2 and 4; TLS on, agents enrolled with join
tokens, see scripts/local_cluster.py) run the same job (a small convolutional classifier, heavy
per sample) several ways, in interleaved cycles so that a change of the machine's load hits every
configuration alike:

- solo x1 / x2 / x4: one agent (the others cordoned) -> each node's own samples/s, alone on
  the host;
- cluster: the three agents together, b_i split by measured throughput (the default);
- together: the three agents at the same time, each on its own one-node job -> each node's
  solo samples/s while the host carries the cluster's load (three agents computing), measured
  over the window in which all three jobs run past their warm-up;
- share x1 / x2 / x4 (after each cluster run): each agent alone on a job whose global batch is
  the mean b_i it got in that cluster run -> each node's own samples/s at the batch size it
  actually trains in the cluster;
- equal (once, on a second coordinator started with `--split equal`): every node gets B/3;
- plain: a plain eager PyTorch loop (same model, batch, optimizer, one thread) in this process,
  right after each cycle's solo x1 run.

A configuration's throughput is the samples of its applied parts over the wall time from the
first kept round's start to the last round's end, from the recorded rounds (the first --warmup
rounds are left out: program load, first parameter pull, the estimator's first observation).
Jobs are followed with `epochmesh watch` streams (no polling processes during the rounds).
Each cycle gives cluster / (solo x1 + solo x2 + solo x4) and cluster / (sum of the together
runs); the figures are medians over cycles.

The job: global batch 768 in micro-batches of 128 (--batch, --micro-batch: the job's
micro_batch, every node computes its b_i in forward/backward passes of at most 128 samples and
accumulates the gradient). A round then computes for ~0.5 s on this host. Why these values:
samples/s per pass depend on the pass's size (this conv model runs ~850 samples/s at 192 per
pass on one core but ~600 at 384: its activations leave the caches), so without micro-batches
a node that trains b_i = B/3 in the cluster runs faster per sample than it does alone at B and
the cluster is flattered at large B (session 6 measured > 1 at B = 384). With passes of at most
128 samples the solo runs and the cluster compute alike. And at B = 192 without micro-batches
(rounds of ~0.14 s, --batch 192 --micro-batch 0) the fixed cost of a lockstep round (task
hand-out, update push, aggregation: 12-20 ms on this 2-core host, session 9's timeline) and the
wait for the slowest of three nodes weigh 15-20 % of a round: that configuration measures the
round's fixed cost and the host's drift more than how the cluster adds up (0.72-0.92 over
sessions 6-9, see the README). Still, a node's samples/s also depend on b_i; cluster /
(share x1 + share x2 + share x4) compares each node at the batch it really trains and
isolates what coordinating three nodes costs.

And the emulated devices share this host's cores. Alone, a node has the host to itself;
in the cluster the three agents need 1 + 1/2 + 1/4 cores of compute plus the coordinator, on a
2-core host, and the fast agent then waits for a core now and then. The first ratio therefore
mixes what the system costs with what the host can give; the second compares like with like
(same host load) and measures what training the three nodes in lockstep costs against letting
each train on its own.

The machine is shared: for each run the script measures, from /proc, the CPU the benchmark's
own processes used (coordinator, agents, the CLI), the rest of the machine's busy CPU during
the kept rounds ("foreign_cores"; 0 = quiet, 1 = one core taken by other work) and the CPU the
hypervisor withheld from this virtual machine ("steal_cores"). --wait-quiet waits before each
run for the other work to calm down. A run during which the two together exceed
--max-disturbed cores (default 0.05) is measured again, up to --retries times, and the least
disturbed attempt is kept ("runs_measured_again" counts them): one solo run that lost a tenth of
its core to the hypervisor would deflate the sum of solos and inflate every ratio over it (a
session-8 run without this gave 0.93, the fast node's solo 11-16 % slower in two of its three
cycles than in the first). Per-round analysis (to stderr, and with --keep in
DIR/*.rounds.jsonl): each node's b_i, compute seconds, the rest of its round (parameter pull,
update push, waiting for a core) and its idle time waiting for the round's slowest node.

Emulation note: a slowed agent computes at full speed and then sleeps (F - 1) x its CPU time; it
needs only 1/F of a core, but when it computes at the same moment as the fast agent the kernel
splits a core between them and the fast node, whose emulated device is a whole core, runs slower
than it would alone. With --nice N (the default 10) the slowed agents run at that scheduling
priority, in every configuration alike, so that they take the CPU they need without taking it
from the fast node (their sleep absorbs the wait); --nice 0 measures without. And with --pin
(the default on a machine of 2 or more CPUs) the fast agent runs on CPU 0 alone, the slowed
agents and the coordinator (1/2 + 1/4 of a core + its share) on the other CPUs, in every
configuration alike: each emulated device then has the CPU it stands for. Measured in two
single-cycle runs a few minutes apart: unpinned, the fast node's part of a round spent 31 ms
outside its compute and computed 17 % slower per sample than alone (cluster / sum of solos
0.673); pinned, 13 ms and as fast as alone (0.787). --no-pin measures without.

New nodes have every round checked (two others each recompute 1/24 of it) until they are
trusted, so in a fresh cluster each node spends ~1/12 of its compute on checks and the
cluster cannot pass ~0.92 of the sum of solos (a solo node has nobody to check it).
--trusted first runs a warm-up job of short rounds on all three agents until each is checked
with the floor probability (a fifth of its rounds), then measures: a long-lived cluster's
figures. The output says whether the run was trusted and each node's check probability
when the measurements started.

Prints one JSON line: cluster_over_sum_of_solos (target >= 0.85),
cluster_over_sum_of_share_solos, cluster_over_sum_of_concurrent_solos, equal_over_sum_of_solos, system_over_plain_loop (one agent
through the whole system vs the plain loop, target >= 0.9), per-cycle ratios (also from median
rounds: each run's median over rounds of samples / time since the previous round's end, which
a few rounds delayed by other work do not move), load, foreign and stolen CPU of every run.

    .venv/bin/python scripts/bench_training.py [--cycles 3] [--rounds 24] [--batch 768]
        [--micro-batch 128] [--trusted]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from local_cluster import BIN, LocalCluster, earn_trust, wait_for
from safetensors.torch import save_file

SLOWDOWNS = (1, 2, 4)
TOGETHER_EPOCHS = 20
# --trusted: the warm-up job's batch (no micro-batches: rounds of a few tens of ms) and the
# epochs it is given (it is cancelled once every agent is trusted, long before they run out).
TRUST_BATCH = 48
TRUST_ROUNDS_PER_EPOCH = 20
TRUST_EPOCHS = 1000
log = logging.getLogger("bench_training")

MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 64, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 8),
    )
"""

JOB = """name = "{name}"
[model]
file = "model.py"
loss = "cross_entropy"
[data]
train = "train.safetensors"
inputs = ["x"]
targets = ["y"]
[train]
epochs = {epochs}
global_batch = {batch}
micro_batch = {micro}
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = 0
[cluster]
aggregation = "ps"
min_nodes = {nodes}
max_nodes = {nodes}
checkpoint_every = 1000
"""


def dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 24, 24, generator=g)
    w = torch.randn(24 * 24, 8, generator=g)
    return {"x": x, "y": (x.flatten(1) @ w).argmax(dim=1)}


def write_job(
    d: Path,
    batch: int,
    rounds: int,
    nodes: int,
    name: str = "bench-conv",
    epochs: int = 1,
    micro: int = 0,
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL)
    save_file(dataset(batch * rounds), str(d / "train.safetensors"))
    (d / "job.toml").write_text(
        JOB.format(batch=batch, nodes=nodes, name=name, epochs=epochs, micro=micro)
    )
    return d / "job.toml"


# -- CPU accounting -----------------------------------------------------------------------------


def _busy(t: Any) -> float:
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def _steal(t: Any) -> float:
    """CPU time the hypervisor gave to other machines while this one wanted it."""
    return float(getattr(t, "steal", 0.0))


def _tree_cpu_seconds(p: psutil.Process) -> float:
    """CPU seconds of a process and its descendants, alive or reaped (an agent's program
    children compute its steps)."""
    t = p.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in p.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue  # gone: its time moves to its parent's children_* once reaped
        total += c.user + c.system
    return total


class CpuSampler:
    """Samples, every `period` seconds, the machine's busy CPU seconds and those of the tracked
    processes with their children (and of this process with its finished children), so that the CPU used in any
    past window can be read off by interpolation."""

    def __init__(self, pids: dict[str, int], period: float = 0.2) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.period = period
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _sample(self) -> None:
        own: dict[str, float] = {}
        for name, p in self.procs.items():
            try:
                own[name] = _tree_cpu_seconds(p)
            except psutil.Error:
                own[name] = self.samples[-1][2].get(name, 0.0) if self.samples else 0.0
        t = os.times()
        own["bench"] = t.user + t.system + t.children_user + t.children_system
        machine = psutil.cpu_times()
        own["steal"] = _steal(machine)
        self.samples.append((time.time(), _busy(machine), own))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _at(self, when: float) -> tuple[float, dict[str, float]]:
        s = self.samples
        if when <= s[0][0]:
            return s[0][1], dict(s[0][2])
        for (t0, b0, o0), (t1, b1, o1) in zip(s, s[1:], strict=False):
            if t0 <= when <= t1:
                f = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
                return b0 + f * (b1 - b0), {k: o0[k] + f * (o1[k] - o0[k]) for k in o1}
        return s[-1][1], dict(s[-1][2])

    def window(self, start: float, end: float) -> dict[str, float]:
        """Cores used in [start, end] (wall clock): each tracked process, the benchmark's
        tooling, `foreign` (the machine's busy CPU minus all of those) and `steal` (CPU the
        hypervisor gave to other virtual machines)."""
        b0, o0 = self._at(start)
        b1, o1 = self._at(end)
        span = max(1e-6, end - start)
        out = {k: round((o1[k] - o0[k]) / span, 3) for k in o1}
        ours = sum(v for k, v in out.items() if k != "steal")
        out["foreign"] = round(max(0.0, (b1 - b0) / span - ours), 3)
        return out


# -- one configuration -------------------------------------------------------------------------


def disturbed_cores(cpu: dict[str, float]) -> float:
    """Cores that other work on the machine and the hypervisor took during a window."""
    return cpu.get("foreign", 0.0) + cpu.get("steal", 0.0)


@dataclass
class Run:
    name: str
    samples_per_s: float
    rounds: list[dict[str, Any]]
    cpu: dict[str, float] = field(default_factory=dict)
    load: float = 0.0

    def summary(self, names: dict[str, str]) -> dict[str, Any]:
        """Per node over the kept rounds: mean b_i, compute, rest of its round, idle."""
        nodes: dict[str, dict[str, list[float]]] = {}
        late = 0
        walls = []
        for r in self.rounds:
            wall = (r["finished_ms"] - r["started_ms"]) / 1000.0
            walls.append(wall)
            for p in r["parts"]:
                d = nodes.setdefault(names.get(p["node_id"], p["node_id"]), {})
                if p["status"] != "applied":
                    late += 1
                    continue
                own = p["seconds"] + p.get("communicate_seconds", 0.0)
                d.setdefault("b", []).append(p["local_batch"])
                d.setdefault("compute_s", []).append(p["seconds"])
                d.setdefault("other_s", []).append(p.get("communicate_seconds", 0.0))
                d.setdefault("idle_s", []).append(max(0.0, wall - own))
        return {
            "samples_per_s": round(self.samples_per_s, 1),
            "median_round_samples_per_s": round(median_throughput(self.rounds), 1),
            "rounds": len(self.rounds),
            "round_s": round(statistics.fmean(walls), 3) if walls else None,
            "not_applied_parts": late,
            "nodes": {
                n: {k: round(statistics.fmean(v), 3) for k, v in sorted(d.items())}
                for n, d in sorted(nodes.items())
            },
            "cpu_cores": self.cpu,
            "load1": round(self.load, 2),
        }


def _applied(r: dict[str, Any]) -> int:
    return sum(p["local_batch"] for p in r["parts"] if p["status"] == "applied")


def throughput(rounds: list[dict[str, Any]]) -> float:
    """Samples applied over the wall time from the first round's start to the last's end."""
    seconds = (rounds[-1]["finished_ms"] - rounds[0]["started_ms"]) / 1000.0
    return sum(_applied(r) for r in rounds) / seconds


def median_throughput(rounds: list[dict[str, Any]]) -> float:
    """The median over rounds of samples / (this round's end - the previous round's end): the
    same quantity, robust to the few rounds that another process on the machine delays."""
    rates = [
        _applied(r) / max(1e-6, (r["finished_ms"] - prev["finished_ms"]) / 1000.0)
        for prev, r in zip(rounds, rounds[1:], strict=False)
    ]
    return statistics.median(rates)


class Bench:
    """One coordinator with the agents x1, x2, x4 (processes kept across configurations)."""

    def __init__(self, work: Path, args: argparse.Namespace, split: str = "throughput") -> None:
        self.work = work
        self.args = args
        self.cluster = LocalCluster(work)
        pins = placement(args.pin)
        self.cluster.start_coordinator("--split", split, cpus=pins.get("coordinator"))
        for s in SLOWDOWNS:
            proc = self.cluster.start_agent(f"x{s}", "--slowdown", str(s), cpus=pins.get(f"x{s}"))
            if s > 1 and args.nice:
                # The agent leads its own process group: every thread of it, now and later.
                os.setpriority(os.PRIO_PGRP, proc.pid, args.nice)
        self.cluster.login()

        def registered() -> list[dict[str, Any]] | None:
            nodes = json.loads(self.cluster.cli("nodes", "--output", "json"))["nodes"]
            return nodes if len(nodes) == len(SLOWDOWNS) else None

        nodes = wait_for(registered, 120, "the agents' registration", interval=1.0)
        self.names = {n["node_id"]: n["name"] for n in nodes}
        pids = {"coordinator": self.cluster.procs[0].pid}
        pids.update({name: p.pid for name, p in self.cluster.agents.items()})
        self.sampler = CpuSampler(pids)
        self.sampler.__enter__()
        self.cordoned: set[str] = set()
        self.jobs = 0
        self.reruns = 0

    def close(self) -> None:
        self.sampler.__exit__()
        self.cluster.stop()

    def check_probabilities(self) -> dict[str, float]:
        """Each agent's probability that its next round is checked (its verification record)."""
        nodes = json.loads(self.cluster.cli("nodes", "--output", "json"))["nodes"]
        return {n["name"]: round(n["reputation"]["check_probability"], 3) for n in nodes}

    def earn_trust(self, limit_s: float) -> float:
        """--trusted: a warm-up job of short rounds on every agent until each is trusted
        (local_cluster.earn_trust); the warm-up's seconds."""
        self.use([f"x{s}" for s in SLOWDOWNS])
        job_toml = write_job(
            self.work / "trust_warmup",
            TRUST_BATCH,
            TRUST_ROUNDS_PER_EPOCH,
            len(SLOWDOWNS),
            "bench-trust-warmup",
            epochs=TRUST_EPOCHS,
        )
        return earn_trust(self.cluster, job_toml, self.check_probabilities, len(SLOWDOWNS), limit_s)

    def use(self, names: list[str]) -> None:
        """Cordon every agent but `names`."""
        for s in SLOWDOWNS:
            name = f"x{s}"
            if name in names and name in self.cordoned:
                self.cluster.cli("uncordon", name)
                self.cordoned.discard(name)
            elif name not in names and name not in self.cordoned:
                self.cluster.cli("cordon", name)
                self.cordoned.add(name)

    def wait_quiet(self) -> None:
        """With --wait-quiet C: wait (at most --wait-max seconds) until the machine's busy CPU
        outside this benchmark, over 3 s, is below C cores."""
        limit = self.args.wait_quiet
        if limit <= 0:
            return
        deadline = time.monotonic() + self.args.wait_max
        while True:
            t0 = time.time()
            time.sleep(3.0)
            cpu = self.sampler.window(t0, time.time())
            foreign = disturbed_cores(cpu)
            if foreign < limit or time.monotonic() >= deadline:
                log.info("foreign load %.2f cores (waiting for < %.2f)", foreign, limit)
                return

    def run(self, label: str, names: list[str], batch: int | None = None) -> Run:
        """`run_once`, measured again (up to --retries times) while other work on the machine
        or the hypervisor took more than --max-disturbed cores during its kept rounds; the
        least disturbed attempt is kept. A solo run that loses a tenth of its core to the
        hypervisor understates the node and flatters every ratio over it, and a disturbed
        cluster run does the opposite."""
        attempts: list[Run] = []
        while True:
            run = self.run_once(label, names, batch, attempt=len(attempts))
            attempts.append(run)
            disturbed = disturbed_cores(run.cpu)
            if disturbed <= self.args.max_disturbed or len(attempts) > self.args.retries:
                break
            self.reruns += 1
            log.info(
                "%s: %.2f cores taken by other work or the hypervisor (> %.2f): measuring again",
                label,
                disturbed,
                self.args.max_disturbed,
            )
        kept, run = min(enumerate(attempts), key=lambda a: disturbed_cores(a[1].cpu))
        if len(attempts) > 1:
            log.info("%s: keeping attempt %d of %d", label, kept, len(attempts))
        return run

    def run_once(
        self, label: str, names: list[str], batch: int | None = None, attempt: int = 0
    ) -> Run:
        """One job on `names`; with --keep its rounds go to DIR/LABEL.rounds.jsonl (a repeated
        measurement's to DIR/LABEL.attemptN.rounds.jsonl)."""
        self.use(names)
        self.wait_quiet()
        self.jobs += 1
        args = self.args
        job_toml = write_job(
            self.work / f"job{self.jobs}",
            batch or args.batch,
            args.rounds,
            len(names),
            f"bench-{label}",
            micro=args.micro_batch,
        )
        job_id = json.loads(self.cluster.cli("submit", str(job_toml), "--output", "json"))["job_id"]
        load = os.getloadavg()[0]
        watch = subprocess.run(
            [str(BIN / "epochmesh"), "--coordinator", self.cluster.address, "watch", job_id],
            env=self.cluster.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=900,
            check=False,
        )
        if watch.returncode != 0:
            raise RuntimeError(f"job {job_id} ({label}) did not succeed: {watch.stderr.strip()}")
        lines = self.cluster.cli("rounds", job_id, "--output", "json").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        if args.keep is not None:
            name = f"{label}.attempt{attempt}" if attempt else label
            (args.keep / f"{name}.rounds.jsonl").write_text("\n".join(lines) + "\n")
        kept = records[args.warmup :]
        if len(kept) < 2:
            raise RuntimeError(f"{label}: only {len(records)} rounds; raise --rounds")
        # Let the sampler pass the window's end before reading it.
        time.sleep(2 * self.sampler.period)
        cpu = self.sampler.window(kept[0]["started_ms"] / 1000.0, kept[-1]["finished_ms"] / 1000.0)
        run = Run(label, throughput(kept), kept, cpu, load)
        log.info("%s: %s", label, json.dumps(run.summary(self.names)))
        return run

    def run_together(self, label: str) -> dict[str, Run]:
        """Every agent on its own one-node job, all at the same time: each node's solo speed
        while the host carries the same load as in the cluster run (three agents computing).
        Measured over the window in which all three jobs are past their warm-up (a job's
        benchmark of a slowed node takes a while: the jobs run TOGETHER_EPOCHS epochs); the
        jobs still running when the first one ends are cancelled."""
        names = [f"x{s}" for s in SLOWDOWNS]
        # Submit with every agent cordoned (the jobs wait), then release the agents together.
        self.use([])
        args = self.args
        jobs: list[str] = []
        for _ in names:
            self.jobs += 1
            job_toml = write_job(
                self.work / f"job{self.jobs}",
                args.batch,
                args.rounds,
                1,
                f"bench-{label}",
                epochs=TOGETHER_EPOCHS,
                micro=args.micro_batch,
            )
            out = self.cluster.cli("submit", str(job_toml), "--output", "json")
            jobs.append(json.loads(out)["job_id"])
        self.wait_quiet()
        self.use(names)
        load = os.getloadavg()[0]
        watches = [
            subprocess.Popen(
                [str(BIN / "epochmesh"), "--coordinator", self.cluster.address, "watch", job],
                env=self.cluster.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for job in jobs
        ]
        try:
            wait_for(lambda: any(w.poll() is not None for w in watches), 900, "a job's end", 0.5)
        finally:
            for job, w in zip(jobs, watches, strict=True):
                if w.poll() is None:
                    self.cluster.cli("cancel", job)
                w.wait(timeout=60)
        per_job = []
        for job in jobs:
            lines = self.cluster.cli("rounds", job, "--output", "json").splitlines()
            per_job.append([json.loads(line) for line in lines if line.strip()])
            if args.keep is not None:
                (args.keep / f"{label}.{job}.rounds.jsonl").write_text("\n".join(lines) + "\n")
        if any(len(r) <= args.warmup + 1 for r in per_job):
            raise RuntimeError(f"{label}: a job ended before its warm-up; raise --rounds")
        start = max(r[args.warmup]["started_ms"] for r in per_job)
        end = min(r[-1]["finished_ms"] for r in per_job)
        time.sleep(2 * self.sampler.period)
        cpu = self.sampler.window(start / 1000.0, end / 1000.0)
        out: dict[str, Run] = {}
        for records in per_job:
            kept = [r for r in records if r["started_ms"] >= start and r["finished_ms"] <= end]
            if len(kept) < 2:
                raise RuntimeError(f"{label}: under 2 rounds in the common window; raise --rounds")
            node = self.names.get(kept[0]["parts"][0]["node_id"], "?")
            out[node] = Run(f"{label}.{node}", throughput(kept), kept, cpu, load)
            log.info("%s %s: %s", label, node, json.dumps(out[node].summary(self.names)))
        if sorted(out) != sorted(names):
            raise RuntimeError(f"{label}: the jobs ran on {sorted(out)}, not one per agent")
        return out


def placement(pin: bool) -> dict[str, set[int]]:
    """With --pin on a machine of 2 or more CPUs: the fast agent (an emulated device of one
    whole core) gets CPU 0 to itself; the slowed agents (1/2 and 1/4 of a core) and the
    coordinator share the other CPUs. Without pinning the kernel moves them around and the
    fast node, whose device is a whole core, waits for a core now and then."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return {}
    rest = set(cpus[1:])
    return {"x1": {cpus[0]}, "x2": rest, "x4": rest, "coordinator": rest}


def plain_loop(batch: int, rounds: int, warmup: int, micro: int = 0) -> float:
    """Samples/s of an eager PyTorch loop on one thread: the same model, batch and optimizer,
    and with `micro` > 0 the same gradient accumulation (chunks of at most `micro` samples,
    each chunk's mean loss weighted by its share of the batch)."""
    torch.set_num_threads(1)
    ns: dict[str, Any] = {}
    exec(MODEL, ns)  # noqa: S102 (our own model source, as the submitter would run it)
    model = ns["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset(batch * rounds)
    step = micro if micro > 0 else batch
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        x = data["x"][r * batch : (r + 1) * batch]
        y = data["y"][r * batch : (r + 1) * batch]
        opt.zero_grad()
        for i in range(0, batch, step):
            xs, ys = x[i : i + step], y[i : i + step]
            loss = torch.nn.functional.cross_entropy(model(xs), ys) * (len(ys) / batch)
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    kept = times[warmup:]
    return batch * len(kept) / sum(kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3, help="interleaved measurement cycles")
    parser.add_argument("--rounds", type=int, default=24, help="rounds per job (one epoch)")
    parser.add_argument("--warmup", type=int, default=3, help="first rounds left out")
    parser.add_argument("--batch", type=int, default=768, help="global batch")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=128,
        help="the job's micro_batch: samples per forward/backward pass on a node (0: the "
        "whole local batch in one pass)",
    )
    parser.add_argument(
        "--nice", type=int, default=10, help="scheduling priority of the slowed agents"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin the fast agent to a CPU of its own, the others to the rest",
    )
    parser.add_argument("--no-equal", action="store_true", help="skip the equal-split run")
    parser.add_argument("--no-together", action="store_true", help="skip the concurrent solo runs")
    parser.add_argument(
        "--no-share", action="store_true", help="skip the solo runs at each node's cluster b_i"
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="CORES",
        help="before each run wait until other work on the machine uses fewer cores than this",
    )
    parser.add_argument("--wait-max", type=float, default=300.0, help="longest such wait (s)")
    parser.add_argument(
        "--max-disturbed",
        type=float,
        default=0.05,
        metavar="CORES",
        help="measure a run again when other work and the hypervisor took more than this",
    )
    parser.add_argument("--retries", type=int, default=3, help="at most this many times")
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="let every agent earn trust first (a warm-up job of short rounds until each is "
        "checked with the floor probability): a long-lived cluster's figures, not new nodes'",
    )
    parser.add_argument("--trust-limit", type=float, default=600.0, help="the warm-up at most, s")
    parser.add_argument("--keep", type=Path, help="keep the work dir and round records here")
    args = parser.parse_args()
    if args.cycles < 1 or args.rounds <= args.warmup + 1:
        parser.error("need --cycles >= 1 and --rounds > --warmup + 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    # SIGTERM unwinds like an error, so that every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-bench-"))
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()
    configs = [(f"solo_x{s}", [f"x{s}"]) for s in SLOWDOWNS] + [
        ("cluster", [f"x{s}" for s in SLOWDOWNS])
    ]
    cycles: list[dict[str, Run]] = []
    plains: list[float] = []
    equal: Run | None = None
    warmup_s: float | None = None
    check_probabilities: dict[str, float] = {}
    try:
        bench = Bench(work / "throughput", args)
        try:
            if args.trusted:
                warmup_s = bench.earn_trust(args.trust_limit)
            check_probabilities = bench.check_probabilities()
            for c in range(args.cycles):
                # Alternate the order, so that a drift of the load does not favour one side.
                order = configs if c % 2 == 0 else configs[::-1]
                runs: dict[str, Run] = {}
                for label, nodes in order:
                    runs[label] = bench.run(f"{label}.{c}", nodes)
                    if label == "solo_x1":
                        # Right after the one-agent run, in the same conditions.
                        plains.append(
                            plain_loop(args.batch, args.rounds, args.warmup, args.micro_batch)
                        )
                        log.info("plain loop: %.1f samples/s", plains[-1])
                    if label == "cluster" and not args.no_together:
                        for name, r in bench.run_together(f"together.{c}").items():
                            runs[f"together_{name}"] = r
                    if label == "cluster" and not args.no_share:
                        shares = runs["cluster"].summary(bench.names)["nodes"]
                        for s in SLOWDOWNS:
                            b = max(1, round(shares[f"x{s}"]["b"]))
                            runs[f"share_x{s}"] = bench.run(f"share_x{s}.{c}", [f"x{s}"], b)
                cycles.append(runs)
            names = bench.names
            reruns = bench.reruns
        finally:
            bench.close()
        if not args.no_equal:
            eq = Bench(work / "equal", args, split="equal")
            try:
                equal = eq.run("equal", [f"x{s}" for s in SLOWDOWNS])
                reruns += eq.reruns
            finally:
                eq.close()
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    def cluster_over(kind: str) -> list[float]:
        """Per cycle: cluster samples/s over the sum of the `kind` runs' (solo, together,
        share), for the cycles that have them."""
        return [
            c["cluster"].samples_per_s / sum(c[f"{kind}_x{s}"].samples_per_s for s in SLOWDOWNS)
            for c in cycles
            if f"{kind}_x1" in c
        ]

    def median_rates(kind: str) -> dict[str, float] | None:
        """Each node's median samples/s over the cycles in its `kind` runs (None: not run)."""
        if not any(f"{kind}_x1" in c for c in cycles):
            return None
        return {
            f"slowdown_{s}": round(
                statistics.median(c[f"{kind}_x{s}"].samples_per_s for c in cycles), 1
            )
            for s in SLOWDOWNS
        }

    ratios = cluster_over("solo")
    together = cluster_over("together")
    share = cluster_over("share")
    robust = [
        median_throughput(c["cluster"].rounds)
        / sum(median_throughput(c[f"solo_x{s}"].rounds) for s in SLOWDOWNS)
        for c in cycles
    ]
    med = {label: statistics.median(c[label].samples_per_s for c in cycles) for label, _ in configs}
    total = sum(med[f"solo_x{s}"] for s in SLOWDOWNS)
    foreign = [round(r.cpu.get("foreign", 0.0), 2) for c in cycles for r in c.values()]
    steal = [round(r.cpu.get("steal", 0.0), 2) for c in cycles for r in c.values()]
    out: dict[str, Any] = {
        "model": "conv 1x24x24 -> 32 -> 64 -> 8",
        "global_batch": args.batch,
        "micro_batch": args.micro_batch,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "cycles": args.cycles,
        "nice_slowed_agents": args.nice,
        "pinned": bool(placement(args.pin)),
        "cpu_cores": os.cpu_count(),
        "solo_samples_per_s": {f"slowdown_{s}": round(med[f"solo_x{s}"], 1) for s in SLOWDOWNS},
        "cluster_samples_per_s": round(med["cluster"], 1),
        "cluster_over_sum_of_solos": round(statistics.median(ratios), 3),
        "cluster_over_sum_of_solos_per_cycle": [round(r, 3) for r in ratios],
        "median_round_ratio_per_cycle": [round(r, 3) for r in robust],
        "cluster_over_sum_of_share_solos": round(statistics.median(share), 3) if share else None,
        "cluster_over_sum_of_share_solos_per_cycle": [round(r, 3) for r in share],
        "share_solo_samples_per_s": median_rates("share"),
        "cluster_over_sum_of_concurrent_solos": round(statistics.median(together), 3)
        if together
        else None,
        "cluster_over_sum_of_concurrent_solos_per_cycle": [round(r, 3) for r in together],
        "concurrent_solo_samples_per_s": median_rates("together"),
        "plain_loop_samples_per_s": round(statistics.median(plains), 1),
        "system_over_plain_loop": round(
            statistics.median(
                c["solo_x1"].samples_per_s / p for c, p in zip(cycles, plains, strict=True)
            ),
            3,
        ),
        "cluster_shares": {
            n: round(v, 3)
            for n, v in _shares([r for c in cycles for r in c["cluster"].rounds], names).items()
        },
        "cluster_node_seconds": cycles[len(cycles) // 2]["cluster"].summary(names)["nodes"],
        "foreign_cores_per_run": foreign,
        "steal_cores_per_run": steal,
        "runs_measured_again": reruns,
        "trusted": args.trusted,
        "trust_warmup_s": round(warmup_s, 1) if warmup_s is not None else None,
        "check_probabilities_at_start": check_probabilities,
        "load_avg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "minutes": round((time.time() - started) / 60.0, 1),
    }
    if equal is not None:
        out["equal_split_samples_per_s"] = round(equal.samples_per_s, 1)
        out["equal_over_sum_of_solos"] = round(equal.samples_per_s / total, 3)
    print(json.dumps(out))
    return 0


def _shares(rounds: list[dict[str, Any]], names: dict[str, str]) -> dict[str, float]:
    totals: dict[str, int] = {}
    for r in rounds:
        for p in r["parts"]:
            if p["status"] == "applied":
                n = names.get(p["node_id"], p["node_id"])
                totals[n] = totals.get(n, 0) + p["local_batch"]
    s = sum(totals.values()) or 1
    return {n: totals[n] / s for n in sorted(totals)}


if __name__ == "__main__":
    sys.exit(main())
