"""Local SGD (DiLoCo) and compressed updates with real processes: a coordinator and three agents
(slowdowns 1, 1 and 2), each agent reaching the coordinator through its own emulated WAN link
(scripts/wan.py: 100 Mbit/s, 20 ms RTT), jobs submitted with the `epochmesh` CLI.

- local_sgd + int8: time-boxed rounds: every applied part ran ceil(samples / b_i) inner steps,
  at most 2 H (its ranges: 1.25 times the steps its box is sized for, which is H scaled by at
  most 1.25 so that an epoch's rounds are alike; an epoch's last round takes what is left, up
  to 1.5 H), about H on average, and
  pushed int8 pseudo-gradients (the agents' logs show the int8 payload size);
  every epoch is covered exactly once; the loss falls; and the trained model's loss on the
  whole dataset exceeds that of synchronous fp32 training of the same job (same data, epochs,
  global batch and inner optimizer, on the same cluster) by at most 10% of the initial loss.
- sync + topk (ratio 0.1, error feedback on the agents): top-k gradients on the wire,
  exactly once per epoch, and the loss falls.
- a local SGD job whose rounds compute far longer than they communicate (H = 512): its rounds
  are time-boxed (parts run other step counts than H, the recorded ranges are the steps run)
  and the epoch is still covered exactly once. (The jobs above compute for less time than they
  communicate over the relays: not boxed.)
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.fixtures import make_classification, write_mlp_job
from tests.procs import start_coordinator, token_for, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_training import (
    applied_parts,
    cli,
    indices,
    load_rounds,
    submit,
    wait_succeeded,
)

log = logging.getLogger(__name__)

SLOWDOWNS = (1, 1, 2)
N = 768
SEED = 0  # dataset seed (write_mlp_job)
TRAIN_SEED = 3
GLOBAL_BATCH = 32
EPOCHS = 2
H = 4
# Whole-dataset cross-entropy of local SGD + int8 may exceed synchronous fp32's by this fraction
# of the initial loss (1.40 for this job: 0.14).
WAN_BANDWIDTH = "100mbit"
WAN_RTT = "20ms"
ROOT = Path(__file__).resolve().parents[2]

# The tiny MLP's parameters: 16x32 + 32 + 32x4 + 4 floats in four tensors.
PARAM_SIZES = (16 * 32, 32, 32 * 4, 4)
INT8_BYTES = sum(4 * math.ceil(n / 256) + n for n in PARAM_SIZES)
TOPK_RATIO = 0.1
TOPK_BYTES = sum(8 * math.ceil(TOPK_RATIO * n) for n in PARAM_SIZES)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class WanRelays:
    """scripts/wan.py in a process of its own: one emulated link per agent to the coordinator.

    (Not a WanThread in the test process: its event loop would compete for the test's GIL with
    the sync gRPC channels the test polls with.)"""

    def __init__(self, root: Path, target: str, count: int) -> None:
        self.ready_file = root / "wan-ready.json"
        link_args: list[str] = []
        for i in range(count):
            spec = f"a{i}=127.0.0.1:0,{target},{WAN_BANDWIDTH},{WAN_RTT}"
            link_args += ["--link", spec]
        self.log_path = root / "wan.log"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "wan.py"),
                    *link_args,
                    "--ready-file",
                    str(self.ready_file),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

        def ready() -> dict | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"wan.py exited: {self.log_path.read_text()[-2000:]}")
            try:
                return json.loads(self.ready_file.read_text())
            except (FileNotFoundError, ValueError):
                return None

        info = wait_until(ready, timeout=30, message="wan.py did not get ready")
        self.addresses = [info["links"][f"a{i}"]["listen"] for i in range(count)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[AgentProc]]]:
    root = tmp_path_factory.mktemp("local_sgd")
    # The default heartbeat (2 s, lease 6 s): nothing is killed here, and a loaded machine must
    # not make leases lapse mid-job.
    with start_coordinator(root / "coord") as coord:
        relays = WanRelays(root, coord.address, len(SLOWDOWNS))
        agents: list[AgentProc] = []
        try:
            for i, (s, relay) in enumerate(zip(SLOWDOWNS, relays.addresses, strict=True)):
                # The relay's address is not the coordinator's: the helpers cannot tell its CA
                # from it, so the join token is passed explicitly.
                token = token_for(coord.address, "node")
                extra = ["--token", token] if token else []
                agents.append(
                    AgentProc(
                        relay,
                        root / f"agent-{i}",
                        "--slowdown",
                        str(s),
                        "--name",
                        f"n{i}-x{s}",
                        *extra,
                    )
                )
            wait_until(
                lambda: (
                    len([n for n in list_nodes(coord.address) if n.benchmark.samples_per_second])
                    == len(SLOWDOWNS)
                ),
                timeout=60,
                message="agents did not register and benchmark",
            )
            yield coord.address, agents
        finally:
            for a in agents:
                a.kill9()
            relays.stop()


def job_toml(directory: Path, name: str, **train: Any) -> Path:
    overrides = {
        "name": name,
        "train": {
            "epochs": EPOCHS,
            "global_batch": GLOBAL_BATCH,
            "lr": 0.1,
            "momentum": 0.9,
            "seed": TRAIN_SEED,
            **train,
        },
        "cluster": {"min_nodes": len(SLOWDOWNS), "max_nodes": len(SLOWDOWNS)},
    }
    return write_mlp_job(directory, N, seed=SEED, overrides=overrides)


def run_job(address: str, directory: Path, name: str, **train: Any) -> tuple[list[dict], dict]:
    """Submit, wait for success; (round records, downloaded parameters)."""
    started = time.monotonic()
    job_id = submit(address, job_toml(directory / "job", name, **train))
    wait_succeeded(address, job_id, timeout=150)
    rounds = load_rounds(address, job_id)
    log.info(
        "job %s: %d rounds in %.1fs; round seconds %s",
        name,
        len(rounds),
        time.monotonic() - started,
        [round((r["finished_ms"] - r["started_ms"]) / 1000, 2) for r in rounds],
    )
    for r in rounds:
        log.info(
            "epoch %d round %d loss %.3f parts (node, samples, b_i, steps) %s",
            r["epoch"],
            r["round"],
            r["loss"],
            [
                (p["node_id"], len(indices(p)), p["local_batch"], p["inner_steps"])
                for p in applied_parts(r)
            ],
        )
    out = cli(address, "download", job_id, "-o", str(directory / "result"))
    assert out.returncode == 0, out.stderr
    return rounds, load_file(str(directory / "result" / "model.safetensors"))


def check_exactly_once(rounds: list[dict]) -> None:
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rnd in rounds:
        for part in applied_parts(rnd):
            by_epoch[rnd["epoch"]].extend(indices(part))
    assert sorted(by_epoch) == list(range(EPOCHS))
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(N)), f"epoch {epoch} is not covered exactly once"


def dataset_loss(state: dict[str, torch.Tensor] | None) -> float:
    """Cross-entropy on the whole dataset; `state` None: the job's initial parameters."""
    torch.manual_seed(TRAIN_SEED)
    model = mlp()
    if state is not None:
        model.load_state_dict(state)
    data = make_classification(N, seed=SEED)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(data["x"]), data["y"]))


def round_losses(rounds: list[dict]) -> list[float]:
    return [r["loss"] for r in rounds if applied_parts(r)]


def epoch_losses(rounds: list[dict]) -> list[float]:
    """Per epoch, the mean training loss over its applied parts, weighted by their samples.

    (A single round's loss is no measure of progress: an epoch's last round may train a handful
    of leftover samples.)"""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for rnd in rounds:
        for part in applied_parts(rnd):
            total[rnd["epoch"]] += part["mean_loss"] * len(indices(part))
            count[rnd["epoch"]] += len(indices(part))
    return [total[e] / count[e] for e in sorted(count)]


def pushed_sizes(agents: list[AgentProc], kind: str, codec: str) -> set[int]:
    pattern = re.compile(rf"{kind} of \d+ samples in \d+ step\(s\), .*?(\d+) bytes \({codec}\)")
    return {int(m.group(1)) for a in agents for m in pattern.finditer(a.log_text())}


@pytest.fixture(scope="module")
def local_sgd_int8(
    cluster: tuple[str, list[AgentProc]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict], dict]:
    address, _ = cluster
    return run_job(
        address,
        tmp_path_factory.mktemp("diloco"),
        "diloco-int8",
        sync="local_sgd",
        inner_steps=H,
        outer_lr=0.8,
        outer_momentum=0.3,
        compression="int8",
    )


@pytest.mark.timeout(240)
def test_local_sgd_int8_runs_inner_steps_exactly_once(
    cluster: tuple[str, list[AgentProc]], local_sgd_int8: tuple[list[dict], dict]
) -> None:
    _, agents = cluster
    rounds, trained = local_sgd_int8
    check_exactly_once(rounds)
    most = 2 * H
    steps = []
    for rnd in rounds:
        parts = applied_parts(rnd)
        assert sum(len(indices(p)) for p in parts) <= most * GLOBAL_BATCH
        for p in parts:
            n, b = len(indices(p)), p["local_batch"]
            assert p["inner_steps"] == math.ceil(n / b) <= most, p
            steps.append(p["inner_steps"])
    # The time boxes are sized for about H steps: some nodes run a few more, some fewer.
    assert 0.6 * H <= sum(steps) / len(steps) <= most, steps
    # About H * global_batch samples per round: ~6 rounds an epoch, not 24.
    assert len(rounds) <= EPOCHS * (math.ceil(N / (0.6 * H * GLOBAL_BATCH)) + 2)
    # int8 pseudo-gradients on the wire.
    assert pushed_sizes(agents, "pseudo_gradient", "int8") == {INT8_BYTES}
    losses = round_losses(rounds)
    # Each round's loss and parts (node, local batch, inner steps): what a failure needs.
    table = [
        (r["loss"], [(p["node_id"][-4:], p["local_batch"], p["inner_steps"]) for p in parts])
        for r in rounds
        if (parts := applied_parts(r))
    ]
    assert epoch_losses(rounds)[-1] < 0.6 * losses[0], (epoch_losses(rounds), table)
    assert dataset_loss(trained) < 0.6 * dataset_loss(None), table


@pytest.mark.timeout(240)
def test_sync_topk_with_error_feedback_trains(
    cluster: tuple[str, list[AgentProc]], tmp_path: Path
) -> None:
    address, agents = cluster
    rounds, trained = run_job(
        address, tmp_path, "sync-topk", compression="topk", topk_ratio=TOPK_RATIO
    )
    check_exactly_once(rounds)
    for rnd in rounds:
        for p in applied_parts(rnd):
            assert p["inner_steps"] in (0, 1)
    assert pushed_sizes(agents, "gradient", "topk") == {TOPK_BYTES}
    losses = round_losses(rounds)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert dataset_loss(trained) < 0.7 * dataset_loss(None)


# A job whose rounds compute far longer than they communicate: time-boxed.
BOXED_N = 16384
BOXED_BATCH = 8
BOXED_H = 512  # ~0.3-1 s of steps a round against ~0.1 s of transfers over the relays


@pytest.mark.timeout(240)
def test_long_local_sgd_rounds_are_time_boxed_and_exactly_once(
    cluster: tuple[str, list[AgentProc]], tmp_path: Path
) -> None:
    address, _ = cluster
    overrides = {
        "name": "diloco-boxed",
        "train": {
            "epochs": 1,
            "global_batch": BOXED_BATCH,
            "lr": 0.05,
            "momentum": 0.9,
            "seed": TRAIN_SEED,
            "sync": "local_sgd",
            "inner_steps": BOXED_H,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
        },
        "cluster": {"min_nodes": len(SLOWDOWNS), "max_nodes": len(SLOWDOWNS)},
    }
    job_id = submit(address, write_mlp_job(tmp_path / "job", BOXED_N, overrides=overrides))
    wait_succeeded(address, job_id, timeout=180)
    rounds = load_rounds(address, job_id)
    seen = [i for rnd in rounds for p in applied_parts(rnd) for i in indices(p)]
    assert sorted(seen) == list(range(BOXED_N)), "the epoch is not covered exactly once"
    applied = [rnd for rnd in rounds if applied_parts(rnd)]
    assert len(applied) >= 3, [len(applied_parts(r)) for r in rounds]
    steps = []
    for rnd in applied[:-1]:  # the epoch's last round is not boxed
        for p in applied_parts(rnd):
            n, b = len(indices(p)), p["local_batch"]
            # The recorded ranges are the steps the node ran (a box ends after a whole step).
            assert p["inner_steps"] == math.ceil(n / b), p
            steps.append(p["inner_steps"])
    # Without boxes every part of these rounds would run exactly H steps; in a box a node runs
    # as many as fit (the three nodes, two of them alike, never all land on H every round).
    assert any(k != BOXED_H for k in steps), steps
    assert all(1 <= k <= 2 * BOXED_H for k in steps), steps
