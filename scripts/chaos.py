"""Chaos run: a real job on a local cluster while agents and the coordinator are killed.

Starts `epochmesh-coordinator` (fixed port, so that a restarted one is found at the same
address) and N `epochmesh-agent`s, submits a small convolutional classification job with the
`epochmesh` CLI, and for a bounded time and a bounded number of faults:

- kills a random running agent with SIGKILL and restarts it on the same data dir after a
  random pause (same node id, blob cache reused);
- kills the coordinator with SIGKILL and restarts it on the same data dir after a random pause.

Then it lets the job finish, reads the recorded (live) rounds and checks every epoch: each
sample must be trained exactly once by the applied parts. Finally it runs the same job again
on the same cluster without faults, for the loss to compare with, and prints one JSON line:

    {"kills": .., "agent_kills": .., "coordinator_kills": .., "restarts": .., "epochs": ..,
     "samples_lost": 0, "samples_duplicated": 0, "per_epoch": [...], "rounds": ..,
     "rounds_rolled_back": .., "final_loss": .., "final_loss_without_faults": .., ...}

"final loss" is the sample-weighted mean training loss of the last epoch's applied parts (the
loss of the very last round alone is too noisy to compare). Exit status 1 if a sample was lost
or duplicated, or a job did not succeed.

    .venv/bin/python scripts/chaos.py [--duration 75] [--agent-kills 6] [--coordinator-kills 2]
                                      [--agents 3] [--seed 1] [--keep DIR]

`FaultCluster` and the job helpers are reused by scripts/bench_recovery.py. TLS is on, as in
production (scripts/local_cluster.py: a CA, join tokens, a logged-in CLI).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_cluster import BIN, ClusterError, LocalCluster, wait_for  # noqa: E402

from epochmesh.identity import (
    Identity,
    channel_credentials,
    coordinator_channel_options,
    enroll_with_token,
    identity_credentials,
)
from epochmesh.v1 import (  # noqa: E402
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger("chaos")

JS = common_pb2.JobState
NS = common_pb2.NodeState
T = TypeVar("T")

# Labels are a linear function of the pixels: learnable by this small convnet in a few epochs.
MODEL = """
import torch
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 32, 3, padding=1), nn.Tanh(),
        nn.Flatten(), nn.Linear(32 * 12 * 12, 4),
    )
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the job --------------------------------------------------------------------------------------


def write_job(
    directory: Path,
    *,
    name: str,
    samples: int,
    epochs: int,
    global_batch: int,
    seed: int = 11,
    min_nodes: int = 1,
    max_nodes: int = 8,
    checkpoint_every: int = 5,
    lr: float = 0.01,
    train_extra: str = "",
    aggregation: str = "ps",
) -> Path:
    """model.py, train.safetensors and job.toml of the convnet job; returns job.toml.
    ``train_extra``: more lines of its [train] table (e.g. 'micro_batch = 16')."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.py").write_text(MODEL)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 1, 12, 12, generator=g)
    w = torch.randn(12 * 12, 4, generator=g)
    save_file({"x": x, "y": (x.flatten(1) @ w).argmax(dim=1)}, str(directory / "train.safetensors"))
    (directory / "job.toml").write_text(
        f'name = "{name}"\n\n'
        '[model]\nfile = "model.py"\nloss = "cross_entropy"\n\n'
        '[data]\ntrain = "train.safetensors"\ninputs = ["x"]\ntargets = ["y"]\n\n'
        f'[train]\nepochs = {epochs}\nglobal_batch = {global_batch}\noptimizer = "sgd"\n'
        f"lr = {lr}\nmomentum = 0.9\nseed = {seed}\n{train_extra}\n"
        f'[cluster]\naggregation = "{aggregation}"\nmin_nodes = {min_nodes}\nmax_nodes = {max_nodes}\n'
        f"checkpoint_every = {checkpoint_every}\n"
    )
    return directory / "job.toml"


def applied(rnd: common_pb2.RoundRecord) -> list[common_pb2.RoundPart]:
    return [p for p in rnd.parts if p.status == "applied"]


def coverage(rounds: list[common_pb2.RoundRecord], samples: int) -> list[dict[str, int]]:
    """Per epoch: samples never trained (lost) and extra trainings (duplicated)."""
    counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for rnd in rounds:
        for part in applied(rnd):
            for r in part.ranges:
                for i in range(r.start, r.stop):
                    counts[rnd.epoch][i] += 1
    out = []
    for epoch in sorted(counts):
        c = counts[epoch]
        lost = sum(1 for i in range(samples) if c.get(i, 0) == 0)
        dup = sum(v - 1 for v in c.values() if v > 1)
        out.append({"epoch": epoch, "lost": lost, "duplicated": dup})
    return out


def epoch_loss(rounds: list[common_pb2.RoundRecord], epoch: int) -> float:
    num = den = 0.0
    for rnd in rounds:
        if rnd.epoch == epoch:
            for p in applied(rnd):
                num += p.mean_loss * p.local_batch
                den += p.local_batch
    return num / den if den else float("nan")


# -- the cluster ----------------------------------------------------------------------------------


class FaultCluster(LocalCluster):
    """scripts/local_cluster.py's cluster (TLS on: CA, join tokens, a logged-in CLI) with what
    fault injection needs: the coordinator on a fixed port (a restarted one is found at the
    same address), kill -9 and restart of the coordinator and of numbered agents (same data
    dirs), and operator reads over gRPC."""

    def __init__(self, work: Path, heartbeat_s: float, slowdowns: list[float]) -> None:
        super().__init__(work)
        self.heartbeat_s = heartbeat_s
        self.slowdowns = list(slowdowns)
        self.listen = f"127.0.0.1:{free_port()}"
        self.coordinator: subprocess.Popen[bytes] | None = None
        self._operator: Identity | None = None

    # -- processes ------------------------------------------------------------------------------

    def boot_coordinator(self, timeout: float = 60.0) -> float:
        """Start the coordinator (same data dir, same address) and wait until it serves;
        returns the seconds that took."""
        t0 = time.monotonic()
        self.start_coordinator(
            "--listen", self.listen, "--heartbeat-interval", f"{self.heartbeat_s}"
        )
        self.coordinator = self.procs[-1]
        wait_for(self._serving, timeout, "the coordinator serving", interval=0.02)
        return time.monotonic() - t0

    def _serving(self) -> bool:
        assert self.coordinator is not None
        if self.coordinator.poll() is not None:
            raise ClusterError(f"the coordinator exited with {self.coordinator.returncode}")
        ca = (self.coord_dir / "ca.pem").read_bytes()
        creds = channel_credentials(ca)
        with grpc.secure_channel(self.address, creds, options=coordinator_channel_options()) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=0.5
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def kill_coordinator(self) -> None:
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGKILL)
            self.coordinator.wait()

    def agent_name(self, i: int) -> str:
        return str(i)

    def agent_dir(self, i: int) -> Path:
        return self.work / f"agent-{self.agent_name(i)}"

    def start_agent_i(self, i: int) -> None:
        """Start agent ``i`` (again): a restart keeps its data dir, certificate, node id and
        blob cache (no join token needed then)."""
        name, slowdown = self.agent_name(i), f"{self.slowdowns[i]:g}"
        if not (self.agent_dir(i) / "cert.pem").exists():
            self.start_agent(name, "--slowdown", slowdown)  # enrolls with a fresh node token
            return
        self.agents[name] = self._start(
            [
                str(BIN / "epochmesh-agent"),
                "--coordinator",
                self.address,
                "--data-dir",
                str(self.agent_dir(i)),
                "--name",
                name,
                "--threads",
                "1",
                "--benchmark",
                "quick",
                "--slowdown",
                slowdown,
            ],
            self.work / f"agent-{name}.log",
        )

    def agent_running(self, i: int) -> bool:
        p = self.agents.get(self.agent_name(i))
        return p is not None and p.poll() is None

    def kill_agent(self, i: int) -> None:
        p = self.agents.get(self.agent_name(i))
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def node_id(self, i: int) -> str:
        try:
            return str(json.loads((self.agent_dir(i) / "node.json").read_text())["node_id"])
        except (FileNotFoundError, ValueError, KeyError):
            return ""

    # -- reads --------------------------------------------------------------------------------

    def _channel(self) -> grpc.Channel:
        if self._operator is None:
            self._operator = enroll_with_token(self.address, self.token("operator"))
        creds = identity_credentials(self._operator)
        return grpc.secure_channel(self.address, creds, options=coordinator_channel_options())

    def nodes(self) -> list[common_pb2.NodeInfo]:
        with self._channel() as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            return list(stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=5).nodes)

    def wait_agents_ready(self, timeout: float = 90.0) -> None:
        def ready() -> bool:
            ids = {self.node_id(i) for i in range(len(self.slowdowns))}
            if "" in ids:
                return False
            nodes = {n.node_id: n for n in self.nodes()}
            return all(
                i in nodes
                and nodes[i].state in (NS.NODE_STATE_ONLINE, NS.NODE_STATE_BUSY)
                and nodes[i].benchmark.samples_per_second > 0
                for i in ids
            )

        wait_for(ready, timeout, "all agents registered and benchmarked", interval=0.2)

    def job(self, job_id: str) -> common_pb2.Job:
        with self._channel() as ch:
            stub = job_pb2_grpc.JobServiceStub(ch)
            return stub.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=5)

    def rounds(self, job_id: str) -> list[common_pb2.RoundRecord]:
        with self._channel() as ch:
            stub = job_pb2_grpc.JobServiceStub(ch)
            return list(stub.GetRounds(job_pb2.GetRoundsRequest(job_id=job_id), timeout=10).rounds)

    def events(self, job_id: str) -> list[common_pb2.Event]:
        with self._channel() as ch:
            stub = job_pb2_grpc.JobServiceStub(ch)
            reply = stub.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=job_id), timeout=5)
            return list(reply.events)

    def try_read(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None while the coordinator cannot be reached (it may be restarting)."""
        try:
            return fn()
        except grpc.RpcError:
            return None

    # -- jobs ---------------------------------------------------------------------------------

    def submit(self, job_toml: Path) -> str:
        return str(json.loads(self.cli("submit", str(job_toml), "--output", "json"))["job_id"])

    def wait_job_done(self, job_id: str, timeout: float) -> common_pb2.Job:
        def done() -> common_pb2.Job | None:
            job = self.try_read(lambda: self.job(job_id))
            if job is not None and job.state in (
                JS.JOB_STATE_SUCCEEDED,
                JS.JOB_STATE_FAILED,
                JS.JOB_STATE_CANCELLED,
            ):
                return job
            return None

        return wait_for(done, timeout, f"job {job_id} ending", interval=0.25)


# -- chaos ----------------------------------------------------------------------------------------


def run_chaos(
    cluster: FaultCluster,
    job_id: str,
    *,
    rng: random.Random,
    duration_s: float,
    agent_kills: int,
    coordinator_kills: int,
    gap_s: tuple[float, float],
    pause_s: tuple[float, float],
) -> dict[str, Any]:
    """Faults at random moments until the time or the fault budget is spent or the job ends;
    every killed process is running again when this returns."""
    stats = {"agent_kills": 0, "coordinator_kills": 0, "restarts": 0}
    restart_at: dict[int, float] = {}  # agent -> monotonic time to restart it
    end = time.monotonic() + duration_s
    next_fault = time.monotonic() + rng.uniform(*gap_s)

    def job_running() -> bool:
        job = cluster.try_read(lambda: cluster.job(job_id))
        return job is None or job.state not in (
            JS.JOB_STATE_SUCCEEDED,
            JS.JOB_STATE_FAILED,
            JS.JOB_STATE_CANCELLED,
        )

    while time.monotonic() < end and job_running():
        now = time.monotonic()
        for i, t in list(restart_at.items()):
            if now >= t:
                log.info("restarting agent %d", i)
                cluster.start_agent_i(i)
                stats["restarts"] += 1
                del restart_at[i]
        budget_agents = stats["agent_kills"] < agent_kills
        budget_coord = stats["coordinator_kills"] < coordinator_kills
        if now >= next_fault and (budget_agents or budget_coord):
            running = [i for i in range(len(cluster.agents)) if cluster.agent_running(i)]
            kill_coord = budget_coord and (not budget_agents or not running or rng.random() < 0.25)
            if kill_coord:
                log.info("kill -9 coordinator")
                cluster.kill_coordinator()
                stats["coordinator_kills"] += 1
                time.sleep(rng.uniform(*pause_s))
                took = cluster.boot_coordinator()
                stats["restarts"] += 1
                log.info("coordinator serving again %.2fs after its restart", took)
            elif running:
                i = rng.choice(running)
                log.info("kill -9 agent %d (%s)", i, cluster.node_id(i))
                cluster.kill_agent(i)
                stats["agent_kills"] += 1
                restart_at[i] = time.monotonic() + rng.uniform(*pause_s)
            next_fault = time.monotonic() + rng.uniform(*gap_s)
        time.sleep(0.05)
    for i in restart_at:
        cluster.start_agent_i(i)
        stats["restarts"] += 1
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--duration", type=float, default=75.0, help="seconds of faults at most")
    p.add_argument("--agent-kills", type=int, default=6, help="agent kills at most")
    p.add_argument("--coordinator-kills", type=int, default=2, help="coordinator kills at most")
    p.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=(3.0, 7.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, uniform in [MIN, MAX]",
    )
    p.add_argument(
        "--pause",
        type=float,
        nargs=2,
        default=(0.5, 5.0),
        metavar=("MIN", "MAX"),
        help="seconds a killed process stays down, uniform in [MIN, MAX]",
    )
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--min-nodes", type=int, default=2, help="below it the job pauses")
    p.add_argument(
        "--slowdowns", type=float, nargs="+", default=None, help="per agent (default 4, 6, 8, ...)"
    )
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without faults")
    p.add_argument("--keep", type=Path, help="keep logs and data in DIR")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s chaos: %(message)s", stream=sys.stderr
    )
    slowdowns = args.slowdowns or [4.0 + 2 * i for i in range(args.agents)]
    if len(slowdowns) != args.agents:
        p.error(f"--slowdowns names {len(slowdowns)} agents, --agents is {args.agents}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    cluster = FaultCluster(root, args.heartbeat_interval, slowdowns)
    t_start = time.monotonic()
    try:
        cluster.boot_coordinator()
        cluster.login()
        for i in range(args.agents):
            cluster.start_agent_i(i)
        cluster.wait_agents_ready()
        shape = {
            "samples": args.samples,
            "epochs": args.epochs,
            "global_batch": args.global_batch,
            "min_nodes": args.min_nodes,
        }
        job_id = cluster.submit(write_job(root / "job", name="chaos", **shape))
        log.info("submitted %s; faults for at most %.0fs", job_id, args.duration)
        wait_for(lambda: cluster.try_read(lambda: cluster.rounds(job_id)), 60, "the first round")
        stats = run_chaos(
            cluster,
            job_id,
            rng=rng,
            duration_s=args.duration,
            agent_kills=args.agent_kills,
            coordinator_kills=args.coordinator_kills,
            gap_s=tuple(args.gap),
            pause_s=tuple(args.pause),
        )
        log.info("faults over (%s); waiting for the job to finish", stats)
        job = cluster.wait_job_done(job_id, timeout=300)
        rounds = cluster.rounds(job_id)
        events = cluster.events(job_id)
        per_epoch = coverage(rounds, args.samples)
        chaos_s = time.monotonic() - t_start
        result: dict[str, Any] = {
            "kills": stats["agent_kills"] + stats["coordinator_kills"],
            "agent_kills": stats["agent_kills"],
            "coordinator_kills": stats["coordinator_kills"],
            "restarts": stats["restarts"],
            "state": JS.Name(job.state).removeprefix("JOB_STATE_").lower(),
            "epochs": len(per_epoch),
            "samples_lost": sum(e["lost"] for e in per_epoch),
            "samples_duplicated": sum(e["duplicated"] for e in per_epoch),
            "per_epoch": per_epoch,
            "rounds": len(rounds),
            "rounds_incomplete": sum(1 for r in rounds if len(applied(r)) < len(r.parts)),
            "rounds_rolled_back": sum(
                int(e.attrs.get("rolled_back", "0")) for e in events if e.kind == "job.restored"
            ),
            "paused": sum(1 for e in events if e.kind == "job.paused"),
            "final_loss": round(epoch_loss(rounds, args.epochs - 1), 4),
            "first_round_loss": round(rounds[0].loss, 4) if rounds else None,
            "seconds": round(chaos_s, 1),
        }
        if not args.no_baseline:
            # The same job again, same seed, same cluster, no faults.
            t0 = time.monotonic()
            cluster.wait_agents_ready()
            base_id = cluster.submit(write_job(root / "job-baseline", name="baseline", **shape))
            base = cluster.wait_job_done(base_id, timeout=300)
            base_rounds = cluster.rounds(base_id)
            result["final_loss_without_faults"] = round(epoch_loss(base_rounds, args.epochs - 1), 4)
            result["baseline_state"] = JS.Name(base.state).removeprefix("JOB_STATE_").lower()
            result["baseline_seconds"] = round(time.monotonic() - t0, 1)
        result.update(
            agents=args.agents,
            samples=args.samples,
            global_batch=args.global_batch,
            heartbeat_interval_s=args.heartbeat_interval,
            seed=args.seed,
        )
        print(json.dumps(result), flush=True)
        ok = (
            result["state"] == "succeeded"
            and result["samples_lost"] == 0
            and result["samples_duplicated"] == 0
            and result["epochs"] == args.epochs
            and result.get("baseline_state", "succeeded") == "succeeded"
        )
        return 0 if ok else 1
    finally:
        cluster.stop()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log.info("logs and data kept in %s", root)


if __name__ == "__main__":
    sys.exit(main())
