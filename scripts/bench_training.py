"""Training throughput with real processes: is the cluster as fast as its parts?

Runs the same job (a small convolutional classifier, heavy per sample) several ways, each with
a fresh `epochmesh-coordinator` and `epochmesh-agent` processes on this machine:

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

BIN = Path(sys.executable).parent
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


def wait_for(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not happen within {timeout:.0f}s")


def cli(address: str, *args: str) -> str:
    out = subprocess.run(
        [str(BIN / "epochmesh"), "--coordinator", address, *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"epochmesh {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def run_cluster(
    work: Path, slowdowns: list[float], batch: int, rounds: int, split: str = "throughput"
) -> float:
    """Samples/s of one job on a fresh coordinator with agents of the given slowdowns."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        coord = work / "coordinator"
        coord.mkdir(parents=True)
        log_f = open(work / "coordinator.log", "ab")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    str(BIN / "epochmesh-coordinator"),
                    "--data-dir",
                    str(coord),
                    "--listen",
                    "127.0.0.1:0",
                    "--split",
                    split,
                ],
                stdout=log_f,
                stderr=subprocess.STDOUT,
            )
        )
        addr = coord / "coordinator.addr"
        address = wait_for(lambda: addr.exists() and addr.read_text().strip(), 60, "start")
        for i, s in enumerate(slowdowns):
            agent_log = open(work / f"agent{i}.log", "ab")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [
                        str(BIN / "epochmesh-agent"),
                        "--coordinator",
                        address,
                        "--data-dir",
                        str(work / f"agent{i}"),
                        "--slowdown",
                        str(s),
                        "--threads",
                        "1",
                        "--benchmark",
                        "quick",
                    ],
                    stdout=agent_log,
                    stderr=subprocess.STDOUT,
                )
            )
        job_toml = write_job(work / "job", batch, rounds, len(slowdowns))
        job_id = json.loads(cli(address, "submit", str(job_toml), "--output", "json"))["job_id"]

        def finished() -> bool:
            state = json.loads(cli(address, "status", job_id, "--output", "json"))["state"]
            if state in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} {state}")
            return state == "succeeded"

        wait_for(finished, 900, "the job's end")
        recs = [
            json.loads(line)
            for line in cli(address, "rounds", job_id, "--output", "json").splitlines()
            if line.strip()
        ][WARMUP:]
        samples = sum(
            p["local_batch"] for r in recs for p in r["parts"] if p["status"] == "applied"
        )
        seconds = (recs[-1]["finished_ms"] - recs[0]["started_ms"]) / 1000.0
        return samples / seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


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
