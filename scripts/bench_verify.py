"""Verification of untrusted donors (issue 20), measured on a local cluster of real processes.

Five agents of mixed speeds (TLS on, each its own donor): four honest ones for the whole run and
a fifth, fresh for every job. First a long honest job on all five builds the honest nodes'
records until they are checked at the floor rate (`overhead_trusted`: compute spent on checks
over the cluster's training compute once nodes are trusted; `overhead_new`: while new), then a
clean reference job, then the same job once per cheat with a fresh fifth agent cheating that
way from round CHEAT_FROM on (the agent's test-only EPOCHMESH_TEST_CHEAT switch). Per cheat:

- `rounds_to_quarantine`: rounds of the job closed from its first cheated round (the first its
  log names: a stale cheater with no fitting earlier part sends an honest one) until the
  cheater's quarantine (0: caught before the round after its first cheat closed);
- `loss_over_clean`: the result's loss over the whole dataset (plain PyTorch) over the clean
  job's (`clean_again_over_clean`: the clean job run twice, the noise it is read against);
- exactly-once over the live rounds.

`false_accusations`: honest nodes struck or quarantined over every job. Prints one JSON line:

    .venv/bin/python scripts/bench_verify.py [--samples 1920] [--epochs 3] [--trust-rounds 160]
        [--mode sync|local_sgd|ring|ring_local_sgd] [--inner-steps H] [--random-rounds 40]
        [--only-random]

Random programs (honest randomness must never look like cheating): after the clean job, an
honest job of `RANDOM_MODEL` (the conv net with `nn.Dropout`, `torch.rand_like` noise and a
`torch.randperm` feature order, whose draws the agents seed per chunk from the job, round,
worker and samples) on all five nodes (`random_job`: its verification figures; its checks
must pass), then the `flipped` cheat on that model (`random_cheat`: still caught).
`random_false_accusations`: honest nodes struck, failed or quarantined, plus programs declared
nondeterministic, over those two jobs. `--only-random` runs only those two jobs.

`--mode local_sgd` runs every job as local SGD (H = 12 inner steps, or --inner-steps, of 24
samples a round, SGD with momentum kept across rounds, outer Nesterov lr 0.5, momentum 0.5:
DiLoCo's 0.7 / 0.9 diverges on this model with so few inner steps; the mixed job: micro-
batches of 8, int8 pseudo-gradients): the checks recompute a chunk of inner steps from its
uploaded start state. A chunk is at least one step: a part a time box cut to T < 12 steps
costs a check 1/T of it. `--mode ring` runs
every job as synchronous ring rounds (the agents with `--peer-listen`; the mixed job: micro-
batches of 16 and the int8 wire codec): a member's chunks are recomputed from the start
parameters it uploads, checked against the checksum its ring agreed on; a sixth cheat,
`contribution` (honest chunks, 100 x its contribution into the all-reduce), meets the round's
audit of every member's reduce-scatter. `--mode ring_local_sgd`: local SGD rounds (as
`--mode local_sgd`, but H = 24: a part of 24 chunks gets two checkers at once) in a ring: a
member's chunk of inner steps is recomputed from the start state it uploads with the round's
start parameters, and the six cheats as in `--mode ring`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos import applied, write_job  # noqa: E402
from local_cluster import LocalCluster, wait_for  # noqa: E402

from epochmesh.v1 import (  # noqa: E402
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger("bench_verify")
JS = common_pb2.JobState
NS = common_pb2.NodeState
CHEATS = ("scaled", "flipped", "random", "lazy", "stale")
HONEST = {"h1": "1", "h2": "1.5", "h3": "2", "h4": "3"}  # name -> --slowdown
CHEAT_FROM = 4
# Per mode: the global batch (per inner step in local SGD), lines of the [train] table of every
# job, and those of the mixed job.
MODES = {
    "sync": (240, "", 'micro_batch = 16\ncompression = "int8"'),
    "ring": (240, "", 'micro_batch = 16\ncompression = "int8"'),
    "local_sgd": (
        24,
        'sync = "local_sgd"\ninner_steps = 12\nouter_lr = 0.5\nouter_momentum = 0.5',
        'micro_batch = 8\ncompression = "int8"',
    ),
}
MODES["ring_local_sgd"] = MODES["local_sgd"]
RING_MODES = ("ring", "ring_local_sgd")
# Inner steps per round (--inner-steps overrides). Local SGD in a ring: H = 24, so that a part
# has 24 chunks and the chunk drawn goes to two checkers at once, as a synchronous ring part's
# (with fewer, one at a time: a mismatch then waits a ring round for its second checker).
INNER_STEPS = {"local_sgd": 12, "ring_local_sgd": 24}
# The conv net with random draws: dropout, uniform noise, a random feature order.
RANDOM_MODEL = """
import torch
from torch import nn


class Noise(nn.Module):
    def forward(self, x):
        x = x + 0.05 * (torch.rand_like(x) - 0.5)
        return x[:, torch.randperm(x.shape[1])]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Dropout(0.2), nn.Conv2d(32, 32, 3, padding=1),
        nn.Tanh(), nn.Flatten(), Noise(), nn.Dropout(0.3), nn.Linear(32 * 12 * 12, 4),
    )
"""


class Bench:
    def __init__(self, cluster: LocalCluster, work: Path, mode: str, inner_steps: int) -> None:
        self.cluster = cluster
        self.work = work
        self.global_batch, extra, self.mixed_extra = MODES[mode]
        if mode in INNER_STEPS:
            inner_steps = inner_steps or INNER_STEPS[mode]
            extra = extra.replace(
                f"inner_steps = {INNER_STEPS['local_sgd']}", f"inner_steps = {inner_steps}"
            )
        self.extra = extra
        self.aggregation = "ring" if mode in RING_MODES else "ps"
        # Samples a round trains (every inner step's global batch in local SGD).
        self.per_round = self.global_batch * (inner_steps if mode in INNER_STEPS else 1)
        channel = cluster.operator_channel()
        self.jobs = job_pb2_grpc.JobServiceStub(channel)
        self.sched = scheduler_pb2_grpc.SchedulerServiceStub(channel)

    def nodes(self) -> dict[str, common_pb2.NodeInfo]:
        reply = self.sched.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10)
        return {n.name: n for n in reply.nodes}

    def job(self, job_id: str) -> common_pb2.Job:
        return self.jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), timeout=10)

    def rounds(self, job_id: str, rolled_back: bool = False) -> list[common_pb2.RoundRecord]:
        req = job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=rolled_back)
        return list(self.jobs.GetRounds(req, timeout=10).rounds)

    def events(self, job_id: str) -> list[common_pb2.Event]:
        req = job_pb2.GetJobEventsRequest(job_id=job_id)
        return list(self.jobs.GetJobEvents(req, timeout=10).events)

    def wait_ready(self, names: list[str]) -> None:
        def ready() -> bool:
            nodes = self.nodes()
            return all(n in nodes and nodes[n].benchmark.samples_per_second > 0 for n in names)

        wait_for(ready, 120, f"agents {names} ready", interval=0.3)

    def run_job(
        self,
        name: str,
        samples: int,
        epochs: int,
        seed: int,
        on_poll: Callable[[], None] = lambda: None,
        train_extra: str = "",
        model: str = "",
    ) -> tuple[str, Path]:
        job_dir = self.work / "jobs" / name
        toml = write_job(
            job_dir,
            name=name,
            samples=samples,
            epochs=epochs,
            global_batch=self.global_batch,
            seed=seed,
            min_nodes=5,  # every job starts on all five (the cheater from its first round)
            max_nodes=5,
            checkpoint_every=10,
            train_extra="\n".join(x for x in (self.extra, train_extra) if x),
            aggregation=self.aggregation,
        )
        if model:
            (job_dir / "model.py").write_text(model)
        out = self.cluster.cli("submit", str(toml), "--output", "json")
        job_id = str(json.loads(out)["job_id"])

        def done() -> bool:
            on_poll()
            job = self.job(job_id)
            if job.state in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED):
                raise RuntimeError(f"job {name} ended {job.state}: {job.message}")
            return job.state == JS.JOB_STATE_SUCCEEDED

        wait_for(done, 900, f"job {name} succeeded", interval=0.5)
        return job_id, job_dir

    def result_loss(self, job_id: str, job_dir: Path) -> float:
        """The downloaded result's mean loss over the whole dataset."""
        out = job_dir / "result"
        self.cluster.cli("download", job_id, "-o", str(out))
        spec = importlib.util.spec_from_file_location(f"m_{job_id}", job_dir / "model.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.make_model()
        model.load_state_dict(load_file(str(out / "model.safetensors")))
        data = load_file(str(job_dir / "train.safetensors"))
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(data["x"]), data["y"]))

    def summary(self, job_id: str) -> dict[str, str]:
        found = [e for e in self.events(job_id) if e.kind == "job.verification"]
        return dict(found[-1].attrs) if found else {}


def exactly_once(rounds: list[common_pb2.RoundRecord], samples: int, epochs: int) -> bool:
    seen: dict[int, list[int]] = defaultdict(list)
    for r in rounds:
        for p in applied(r):
            seen[r.epoch].extend(i for x in p.ranges for i in range(x.start, x.stop))
    return sorted(seen) == list(range(epochs)) and all(
        sorted(v) == list(range(samples)) for v in seen.values()
    )


def cheated_rounds(log_path: Path) -> list[int]:
    """The rounds a cheating agent's log says it cheated in (node_agent.testing.cheat.note_cheat: a
    stale cheater with no fitting earlier part, say, sends an honest part)."""
    if not log_path.exists():
        return []
    found = re.findall(r"test cheat \w+: round (\d+) cheated", log_path.read_text(errors="replace"))
    return sorted({int(r) for r in found})


def rounds_to_quarantine(bench: Bench, job_id: str, node_id: str, cheated: list[int]) -> int | None:
    """Rounds of the job closed from the cheater's first cheated round (``cheated``: what its
    log says; without it, its first part from CHEAT_FROM on; rolled-back rounds count) until its
    quarantine (None: never caught)."""
    caught = [
        e for e in bench.events(job_id) if e.kind == "node.quarantined" and e.node_id == node_id
    ]
    rounds = bench.rounds(job_id, rolled_back=True)
    mine = [
        r.round
        for r in rounds
        if r.round >= CHEAT_FROM and any(p.node_id == node_id for p in r.parts)
    ]
    if not caught or not mine:
        return None
    at, first = caught[0].time_ms, min(cheated) if cheated else min(mine)
    return sum(1 for r in rounds if r.round >= first and r.finished_ms <= at)


def run_cheat(
    bench: Bench,
    cluster: LocalCluster,
    cheat: str,
    args: argparse.Namespace,
    peer: list[str],
    model: str = "",
    label: str = "",
) -> dict[str, Any]:
    """The job once with a fresh agent cheating ``cheat``-wise from round CHEAT_FROM on (the
    spare joins once it is quarantined): how fast it was caught, what it cost."""
    label = label or cheat
    name = f"cheat-{label}"
    cluster.start_agent(
        name, "--slowdown", "1", *peer, env={"EPOCHMESH_TEST_CHEAT": f"{cheat}:{CHEAT_FROM}"}
    )
    bench.wait_ready([name])
    node_id = bench.nodes()[name].node_id
    spare: list[bool] = []

    def replace_the_cheater() -> None:
        """The job needs five nodes: once the cheater is quarantined, the spare joins in its
        place."""
        if not spare and bench.nodes()[name].state == NS.NODE_STATE_QUARANTINED:
            cluster.start_agent("spare", "--slowdown", "1", *peer)
            spare.append(True)

    job_id, job_dir = bench.run_job(
        label, args.samples, args.epochs, seed=7, on_poll=replace_the_cheater, model=model
    )
    loss = bench.result_loss(job_id, job_dir)
    cheater = bench.nodes()[name]
    out = {
        "rounds_to_quarantine": rounds_to_quarantine(
            bench, job_id, node_id, cheated_rounds(bench.work / f"agent-{name}.log")
        ),
        "quarantined": cheater.state == NS.NODE_STATE_QUARANTINED,
        "loss": loss,
        "exactly_once": exactly_once(bench.rounds(job_id), args.samples, args.epochs),
        "nondeterministic": nondeterministic(bench, job_id),
        "verification": bench.summary(job_id),
    }
    log.info("%s: %s", label, out)
    cluster.agents[name].terminate()
    if spare:
        cluster.agents["spare"].terminate()
        cluster.agents["spare"].wait()
    return out


def nondeterministic(bench: Bench, job_id: str) -> int:
    """The job's programs declared nondeterministic (job.nondeterministic events)."""
    return sum(1 for e in bench.events(job_id) if e.kind == "job.nondeterministic")


def false_accusations(nodes: dict[str, common_pb2.NodeInfo]) -> int:
    """Honest nodes struck, with a failed check, or quarantined."""
    return sum(
        1
        for n in HONEST
        if nodes[n].strikes > 0
        or nodes[n].reputation.failed_total > 0
        or nodes[n].state == NS.NODE_STATE_QUARANTINED
    )


def random_stage(
    bench: Bench, cluster: LocalCluster, args: argparse.Namespace, peer: list[str]
) -> dict[str, Any]:
    """An honest job of RANDOM_MODEL on all five nodes, then the flipped cheat on it."""
    random_id, _ = bench.run_job(
        "random", args.random_rounds * bench.per_round, 1, seed=3, model=RANDOM_MODEL
    )
    honest = bench.summary(random_id)
    log.info("random-draws job: %s", honest)
    undecidable = nondeterministic(bench, random_id)
    cluster.agents["spare"].terminate()
    cluster.agents["spare"].wait()
    cheat = run_cheat(bench, cluster, "flipped", args, peer, RANDOM_MODEL, "random-flipped")
    return {
        "random_job": honest,
        "random_checked_samples": sum(
            int(honest.get(f"recomputed_{s}") or 0) for s in ("new", "building", "trusted")
        ),
        "random_passed": int(honest.get("passed") or 0),
        "random_cheat": cheat,
        "random_false_accusations": false_accusations(bench.nodes())
        + undecidable
        + cheat["nondeterministic"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1920)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--trust-rounds",
        type=int,
        default=320,
        help="rounds of the honest job that builds the records (trusted after ~50 verified)",
    )
    parser.add_argument(
        "--mixed-rounds",
        type=int,
        default=80,
        help="rounds of an honest job with micro-batches and int8 updates",
    )
    parser.add_argument(
        "--random-rounds",
        type=int,
        default=40,
        help="rounds of the honest job of a model with dropout, noise and a random permutation",
    )
    parser.add_argument(
        "--only-random",
        action="store_true",
        help="run only the random model's honest job and its flipped cheat",
    )
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--mode", choices=sorted(MODES), default="sync")
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=0,
        help="local SGD modes: inner steps per round (default 12, in a ring 24)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    started = time.monotonic()
    with LocalCluster(work) as cluster:
        cluster.start_coordinator("--heartbeat-interval", "1.0")
        cluster.login()
        # Ring members serve their peers (mutual TLS with their node certificates).
        peer = ["--peer-listen", "127.0.0.1:0"] if args.mode in RING_MODES else []
        for name, slow in HONEST.items():
            cluster.start_agent(name, "--slowdown", slow, *peer)
        cluster.start_agent("spare", "--slowdown", "1", *peer)
        bench = Bench(cluster, work, args.mode, args.inner_steps)
        bench.wait_ready([*HONEST, "spare"])
        if args.only_random:
            random = random_stage(bench, cluster, args, peer)
            nodes = bench.nodes()
            result = {
                "mode": args.mode,
                "inner_steps": bench.per_round // bench.global_batch,
                **random,
                "false_accusations": false_accusations(nodes),
                "honest_node_rounds": sum(nodes[n].parts_applied for n in HONEST),
                "seconds": round(time.monotonic() - started, 1),
            }
            print(json.dumps(result))
            return 0

        trust_samples = args.trust_rounds * bench.per_round // 2
        trust_id, _ = bench.run_job("trust", trust_samples, 2, seed=1)
        trust = bench.summary(trust_id)
        log.info("trust-building job: %s", trust)
        # Honest rounds of another shape: micro-batches and int8 updates (their sketches are
        # checked against the codec's tolerance).
        mixed_id, _ = bench.run_job(
            "mixed", args.mixed_rounds * bench.per_round, 1, seed=2, train_extra=bench.mixed_extra
        )
        mixed = bench.summary(mixed_id)
        log.info("micro-batch int8 job: %s", mixed)
        clean_id, clean_dir = bench.run_job("clean", args.samples, args.epochs, seed=7)
        clean_loss = bench.result_loss(clean_id, clean_dir)
        clean = bench.summary(clean_id)
        log.info("clean job: loss %.5f, %s", clean_loss, clean)
        # The same clean job again: how far two honest runs of it land apart (the split by
        # measured speed and, in local SGD, the time boxes make every run's rounds different):
        # the noise a cheat job's loss_over_clean is read against.
        again_id, again_dir = bench.run_job("clean-again", args.samples, args.epochs, seed=7)
        clean_again = bench.result_loss(again_id, again_dir) / clean_loss
        log.info("clean job again: loss over the first %.4f", clean_again)
        random = random_stage(bench, cluster, args, peer)

        cheats: dict[str, dict[str, Any]] = {}
        # Ring members also cheat in what they put into the all-reduce (their ring audit).
        for cheat in (*CHEATS, "contribution") if args.mode in RING_MODES else CHEATS:
            cheats[cheat] = run_cheat(bench, cluster, cheat, args, peer)
            cheats[cheat]["loss_over_clean"] = cheats[cheat].pop("loss") / clean_loss

        nodes = bench.nodes()
        false = false_accusations(nodes)
        node_rounds = sum(nodes[n].parts_applied for n in HONEST)

    def overhead(summaries: list[dict[str, str]], standing: str) -> float | None:
        """Samples recomputed over samples trained by nodes of that standing, summed over
        the jobs given (a trusted node is checked in a fifth of its rounds: the more rounds,
        the steadier the figure)."""
        trained = sum(int(s.get(f"trained_{standing}") or 0) for s in summaries)
        recomputed = sum(int(s.get(f"recomputed_{standing}") or 0) for s in summaries)
        return round(recomputed / trained, 4) if trained else None

    caught = [c["rounds_to_quarantine"] for c in cheats.values()]
    result = {
        "mode": args.mode,
        "inner_steps": bench.per_round // bench.global_batch,
        "cheats": cheats,
        "max_rounds_to_quarantine": None if None in caught else max(caught),
        "max_loss_over_clean": max(c["loss_over_clean"] for c in cheats.values()),
        # New: the honest nodes' first rounds (the cheat jobs' "new" figures include the
        # third-node re-checks spent on the cheaters). Trusted: every job.
        "overhead_new": overhead([trust], "new"),
        "overhead_trusted": overhead(
            [trust, mixed, clean, *(c["verification"] for c in cheats.values())], "trusted"
        ),
        "false_accusations": false,
        "honest_node_rounds": node_rounds,
        "clean_loss": clean_loss,
        "clean_again_over_clean": clean_again,
        "trust_job": trust,
        "mixed_job": mixed,
        **random,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
