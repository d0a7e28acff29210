"""Quotes against what jobs then take and cost, on a real local cluster. Prints one JSON line.

    .venv/bin/python scripts/bench_quote.py [--agents 1,2] [--models zen,mlp,conv,spirals]
                                            [--repeats 2] [--price 3] [--work DIR]
    .venv/bin/python scripts/bench_quote.py --merge RUN.json [RUN.json ...]

``--merge`` reads the JSON lines of earlier runs (repeats run apart, e.g. side by side) and
prints their results again with one summary over all of them.

For each repeat, then each agent count (interleaved: 1, 2, 1, 2 agents, so that a change of
the shared machine's load falls on both counts alike): a fresh local cluster (scripts/local_cluster.py: TLS,
agents with --benchmark quick, each asking ``--price`` credits per node-hour), credits granted
to the operator; then for each model, in order: ``epochmesh quote JOB.toml --output json``,
submit (the program comes from the export cache the quote filled), wait until the job ends,
and compare. ``zen`` is examples/zen; ``spirals`` examples/spirals; ``mlp`` a 4-layer MLP and
``conv`` a small conv net on random data, written here. The later models of a cluster are
quoted with the earlier jobs recorded (calibration); the first with the defaults. Each agent
runs on a core of its own where there are enough (``pinned_agents``; ``--no-pin-agents`` lets
them share): agents that share cores slow each other's steps in every round, which their
reference benchmarks, run one at a time, do not see (on 2 cores, two unpinned agents' MLP steps
took 2.2x as long per sample as one agent's), while a quote is for nodes on machines of their
own.

Actual seconds: from the submit command's start to the job's last update (ended); actual
cost: the job's spent micro-credits. ``ratio`` fields are quoted / actual (1.0 is exact);
``job_seconds_ratio`` compares the coordinator's part alone (from the job's record to its
end) with the quote's ``job_seconds``. ``summary`` gives, per agent count and model, the median
ratio over the repeats and its spread (min, max), and the median 1-minute load average at the
jobs' starts and ends; ``parts`` of a result, per node, its local batches and median compute
seconds per round (what the quote's step model is fitted on); ``profile`` where the job's time
went (submission, start, rounds: compute and the rest).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_cluster import LocalCluster, wait_for  # noqa: E402

log = logging.getLogger("bench_quote")
ROOT = Path(__file__).resolve().parent.parent
ENDED = ("succeeded", "failed", "cancelled")

MLP_MODEL = '''"""A 4-layer MLP classifier (scripts/bench_quote.py)."""
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )
'''
MLP_JOB = """name = "bench-mlp"

[model]
file = "model.py"
loss = "cross_entropy"

[data]
train = "train.safetensors"
inputs = ["x"]
targets = ["y"]

[train]
epochs = 3
global_batch = 128
optimizer = "sgd"
lr = 0.01
seed = 0

[cluster]
aggregation = "ps"
min_nodes = 1
max_nodes = 8
checkpoint_every = 20
"""


CONV_MODEL = '''"""A small conv net on 1x28x28 images (scripts/bench_quote.py)."""
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )
'''


def write_conv(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (2048,), generator=gen)
    save_file({"x": x, "y": y}, str(out / "train.safetensors"))
    (out / "model.py").write_text(CONV_MODEL)
    text = MLP_JOB.replace("bench-mlp", "bench-conv").replace("epochs = 3", "epochs = 2")
    (out / "job.toml").write_text(text.replace("global_batch = 128", "global_batch = 64"))
    return out / "job.toml"


def write_example(name: str, out: Path) -> Path:
    shutil.copytree(ROOT / "examples" / name, out, dirs_exist_ok=True)
    subprocess.run(
        [sys.executable, str(out / "make_data.py"), str(out / "train.safetensors")],
        check=True,
        capture_output=True,
    )
    return out / "job.toml"


def write_job(model: str, out: Path) -> Path:
    if model in ("zen", "spirals"):
        return write_example(model, out)
    if model == "mlp":
        return write_mlp(out)
    if model == "conv":
        return write_conv(out)
    raise SystemExit(f"unknown model {model!r}: zen, spirals, mlp or conv")


def write_mlp(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=gen)
    y = torch.randint(0, 10, (4096,), generator=gen)
    save_file({"x": x, "y": y}, str(out / "train.safetensors"))
    (out / "model.py").write_text(MLP_MODEL)
    (out / "job.toml").write_text(MLP_JOB)
    return out / "job.toml"


def with_budget(path: Path, credits: int) -> Path:
    text = path.read_text()
    if "[market]" not in text:
        text += f"\n[market]\nbudget = {credits}\n"
    path.write_text(text)
    return path


def run_job(cluster: LocalCluster, path: Path) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    q = json.loads(cluster.cli("quote", str(path), "--output", "json"))
    start_ms = time.time() * 1000
    job_id = cluster.cli("submit", str(path)).strip()

    def ended() -> dict[str, Any] | None:
        job: dict[str, Any] = json.loads(cluster.cli("status", job_id, "--output", "json"))
        return job if job["state"] in ENDED else None

    job = wait_for(ended, 1800, f"job {job_id}'s end", interval=2.0)
    assert job is not None  # wait_for raises when it times out
    load_after = os.getloadavg()[0]
    actual_s = (int(job["updated_ms"]) - start_ms) / 1000
    job_s = (int(job["updated_ms"]) - int(job.get("created_ms", 0))) / 1000
    actual_cost = int(job.get("spent_micro", 0))
    chosen = sorted(n["node_id"] for n in q["nodes"])
    lines = cluster.cli("rounds", job_id, "--output", "json").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]  # one round a line
    used = sorted({p["node_id"] for r in records for p in r.get("parts", [])})
    parts: dict[str, dict[str, Any]] = {}
    for r in records:
        for p in r.get("parts", []):
            if p.get("status") == "applied":
                d = parts.setdefault(p["node_id"], {"batches": [], "seconds": []})
                d["batches"].append(int(p.get("local_batch", 0)))
                d["seconds"].append(float(p.get("seconds", 0.0)))
    refs = {n["node_id"]: n["reference_samples_per_second"] for n in q["nodes"]}
    profile = round_profile(start_ms, job, records)
    return {
        "job_id": job_id,
        "state": job["state"],
        "quoted_seconds": round(q["total_seconds"], 2),
        "actual_seconds": round(actual_s, 2),
        "seconds_ratio": round(q["total_seconds"] / actual_s, 3) if actual_s > 0 else None,
        "quoted_submit_seconds": round(q.get("submit_seconds", 0.0), 2),
        "job_seconds_ratio": round(q.get("job_seconds", 0.0) / job_s, 3) if job_s > 0 else None,
        "load": [round(load_before, 2), round(load_after, 2)],
        "quoted_cost_micro": q["total_cost_micro"],
        "actual_cost_micro": actual_cost,
        "cost_ratio": round(q["total_cost_micro"] / actual_cost, 3) if actual_cost else None,
        "quoted_nodes": chosen,
        "used_nodes": used,
        "same_nodes": chosen == used,
        "rates": [
            (n["name"], round(n["samples_per_second"]), n["rate_source"]) for n in q["nodes"]
        ],
        "rounds": q["rounds"],
        "round_overhead_s": round(q["round_overhead_seconds"], 3),
        "overhead_source": q["overhead_source"],
        "start_s": round(q["start_seconds"], 2),
        "flops_per_sample": q["flops_per_sample"],
        "quoted_round_compute_s": round(q["round_compute_seconds"], 4),
        "profile": profile,
        "parts": {
            node: {
                "batches": sorted(set(d["batches"])),
                "median_batch": statistics.median(d["batches"]),
                "median_seconds": round(statistics.median(d["seconds"]), 5),
                "reference_rate": round(refs.get(node, 0.0), 1),
            }
            for node, d in parts.items()
        },
    }


def round_profile(
    start_ms: float, job: dict[str, Any], records: list[dict[str, Any]]
) -> dict[str, Any]:
    """Where a job's time went, from its recorded rounds: submit command to the job's record
    (CLI, upload, program check), record to the first round (claim, job benchmark, program
    load), the rounds (per round: the slowest applied part's compute, the rest of the round's
    wall time, the gap to the next round's start), and the last round to the job's end."""
    applied = [r for r in records if any(p.get("status") == "applied" for p in r["parts"])]
    if not applied:
        return {}
    created = int(job.get("created_ms", 0))
    first = int(applied[0]["started_ms"])
    last = int(applied[-1]["finished_ms"])
    compute = [
        max(float(p.get("seconds", 0.0)) for p in r["parts"] if p.get("status") == "applied")
        for r in applied
    ]
    walls = [(int(r["finished_ms"]) - int(r["started_ms"])) / 1000 for r in applied]
    gaps = [
        (int(b["started_ms"]) - int(a["finished_ms"])) / 1000
        for a, b in zip(applied, applied[1:], strict=False)
    ]
    comm = [
        float(p.get("communicate_seconds", 0.0))
        for r in applied
        for p in r["parts"]
        if p.get("status") == "applied"
    ]
    n = len(applied)
    return {
        "submit_to_record_s": round((created - start_ms) / 1000, 2),
        "record_to_first_round_s": round((first - created) / 1000, 2),
        "rounds_s": round((last - first) / 1000, 2),
        "end_after_last_round_s": round((int(job["updated_ms"]) - last) / 1000, 2),
        "rounds": n,
        "per_round_s": round((last - first) / 1000 / n, 4),
        "median_compute_s": round(statistics.median(compute), 4),
        "median_round_wall_s": round(statistics.median(walls), 4),
        "median_gap_s": round(statistics.median(gaps), 4) if gaps else 0.0,
        "median_communicate_s": round(statistics.median(comm), 4) if comm else 0.0,
    }


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent count and model: the median quoted/actual ratio and its spread."""
    out = []
    keys = sorted({(r["agents"], r["model"]) for r in results}, key=lambda k: (k[0], k[1]))
    for agents, model in keys:
        runs = [r for r in results if (r["agents"], r["model"]) == (agents, model)]
        row: dict[str, Any] = {"agents": agents, "model": model, "runs": len(runs)}
        for key in ("seconds_ratio", "cost_ratio", "job_seconds_ratio", "actual_seconds"):
            xs = [r[key] for r in runs if r.get(key)]
            row[key] = round(statistics.median(xs), 3) if xs else None
            row[f"{key}_spread"] = [min(xs), max(xs)] if xs else None
        loads = [x for r in runs for x in r["load"]]
        row["load"] = round(statistics.median(loads), 2) if loads else None
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="1,2", help="agent counts, comma-separated")
    ap.add_argument(
        "--models", default="zen,mlp,conv,spirals", help="zen, mlp, conv, spirals, in order"
    )
    ap.add_argument("--repeats", type=int, default=2, help="fresh clusters per agent count")
    ap.add_argument("--price", default="3", help="each agent's price, credits per node-hour")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: temp)")
    ap.add_argument(
        "--no-pin-agents",
        dest="pin_agents",
        action="store_false",
        help="let the agents share every core (by default, when there are enough, each agent "
        "runs on a core of its own, as each would on its own machine)",
    )
    ap.add_argument("--merge", nargs="+", type=Path, help="summarise these runs' JSON lines")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.merge:
        merged = []
        for i, run in enumerate(args.merge):
            for r in json.loads(run.read_text())["results"]:
                merged.append({**r, "repeat": f"{i}.{r['repeat']}"})
        report(merged, "merged: " + " ".join(str(m) for m in args.merge))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_quote-"))
    results = []
    runs = [(int(a), k) for k in range(args.repeats) for a in args.agents.split(",")]
    for agents, repeat in runs:
        where = work / f"cluster-{agents}-{repeat}"
        with LocalCluster(where) as cluster:
            cluster.start_coordinator()
            cores = sorted(os.sched_getaffinity(0))
            pin = args.pin_agents and agents <= len(cores)
            for i in range(agents):
                # Pinned, each agent has a core of its own, as each would have its machine.
                cpus = {cores[i]} if pin else None
                cluster.start_agent(f"a{i}", "--price", args.price, cpus=cpus)
            cluster.login()
            me = json.loads(cluster.cli("whoami", "--output", "json"))["principal"]
            cluster.cli("credits", "grant", me, "1000")

            def ready(n: int = agents) -> bool:
                nodes = json.loads(cluster.cli("nodes", "--output", "json"))["nodes"]
                return sum(1 for x in nodes if x["benchmark"]["samples_per_second"] > 0) >= n

            wait_for(ready, 120, f"{agents} benchmarked agent(s)")
            for model in args.models.split(","):
                path = write_job(model, where / "jobs" / model)
                with_budget(path, 100)
                log.info("agents %d (run %d), model %s: quote, submit, wait", agents, repeat, model)
                result = {
                    "agents": agents,
                    "repeat": repeat,
                    "model": model,
                    "pinned_agents": pin,
                    **run_job(cluster, path),
                }
                log.info("%s", result)
                results.append(result)
    report(results, " ".join(["scripts/bench_quote.py", *sys.argv[1:]]))


def report(results: list[dict[str, Any]], command: str) -> None:
    """Log the summary and print the JSON line."""
    ratios = [r["seconds_ratio"] for r in results if r["seconds_ratio"]]
    costs = [r["cost_ratio"] for r in results if r["cost_ratio"]]
    rows = summary(results)
    for r in rows:
        log.info(
            "agents %d %-8s quoted/actual: time %s %s, cost %s %s (%d runs, load %s)",
            r["agents"],
            r["model"],
            r["seconds_ratio"],
            r["seconds_ratio_spread"],
            r["cost_ratio"],
            r["cost_ratio_spread"],
            r["runs"],
            r["load"],
        )
    print(
        json.dumps(
            {
                "bench": "quote",
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "command": command,
                "summary": rows,
                "medians_within_2x": all(
                    r[k] is not None and 0.5 <= r[k] <= 2
                    for r in rows
                    for k in ("seconds_ratio", "cost_ratio")
                ),
                "results": results,
                "within_2x_seconds": all(0.5 <= x <= 2 for x in ratios),
                "within_2x_cost": all(0.5 <= x <= 2 for x in costs),
            }
        )
    )


if __name__ == "__main__":
    main()
