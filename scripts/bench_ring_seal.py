"""What sealing a ring's all-gather costs (docs/ring-rounds.md, "Sealed all-gather"). Writes
one JSON line of figures to stdout.

    scripts/bench_ring_seal.py --members 16 --mb 400             # per member and round
    scripts/bench_ring_seal.py --members 16 --mb 400 --ring 4    # + a real ring, sealed or not

Per member and round (`--members` n, a `--mb` MiB float32 buffer, codec "none"): one pass of
the seal digest over the whole buffer in 1 MiB chunks (its own segment as it sends it, the n-1
others as they arrive), one ECDSA P-256 signature, n-1 signature checks with certificates
already known, and, the first time a certificate is seen (a new member, a renewal), its CA
check as well. Timed here on this process's thread, median of `--reps`, for each digest
(BLAKE3, what rings of this version seal with, and SHA-256, what a ring with an older agent
seals with).

`--ring` n: n PeerServers with mutual TLS in this process and the same all-reduce of
`--ring-mb` MiB (bulk sockets, as agents run it) `--reps` times unsealed (the transports'
signer and verifier removed), sealed with SHA-256 and sealed with BLAKE3, in turn; the median
wall time of each and their ratios to unsealed. All ranks share one event loop here, so a
ratio is the CPU share seals add to the ring, not what a member on a machine of its own sees.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def _median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def micro(members: int, mb: int, reps: int, identities: list[Any]) -> dict[str, Any]:
    from epochmesh.ring.seal import (
        SEAL_DIGESTS,
        SegmentSigner,
        SegmentVerifier,
        seal_message,
        segment_hasher,
    )

    buf = memoryview(bytearray(b"\x5a" * (mb * MiB)))

    def hash_all(name: str) -> Callable[[], None]:
        def run() -> None:
            h = segment_hasher(name)
            for i in range(0, len(buf), MiB):
                h.update(buf[i : i + MiB])
            h.digest()

        return run

    hash_s = {name: _median_s(hash_all(name), reps) for name in SEAL_DIGESTS}
    digest = hashlib.sha256(b"x").digest()
    message = seal_message("job", 1, 0, 1, "node-0", digest)
    signer = SegmentSigner(lambda: identities[0])
    seal = signer.seal(message, digest)
    sign_s = _median_s(lambda: signer.seal(message, digest), 200)
    verifier = SegmentVerifier(identities[0].ca_pem)
    verifier.check("node-0", message, seal)
    verify_s = _median_s(lambda: verifier.check("node-0", message, seal), 200)

    def cold() -> None:
        SegmentVerifier(identities[0].ca_pem).check("node-0", message, seal)

    cold_s = _median_s(cold, 50)
    fixed = sign_s + (members - 1) * verify_s
    result: dict[str, Any] = {"members": members, "buffer_mib": mb}
    for name, seconds in hash_s.items():
        result[f"{name}_mib_per_s"] = round(mb / seconds, 1)
        result[f"{name}_hash_s"] = round(seconds, 4)
        result[f"{name}_per_member_round_s"] = round(seconds + fixed, 4)
    return result | {
        "sign_us": round(sign_s * 1e6, 1),
        "verify_us": round(verify_s * 1e6, 1),
        "cold_certificate_us": round(cold_s * 1e6, 1),
        "first_round_extra_s": round((members - 1) * (cold_s - verify_s), 4),
        "seal_wire_bytes_per_segment": 2 + 32 + 2 + len(seal.signature) + 3 + len(seal.certificate),
    }


async def ring(n: int, mb: int, reps: int, identities: list[Any]) -> dict[str, Any]:
    import torch

    from epochmesh.ring.seal import BLAKE3, SHA256
    from node_agent.ring.allreduce import Ring, ring_allreduce
    from node_agent.ring.service import PeerServer
    from node_agent.ring.transport import RingTransport

    ids = [f"node-{i}" for i in range(n)]
    servers = [
        PeerServer("127.0.0.1:0", identity=identities[i], tune_malloc=False) for i in range(n)
    ]
    for s in servers:
        await s.start()
    transports = [
        RingTransport.for_server(ids[i], servers[i], identity=identities[i]) for i in range(n)
    ]
    seals = [(t.signer, t.verifier) for t in transports]
    numel = mb * MiB // 4
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    modes = ("unsealed", SHA256, BLAKE3)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    digests: set[str] = set()
    try:
        for rep in range(len(modes) * (reps + 1)):
            mode = modes[rep % len(modes)]
            sealed = mode != "unsealed"
            for t, (signer, verifier) in zip(transports, seals, strict=True):
                t.signer, t.verifier = (signer, verifier) if sealed else (None, None)
            bufs = [x.clone() for x in inputs]
            addrs = [s.address for s in servers]
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    ring_allreduce(
                        bufs[r],
                        Ring(ids, addrs, r, rep, seal_digest=mode if sealed else BLAKE3),
                        transports[r],
                        30.0,
                        job_id="bench",
                        round=1,
                    )
                    for r in range(n)
                )
            )
            wall = time.perf_counter() - t0
            digests |= {hashlib.sha256(b.numpy().tobytes()).hexdigest() for b in bufs}
            if rep >= len(modes):  # the first of each is a warm-up (connections, caches)
                times[mode].append(wall)
    finally:
        for t in transports:
            await t.close()
        for s in servers:
            await s.stop(None)
    if len(digests) != 1:
        raise AssertionError("the ranks' sums differ")
    median = {mode: statistics.median(times[mode]) for mode in modes}
    return {
        "ring_members": n,
        "ring_mib": mb,
        "ring_unsealed_s": round(median["unsealed"], 3),
        **{f"ring_{d}_s": round(median[d], 3) for d in (SHA256, BLAKE3)},
        **{
            f"ring_{d}_vs_unsealed": round(median[d] / median["unsealed"], 3)
            for d in (SHA256, BLAKE3)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=16, help="ring size for the figures")
    parser.add_argument("--mb", type=int, default=400, help="buffer MiB (400: 100M params)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ring", type=int, default=0, help="also run a real ring of n peers")
    parser.add_argument("--ring-mb", type=int, default=32)
    args = parser.parse_args(argv)
    from coordinator.trust.tokens import ensure_ca, issue_identity

    with tempfile.TemporaryDirectory() as tmp:
        ca = ensure_ca(Path(tmp))
        count = max(args.ring, 1)
        identities = [issue_identity(ca, "node", f"node-{i}") for i in range(count)]
        result = micro(args.members, args.mb, args.reps, identities)
        if args.ring:
            result |= asyncio.run(ring(args.ring, args.ring_mb, args.reps, identities))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
