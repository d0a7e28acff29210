"""Recovery times of a running job, measured on a local cluster of real processes.

Starts a coordinator and N agents (scripts/chaos.py's FaultCluster, TLS on), submits a long job, and
measures, several times each:

- agent kill: `kill -9` of a random agent at a random moment of a round, to the completion of
  the first round that did without it (closed early because the node fell silent, at its
  deadline, or planned without it). Target: at most two heartbeat intervals. Also: kill to
  OFFLINE (the lease lapsing), and the restarted agent's way back (restart on the same data dir
  to its first applied part: registration, benchmark on the job, first round);
- coordinator restart: `kill -9` of the coordinator, then a restart on the same data dir, to
  the next completed round (process start, restore from the checkpoint, agents reconnecting by
  themselves, the round). Target: at most 15 s. Also: restart to serving (health check).

Prints one JSON line with the medians, every sample, and the heartbeat interval used:

    .venv/bin/python scripts/bench_recovery.py [--heartbeat-interval 2.0] [--agent-kills 5]
                                               [--coordinator-restarts 3] [--agents 3]

With ``--standby``: a PostgreSQL server of its own (tests/pg.py), two coordinators on one
database and one blob dir (the second a standby), agents given both addresses and a job; `kill
-9` of the active, then one JSON line: ``takeover_s`` (the kill to the next applied round, on
the standby now active), ``serving_s`` (the kill to the standby's health SERVING),
``lost_samples`` and ``duplicated_samples`` (over every epoch of the finished job: samples no
applied part covered, and applications beyond the first):

    .venv/bin/python scripts/bench_recovery.py --standby [--agents 2] [--samples 384]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/ for --standby

from chaos import JS, NS, FaultCluster, applied, wait_for, write_job  # noqa: E402

from epochmesh.v1 import common_pb2  # noqa: E402

log = logging.getLogger("bench_recovery")


def steady_round(cluster: FaultCluster, job_id: str, after_ms: int, nodes: set[str]) -> None:
    """Until a round finished after ``after_ms`` has an applied part from each of ``nodes``."""

    def full() -> bool:
        rounds = cluster.try_read(lambda: cluster.rounds(job_id)) or []
        return any(
            r.finished_ms > after_ms and nodes <= {p.node_id for p in applied(r)} for r in rounds
        )

    wait_for(full, 120, "a round with every agent", interval=0.05)


def round_without(
    rounds: list[common_pb2.RoundRecord], node_id: str, t_ms: int
) -> common_pb2.RoundRecord | None:
    later = [
        r
        for r in rounds
        if r.finished_ms > t_ms and applied(r) and all(p.node_id != node_id for p in applied(r))
    ]
    return min(later, key=lambda r: r.finished_ms, default=None)


def node_state(cluster: FaultCluster, node_id: str) -> int:
    return next((n.state for n in cluster.nodes() if n.node_id == node_id), 0)


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument(
        "--slowdowns", type=float, nargs="+", default=None, help="per agent (default 4, 6, 8, ...)"
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=2.0,
        help="the coordinator's heartbeat interval (its default is 2 s)",
    )
    p.add_argument("--agent-kills", type=int, default=5)
    p.add_argument("--coordinator-restarts", type=int, default=3)
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", type=Path, help="keep logs and data in DIR")
    p.add_argument(
        "--standby",
        action="store_true",
        help="measure a standby coordinator's takeover on PostgreSQL instead (see above)",
    )
    p.add_argument("--epochs", type=int, default=2, help="--standby: the job's epochs")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s bench: %(message)s", stream=sys.stderr
    )
    if args.standby:
        return standby_takeover(args)
    slowdowns = args.slowdowns or [4.0 + 2 * i for i in range(args.agents)]
    root = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    hb = args.heartbeat_interval
    cluster = FaultCluster(root, hb, slowdowns)
    kill_to_round: list[float] = []
    kill_to_offline: list[float] = []
    rejoin: list[float] = []
    restart_to_round: list[float] = []
    restart_to_serving: list[float] = []
    try:
        cluster.boot_coordinator()
        cluster.login()
        for i in range(args.agents):
            cluster.start_agent_i(i)
        cluster.wait_agents_ready()
        job_toml = write_job(
            root / "job",
            name="recovery",
            samples=args.samples,
            epochs=10_000,  # runs until cancelled
            global_batch=args.global_batch,
            checkpoint_every=args.checkpoint_every,
        )
        job_id = cluster.submit(job_toml)
        all_ids = {cluster.node_id(i) for i in range(args.agents)}
        mark = 0

        for k in range(args.agent_kills):
            steady_round(cluster, job_id, mark, all_ids)
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the round in progress
            i = rng.randrange(args.agents)
            node = cluster.node_id(i)
            kill_ms = int(time.time() * 1000)
            t_kill = time.monotonic()
            cluster.kill_agent(i)
            r = wait_for(
                lambda: round_without(cluster.rounds(job_id), node, kill_ms),  # noqa: B023
                60,
                "a round without the killed agent",
                interval=0.02,
            )
            kill_to_round.append((r.finished_ms - kill_ms) / 1000)
            wait_for(
                lambda: node_state(cluster, node) == NS.NODE_STATE_OFFLINE,  # noqa: B023
                60,
                "the killed node OFFLINE",
                interval=0.05,
            )
            kill_to_offline.append(time.monotonic() - t_kill)
            restart_ms = int(time.time() * 1000)
            t_restart = time.monotonic()
            cluster.start_agent_i(i)
            steady_round(cluster, job_id, restart_ms, {node})
            rejoin.append(time.monotonic() - t_restart)
            mark = int(time.time() * 1000)
            log.info(
                "agent kill %d: round without it after %.2fs, OFFLINE after %.2fs, "
                "back in a round %.2fs after its restart",
                k + 1,
                kill_to_round[-1],
                kill_to_offline[-1],
                rejoin[-1],
            )

        for k in range(args.coordinator_restarts):
            steady_round(cluster, job_id, mark, all_ids)
            time.sleep(rng.uniform(0.0, 0.3))
            cluster.kill_coordinator()
            restart_ms = int(time.time() * 1000)
            serving = cluster.boot_coordinator()
            r = wait_for(
                lambda: [
                    x
                    for x in (cluster.try_read(lambda: cluster.rounds(job_id)) or [])
                    if x.finished_ms > restart_ms  # noqa: B023
                ],
                120,
                "a round after the coordinator restart",
                interval=0.02,
            )
            first = min(x.finished_ms for x in r)
            restart_to_round.append((first - restart_ms) / 1000)
            restart_to_serving.append(serving)
            mark = int(time.time() * 1000)
            log.info(
                "coordinator restart %d: serving after %.2fs, next round after %.2fs",
                k + 1,
                serving,
                restart_to_round[-1],
            )

        job = cluster.job(job_id)
        state = JS.Name(job.state).removeprefix("JOB_STATE_").lower()
        if state in ("running", "paused", "queued"):
            cluster.cli("cancel", job_id)
        result: dict[str, Any] = {
            "heartbeat_interval_s": hb,
            "job_state": state,
            "lease_ttl_s": 3 * hb,
            "agents": args.agents,
            "slowdowns": slowdowns,
            "agent_kill_to_next_round_s": median(kill_to_round),
            "agent_kill_to_next_round_target_s": 2 * hb,
            "agent_kill_to_offline_s": median(kill_to_offline),
            "agent_restart_to_applied_part_s": median(rejoin),
            "coordinator_restart_to_next_round_s": median(restart_to_round),
            "coordinator_restart_to_next_round_target_s": 15.0,
            "coordinator_restart_to_serving_s": median(restart_to_serving),
            "samples": {
                "agent_kill_to_next_round_s": [round(x, 3) for x in kill_to_round],
                "agent_kill_to_offline_s": [round(x, 3) for x in kill_to_offline],
                "agent_restart_to_applied_part_s": [round(x, 3) for x in rejoin],
                "coordinator_restart_to_next_round_s": [round(x, 3) for x in restart_to_round],
                "coordinator_restart_to_serving_s": [round(x, 3) for x in restart_to_serving],
            },
        }
        print(json.dumps(result), flush=True)
        return 0
    finally:
        cluster.stop()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log.info("logs and data kept in %s", root)


def coverage(rounds: list[common_pb2.RoundRecord], n: int, epochs: int) -> tuple[int, int]:
    """(samples lost, applications beyond the first) over the job's epochs."""
    counts = [[0] * n for _ in range(epochs)]
    for r in rounds:
        for part in applied(r):
            for rng in part.ranges:
                for i in range(rng.start, rng.stop):
                    counts[r.epoch][i] += 1
    lost = sum(1 for epoch in counts for c in epoch if c == 0)
    duplicated = sum(c - 1 for epoch in counts for c in epoch if c > 1)
    return lost, duplicated


def standby_takeover(args: argparse.Namespace) -> int:
    """``--standby``: see the module docstring."""
    import os

    from tests.pg import PgServer, find_bin_dir
    from tests.procs import free_port, token_for
    from tests.system.test_agent import AgentProc
    from tests.system.test_coordinator_failover import (
        SharedCluster,
        start_standby,
        stop,
        wait_serving,
    )
    from tests.system.test_fault_tolerance import job_doc

    bin_dir = find_bin_dir()
    if bin_dir is None:
        log.error("--standby needs PostgreSQL's programs (initdb, pg_ctl, postgres, psql)")
        return 2
    slowdowns = args.slowdowns or [2.0 + i for i in range(args.agents)]
    root = args.keep or Path(tempfile.mkdtemp(prefix="epochmesh-standby-"))
    root.mkdir(parents=True, exist_ok=True)
    server = PgServer(bin_dir).start()
    cluster: SharedCluster | None = None
    standby = None
    try:
        url = server.url(server.create_database())
        os.environ["EPOCHMESH_STORE"] = url  # the helpers' `token create`
        cluster = SharedCluster(root, url)
        first, second = cluster.address, f"127.0.0.1:{free_port()}"
        standby = start_standby(root / "coord2", second, url, root / "blobs")
        names = [f"a{i}" for i in range(args.agents)]
        for name, slowdown in zip(names, slowdowns, strict=False):
            token = token_for(first, "node")
            assert token
            cluster.agents[name] = AgentProc(
                f"{first},{second}",
                root / f"agent-{name}",
                "--name",
                name,
                "--slowdown",
                f"{slowdown:g}",
                "--token",
                token,
            )
        cluster.wait_ready(names, timeout=180)
        n, epochs, every = args.samples, args.epochs, args.checkpoint_every
        doc = job_doc("standby", epochs=epochs, checkpoint_every=every)
        job_id = cluster.submit(root / "job", doc, n)
        cluster.wait_rounds(
            job_id,
            lambda rs: sum(1 for r in rs if applied(r)) >= every + 2,
            timeout=240,
            what="rounds past the first checkpoint",
        )
        killed_ms = int(time.time() * 1000)
        cluster.coord.kill9()
        serving_s = wait_serving(second, "the standby never became active")
        cluster.point_at(second)
        after = cluster.wait_rounds(
            job_id,
            lambda rs: [r for r in rs if r.finished_ms > killed_ms and applied(r)],
            timeout=240,
            what="a round after the takeover",
        )
        takeover_s = (min(r.finished_ms for r in after) - killed_ms) / 1000
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=600)
        lost, duplicated = coverage(cluster.rounds(job_id), n, epochs)
        result: dict[str, Any] = {
            "takeover_s": round(takeover_s, 3),
            "serving_s": round(serving_s, 3),
            "lost_samples": lost,
            "duplicated_samples": duplicated,
            "agents": args.agents,
            "samples": n,
            "epochs": epochs,
            "checkpoint_every": every,
            "heartbeat_interval_s": 0.5,
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(result), flush=True)
        return 0
    finally:
        if cluster is not None:
            cluster.stop()
        if standby is not None:
            stop(standby)
        server.stop()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log.info("logs and data kept in %s", root)


if __name__ == "__main__":
    sys.exit(main())
