"""The CUDA path, end to end, on a machine with an NVIDIA GPU (run through scripts/gpu_check.sh).

Real processes as in production (TLS, enrolled agents, the CLI; scripts/local_cluster.py):

1. discovery: the agent's own device discovery (node_agent.core.devices) in this process;
2. the agents' reference benchmark: two agents on cuda:0 and one on the CPU (all its cores),
   each one's samples/s and peak memory per batch size as the coordinator recorded them;
3. a two-agent job sharing the GPU (both agents on cuda:0, the CPU agent cordoned): every
   sample of every epoch applied exactly once, and the downloaded parameters equal the
   recorded rounds replayed in plain PyTorch (the submitter's model.py, on cuda:0 and on the
   CPU) within --tolerance;
4. throughput of one convolutional job (scripts/bench_training.py's model) on the two GPU
   agents, on one GPU agent and on the CPU agent, from the recorded rounds (samples applied
   over the wall time from the first kept round's start to the last round's end);
5. peak GPU memory per agent process while the jobs ran (nvidia-smi, sampled every 0.2 s).

Prints one JSON line (also written to OUT/gpu_check.json) and exits 1 when a check fails.
`--allow-cpu` runs the same steps with CPU agents on a machine without a GPU (to try the
script itself; its figures say nothing about CUDA).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from bench_training import throughput
from bench_training import write_job as write_conv_job
from local_cluster import ClusterError, LocalCluster, wait_for
from safetensors.torch import load_file, save_file

from node_agent.core.devices import discover_cuda

log = logging.getLogger("gpu_check")

MLP_MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))
"""

MLP_JOB = """name = "gpu-replay"
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
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = {seed}
[cluster]
aggregation = "ps"
min_nodes = 2
max_nodes = 2
checkpoint_every = 5
"""


def mlp_dataset(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 10, generator=g)
    return {"x": x, "y": (x @ w).argmax(dim=1)}


class GpuMemory:
    """Peak GPU memory per process (MiB) from `nvidia-smi --query-compute-apps`, sampled on a
    thread until stopped; empty where nvidia-smi is missing."""

    def __init__(self, interval: float = 0.2) -> None:
        self.peak: dict[int, int] = defaultdict(int)
        self.total_peak = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None
        if self.available:
            self._thread.start()

    def _run(self) -> None:
        cmd = [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ]
        while not self._stop.wait(self._interval):
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            total = 0
            for line in out.stdout.splitlines():
                pid_text, _, mem_text = line.partition(",")
                try:
                    pid, mem = int(pid_text), int(mem_text)
                except ValueError:
                    continue
                self.peak[pid] = max(self.peak[pid], mem)
                total += mem
            self.total_peak = max(self.total_peak, total)

    def stop(self) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=5)


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (the agent's program children and zygote)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.NoSuchProcess:
        return {pid}


def nodes(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    rows = json.loads(cluster.cli("nodes", "--output", "json"))["nodes"]
    return {n["name"]: n for n in rows}


def run_job(cluster: LocalCluster, job_toml: Path, timeout: float) -> tuple[str, list[dict]]:
    job_id = json.loads(cluster.cli("submit", str(job_toml), "--output", "json"))["job_id"]

    def finished() -> str:
        out = subprocess.run(
            [str(Path(sys.executable).parent / "epochmesh"), "--coordinator", cluster.address]
            + ["status", job_id, "--output", "json"],
            capture_output=True,
            text=True,
            env=cluster.env,
            check=False,
        )
        state = json.loads(out.stdout)["state"] if out.stdout.strip() else ""
        if state in ("failed", "cancelled"):
            raise ClusterError(f"job {job_id} {state}: {out.stdout.strip()}")
        return state if state == "succeeded" else ""

    wait_for(finished, timeout, f"job {job_id}", interval=0.5)
    lines = cluster.cli("rounds", job_id, "--output", "json").splitlines()
    return job_id, [json.loads(line) for line in lines if line.strip()]


def applied(rnd: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((p for p in rnd["parts"] if p["status"] == "applied"), key=lambda p: p["node_id"])


def exactly_once(rounds: list[dict[str, Any]], n: int, epochs: int) -> bool:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in applied(rnd):
            by_epoch[rnd["epoch"]].extend(i for a, b in part["ranges"] for i in range(a, b))
    return sorted(by_epoch) == list(range(epochs)) and all(
        sorted(seen) == list(range(n)) for seen in by_epoch.values()
    )


def replay(
    model_py: Path, rounds: list[dict[str, Any]], data: dict[str, torch.Tensor], seed: int, dev: str
) -> dict[str, torch.Tensor]:
    """The recorded rounds in a plain PyTorch loop on `dev` (SGD lr 0.05 momentum 0.9, each
    applied part's mean-loss gradient weighted by its share of the round)."""
    namespace: dict[str, Any] = {}
    exec(compile(model_py.read_text(), str(model_py), "exec"), namespace)
    torch.manual_seed(seed)
    model = namespace["make_model"]().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data["x"].to(dev), data["y"].to(dev)
    for rnd in rounds:
        parts = applied(rnd)
        total = sum(p["local_batch"] for p in parts)
        if not total:
            continue
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for part in parts:
            idx = torch.tensor([i for a, b in part["ranges"] for i in range(a, b)], device=dev)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g.add_(p.grad, alpha=part["local_batch"] / total)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())


def benchmark_summary(node: dict[str, Any]) -> dict[str, Any]:
    bench = node.get("benchmark", {})
    return {
        "device": [d.get("name") or d.get("kind") for d in node.get("devices", [])],
        "samples_per_second": round(bench.get("samples_per_second", 0.0), 1),
        "points": [
            {
                "batch": p.get("batch_size"),
                "samples_per_second": round(p.get("samples_per_second", 0.0), 1),
                "peak_memory_mib": round(int(p.get("peak_memory_bytes", 0)) / 2**20, 1),
            }
            for p in bench.get("points", [])
        ],
    }


def check(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    gpus = discover_cuda(torch)
    result["devices"] = [
        {"name": d.name, "memory_gib": round(d.total_memory_bytes / 2**30, 1), "driver": d.driver}
        for d in gpus
    ]
    if not gpus and not args.allow_cpu:
        raise ClusterError("no CUDA device found (torch.cuda.is_available() is false)")
    gpu = "cuda:0" if gpus else "cpu"
    replay_devices = ["cpu", "cuda:0"] if gpus else ["cpu"]
    memory = GpuMemory()
    cluster = LocalCluster(work)
    try:
        cluster.start_coordinator("--heartbeat-interval", "1")
        agents = {
            "gpu-a": cluster.start_agent("gpu-a", "--device", gpu, "--benchmark", "full"),
            "gpu-b": cluster.start_agent("gpu-b", "--device", gpu, "--benchmark", "full"),
            "cpu": cluster.start_agent(
                "cpu",
                "--device",
                "cpu",
                "--benchmark",
                "full",
                "--threads",
                str(max(1, (os.cpu_count() or 2) // 2)),
            ),
        }
        cluster.login()
        wait_for(
            lambda: (
                all(
                    n.get("benchmark", {}).get("samples_per_second")
                    for n in nodes(cluster).values()
                )
                and len(nodes(cluster)) == 3
            ),
            180,
            "three agents' reference benchmarks",
            interval=0.5,
        )
        result["reference_benchmark"] = {k: benchmark_summary(v) for k, v in nodes(cluster).items()}

        # Two agents sharing the GPU: exactly once and the replay.
        cluster.cli("cordon", "cpu")
        n, epochs, seed = 4096, 3, 11
        job_dir = work / "replay-job"
        job_dir.mkdir()
        (job_dir / "model.py").write_text(MLP_MODEL)
        data = mlp_dataset(n)
        save_file(data, str(job_dir / "train.safetensors"))
        (job_dir / "job.toml").write_text(MLP_JOB.format(epochs=epochs, batch=512, seed=seed))
        job_id, rounds = run_job(cluster, job_dir / "job.toml", args.job_timeout)
        cluster.cli("download", job_id, "-o", str(work / "replay-result"))
        trained = load_file(str(work / "replay-result" / "model.safetensors"))
        names = {v["node_id"]: k for k, v in nodes(cluster).items()}
        shares: dict[str, int] = defaultdict(int)
        for rnd in rounds:
            for p in applied(rnd):
                shares[names.get(p["node_id"], p["node_id"])] += p["local_batch"]
        diffs = {
            dev: max_diff(trained, replay(job_dir / "model.py", rounds, data, seed, dev))
            for dev in replay_devices
        }
        result["shared_gpu_job"] = {
            "rounds": len(rounds),
            "samples_by_node": dict(shares),
            "exactly_once": exactly_once(rounds, n, epochs),
            "replay_max_abs_diff": {k: float(f"{v:.2e}") for k, v in diffs.items()},
        }

        # Throughput of one conv job: two GPU agents, one GPU agent, the CPU agent.
        rates: dict[str, float] = {}
        for label, cordon, uncordon, count in (
            ("gpu_x2", [], [], 2),
            ("gpu_x1", ["gpu-b"], [], 1),
            ("cpu_x1", ["gpu-a"], ["cpu"], 1),
        ):
            for name in cordon:
                cluster.cli("cordon", name)
            for name in uncordon:
                cluster.cli("uncordon", name)
            toml = write_conv_job(
                work / f"conv-{label}",
                batch=args.batch,
                rounds=args.rounds,
                nodes=count,
                name=f"conv-{label}",
                micro=args.micro_batch,
            )
            _, conv_rounds = run_job(cluster, toml, args.job_timeout)
            kept = conv_rounds[args.warmup :]
            rates[label] = round(throughput(kept), 1)
        result["conv_samples_per_second"] = rates
        result["gpu_over_cpu"] = round(rates["gpu_x1"] / rates["cpu_x1"], 2)
        result["gpu_x2_over_x1"] = round(rates["gpu_x2"] / rates["gpu_x1"], 2)
        memory.stop()
        result["peak_gpu_memory_mib"] = {
            name: sum(memory.peak.get(pid, 0) for pid in process_tree(proc.pid))
            for name, proc in agents.items()
            if name.startswith("gpu")
        }
        result["peak_gpu_memory_mib"]["all_processes"] = memory.total_peak
    finally:
        memory.stop()
        cluster.stop()
    coordinator_log = (work / "coordinator.log").read_text(errors="replace")
    result["leases_lost"] = coordinator_log.count("is OFFLINE: lease expired")
    shared = result["shared_gpu_job"]
    result["ok"] = bool(
        shared["exactly_once"]
        and set(shared["samples_by_node"]) == {"gpu-a", "gpu-b"}
        and max(shared["replay_max_abs_diff"].values()) <= args.tolerance
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write gpu_check.json and the logs here")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (cpu agents)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="replay max abs difference")
    parser.add_argument("--batch", type=int, default=4096, help="conv job's global batch")
    parser.add_argument("--micro-batch", type=int, default=0, help="conv job's micro_batch")
    parser.add_argument("--rounds", type=int, default=12, help="conv job's rounds (one epoch)")
    parser.add_argument("--warmup", type=int, default=2, help="conv rounds left out")
    parser.add_argument("--job-timeout", type=float, default=240.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="gpu_check: %(message)s", stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="epochmesh-gpu-check-"))
    try:
        result = check(args, work)
    except ClusterError as exc:
        log.error("%s", exc)
        result = {"ok": False, "error": str(exc)}
    finally:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            for log_file in work.glob("*.log"):
                shutil.copy(log_file, args.out / log_file.name)
        shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        (args.out / "gpu_check.json").write_text(line + "\n")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
