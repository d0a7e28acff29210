"""Training through the parameter server with real processes: a coordinator, three agents with
slowdowns 1, 2 and 4, and the `epochmesh` CLI.

- Equivalence: replaying the recorded rounds in a plain single-process PyTorch loop (the
  submitter's model.py, eager, no epochmesh code) gives the downloaded parameters within 1e-5.
- Exactly once: per epoch, the applied parts' index ranges partition the dataset.
- The allocation follows speed: average b_i shares within 20% of 4:2:1.
- A WatchJob stream open for the whole job gets every round and every event of the job once,
  in order, in updates at most every WATCH_MIN_INTERVAL_S (not one per change).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coordinator.engine.engine import WATCH_MIN_INTERVAL_S
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_dataset, write_job
from tests.procs import (
    STEADY_LEASES,
    console_script,
    start_coordinator,
    sync_channel_for,
    wait_until,
)
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import logged_in_env

SLOWDOWNS = (1, 2, 4)

# Convolutions: heavy per sample and light in parameters, so compute grows with the batch and
# 4:2:1 speeds show as 4:2:1 shares (a tiny MLP is dominated by fixed per-step costs).
MODEL = """
import torch
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 64, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 8),
    )
"""


def cli(address: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(console_script("epochmesh")), "--coordinator", address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=logged_in_env(address),
    )


def make_dataset(n: int, side: int = 24) -> dict[str, torch.Tensor]:
    """``n`` images of ``side`` x ``side`` pixels (the model pools to any size), 8 classes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, side, side, generator=g)
    w = torch.randn(side * side, 8, generator=g)
    return {"x": x, "y": (x.flatten(1) @ w).argmax(dim=1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[AgentProc]]]:
    root = tmp_path_factory.mktemp("training")
    with start_coordinator(root / "coord", *STEADY_LEASES) as coord:
        agents = [
            AgentProc(coord.address, root / f"agent-x{s}", "--slowdown", str(s), "--name", f"x{s}")
            for s in SLOWDOWNS
        ]
        try:
            wait_until(
                lambda: (
                    len([n for n in list_nodes(coord.address) if n.benchmark.samples_per_second])
                    == len(SLOWDOWNS)
                ),
                timeout=180,
                message="agents did not register and benchmark",
            )
            yield coord.address, agents
        finally:
            for a in agents:
                a.kill9()


def submit(address: str, job_toml: Path) -> str:
    out = cli(address, "submit", str(job_toml), "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["job_id"]


def wait_job_state(address: str, job_id: str, state: str, timeout: float) -> dict:
    """Wait for the job to reach ``state`` ("succeeded", "failed", ...; another end fails at
    once), polling GetJob over one gRPC channel (an `epochmesh status` process per poll costs
    a Python start, ~0.3 s of CPU, on these 2 cores); then the CLI's `status --output json`
    of the job, once."""
    want = getattr(common_pb2, f"JOB_STATE_{state.upper()}")
    ended = (
        common_pb2.JOB_STATE_SUCCEEDED,
        common_pb2.JOB_STATE_FAILED,
        common_pb2.JOB_STATE_CANCELLED,
    )
    with sync_channel_for(address) as channel:
        jobs = job_pb2_grpc.JobServiceStub(channel)

        def reached() -> bool:
            job = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
            if job.state in ended and job.state != want:
                raise AssertionError(f"job ended {common_pb2.JobState.Name(job.state)}: {job}")
            return job.state == want

        wait_until(reached, timeout=timeout, interval=0.25, message=f"job {job_id} never {state}")
    out = cli(address, "status", job_id, "--output", "json")
    assert out.returncode in (0, 5), out.stderr
    job = json.loads(out.stdout)
    assert job["state"] == state, job
    return job


def wait_succeeded(address: str, job_id: str, timeout: float) -> dict:
    return wait_job_state(address, job_id, "succeeded", timeout)


def load_rounds(address: str, job_id: str) -> list[dict]:
    out = cli(address, "rounds", job_id, "--output", "json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def applied_parts(rnd: dict) -> list[dict]:
    return sorted((p for p in rnd["parts"] if p["status"] == "applied"), key=lambda p: p["node_id"])


def indices(part: dict) -> list[int]:
    return [i for a, b in part["ranges"] for i in range(a, b)]


def import_model(path: Path):
    spec = importlib.util.spec_from_file_location("replay_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Watcher:
    """A WatchJob stream read on a thread from the job's submission to its end."""

    def __init__(self, address: str, job_id: str) -> None:
        self.updates: list[tuple[float, job_pb2.JobUpdate]] = []
        self.channel = sync_channel_for(address)
        stream = job_pb2_grpc.JobServiceStub(self.channel).WatchJob(
            job_pb2.WatchJobRequest(job_id=job_id), timeout=240
        )

        def read() -> None:
            for update in stream:
                self.updates.append((time.monotonic(), update))

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def check(self, address: str, job_id: str, rounds: list[int]) -> None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the watch did not end with the job"
        self.channel.close()
        watched = [r.round for _, u in self.updates for r in u.rounds]
        assert watched == rounds, f"watched rounds {watched}, stored {rounds}"
        events = [e.id for _, u in self.updates for e in u.events]
        with sync_channel_for(address) as ch:  # the finished job, read again in one go
            final = list(
                job_pb2_grpc.JobServiceStub(ch).WatchJob(
                    job_pb2.WatchJobRequest(job_id=job_id), timeout=30
                )
            )
        everything = [e for u in final for e in u.events]
        assert events == [e.id for e in everything], [
            (e.id, e.kind, e.message) for e in everything if e.id not in events
        ]
        # One update per few changes, not one per change (two or more changes a round here):
        # a reader late on its stream can get two at once, but not most of them.
        gaps = [b - a for (a, _), (b, _) in zip(self.updates, self.updates[1:], strict=False)]
        close = [g for g in gaps if g < 0.8 * WATCH_MIN_INTERVAL_S]
        assert len(close) <= max(2, len(gaps) // 4), (len(close), len(gaps), gaps)


def replay_difference(
    address: str,
    job_id: str,
    tmp_path: Path,
    data: dict[str, torch.Tensor],
    rounds: list[dict],
    seed: int,
) -> float:
    """Download the job's result and replay its recorded rounds in a plain PyTorch loop (the
    submitter's model.py, SGD lr 0.05 momentum 0.9, each applied part's mean-loss gradient on
    its whole b_i weighted by its share of the round); the max abs parameter difference."""
    out = cli(address, "download", job_id, "-o", str(tmp_path / "result"))
    assert out.returncode == 0, out.stderr
    trained = load_file(str(tmp_path / "result" / "model.safetensors"))
    module = import_model(tmp_path / "job" / "model.py")
    torch.manual_seed(seed)
    model = module.make_model()
    assert set(trained) == set(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.functional.cross_entropy
    for rnd in rounds:
        parts = applied_parts(rnd)
        if not parts:
            continue
        total_b = sum(p["local_batch"] for p in parts)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for part in parts:
            idx = torch.tensor(indices(part))
            model.zero_grad()
            loss_fn(model(data["x"][idx]), data["y"][idx]).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g.add_(p.grad, alpha=part["local_batch"] / total_b)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
    return max((trained[k] - v).abs().max().item() for k, v in model.state_dict().items())


@pytest.mark.timeout(300)
def test_three_agents_match_single_process_replay(
    cluster: tuple[str, list[AgentProc]], tmp_path: Path
) -> None:
    address, _ = cluster
    # Parts of tens of samples: every part is cut into 12 chunks for verification, and a pass
    # of the program has a fixed cost (~1.5 ms here), which in parts of a few samples (global
    # batch 192: ~27 for the slowest node) weighs on a slow node's speed more than its device.
    # 16 x 16 images: the parts' compute still far above that fixed cost (2.25 times less than
    # at 24 x 24, for the agents, their checks and the replay alike).
    n = 4608
    data = make_dataset(n, side=16)
    job_toml = write_job(
        tmp_path / "job",
        MODEL,
        data,
        {
            "name": "equivalence",
            "model": {"file": "model.py", "loss": "cross_entropy"},
            "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
            "train": {
                "epochs": 3,
                "global_batch": 768,
                "optimizer": "sgd",
                "lr": 0.05,
                "momentum": 0.9,
                "seed": 7,
            },
            "cluster": {"aggregation": "ps", "min_nodes": 3, "max_nodes": 3, "checkpoint_every": 5},
        },
    )
    job_id = submit(address, job_toml)
    watcher = Watcher(address, job_id)
    wait_succeeded(address, job_id, timeout=240)
    rounds = load_rounds(address, job_id)
    watcher.check(address, job_id, [r["round"] for r in rounds])

    # Exactly once per epoch, from the records alone.
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in applied_parts(rnd):
            by_epoch[rnd["epoch"]].extend(indices(part))
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(n)), f"epoch {epoch} is not covered exactly once"

    # Download, then replay the recorded rounds with plain PyTorch.
    diff = replay_difference(address, job_id, tmp_path, data, rounds, seed=7)
    assert diff <= 1e-5, f"max abs difference {diff}"

    # The allocation follows speed: over rounds where all three nodes trained, each node's share
    # of the samples is its share of the measured speed (samples over compute seconds, from the
    # records), i.e. the split evens out compute times; and the slower the node, the smaller.
    # (Not the nominal 4:2:1 of the slowdowns: a part of a few samples pays a fixed cost per
    # pass of the program, slowed down too, so a x4 node is more than 4 times slower here.)
    # The split starts from the benchmarks and follows what the rounds measure: compared over
    # the later half of those rounds, once it has had rounds to follow.
    names = {n.node_id: n.name for n in list_nodes(address)}
    totals: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    full = [
        parts
        for rnd in rounds
        if len(parts := applied_parts(rnd)) == 3 and sum(p["local_batch"] for p in parts) == 768
    ]
    assert len(full) >= 10, f"only {len(full)} rounds with all three nodes"
    for parts in full[len(full) // 2 :]:
        for p in parts:
            totals[names[p["node_id"]]] += p["local_batch"]
            seconds[names[p["node_id"]]] += p["seconds"]
    total = sum(totals.values())
    rates = {name: totals[name] / seconds[name] for name in totals}
    speed = sum(rates.values())
    names_by_slowdown = [f"x{s}" for s in sorted(SLOWDOWNS)]
    shares = [totals[name] / total for name in names_by_slowdown]
    assert shares == sorted(shares, reverse=True), (shares, names_by_slowdown)
    for name in names_by_slowdown:
        want = rates[name] / speed
        got = totals[name] / total
        assert abs(got - want) <= 0.2 * want, (
            f"share of {name}: {got:.3f}, its share of the measured speed {want:.3f}; rounds: "
            + "; ".join(
                f"{r['round']}:"
                + ",".join(
                    f"{names[p['node_id']]}={p['local_batch']}/{p['status']}/{p['seconds']:.3f}"
                    for p in r["parts"]
                )
                for r in rounds
            )
        )


@pytest.mark.timeout(180)
def test_micro_batches_train_what_whole_batches_train(
    cluster: tuple[str, list[AgentProc]], tmp_path: Path
) -> None:
    """micro_batch = 16: every node computes its b_i in passes of at most 16 samples (b_i is up
    to ~55 here) and accumulates the gradient; the result is what whole-batch passes give, as
    replayed by the plain loop, within the same 1e-5."""
    address, _ = cluster
    n = 384
    data = make_dataset(n)
    job_toml = write_job(
        tmp_path / "job",
        MODEL,
        data,
        {
            "name": "micro-batches",
            "model": {"file": "model.py", "loss": "cross_entropy"},
            "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
            "train": {
                "epochs": 2,
                "global_batch": 96,
                "micro_batch": 16,
                "optimizer": "sgd",
                "lr": 0.05,
                "momentum": 0.9,
                "seed": 3,
            },
            "cluster": {"aggregation": "ps", "min_nodes": 3, "max_nodes": 3},
        },
    )
    job_id = submit(address, job_toml)
    status = wait_succeeded(address, job_id, timeout=150)
    assert status["spec"]["micro_batch"] == 16
    out = cli(address, "status", job_id)
    assert out.returncode == 0 and "batch 96 (passes of 16)" in out.stdout, out.stdout
    rounds = load_rounds(address, job_id)
    assert len(rounds) >= 2 * n // 96
    assert max(p["local_batch"] for r in rounds for p in applied_parts(r)) > 16
    diff = replay_difference(address, job_id, tmp_path, data, rounds, seed=3)
    assert diff <= 1e-5, f"max abs difference {diff}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case,expect",
    [
        ("missing_model", "model.py"),
        ("model_raises", "boom"),
        ("not_exportable", "export"),
        ("first_dims_differ", "first dimension"),
        ("typo_key", "global_batch"),
        ("batch_below_nodes", "min_nodes"),
    ],
)
def test_bad_jobs_are_refused_and_nothing_is_stored(
    cluster: tuple[str, list[AgentProc]], tmp_path: Path, case: str, expect: str
) -> None:
    address, _ = cluster
    before_jobs = cli(address, "status", "--output", "json").stdout
    before_blobs = json.loads(cli(address, "stats", "--output", "json").stdout)["blobs"]
    doc: dict = {
        "name": "bad",
        "model": {"file": "model.py", "loss": "cross_entropy"},
        "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": {"epochs": 1, "global_batch": 8},
        "cluster": {"min_nodes": 1, "max_nodes": 3},
    }
    model = MODEL
    data = make_dataset(16)
    if case == "model_raises":
        model = "def make_model():\n    raise RuntimeError('boom')\n"
    elif case == "not_exportable":
        model = MODEL + (
            "\n\nclass Branchy(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n"
            "        self.fc = nn.Linear(24, 8)\n"
            "    def forward(self, x):\n"
            "        return self.fc(x) if x.sum() > 0 else -self.fc(x)\n\n\n"
            "def make_model():\n    return Branchy()\n"
        )
    elif case == "first_dims_differ":
        data = {"x": data["x"], "y": data["y"][:10]}
    elif case == "typo_key":
        doc["train"] = {"epochs": 1, "global_bach": 8}
    elif case == "batch_below_nodes":
        doc["train"]["global_batch"] = 2
        doc["cluster"]["min_nodes"] = 3
    job_toml = write_job(tmp_path / "job", model, data, doc)
    if case == "missing_model":
        (tmp_path / "job" / "model.py").unlink()
    if case == "first_dims_differ":
        write_dataset(tmp_path / "job" / "train.safetensors", data)
    out = cli(address, "submit", str(job_toml))
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert expect in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert cli(address, "status", "--output", "json").stdout == before_jobs
    assert json.loads(cli(address, "stats", "--output", "json").stdout)["blobs"] == before_blobs
