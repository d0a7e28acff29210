"""The fixed cost of a synchronous parameter-server (or ring) round, against gloo DDP on the same
model.

One coordinator and four agents as in production (TLS, agents enrolled with join tokens, see
scripts/local_cluster.py; one compute thread each, no slowdown). For each agent count (--agents,
default 1,2,4) the agents beyond the count are cordoned and a job runs a small MLP (32 -> 64 ->
8, global batch --batch 64, SGD with momentum; a node's compute is a few milliseconds) for
--rounds rounds; its recorded rounds (`epochmesh rounds --output json`) give per round:

- overhead = the round's wall time (finished_ms - started_ms) minus the slowest applied part's
  compute seconds (the part's `seconds`, as the node reported it): hand-out, the parameters'
  trip, the update's push, aggregation and the optimizer step, event-loop hops;
- period overhead = the time from the previous round's end to this one's end minus the slowest
  part's compute: also what happens between two rounds (the record write, the next round's
  planning and the scheduler pass before it).

Both are medians over the rounds after --warmup (with the 10th and 90th percentiles). In the
same run, `ddp_round_ms`: torch.distributed DistributedDataParallel (gloo, one process per rank
on loopback, one thread each) on the same model and global batch split over the same number of
ranks, the median time of one step (forward, backward with the gradient all-reduce, optimizer
step) over the same number of rounds, the slowest rank's. `ddp_compute_ms` is the same step in
one process without DDP at the per-rank batch (what a rank computes).

`--aggregation ring`: the same jobs as synchronous ring rounds (the agents listen for peers,
`--peer-listen`; counts of 2 or more): a round's overhead then holds the task's trip, the
all-reduce over the members' bulk sockets (mutual TLS, sealed), the step and the report.

The machine is shared: the 1-minute load average is recorded for every measurement. With
--cycles C every count is measured C times, in alternating order, and the figures are the
medians over cycles (each cycle's figure is in `per_cycle`).

Prints one JSON line.

    .venv/bin/python scripts/bench_round_overhead.py [--agents 1,2,4] [--rounds 130]
        [--warmup 10] [--batch 64] [--cycles 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import multiprocessing as mp  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
from local_cluster import BIN, LocalCluster, wait_for  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

log = logging.getLogger("bench_round_overhead")

IN, HIDDEN, OUT = 32, 64, 8

MODEL = f"""
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear({IN}, {HIDDEN}), nn.Tanh(), nn.Linear({HIDDEN}, {OUT}))
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
epochs = 1
global_batch = {batch}
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = 0
[cluster]
aggregation = "{aggregation}"
min_nodes = {nodes}
max_nodes = {nodes}
"""


def dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return {"x": x, "y": (x @ w).argmax(dim=1)}


def write_job(
    d: Path, batch: int, rounds: int, nodes: int, name: str, aggregation: str = "ps"
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL)
    save_file(dataset(batch * rounds), str(d / "train.safetensors"))
    (d / "job.toml").write_text(
        JOB.format(batch=batch, nodes=nodes, name=name, aggregation=aggregation)
    )
    return d / "job.toml"


def percentiles(values: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentiles (ms, rounded)."""
    qs = statistics.quantiles(values, n=10, method="inclusive")
    return {
        "median": round(statistics.median(values), 2),
        "p10": round(qs[0], 2),
        "p90": round(qs[-1], 2),
    }


def round_figures(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per-round overheads (ms) of the kept rounds: wall - slowest compute, and end-to-end
    period - slowest compute."""
    overhead: list[float] = []
    period: list[float] = []
    compute: list[float] = []
    not_applied = 0
    for i, r in enumerate(records):
        applied = [p for p in r["parts"] if p["status"] == "applied"]
        not_applied += len(r["parts"]) - len(applied)
        if i < warmup or not applied:
            continue
        slowest = max(p["seconds"] for p in applied) * 1000.0
        compute.append(slowest)
        overhead.append(r["finished_ms"] - r["started_ms"] - slowest)
        if i > 0:
            period.append(r["finished_ms"] - records[i - 1]["finished_ms"] - slowest)
    if len(overhead) < 2:
        raise RuntimeError(f"only {len(overhead)} rounds past the warm-up; raise --rounds")
    return {
        "rounds": len(overhead),
        "overhead_ms": percentiles(overhead),
        "period_overhead_ms": percentiles(period),
        "slowest_compute_ms": percentiles(compute),
        "not_applied_parts": not_applied,
    }


class Cluster:
    """One coordinator and `agents` agents (processes kept across the measurements)."""

    def __init__(
        self, work: Path, agents: int, coordinator_args: list[str], ring: bool = False
    ) -> None:
        self.work = work
        self.cluster = LocalCluster(work)
        self.cluster.start_coordinator(*coordinator_args)
        self.names = [f"a{i}" for i in range(agents)]
        for name in self.names:
            self.cluster.start_agent(name, *(["--peer-listen", "127.0.0.1:0"] if ring else []))
        self.cluster.login()

        def registered() -> list[dict[str, Any]] | None:
            nodes = json.loads(self.cluster.cli("nodes", "--output", "json"))["nodes"]
            return nodes if len(nodes) == agents else None

        wait_for(registered, 180, "the agents' registration", interval=1.0)
        self.cordoned: set[str] = set()
        self.jobs = 0
        self.procs = {"coordinator": psutil.Process(self.cluster.procs[0].pid)}
        self.procs.update({n: psutil.Process(p.pid) for n, p in self.cluster.agents.items()})

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the coordinator and of each agent with its children."""
        out = {}
        for name, p in self.procs.items():
            t = p.cpu_times()
            total = t.user + t.system + t.children_user + t.children_system
            for child in p.children(recursive=True):
                try:
                    c = child.cpu_times()
                except psutil.Error:
                    continue
                total += c.user + c.system
            out[name] = total
        return out

    def profile(self, count: int, label: str, args: argparse.Namespace) -> list[Any]:
        """With --profile DIR: py-spy samples the coordinator and the agents in use while the
        job runs (collapsed stacks, DIR/LABEL.NAME.txt)."""
        if args.profile is None:
            return []
        spy = BIN / "py-spy"
        procs = []
        for name in ["coordinator", *self.names[:count]]:
            target = args.profile / f"{label}.{name}.txt"
            procs.append(
                subprocess.Popen(
                    [
                        str(spy),
                        "record",
                        "--format",
                        "raw",
                        "--rate",
                        "250",
                        "--idle",
                        "--subprocesses",
                        "-p",
                        str(self.procs[name].pid),
                        "-o",
                        str(target),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        return procs

    def use(self, count: int) -> None:
        """Cordon every agent but the first `count`."""
        for i, name in enumerate(self.names):
            if i < count and name in self.cordoned:
                self.cluster.cli("uncordon", name)
                self.cordoned.discard(name)
            elif i >= count and name not in self.cordoned:
                self.cluster.cli("cordon", name)
                self.cordoned.add(name)

    def run(self, count: int, args: argparse.Namespace) -> dict[str, Any]:
        self.use(count)
        self.jobs += 1
        job_toml = write_job(
            self.work / f"job{self.jobs}",
            args.batch,
            args.rounds,
            count,
            f"overhead-{count}",
            args.aggregation,
        )
        out = self.cluster.cli("submit", str(job_toml), "--output", "json")
        job_id = json.loads(out)["job_id"]
        load = os.getloadavg()[0]
        spies = self.profile(count, f"agents{count}.{self.jobs}", args)
        cpu0 = self.cpu_seconds()
        watch = subprocess.run(
            [str(BIN / "epochmesh"), "--coordinator", self.cluster.address, "watch", job_id],
            env=self.cluster.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=1800,
            check=False,
        )
        cpu1 = self.cpu_seconds()
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(timeout=60)
        if watch.returncode != 0:
            raise RuntimeError(f"job {job_id} did not succeed: {watch.stderr.strip()}")
        lines = self.cluster.cli("rounds", job_id, "--output", "json").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        if args.keep is not None:
            (args.keep / f"agents{count}.{self.jobs}.rounds.jsonl").write_text(
                "\n".join(lines) + "\n"
            )
        figures = round_figures(records, args.warmup)
        # CPU per round (all rounds of the job, warm-up included): what a round costs whatever
        # the machine's load, unlike its wall time.
        used = {n: cpu1[n] - cpu0[n] for n in cpu0}
        figures["coordinator_cpu_ms_per_round"] = round(
            used["coordinator"] * 1000.0 / len(records), 2
        )
        figures["agent_cpu_ms_per_round"] = round(
            sum(used[n] for n in self.names[:count]) * 1000.0 / len(records) / count, 2
        )
        figures["load1"] = round((load + os.getloadavg()[0]) / 2, 2)
        log.info("%d agent(s): %s", count, json.dumps(figures))
        return figures

    def close(self) -> None:
        self.cluster.stop()


# -- gloo DDP -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_model() -> torch.nn.Module:
    ns: dict[str, Any] = {}
    exec(MODEL, ns)  # noqa: S102 (our own model source, as the submitter would run it)
    model: torch.nn.Module = ns["make_model"]()
    return model


def _ddp_rank(rank: int, world: int, port: int, batch: int, steps: int, out: Any) -> None:
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        torch.manual_seed(0)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        model = DistributedDataParallel(_make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        local = batch // world + (1 if rank < batch % world else 0)
        data = dataset(batch * steps)
        times: list[float] = []
        for s in range(steps):
            x = data["x"][s * batch : s * batch + local]
            y = data["y"][s * batch : s * batch + local]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradient here
            opt.step()
            times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        out.put((rank, times))
    except BaseException as exc:  # report instead of hanging the parent
        out.put((rank, repr(exc)))


def ddp_round_ms(world: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median (p10, p90) over steps of the slowest rank's step time, ms."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_ddp_rank, args=(r, world, port, batch, steps, out))
        for r in range(world)
    ]
    load = os.getloadavg()[0]
    for p in procs:
        p.start()
    results: dict[int, list[float]] = {}
    try:
        for _ in range(world):
            rank, times = out.get(timeout=600)
            if isinstance(times, str):
                raise RuntimeError(f"DDP rank {rank} failed: {times}")
            results[rank] = times
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    slowest = [max(results[r][s] for r in results) * 1000.0 for s in range(steps)]
    return {
        "ddp_round_ms": percentiles(slowest[warmup:]),
        "load1": round((load + os.getloadavg()[0]) / 2, 2),
    }


def compute_ms(local_batch: int, steps: int, warmup: int) -> float:
    """The median step (forward, backward, optimizer step) of one process without DDP at
    `local_batch` samples: what a rank or a node computes."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset(local_batch * steps)
    times = []
    for s in range(steps):
        x = data["x"][s * local_batch : (s + 1) * local_batch]
        y = data["y"][s * local_batch : (s + 1) * local_batch]
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[warmup:]) * 1000.0, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="1,2,4", help="agent counts, comma-separated")
    parser.add_argument(
        "--rounds", type=int, default=130, help="rounds per job (one epoch; >= warmup + 100)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="first rounds left out")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--cycles", type=int, default=1, help="measurements per agent count")
    parser.add_argument("--no-ddp", action="store_true", help="skip the gloo DDP runs")
    parser.add_argument(
        "--aggregation", choices=("ps", "ring"), default="ps", help="the jobs' aggregation"
    )
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        help="an extra argument for epochmesh-coordinator (repeatable)",
    )
    parser.add_argument(
        "--profile", type=Path, help="py-spy the coordinator and agents, stacks to this dir"
    )
    parser.add_argument("--keep", type=Path, help="keep the work dir and round records here")
    args = parser.parse_args()
    counts = [int(c) for c in args.agents.split(",") if c.strip()]
    if not counts or min(counts) < 1 or args.rounds <= args.warmup + 2 or args.cycles < 1:
        parser.error("need agent counts >= 1, --rounds > --warmup + 2 and --cycles >= 1")
    if args.aggregation == "ring" and min(counts) < 2:
        parser.error("a ring needs agent counts >= 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-overhead-"))
    for d in (args.keep, args.profile):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()[0]
    ours: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
    ddp: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
    try:
        cluster = Cluster(
            work / "cluster", max(counts), args.coordinator_arg, args.aggregation == "ring"
        )
        try:
            for c in range(args.cycles):
                order = counts if c % 2 == 0 else counts[::-1]
                for count in order:
                    ours[count].append(cluster.run(count, args))
                    if not args.no_ddp:
                        ddp[count].append(ddp_round_ms(count, args.batch, args.rounds, args.warmup))
                        log.info("DDP %d rank(s): %s", count, json.dumps(ddp[count][-1]))
        finally:
            cluster.close()
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key]["median"] for r in runs), 2)

    out: dict[str, Any] = {
        "model": f"mlp {IN} -> {HIDDEN} -> {OUT}",
        "aggregation": args.aggregation,
        "global_batch": args.batch,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "cycles": args.cycles,
        "cpu_cores": os.cpu_count(),
        "overhead_ms_per_round": {str(c): med(ours[c], "overhead_ms") for c in counts},
        "period_overhead_ms_per_round": {
            str(c): med(ours[c], "period_overhead_ms") for c in counts
        },
        "slowest_compute_ms": {str(c): med(ours[c], "slowest_compute_ms") for c in counts},
        "coordinator_cpu_ms_per_round": {
            str(c): round(statistics.median(r["coordinator_cpu_ms_per_round"] for r in ours[c]), 2)
            for c in counts
        },
        "agent_cpu_ms_per_round": {
            str(c): round(statistics.median(r["agent_cpu_ms_per_round"] for r in ours[c]), 2)
            for c in counts
        },
        "compute_ms_at_local_batch": {
            str(c): compute_ms(args.batch // c, args.rounds, args.warmup) for c in counts
        },
        "per_cycle": {str(c): ours[c] for c in counts},
        "load_avg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
    if not args.no_ddp:
        out["ddp_round_ms"] = {str(c): med(ddp[c], "ddp_round_ms") for c in counts}
        out["ddp_per_cycle"] = {str(c): ddp[c] for c in counts}
    out["minutes"] = round((time.time() - started) / 60.0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
