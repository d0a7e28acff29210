#!/usr/bin/env python3
"""Control-plane benchmark: one coordinator process, N simulated agents heartbeating.

    .venv/bin/python scripts/bench_control_plane.py [--agents 2000] [--interval 5] [--duration 30]
        [--store postgresql | --store postgresql://USER@HOST:PORT/DB] [--profile FILE]

Starts `epochmesh-coordinator` on a fresh data dir and port, then client processes (asyncio,
grpc.aio) that register the agents (each agent on its own connection by default); like real
agents, each heartbeats from its registration on, at its own random phase, at the interval the
coordinator gave in its last answer: --interval (the coordinator's --heartbeat-interval) until
the fleet would heartbeat more often than the coordinator's --max-heartbeats-per-second, then
stretched to stay within it (pass that flag with --coordinator-arg; --fixed-interval makes the
agents ignore the answers: the load a fleet that did not follow would put on it). Once all are
registered, --duration seconds are measured. Prints one JSON line:

  agents, heartbeats, heartbeats_per_s, p50_ms, p99_ms, max_ms, errors, error_codes (errors
  by status code: FAILED_PRECONDITION is a lease that lapsed; such an agent registers again
  as the same node, like a real one), registered (agents registered when the window began:
  after --register-timeout the bench measures anyway),
  coordinator_cpu_s_per_1000_heartbeats (user+system CPU of the coordinator process during the
  measured window, per 1000 heartbeats), duration_s, register_s, client_processes, store
  ("sqlite" or "postgresql"), client_nice, coordinator_cores (--pin-coordinator), interval_s,
  told_interval_s (the median interval the agents heartbeat at by the end), fixed_interval

The store is SQLite in the data dir by default. ``--store postgresql`` (the word alone) starts a
throwaway PostgreSQL server of the bench's own (tests/pg.py: durability off, as in the tests)
and a fresh database on it; ``--store postgresql://...`` uses that database as it is.
``--profile FILE`` records the coordinator with py-spy (when it is installed: it is no
dependency of the project) during the measured window and writes its flame-graph input
(collapsed stacks) to FILE.

Latency is the agent's view: from issuing Heartbeat to the response. The load generator runs on
the same machine and competes with the coordinator for CPU; its CPU per 1000 heartbeats is
reported too, and so is the busy CPU of everything else on the machine during the window
(foreign_cores), and the CPU the hypervisor withheld from this virtual machine (steal_cores):
tail latencies on a machine where other work takes cores are that work's, not the
coordinator's; compare runs at similar foreign_cores. The load generators run niced
(--client-nice, default 10; reported as client_nice): on a shared machine the kernel would
otherwise take the coordinator's thread off a core for tens of milliseconds in favour of the
generators' (a production coordinator has its machine to itself); they still get every cycle
the coordinator leaves (it uses well under one of two cores at 500 heartbeats a second).
``--pin-coordinator`` goes further: the coordinator alone on the first core, the load
generators, the bench and its PostgreSQL server on the others (reported as coordinator_cores),
the nearest this machine comes to a load generator on another machine.

TLS is on, as in production: the bench enrolls one operator identity with a real join token
(`epochmesh-coordinator token create`) and every simulated agent calls with it (an operator may
act as any node), so each heartbeat pays the TLS record layer and the per-call certificate
and signature check (epochmesh.identity.secure_aio_channel: the call credentials are added by a
client interceptor, a method's signature is reused for a minute, and the coordinator checks a
signature it has verified before with a lookup). `--insecure` measures plaintext instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.identity import (
    Identity,
    channel_credentials,
    coordinator_channel_options,
    enroll_with_token,
    secure_aio_channel,
)
from epochmesh.v1 import agent_pb2, agent_pb2_grpc

# -- client worker (a subprocess of the bench) ------------------------------------------------


def _progress(message: str) -> None:
    print(f"bench_control_plane: {message}", file=sys.stderr, flush=True)


async def run_worker(args: argparse.Namespace) -> None:
    """Register ``args.agents`` agents, say READY, wait for the start time on stdin, heartbeat
    until the end time, print the latencies (ms) as one JSON line."""
    n = args.agents
    n_channels = min(n, args.connections) if args.connections > 0 else n
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    if args.identity_dir:
        identity = Identity.load(Path(args.identity_dir))
        channels = [secure_aio_channel(args.address, identity, options) for _ in range(n_channels)]
    else:
        channels = [
            grpc.aio.insecure_channel(args.address, options=options) for _ in range(n_channels)
        ]
    stubs = [agent_pb2_grpc.AgentServiceStub(ch) for ch in channels]
    leases: list[tuple[str, str]] = [("", "")] * n
    # The interval each agent heartbeats at: the coordinator's answer to its last Register or
    # Heartbeat, as a real agent does (the coordinator stretches it past its heartbeat rate
    # limit), or --interval throughout with --fixed-interval.
    intervals: list[float] = [args.interval] * n
    sem = asyncio.Semaphore(64)

    def follow(i: int, told_ms: int) -> None:
        if told_ms > 0 and not args.fixed_interval:
            intervals[i] = told_ms / 1000.0

    async def register(i: int, node_id: str = "") -> None:
        async with sem:
            req = agent_pb2.RegisterRequest(
                name=f"{args.prefix}-{i}", agent_version="bench", node_id=node_id
            )
            req.devices.add(kind="cpu", index=0, cores=1)
            resp = await stubs[i % n_channels].Register(req, timeout=60)
            leases[i] = (resp.node_id, resp.lease_id)
            follow(i, resp.heartbeat_interval_ms)

    latencies: list[float] = []
    errors = 0
    register_failures = 0
    codes: dict[str, int] = {}  # status code -> errors in the window
    rng = random.Random(args.seed)
    # Measurement window (wall clock), set by the driver once every agent is registered.
    window = [float("inf"), float("inf")]
    stop = asyncio.Event()

    async def agent_loop(i: int) -> None:
        """Like a real agent: heartbeat every interval from registration on, at its own
        phase; only heartbeats sent inside the window are measured."""
        nonlocal errors, register_failures
        for attempt in range(5):
            try:
                await register(i)
                break
            except grpc.aio.AioRpcError as exc:
                _progress(f"{args.prefix}-{i}: Register failed ({exc.code().name}), again")
                await asyncio.sleep(1.0 + attempt)
        else:
            register_failures += 1
            leases[i] = ("", "failed")
            return
        node_id, lease_id = leases[i]
        stub = stubs[i % n_channels]
        req = agent_pb2.HeartbeatRequest(node_id=node_id, lease_id=lease_id)
        next_at = time.time() + rng.uniform(0, intervals[i])
        while True:
            delay = next_at - time.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except TimeoutError:
                    pass
            now = time.time()
            if stop.is_set() or now >= window[1]:
                return
            measured = now >= window[0]
            sent = time.perf_counter()
            try:
                answer = await stub.Heartbeat(req, timeout=10)
                follow(i, answer.heartbeat_interval_ms)
                if measured:
                    latencies.append((time.perf_counter() - sent) * 1000.0)
            except grpc.aio.AioRpcError as exc:
                if measured:
                    errors += 1
                    codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # The lease lapsed (the coordinator fell behind): like a real agent,
                    # register again, as the same node.
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await register(i, node_id)
                        req = agent_pb2.HeartbeatRequest(
                            node_id=leases[i][0], lease_id=leases[i][1]
                        )
            next_at += intervals[i]

    t0 = time.monotonic()
    agents = [asyncio.create_task(agent_loop(i)) for i in range(n)]
    reported = t0
    deadline = t0 + args.register_timeout
    while (done := sum(1 for lease in leases if lease[0] or lease[1])) < n:
        if time.monotonic() > deadline:
            _progress(f"{args.prefix}: only {done}/{n} registered in {args.register_timeout:g} s")
            break
        if time.monotonic() - reported >= 10:
            reported = time.monotonic()
            _progress(f"{args.prefix}: {done}/{n} registered after {reported - t0:.0f} s")
        await asyncio.sleep(0.05)
    register_s = time.monotonic() - t0
    if register_failures:
        _progress(f"{args.prefix}: {register_failures} agents never registered")
    registered = sum(1 for lease in leases if lease[0])
    # This process stands for thousands of agents (each a process of its own in a real fleet):
    # what it built to register them is moved out of its collector's sight, so that full
    # collections over thousands of channels do not stall every agent's call at once and
    # count as the coordinator's latency.
    gc.collect()
    gc.freeze()
    print(
        json.dumps({"ready": True, "register_s": register_s, "registered": registered}),
        flush=True,
    )

    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    window[0], window[1] = map(float, line.split())
    await asyncio.sleep(max(0.0, window[1] - time.time()))
    stop.set()
    # Heartbeats in flight end within their timeout; agents still registering are stopped.
    _, pending = await asyncio.wait(agents, timeout=15)
    for task in pending:
        task.cancel()
    await asyncio.gather(*agents, return_exceptions=True)
    for ch in channels:
        await ch.close()
    told = statistics.median(intervals) if intervals else args.interval
    print(
        json.dumps({"latencies": latencies, "errors": errors, "codes": codes, "told_s": told}),
        flush=True,
    )


# -- the bench driver -------------------------------------------------------------------------


def _start_postgres() -> tuple[Any, str]:
    """A throwaway PostgreSQL server (tests/pg.py) and the URL of a fresh database on it."""
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/
    from tests.pg import PgServer, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise SystemExit(
            "bench_control_plane: --store postgresql needs PostgreSQL's programs "
            "(initdb, pg_ctl, postgres, psql)"
        )
    server = PgServer(bin_dir).start()
    try:
        return server, server.url(server.create_database())
    except BaseException:
        server.stop()
        raise


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _busy_s() -> float:
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def _steal_s() -> float:
    """CPU time the hypervisor gave to other virtual machines while this one wanted it."""
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def _health_channel(address: str, ca_file: Path | None) -> grpc.Channel:
    if ca_file is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(
        address, channel_credentials(ca_file.read_bytes()), options=coordinator_channel_options()
    )


def wait_for_coordinator(
    proc: subprocess.Popen[bytes], addr_file: Path, timeout: float, ca_file: Path | None
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}")
        if (
            addr_file.exists()
            and (address := addr_file.read_text().strip())
            and (ca_file is None or ca_file.exists())
        ):
            with _health_channel(address, ca_file) as ch:
                try:
                    resp = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=1
                    )
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return address
                except grpc.RpcError:
                    pass
        time.sleep(0.05)
    raise RuntimeError("coordinator did not start in time")


def _pinned_cores(args: argparse.Namespace) -> tuple[set[int], set[int]] | None:
    """With --pin-coordinator: (the coordinator's cores, everything else's), else None."""
    cores = sorted(os.sched_getaffinity(0))
    if not args.pin_coordinator or len(cores) < 2:
        return None
    return {cores[0]}, set(cores[1:])


def run_bench(args: argparse.Namespace) -> dict[str, object]:
    pinned = _pinned_cores(args)
    if pinned is not None:
        # The bench, its PostgreSQL server and its load generators (children inherit it) on the
        # other cores; the coordinator alone on its own (set in its child before exec).
        os.sched_setaffinity(0, pinned[1])
    pg_server = None
    store_url = args.store
    if store_url == "postgresql":
        _progress("starting a PostgreSQL server")
        pg_server, store_url = _start_postgres()
    try:
        return _run_bench(args, store_url, pinned)
    finally:
        if pg_server is not None:
            pg_server.stop()


def _run_bench(
    args: argparse.Namespace, store_url: str, pinned: tuple[set[int], set[int]] | None
) -> dict[str, object]:
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="bench-cp-")) if own_dir else Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    coordinator_bin = Path(sys.executable).parent / "epochmesh-coordinator"
    log = open(data_dir / "coordinator-stderr.log", "ab")
    # `serve` and `token create` find the same database through the environment.
    env = {**os.environ, "EPOCHMESH_STORE": store_url}
    coord = subprocess.Popen(
        [
            str(coordinator_bin),
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
            "--heartbeat-interval",
            str(args.interval),
            "--log-level",
            "WARNING",
            *(["--insecure"] if args.insecure else []),
            *args.coordinator_arg,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, pinned[0])) if pinned else None,
    )
    workers: list[subprocess.Popen[str]] = []
    profiler: subprocess.Popen[bytes] | None = None
    try:
        ca_file = None if args.insecure else data_dir / "ca.pem"
        address = wait_for_coordinator(coord, data_dir / "coordinator.addr", 60, ca_file)
        identity_dir = ""
        if not args.insecure:
            token = subprocess.run(
                [
                    str(coordinator_bin),
                    "token",
                    "create",
                    "--data-dir",
                    str(data_dir),
                    "--role",
                    "operator",
                    "--log-level",
                    "WARNING",
                ],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            ).stdout.strip()
            identity_dir = str(data_dir / "bench-identity")
            enroll_with_token(address, token, name="bench").save(Path(identity_dir))
        per_worker = [args.agents // args.clients] * args.clients
        for i in range(args.agents % args.clients):
            per_worker[i] += 1
        for w, count in enumerate(per_worker):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--address",
                address,
                "--agents",
                str(count),
                "--interval",
                str(args.interval),
                *(["--fixed-interval"] if args.fixed_interval else []),
                "--connections",
                str(args.connections),
                "--prefix",
                f"bench{w}",
                "--seed",
                str(args.seed + w),
                "--register-timeout",
                str(args.register_timeout),
                "--identity-dir",
                identity_dir,
            ]
            workers.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=(lambda: os.nice(args.client_nice)) if args.client_nice else None,
                )
            )
        _progress(f"registering {args.agents} agents in {args.clients} client processes")
        register_s = 0.0
        registered = 0
        for worker in workers:
            assert worker.stdout is not None
            ready = json.loads(worker.stdout.readline())
            register_s = max(register_s, float(ready["register_s"]))
            registered += int(ready["registered"])

        cpu = psutil.Process(coord.pid)
        clients = [psutil.Process(w.pid) for w in workers]
        start = time.time() + 0.5
        end = start + args.duration
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write(f"{start} {end}\n")
            worker.stdin.flush()
        _progress(f"registered in {register_s:.1f} s; measuring {args.duration:g} s")
        if args.profile:
            profiler = _start_profiler(coord.pid, args.profile, args.duration)
        time.sleep(max(0.0, start - time.time()))
        cpu_start, clients_start, busy_start = cpu.cpu_times(), _cpu_s(clients), _busy_s()
        steal_start = _steal_s()
        time.sleep(max(0.0, end - time.time()))
        cpu_end, clients_end, busy_end = cpu.cpu_times(), _cpu_s(clients), _busy_s()
        steal = (_steal_s() - steal_start) / args.duration
        load = os.getloadavg()[0]

        latencies: list[float] = []
        errors = 0
        codes: dict[str, int] = {}
        told: list[float] = []
        for worker in workers:
            assert worker.stdout is not None
            result = json.loads(worker.stdout.readline())
            told.append(float(result["told_s"]))
            latencies.extend(result["latencies"])
            errors += int(result["errors"])
            for code, count in result["codes"].items():
                codes[code] = codes.get(code, 0) + int(count)
            worker.wait(timeout=60)
        cpu_s = (cpu_end.user - cpu_start.user) + (cpu_end.system - cpu_start.system)
        client_s = clients_end - clients_start
        # Busy CPU of the rest of the machine (other users' work) in the window, in cores.
        foreign = max(0.0, (busy_end - busy_start) - cpu_s - client_s) / args.duration
        if profiler is not None:
            profiler.wait(timeout=60)
        count = len(latencies)
        return {
            "agents": args.agents,
            "heartbeats": count,
            "heartbeats_per_s": round(count / args.duration, 1),
            "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "max_ms": round(max(latencies, default=float("nan")), 2),
            "errors": errors,
            "error_codes": codes,
            "coordinator_cpu_s_per_1000_heartbeats": round(cpu_s / count * 1000, 3)
            if count
            else None,
            "client_cpu_s_per_1000_heartbeats": round(client_s / count * 1000, 3)
            if count
            else None,
            "tls": not args.insecure,
            "foreign_cores": round(foreign, 2),
            "steal_cores": round(steal, 2),
            "load_avg_1m": round(load, 2),
            "duration_s": args.duration,
            "interval_s": args.interval,
            # the interval the agents heartbeat at by the end (the coordinator's answer)
            "told_interval_s": round(statistics.median(told), 2) if told else None,
            "fixed_interval": args.fixed_interval,
            "register_s": round(register_s, 2),
            "registered": registered,
            "client_processes": args.clients,
            "client_nice": args.client_nice,
            "coordinator_cores": sorted(pinned[0]) if pinned else None,
            "store": "postgresql" if store_url else "sqlite",
        }
    finally:
        if profiler is not None and profiler.poll() is None:
            profiler.kill()
            profiler.wait()
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        if coord.poll() is None:
            coord.send_signal(signal.SIGTERM)
            try:
                coord.wait(timeout=30)
            except subprocess.TimeoutExpired:
                coord.kill()
                coord.wait()
        log.close()
        if own_dir and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def _start_profiler(pid: int, out: str, duration: float) -> subprocess.Popen[bytes] | None:
    """py-spy recording ``pid`` for ``duration`` seconds into ``out`` (collapsed stacks)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        _progress("--profile: py-spy is not installed; no profile")
        return None
    return subprocess.Popen(
        [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            "100",
            "--nonblocking",
            "--duration",
            str(max(1, int(duration))),
            "--pid",
            str(pid),
            "--output",
            out,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=2000)
    parser.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="the coordinator's heartbeat interval (--heartbeat-interval), s",
    )
    parser.add_argument(
        "--fixed-interval",
        action="store_true",
        help="agents heartbeat every --interval whatever the coordinator answers (by default "
        "they follow the interval in its answers, as real agents do)",
    )
    parser.add_argument("--duration", type=float, default=30.0, help="measured time (s)")
    parser.add_argument("--clients", type=int, default=1, help="load-generator processes")
    parser.add_argument(
        "--pin-coordinator",
        action="store_true",
        help=(
            "run the coordinator alone on the first core and the load generators, the bench "
            "and its PostgreSQL server on the others (as if the generators ran elsewhere)"
        ),
    )
    parser.add_argument(
        "--client-nice",
        type=int,
        default=10,
        metavar="N",
        help=(
            "the load generators' niceness (0: the coordinator's): they run on the coordinator's "
            "cores, and the kernel's scheduler otherwise preempts the coordinator for them"
        ),
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=0,
        help="channels per client process (0 = one per agent, like real agents)",
    )
    parser.add_argument("--data-dir", default=None, help="coordinator data dir (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dir")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--register-timeout",
        type=float,
        default=300.0,
        help="measure anyway after this many seconds of registering (s)",
    )
    parser.add_argument("--insecure", action="store_true", help="plaintext instead of TLS")
    parser.add_argument(
        "--store",
        default="",
        metavar="URL",
        help="postgresql (a throwaway server of the bench's own) or a postgresql:// URL "
        "(default: SQLite in the data dir)",
    )
    parser.add_argument(
        "--profile", default="", metavar="FILE", help="py-spy the coordinator into FILE"
    )
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for epochmesh-coordinator serve (repeat for more), e.g. "
        "--coordinator-arg=--http-listen= (no metrics, so no gRPC metrics interceptor)",
    )
    parser.add_argument("--identity-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(run_worker(args))
        return 0
    if args.agents <= 0 or args.clients <= 0 or args.duration <= 0 or args.interval <= 0:
        parser.error("agents, clients, duration and interval must be positive")
    if args.store and args.store != "postgresql" and not args.store.startswith("postgresql://"):
        parser.error("--store must be postgresql or a postgresql://USER@HOST:PORT/DB URL")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # Killed (timeout, Ctrl-C): stop the coordinator, the clients and the database server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(json.dumps(run_bench(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
