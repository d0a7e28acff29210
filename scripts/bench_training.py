"""Training throughput with real processes: is the cluster as fast as its parts?

Runs the same job (a small convolutional classifier, heavy per sample) several ways, each with
a fresh `epochmesh-coordinator` and `epochmesh-agent` processes on this machine (TLS on, agents
enrolled with join tokens, see scripts/local_cluster.py):

- solo: one agent with --slowdown 1, 2 and 4 in turn -> each node's own samples/s;
- cluster: the three agents together, b_i split by measured throughput (the default);
- equal: the three agents together with `--split equal` (every node gets B/3);
- plain: a plain eager PyTorch loop (same model, batch, optimizer, one thread) in this process.

Throughput is samples trained / wall time from the first round's start to the last round's end,
taken from the recorded rounds (the first WARMUP rounds are left out). Prints one JSON line:
cluster_over_sum_of_solos (target >= 0.85), equal_over_sum_of_solos, and
system_over_plain_loop (one agent through the whole system vs the plain loop, target >= 0.9).

    .venv/bin/python scripts/bench_training.py [--rounds 12] [--batch 192]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from local_cluster import LocalCluster, wait_for
from safetensors.torch import save_file

WARMUP = 2
log = logging.getLogger("bench_training")

MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 64, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 8),
    )
"""

JOB = """name = "bench-conv"
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


def write_job(d: Path, batch: int, rounds: int, nodes: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL)
    save_file(dataset(batch * rounds), str(d / "train.safetensors"))
    (d / "job.toml").write_text(JOB.format(batch=batch, nodes=nodes))
    return d / "job.toml"


def run_cluster(
    work: Path, slowdowns: list[float], batch: int, rounds: int, split: str = "throughput"
) -> float:
    """Samples/s of one job on a fresh coordinator with agents of the given slowdowns."""
    with LocalCluster(work) as cluster:
        cluster.start_coordinator("--split", split)
        for i, s in enumerate(slowdowns):
            cluster.start_agent(f"agent{i}", "--slowdown", str(s))
        cluster.login()
        job_toml = write_job(work / "job", batch, rounds, len(slowdowns))
        out = cluster.cli("submit", str(job_toml), "--output", "json")
        job_id = json.loads(out)["job_id"]

        def finished() -> bool:
            state = json.loads(cluster.cli("status", job_id, "--output", "json"))["state"]
            if state in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} {state}")
            return state == "succeeded"

        wait_for(finished, 900, "the job's end", interval=0.2)
        recs = [
            json.loads(line)
            for line in cluster.cli("rounds", job_id, "--output", "json").splitlines()
            if line.strip()
        ][WARMUP:]
    samples = sum(p["local_batch"] for r in recs for p in r["parts"] if p["status"] == "applied")
    seconds = (recs[-1]["finished_ms"] - recs[0]["started_ms"]) / 1000.0
    return samples / seconds


def plain_loop(batch: int, rounds: int) -> float:
    """Samples/s of an eager PyTorch loop on one thread: the same model, batch and optimizer."""
    torch.set_num_threads(1)
    ns: dict = {}
    exec(MODEL, ns)  # noqa: S102 (our own model source, as the submitter would run it)
    model = ns["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset(batch * rounds)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        x = data["x"][r * batch : (r + 1) * batch]
        y = data["y"][r * batch : (r + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    kept = times[WARMUP:]
    return batch * len(kept) / sum(kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=192)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    work = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-bench-"))
    try:
        solo = {}
        for s in (1, 2, 4):
            solo[s] = run_cluster(work / f"solo{s}", [s], args.batch, args.rounds)
            log.info("solo slowdown %s: %.1f samples/s", s, solo[s])
        cluster = run_cluster(work / "cluster", [1, 2, 4], args.batch, args.rounds)
        log.info("cluster: %.1f samples/s", cluster)
        equal = run_cluster(work / "equal", [1, 2, 4], args.batch, args.rounds, split="equal")
        log.info("equal split: %.1f samples/s", equal)
        plain = plain_loop(args.batch, args.rounds)
        log.info("plain loop: %.1f samples/s", plain)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    total = sum(solo.values())
    print(
        json.dumps(
            {
                "model": "conv 1x24x24 -> 32 -> 64 -> 8",
                "global_batch": args.batch,
                "rounds": args.rounds,
                "cpu_cores": os.cpu_count(),
                "solo_samples_per_s": {f"slowdown_{k}": round(v, 1) for k, v in solo.items()},
                "cluster_samples_per_s": round(cluster, 1),
                "equal_split_samples_per_s": round(equal, 1),
                "cluster_over_sum_of_solos": round(cluster / total, 3),
                "equal_over_sum_of_solos": round(equal / total, 3),
                "plain_loop_samples_per_s": round(plain, 1),
                "system_over_plain_loop": round(solo[1] / plain, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
