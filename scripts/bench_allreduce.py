"""Our ring all-reduce between PeerServices against torch.distributed's gloo all-reduce, same
tensors, same processes, same run. Prints one JSON line of figures.

    scripts/bench_allreduce.py --peers 4 --mb 64            # plaintext, as gloo
    scripts/bench_allreduce.py --peers 4 --mb 64 --tls      # mutual TLS, as agents run it

With `--tls` the bulk socket runs as enrolled agents run it: a mutual-TLS handshake with node
certificates, then AES-256-GCM records (`node_agent.ring.bulk_conn`); gloo has no encryption,
so the ratio is against plaintext gloo.

Our ring runs as agents run it: chunks over each PeerServer's bulk socket (`node_agent.ring.bulk`,
set up per attempt through the OpenBulk RPC), or with `--transport grpc` over PushChunks (the
fallback for peers without a bulk socket). `ours_streams` counts the attempts' streams by path
("bulk_kept": those of the bulk streams that went on a connection kept from an earlier
attempt, as agents keep them; the first repetition opens them).

Spawns `--peers` processes (multiprocessing "spawn"). Each one starts a PeerServer on a loopback
port and joins a gloo process group (TCP store on loopback), then, `--reps` times, all-reduces
the same float32 tensor (`--mb` MiB, seeded randn per rank) with both, in alternating order
(ours first in even repetitions, gloo first in odd ones) so that neither always runs on a warmer
machine. Every timed operation starts right after a gloo barrier; its time is the slowest rank's.

Figures: bus bandwidth = 2(n-1)/n * bytes / seconds (the nccl-tests definition: what each link
carries), median over the repetitions, for ours and gloo, and their ratio (median of the
per-repetition ratios, which cancels load that drifts across repetitions); the CPU seconds an
operation costs, summed over the ranks (process time: every thread of the process), which is
what decides the wall time when the peers outnumber the cores. Checks: our result is
bit-identical on every rank (sha256 of the bytes), and equals gloo's within float tolerance.

Only the data path is timed: the ring's per-round set-up (stream, schedule) is inside the
timing, process start-up and the first warm-up repetition are not.

`--floor` adds a third timed operation per repetition: the gRPC transport floor. Every rank
streams exactly the frames our ring sends over PushChunks (same RingChunk bytes, built from the
same buffer, 1 MiB chunks) to its right neighbour over one grpc.aio client stream, into a
handler that only counts them: no schedule, no waiting on the left neighbour, no reduction.
`floor_vs_gloo` bounds the ratio any ring over PushChunks can reach on this machine (the bulk
socket is not bound by it), and with `--transport grpc`, `ours_vs_floor` says how much of the
gap is our ring rather than the transport.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

# One thread per process for numpy/torch maths: n processes share the machine's cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import multiprocessing as mp  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    args: dict[str, Any],
    store_port: int,
    addr_queue: Any,
    ring_conn: Any,
    result_queue: Any,
) -> None:
    try:
        result_queue.put(_run_worker(rank, args, store_port, addr_queue, ring_conn))
    except BaseException as exc:  # report instead of hanging the parent
        import traceback

        result_queue.put({"rank": rank, "error": f"{exc!r}\n{traceback.format_exc()}"})


def _run_worker(
    rank: int, args: dict[str, Any], store_port: int, addr_queue: Any, ring_conn: Any
) -> dict[str, Any]:
    import asyncio
    import hashlib
    import logging

    import torch
    import torch.distributed as dist

    from epochmesh.identity import Identity
    from node_agent.ring.allreduce import Ring, ring_allreduce
    from node_agent.ring.service import PeerServer
    from node_agent.ring.transport import RingTransport

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    n = args["peers"]
    numel = args["mb"] * (1 << 20) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))

    async def main() -> dict[str, Any]:
        ident = None
        if args["tls"]:
            ident = Identity(**args["identities"][rank])
        bulk = args["transport"] == "bulk"
        server = PeerServer("127.0.0.1:0", identity=ident, bulk=bulk)
        await server.start()
        floor = _Floor(rank, n, x) if args["floor"] else None
        floor_address = await floor.start() if floor is not None else ""
        addr_queue.put((rank, server.address, floor_address))
        addresses, floor_addresses = ring_conn.recv()
        if floor is not None:
            floor.connect(floor_addresses[(rank + 1) % n])
        node_ids = [f"node-{i}" for i in range(n)]
        transport = RingTransport.for_server(node_ids[rank], server, identity=ident, bulk=bulk)
        ring = Ring(node_ids, addresses, rank, attempt=0)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{store_port}",
            rank=rank,
            world_size=n,
        )
        names = ["ours", "gloo"] + (["floor"] if floor is not None else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        digest = ""
        max_diff = 0.0
        close = True
        ours = torch.empty_like(x)
        ref = torch.empty_like(x)

        # gloo calls block, so they run in a thread: this process's event loop must keep
        # serving its PeerService (a neighbour may still be closing its stream to us).
        async def run_ours(round_: int) -> tuple[float, float]:
            ours.copy_(x)
            await asyncio.to_thread(dist.barrier)
            t0, c0 = time.perf_counter(), time.process_time()
            await ring_allreduce(
                ours, ring, transport, args["deadline"], args["codec"], job_id="bench", round=round_
            )
            return time.perf_counter() - t0, time.process_time() - c0

        def run_gloo() -> tuple[float, float]:
            ref.copy_(x)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            dist.all_reduce(ref)
            return time.perf_counter() - t0, time.process_time() - c0

        async def run_floor() -> tuple[float, float]:
            assert floor is not None
            await asyncio.to_thread(dist.barrier)
            t0, c0 = time.perf_counter(), time.process_time()
            await floor.run()
            return time.perf_counter() - t0, time.process_time() - c0

        async def run(name: str, rep: int) -> tuple[float, float]:
            if name == "ours":
                return await run_ours(rep)
            if name == "gloo":
                return await asyncio.to_thread(run_gloo)
            return await run_floor()

        for rep in range(args["warmup"] + args["reps"]):
            # Rotate the order, so that no operation always runs on a warmer machine.
            shift = rep % len(names)
            measured = {name: await run(name, rep) for name in names[shift:] + names[:shift]}
            if rep >= args["warmup"]:
                for name, (wall, proc) in measured.items():
                    times[name].append(wall)
                    cpu[name].append(proc)
            d = hashlib.sha256(ours.numpy().tobytes()).hexdigest()
            if digest and d != digest:
                digest = "differs-between-reps"
            elif not digest:
                digest = d
            max_diff = max(max_diff, float((ours - ref).abs().max()))
            close = close and bool(torch.allclose(ours, ref, rtol=1e-5, atol=1e-5))
        await asyncio.to_thread(dist.barrier)
        dist.destroy_process_group()
        await transport.close()
        await server.stop(None)
        if floor is not None:
            await floor.stop()
        return {
            "rank": rank,
            "streams": {
                "bulk": transport.bulk_streams,
                "grpc": transport.grpc_streams,
                "bulk_kept": transport.bulk_reused,
            },
            "times": times,
            "cpu": cpu,
            "digest": digest,
            "max_diff": max_diff,
            "close": close,
        }

    return asyncio.run(main())


class _Floor:
    """The gRPC transport floor: stream our ring's frames to the right neighbour, count the
    left neighbour's, nothing else (see the module docstring)."""

    METHOD = "/epochmesh.bench.Floor/Sink"

    def __init__(self, rank: int, n: int, tensor: Any) -> None:
        from epochmesh.ring.schedule import RingSchedule, chunk_elems_for
        from node_agent.ring.wire import ring_chunk_header

        self.n = n
        self.buf = tensor.numpy()
        sch = RingSchedule.build(n, tensor.numel(), chunk_elems_for("none"))
        self.sends: list[tuple[bytes, int, int, int]] = []
        for t, seg, c in sch.send_order(rank):
            lo, hi = sch.segment_chunks(seg)[c]
            header = ring_chunk_header(
                job_id="floor",
                round=1,
                attempt=0,
                from_node_id=f"node-{rank}",
                phase=sch.phase(t),
                step=sch.phase_step(t),
                segment=seg,
                last=c == len(sch.segment_chunks(seg)) - 1,
            )
            self.sends.append((header, (lo - sch.segments[seg][0]) * 4, lo, hi))
        # Payload bytes the left neighbour sends here (its frames carry a header on top).
        self.expected = 4 * sum(
            hi - lo
            for seg in (sch.recv_segment(rank, t) for t in range(sch.num_steps))
            for lo, hi in sch.segment_chunks(seg)
        )
        self._done: Any = None

    async def start(self) -> str:
        import asyncio

        import grpc

        from epochmesh.grpc_util import SERVER_OPTIONS

        self._done = asyncio.Queue()

        async def sink(requests: Any, context: Any) -> bytes:
            received = 0
            async for raw in requests:
                received += len(raw)
            await self._done.put(received)
            return b""

        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "epochmesh.bench.Floor",
                    {"Sink": grpc.stream_unary_rpc_method_handler(sink)},
                )
            ]
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def connect(self, address: str) -> None:
        import grpc

        from epochmesh.grpc_util import CHANNEL_OPTIONS

        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.method = self.channel.stream_unary(self.METHOD)

    async def run(self) -> None:
        import asyncio

        from node_agent.ring.wire import frame_ring_chunk

        async def send() -> None:
            call = self.method()
            for header, offset, lo, hi in self.sends:
                payload = memoryview(self.buf[lo:hi]).cast("B")
                await call.write(frame_ring_chunk(header, offset, payload))
            await call.done_writing()
            await call

        received, _ = await asyncio.gather(self._done.get(), send())
        if received < self.expected:
            raise RuntimeError(f"floor stream carried {received} bytes, less than {self.expected}")

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64, help="tensor size in MiB (float32)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8"])
    parser.add_argument("--deadline", type=float, default=30.0, help="ring step deadline, s")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="our ring over mutual TLS with node certificates, as agents run it (gloo has no "
        "encryption, so the default compares plaintext with plaintext)",
    )
    parser.add_argument(
        "--transport",
        choices=["bulk", "grpc"],
        default="bulk",
        help="our ring's data path: the bulk socket (as agents run it) or PushChunks over gRPC",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the gRPC transport floor: our frames streamed around the ring with no "
        "ring logic (plaintext, codec none)",
    )
    parser.add_argument("--timeout", type=float, default=110.0, help="whole benchmark, s")
    args = parser.parse_args(argv)
    if args.peers < 2 or args.mb < 1 or args.reps < 1:
        parser.error("need --peers >= 2, --mb >= 1, --reps >= 1")
    if args.floor and (args.codec != "none" or args.tls):
        parser.error("--floor measures plaintext frames of codec none")
    settings = vars(args)
    if args.tls:
        import tempfile
        from pathlib import Path

        from coordinator.trust.tokens import ensure_ca, issue_identity

        with tempfile.TemporaryDirectory() as tmp:
            ca = ensure_ca(Path(tmp))
            settings["identities"] = [
                vars(issue_identity(ca, "node", f"node-{r}")) for r in range(args.peers)
            ]

    started = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    addr_queue = ctx.Queue()
    result_queue = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(args.peers)]
    store_port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, settings, store_port, addr_queue, pipes[r][1], result_queue),
            daemon=True,
        )
        for r in range(args.peers)
    ]
    for p in procs:
        p.start()
    deadline = started + args.timeout
    results: list[dict[str, Any]] = []
    try:
        addresses: dict[int, tuple[str, str]] = {}
        while len(addresses) < args.peers:
            rank, address, floor_address = addr_queue.get(
                timeout=max(1.0, deadline - time.perf_counter())
            )
            addresses[rank] = (address, floor_address)
        ring_addresses = [addresses[r][0] for r in range(args.peers)]
        floor_addresses = [addresses[r][1] for r in range(args.peers)]
        for parent_end, _ in pipes:
            parent_end.send((ring_addresses, floor_addresses))
        while len(results) < args.peers:
            res = result_queue.get(timeout=max(1.0, deadline - time.perf_counter()))
            if "error" in res:
                print(f"rank {res['rank']} failed:\n{res['error']}", file=sys.stderr)
                return 1
            results.append(res)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

    n = args.peers
    nbytes = args.mb * (1 << 20)
    bus = 2 * (n - 1) / n * nbytes
    reps = args.reps

    def per_rep(name: str) -> tuple[list[float], list[float]]:
        # An operation takes as long as its slowest rank; its CPU is the sum over the ranks.
        wall = [max(r["times"][name][i] for r in results) for i in range(reps)]
        cpu = [sum(r["cpu"][name][i] for r in results) for i in range(reps)]
        return wall, cpu

    ours_s, ours_cpu = per_rep("ours")
    gloo_s, gloo_cpu = per_rep("gloo")
    ours_bw = [bus / t / 1e9 for t in ours_s]
    gloo_bw = [bus / t / 1e9 for t in gloo_s]
    digests = {r["digest"] for r in results}
    out = {
        "peers": n,
        "mb": args.mb,
        "codec": args.codec,
        "tls": args.tls,
        "transport": args.transport,
        "reps": reps,
        "ours_bus_gbps": round(statistics.median(ours_bw), 4),
        "gloo_bus_gbps": round(statistics.median(gloo_bw), 4),
        "ratio": round(statistics.median(o / g for o, g in zip(ours_bw, gloo_bw, strict=True)), 4),
        "ratio_of_medians": round(statistics.median(ours_bw) / statistics.median(gloo_bw), 4),
        "ours_seconds": round(statistics.median(ours_s), 4),
        "gloo_seconds": round(statistics.median(gloo_s), 4),
        "ours_cpu_seconds": round(statistics.median(ours_cpu), 4),
        "gloo_cpu_seconds": round(statistics.median(gloo_cpu), 4),
        "ours_runs_gbps": [round(b, 3) for b in ours_bw],
        "gloo_runs_gbps": [round(b, 3) for b in gloo_bw],
        "ours_streams": {
            kind: sum(r["streams"][kind] for r in results) for kind in ("bulk", "grpc", "bulk_kept")
        },
        "identical_across_ranks": len(digests) == 1 and "differs-between-reps" not in digests,
        "sums_match_gloo": all(r["close"] for r in results),
        "max_abs_diff_vs_gloo": max(r["max_diff"] for r in results),
        **_floor_figures(per_rep, bus, ours_bw, gloo_bw, args.floor),
        "cores": os.cpu_count(),
        "load_avg_1m_start": round(load_at_start, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))
    return 0


def _floor_figures(
    per_rep: Any, bus: float, ours_bw: list[float], gloo_bw: list[float], floor: bool
) -> dict[str, Any]:
    if not floor:
        return {}
    floor_s, floor_cpu = per_rep("floor")
    floor_bw = [bus / t / 1e9 for t in floor_s]
    return {
        "floor_bus_gbps": round(statistics.median(floor_bw), 4),
        "floor_vs_gloo": round(
            statistics.median(f / g for f, g in zip(floor_bw, gloo_bw, strict=True)), 4
        ),
        "ours_vs_floor": round(
            statistics.median(o / f for o, f in zip(ours_bw, floor_bw, strict=True)), 4
        ),
        "floor_seconds": round(statistics.median(floor_s), 4),
        "floor_cpu_seconds": round(statistics.median(floor_cpu), 4),
        "floor_runs_gbps": [round(b, 3) for b in floor_bw],
    }


if __name__ == "__main__":
    sys.exit(main())
