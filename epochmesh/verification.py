"""Verification rules both sides share (issue 20; pure): how a part is cut into chunks, what a
commitment must satisfy, and the tolerances of the two comparisons.

- A verified part is cut into ``chunk_count`` consecutive chunks (`chunk_bounds`); the node
  computes each chunk's gradient on its own (the update is their sample-weighted sum) and sends
  each chunk's samples and mean loss with its update (the commitment).
- After the update is in, the coordinator may send a secret sketch seed; the node answers with
  the CountSketch of every chunk's gradient (epochmesh.sketch). Their weighted sum must be the
  sketch of the update it sent, within the codec's tolerance (`consistency_tolerance`).
- Then another donor's node recomputes one chunk (drawn after the sketches are in) and its
  sketch must match the node's within the tolerance measured for the pair of devices
  (`recompute_tolerance`, docs/device-tolerance.md).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

from epochmesh.optim import PARAM_PREFIX

# Chunks per verified part. A check recomputes one of them (coordinator/verification/reputation.py:
# CHECK_FRACTION = 0.08 of them, at least one): 1/12 = 8.3 % of the part's compute.
VERIFY_CHUNKS = 12
# Chunks a part is cut into: twice VERIFY_CHUNKS, each check drawing two checkers at once
# (coordinator/engine/verifier.py), so every part of a round runs this many passes at most.
PART_CHUNKS = 2 * VERIFY_CHUNKS
# A chunk holds at least this many samples (a part of fewer than 2 x 12 samples has fewer
# chunks): a pass of the program has a fixed cost (~1.5 ms for the tests' MLP on this host's
# CPU), and one-sample chunks made a slow node's small part cost it twice its compute, which
# moved the split by speed; a checked chunk of a small part is then a larger share of it, of
# a part that is itself small.
MIN_CHUNK_SAMPLES = 2
SKETCH_BUCKETS = 256
# Upper bounds on what a node may send (bad input past them).
MAX_CHUNKS = 64
MAX_BUCKETS = 4096

# Relative gradient difference of the same micro-batch recomputed on two devices, measured
# (docs/device-tolerance.md; scripts/measure_device_tolerance.py): CPU vs CPU at 1 and 2
# threads (agents run with different thread counts; the conv net sets it), CPU vs an H100,
# and two CUDA processes on the same GPU model. Convolutions under cuDNN's TF32 default set
# the CPU-vs-CUDA figure.
MEASURED_DEVICE_DIFFERENCE = {
    ("cpu", "cpu"): 7.4e-6,
    ("cpu", "cuda"): 9.3e-5,
    ("cuda", "cuda"): 8.0e-9,
}
# The same for a local SGD chunk: the parameter difference (start - end) of the same 16 inner
# steps from the same parameters and optimizer state, SGD with momentum and AdamW
# (scripts/measure_device_tolerance.py --local-steps 16, on the lent H100 and its 16-core CPU,
# session 18; docs/device-tolerance.md). AdamW's normalised steps amplify small gradient
# differences: the transformer 4.7e-5 between 1 and 16 CPU threads (5.7e-7 for one gradient),
# the conv net 1.4e-4 CPU vs CUDA under cuDNN's TF32 default and 3.3e-6 between two CUDA runs
# (cuDNN's nondeterministic kernels, amplified).
MEASURED_LOCAL_SGD_DIFFERENCE = {
    ("cpu", "cpu"): 4.7e-5,
    ("cpu", "cuda"): 1.41e-4,
    ("cuda", "cuda"): 3.3e-6,
}
# The tolerance is the measured difference times this factor, never below TOLERANCE_FLOOR
# (a sketch of 256 buckets estimates a distance to within a few tens of per cent; a cheat is
# O(0.01) to O(1) away: a stale gradient one SGD step old is the closest, > 1e-2 in the tests).
SAFETY_FACTOR = 20.0
TOLERANCE_FLOOR = 1.0e-5
# Two different GPU models were not measured: they are judged like a CPU and a GPU.

# |sketch(update) - sum_i w_i sketch(chunk_i)| / |sum_i w_i sketch(chunk_i)| allowed per codec:
# float32 sums against float64 ones (none), the codec's rounding (fp16, bf16), int8's rounding
# of the update plus the error-feedback residual carried between rounds. Measured worst over
# 30 rounds of an MLP (tests/unit/test_verification.py): fp16 2.4e-4, bf16 1.9e-3, int8 1.5e-2;
# each tolerance keeps a margin of 6x or more. topk sends ~1 % of the coordinates (the rest is
# carried over): no consistency can be asked of it; its updates are judged by screening and
# recomputation alone.
CONSISTENCY_TOLERANCE = {
    "none": 1e-4,
    "fp16": 5e-3,
    "bf16": 2e-2,
    "int8": 0.1,
}


def chunk_count(samples: int, verify_chunks: int) -> int:
    """How many chunks a part of ``samples`` is cut into: ``verify_chunks``, fewer when a
    chunk would hold less than MIN_CHUNK_SAMPLES, at least one."""
    if samples < 1 or verify_chunks < 1:
        return 0
    return max(1, min(verify_chunks, samples // MIN_CHUNK_SAMPLES))


def chunk_bounds(samples: int, verify_chunks: int) -> list[tuple[int, int]]:
    """The chunks' [start, end) offsets into the part's samples, in order: ``chunk_count`` of
    them, sizes differing by at most one (the larger first)."""
    return even_split(samples, chunk_count(samples, verify_chunks))


def even_split(total: int, k: int) -> list[tuple[int, int]]:
    """[0, total) cut into ``k`` consecutive [start, end) ranges whose sizes differ by at most
    one (the larger first); none for k < 1."""
    if k < 1:
        return []
    base, extra = divmod(total, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def commitment_problem(
    chunks: Sequence[tuple[int, float]],
    num_samples: int,
    mean_loss: float,
    verify_chunks: int,
    sizes: Sequence[int] | None = None,
) -> str:
    """Why an update's chunk commitments (samples, loss per chunk) do not fit it ("" if they
    do): the count and sizes `chunk_bounds` gives (or ``sizes``), finite losses, and a
    sample-weighted loss equal to the update's mean_loss."""
    if verify_chunks <= 0:
        return "" if not chunks else "the task asked for no chunk commitments"
    want = (
        sizes if sizes is not None else [e - s for s, e in chunk_bounds(num_samples, verify_chunks)]
    )
    if not chunks:
        return f"the update carries no chunk commitments (the task asked for {len(want)})"
    if len(chunks) != len(want):
        return f"{len(chunks)} chunk commitments for {num_samples} samples; expected {len(want)}"
    total = 0.0
    for i, ((samples, loss), size) in enumerate(zip(chunks, want, strict=True)):
        if samples != size:
            return f"chunk {i} commits {samples} samples; it has {size}"
        if not math.isfinite(loss):
            return f"chunk {i} commits a loss of {loss}"
        total += loss * samples
    weighted = total / num_samples
    if not math.isclose(weighted, mean_loss, rel_tol=1e-5, abs_tol=1e-6):
        return (
            f"the chunks' sample-weighted loss {weighted:.9g} is not the update's mean_loss "
            f"{mean_loss:.9g}"
        )
    return ""


# -- local SGD ----------------------------------------------------------------------------------
#
# A local SGD part is H inner steps (consecutive local_batch slices of its samples) from the
# round's parameters and the node's inner optimizer state. Its chunks are runs of consecutive
# steps; chunk k's "gradient" is the parameters before its steps minus after them, so that the
# chunks add up (unweighted) to the part's pseudo-gradient. A time box may stop the node short
# of its planned steps (by a quarter, typically): the node keeps its state at the start of
# each piece of a grid twice as fine (`local_sgd_grid`), and once it stopped groups the pieces
# it reached into at most verify_chunks chunks (`local_sgd_groups`), so that a part cut to half
# its plan still has verify_chunks chunks and a check recomputes about 1/verify_chunks of what
# it trained (cut from the planned steps, the chunks were 1/9 of it: 10.6 % for new nodes). A chunk
# cannot be recomputed from the round's parameters alone, so with its update the node commits
# to the state each chunk started from (`state_digest` of its parameters and inner optimizer
# state); the state of the chunk drawn is uploaded after the sketches and checked against that
# digest and against the sketches of the chunks before it.

DIGEST_BYTES = 32


def step_chunk_bounds(steps: int, verify_chunks: int) -> list[tuple[int, int]]:
    """The [start, end) step ranges of a local SGD part of ``steps`` planned steps: at most
    ``verify_chunks`` chunks of at least one step, sizes differing by at most one."""
    if steps < 1 or verify_chunks < 1:
        return []
    return even_split(steps, min(verify_chunks, steps))


def local_sgd_grid(steps: int, verify_chunks: int) -> list[tuple[int, int]]:
    """The [start, end) step ranges of the pieces of a local SGD part of ``steps`` planned
    steps: 2 x verify_chunks of at least one step (`step_chunk_bounds`); the node keeps its
    state at the start of each piece it reaches."""
    return step_chunk_bounds(steps, 2 * verify_chunks)


def local_sgd_groups(pieces: int, verify_chunks: int) -> list[tuple[int, int]]:
    """The [start, end) piece ranges of the chunks of a part whose node reached ``pieces``
    pieces of its grid: at most ``verify_chunks`` chunks, sizes differing by at most one."""
    return even_split(pieces, min(verify_chunks, pieces))


def local_sgd_chunk_samples(
    part_samples: int, local_batch: int, verify_chunks: int, trained: int
) -> list[int]:
    """The samples of each chunk of a local SGD part of ``part_samples`` samples stepped
    ``local_batch`` at a time, of which a time box let the node train the first ``trained``
    (whole steps, or all): the pieces of the planned steps' grid it reached (the last cut where
    the training stopped), grouped (`local_sgd_groups`)."""
    if part_samples < 1 or local_batch < 1 or trained < 1:
        return []
    sizes = [min(local_batch, part_samples - s) for s in range(0, part_samples, local_batch)]
    pieces: list[int] = []
    for start, end in local_sgd_grid(len(sizes), verify_chunks):
        done = sum(sizes[:start])
        if done >= trained:
            break
        pieces.append(min(sum(sizes[start:end]), trained - done))
    return [sum(pieces[a:b]) for a, b in local_sgd_groups(len(pieces), verify_chunks)]


def state_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 of named tensors (sorted by name; each its name, dtype, shape and bytes): what a
    local SGD node commits for the state a chunk started from."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


# A ring job's local SGD upload of a chunk's start state also carries the parameters the round
# started from (the coordinator holds a ring's versions only at checkpoints), their names under
# this prefix: the coordinator checks them against the checksum the ring agreed on, then the
# chunk's start state against them.
ROUND_START_PREFIX = "start/"


def with_round_start(
    state: Mapping[str, torch.Tensor], round_start: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A chunk's start ``state`` with the round's start parameters (``round_start``:
    "param/<name>", e.g. the first chunk's start state) added under ROUND_START_PREFIX."""
    out = dict(state)
    for key, t in round_start.items():
        if key.startswith(PARAM_PREFIX):
            out[ROUND_START_PREFIX + key.removeprefix(PARAM_PREFIX)] = t
    return out


def split_round_start(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What `with_round_start` joined: (the chunk's start state, the round's start parameters
    as "param/<name>")."""
    state = {k: t for k, t in tensors.items() if not k.startswith(ROUND_START_PREFIX)}
    start = {
        PARAM_PREFIX + k.removeprefix(ROUND_START_PREFIX): t
        for k, t in tensors.items()
        if k.startswith(ROUND_START_PREFIX)
    }
    return state, start


def local_sgd_commitment_problem(
    chunks: Sequence[tuple[int, float, bytes]],
    num_samples: int,
    mean_loss: float,
    part_samples: int,
    local_batch: int,
    verify_chunks: int,
) -> str:
    """Why a local SGD update's chunk commitments (samples, loss, start digest per chunk) do not
    fit it ("" if they do): the chunks `local_sgd_chunk_samples` gives for the samples it
    trained, finite losses whose sample-weighted mean is its mean_loss, a digest each."""
    want = local_sgd_chunk_samples(part_samples, local_batch, verify_chunks, num_samples)
    if not chunks:
        return f"the update carries no chunk commitments (the task asked for {len(want)})"
    for i, (_, _, digest) in enumerate(chunks):
        if len(digest) != DIGEST_BYTES:
            return (
                f"chunk {i} commits a start digest of {len(digest)} bytes (a SHA-256 has "
                f"{DIGEST_BYTES})"
            )
    return commitment_problem(
        [(n, loss) for n, loss, _ in chunks], num_samples, mean_loss, verify_chunks, want
    )


def device_kind(device_type: str) -> str:
    """ "cuda" for any GPU, "cpu" otherwise (the device types an agent reports)."""
    return "cuda" if device_type.lower() in ("cuda", "gpu", "rocm") else "cpu"


def recompute_tolerance(
    kind_a: str, kind_b: str, same_model: bool = True, local_sgd: bool = False
) -> float:
    """The relative sketch distance allowed between a chunk's gradient (``local_sgd``: its
    inner steps' parameter difference) computed on a device of ``kind_a`` and its
    recomputation on one of ``kind_b`` ("cpu" / "cuda"): the measured difference times
    SAFETY_FACTOR. Two GPUs of different models count as unmeasured (like a CPU and a GPU)."""
    a, b = sorted((device_kind(kind_a), device_kind(kind_b)))
    table = MEASURED_LOCAL_SGD_DIFFERENCE if local_sgd else MEASURED_DEVICE_DIFFERENCE
    measured = table[(a, b)]
    if a == b == "cuda" and not same_model:
        measured = table[("cpu", "cuda")]
    return max(TOLERANCE_FLOOR, measured * SAFETY_FACTOR)


def consistency_tolerance(codec: str) -> float | None:
    """The relative distance allowed between the update's sketch and its chunks' (None: the
    codec permits no check, see CONSISTENCY_TOLERANCE)."""
    return CONSISTENCY_TOLERANCE.get(codec or "none")


def loss_matches(committed: float, recomputed: float, tolerance: float) -> bool:
    """Whether a chunk's committed loss and its recomputation agree (relative, with a floor
    for losses near zero)."""
    return abs(committed - recomputed) <= tolerance * max(abs(committed), abs(recomputed), 1e-3)
