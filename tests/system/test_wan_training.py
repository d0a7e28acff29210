"""Local SGD with int8 over emulated WAN links reaches the loss of synchronous fp32 training.

Real processes: an `epochmesh-coordinator`, two `epochmesh-agent`s that each dial it through
their own emulated link (epochmesh/testing/wan.py relays on a thread of this test: 50 Mbit/s, 20 ms
RTT), and the `epochmesh` CLI. The same job (the fixtures' tiny classifier, 16 -> 32 -> 4, on
512 samples, 3 epochs, global batch 64) is trained twice on that cluster:

  (a) sync = "sync", compression = "none": SGD lr 0.2, momentum 0.9 (24 rounds);
  (b) sync = "local_sgd", H = 4 inner steps of the same SGD, outer Nesterov with outer_lr 0.8
      and outer_momentum 0.3, compression = "int8" (about 6 rounds: time-boxed, a node runs
      as many steps of its ranges as fit in a box sized for about H, at most 2 H).

Both train every sample of every epoch once. Each job's result is downloaded and evaluated on
the whole dataset with plain PyTorch (the submitter's model.py, no epochmesh code).

Tolerance: (b)'s loss <= (a)'s loss + 0.05 (cross-entropy in nats; ~1.4 untrained). Why: with
the same samples, local SGD synchronises 4 times less often and each node's inner steps follow
its own 32-sample batches, so it lands near, not on, sync's point; int8 adds at most half a
block scale of error per element (carried over by error feedback). A single-process
simulation of both schedules (same data, int8 round trip included) gives 0.103 vs 0.116; this
system measured 0.096 vs 0.097 and 0.114 vs 0.094 in two runs (sync differs between runs when
a late part sends its samples back to a later round). 0.05 leaves room for the per-run b_i
split, while a broken codec, aggregation weight or sign costs 0.3 or more. DiLoCo's outer
0.7 / 0.9 is not used here: with only 6 outer steps it overshoots on this task (simulation and
system alike end near loss 3 on 1024 samples); 0.8 / 0.3 is stable.
Also checked: every applied part of (b) ran ceil(samples / b_i) <= 2 H inner steps. (Bytes per
sample are scripts/bench_wan.py's business: with this tiny model, control traffic and the
per-job bandwidth probe outweigh the updates.)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from epochmesh.testing.wan import WanLink, WanThread
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import MLP_DIR, make_classification, write_mlp_job
from tests.procs import (
    console_script,
    start_coordinator,
    sync_channel_for,
    token_for,
    wait_until,
)
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import engine_available, logged_in_env

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not engine_available(), reason="coordinator without training engine"),
]

SAMPLES = 512
EPOCHS = 3
BATCH = 64
INNER_STEPS = 4
AGENTS = 2
OUTER_LR = 0.8
OUTER_MOMENTUM = 0.3
TOLERANCE = 0.05
BANDWIDTH_BPS = 50e6
RTT_MS = 20.0
JS = common_pb2.JobState


@dataclass
class WanCluster:
    address: str
    wan: WanThread
    agents: list[AgentProc]
    root: Path


def cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(console_script("epochmesh")), "--coordinator", address, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=logged_in_env(address),
    )


@pytest.fixture(scope="module")
def wan_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WanCluster]:
    root = tmp_path_factory.mktemp("wan-training")
    with start_coordinator(root / "coord", "--heartbeat-interval", "0.5") as coord:
        links = [
            WanLink("127.0.0.1:0", coord.address, BANDWIDTH_BPS, RTT_MS, name=f"a{i}", seed=i)
            for i in range(AGENTS)
        ]
        with WanThread(*links) as wan:
            agents = []
            try:
                for i, link in enumerate(links):
                    token = token_for(coord.address, "node")
                    assert token
                    agents.append(
                        AgentProc(
                            link.address,
                            root / f"agent{i}",
                            "--token",
                            token,
                            "--name",
                            f"a{i}",
                            "--no-peer",
                        )
                    )
                wait_until(
                    lambda: (
                        len([n for n in list_nodes(coord.address) if n.benchmark.rtt_ms > 0])
                        == AGENTS
                    ),
                    timeout=60,
                    interval=0.2,
                    message="agents did not register and benchmark through the links",
                )
                yield WanCluster(coord.address, wan, agents, root)
            finally:
                for a in agents:
                    a.kill9()


def train(c: WanCluster, name: str, train_overrides: dict[str, object]) -> str:
    """Submit the job through the CLI, wait for it to succeed; its id."""
    job_toml = write_mlp_job(
        c.root / name,
        SAMPLES,
        overrides={
            "name": name,
            "train": {
                "epochs": EPOCHS,
                "global_batch": BATCH,
                "lr": 0.2,
                "momentum": 0.9,
                **train_overrides,
            },
            "cluster": {"min_nodes": AGENTS, "max_nodes": AGENTS, "checkpoint_every": 1000},
        },
    )
    out = cli(c.address, "submit", str(job_toml), "--output", "json")
    assert out.returncode == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])
    # Poll over one gRPC channel: a CLI process per poll would cost more CPU than the job.
    with sync_channel_for(c.address) as channel:
        jobs = job_pb2_grpc.JobServiceStub(channel)

        def done() -> bool:
            job = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)
            assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job.message
            return job.state == JS.JOB_STATE_SUCCEEDED

        wait_until(done, timeout=90, interval=0.25, message=f"{name} did not finish")
    return job_id


def rounds_of(address: str, job_id: str) -> list[dict]:
    out = cli(address, "rounds", job_id, "--output", "json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def final_loss(c: WanCluster, job_id: str, name: str) -> float:
    """Cross-entropy of the downloaded model on the whole dataset, in plain PyTorch."""
    out = cli(c.address, "download", job_id, "-o", str(c.root / f"{name}-result"))
    assert out.returncode == 0, out.stderr
    state = load_file(str(c.root / f"{name}-result" / "model.safetensors"))
    spec = importlib.util.spec_from_file_location(f"wan_{name}_model", MLP_DIR / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.make_model()
    model.load_state_dict(state)
    data = make_classification(SAMPLES)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(data["x"]), data["y"]))


def test_local_sgd_int8_over_wan_matches_sync_fp32(wan_cluster: WanCluster) -> None:
    t0 = time.monotonic()
    sync_id = train(wan_cluster, "sync-fp32", {})
    t_sync = time.monotonic() - t0
    local_id = train(
        wan_cluster,
        "local-int8",
        {
            "sync": "local_sgd",
            "inner_steps": INNER_STEPS,
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MOMENTUM,
            "compression": "int8",
        },
    )
    t_local = time.monotonic() - t0 - t_sync

    records = rounds_of(wan_cluster.address, local_id)
    assert records
    for r in records:
        for p in r["parts"]:
            if p["status"] == "applied":
                samples = sum(b - a for a, b in p["ranges"])
                most = 2 * INNER_STEPS  # the ranges of a time box, or an epoch's last round
                assert p["inner_steps"] == -(-samples // p["local_batch"]) <= most, p

    loss_sync = final_loss(wan_cluster, sync_id, "sync")
    loss_local = final_loss(wan_cluster, local_id, "local")
    # Each local SGD round's loss and parts (node, local batch, inner steps): what a failure
    # needs to be understood.
    parts = [
        (
            r.get("loss"),
            [
                (p["node_id"][-4:], p["local_batch"], p["inner_steps"])
                for p in r["parts"]
                if p["status"] == "applied"
            ],
        )
        for r in records
    ]
    detail = (
        f"sync fp32: loss {loss_sync:.4f} ({t_sync:.1f}s); "
        f"local SGD int8: loss {loss_local:.4f} ({t_local:.1f}s, {len(records)} rounds: {parts})"
    )
    print(detail)  # noqa: T201 (shown with -s: the measured figures behind the tolerance)
    assert loss_sync < 0.3, detail
    assert loss_local <= loss_sync + TOLERANCE, detail
