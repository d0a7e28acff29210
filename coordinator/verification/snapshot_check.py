"""Whether a local SGD node's uploaded chunk start state is the one it committed to (issue 20;
pure, apart from the decoding of the round's parameters).

A local SGD part's chunk k starts from the state S_k = (parameters P_k, inner optimizer state
O_k) the node reached after chunks 0..k-1. With its update the node committed to the SHA-256 of
every S_k (epochmesh.verification.state_digest), and after the seed to the sketches of every
chunk's parameter difference d_j = P_j - P_{j+1}. The upload of S_k (after chunk k was drawn)
is accepted when:

- its digest is the committed one (the state cannot be shaped after the seed or the draw);
- it holds the job's parameters (names, dtypes, shapes) and optimizer state that names them;
- k = 0: P_0 is the round's parameters, bit for bit;
- k > 0: sketch(P_round - P_k) equals the sum of the committed sketches of chunks 0..k-1 within
  SNAPSHOT_TOLERANCE (both are exact differences of the same float32 values, up to float32
  rounding of each d_j: a few 1e-8 relative).

A cheater that sent made-up chunks must either upload a state its sketches do not lead to
(caught here), or one that they do, from which the checker's recomputation of chunk k differs
from the made-up d_k.

A ring member's checked part (`ring_start_problem`) starts from the parameters of the round's
version, which the coordinator does not hold between checkpoints: the member uploads them, and
they must be the job's parameters hashing (epochmesh.wire.tensors.params_checksum, in the program's
order) to the checksum the ring's majority agreed on for that version.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from epochmesh.optim import OPTIM_PREFIX, PARAM_PREFIX
from epochmesh.sketch import relative_distance, sketch
from epochmesh.v1 import common_pb2
from epochmesh.verification import state_digest
from epochmesh.wire.tensors import decode_bundle, params_checksum

# Relative distance allowed between sketch(P_round - P_k) and the committed sketches of the
# chunks before k: float32 rounding of each difference (measured: < 1e-7 in
# tests/unit/test_snapshot_check.py), with a wide margin; a made-up state is O(1) away.
SNAPSHOT_TOLERANCE = 1e-4


def snapshot_problem(
    tensors: Mapping[str, torch.Tensor],
    digest: bytes,
    round_payload: tuple[common_pb2.TensorBundle, bytes],
    earlier: torch.Tensor,
    seed: int,
    buckets: int,
) -> tuple[str, dict[str, str]]:
    """Why the uploaded start state ``tensors`` of a chunk is not the committed one ("" if it
    is), with the evidence. ``earlier``: the committed sketches of the chunks before it
    (k x buckets, k >= 0); ``round_payload``: the round's parameters as the coordinator encoded
    them."""
    got = state_digest(tensors)
    if got != digest:
        return (
            "is not the state it committed to (its digest differs)",
            {"committed_digest": digest.hex(), "uploaded_digest": got.hex()},
        )
    round_params = decode_bundle(round_payload[0], round_payload[1])
    params = {
        k.removeprefix(PARAM_PREFIX): t for k, t in tensors.items() if k.startswith(PARAM_PREFIX)
    }
    names = set(round_params)
    if set(params) != names:
        missing = sorted(names - set(params))[:3]
        extra = sorted(set(params) - names)[:3]
        return f"does not hold the job's parameters (missing {missing}, unknown {extra})", {}
    for name, t in params.items():
        ref = round_params[name]
        if t.dtype != ref.dtype or t.shape != ref.shape:
            return (
                f"holds parameter {name!r} as {t.dtype} {list(t.shape)}; the job's is "
                f"{ref.dtype} {list(ref.shape)}",
                {},
            )
    for key, t in tensors.items():
        if key.startswith(PARAM_PREFIX):
            continue
        state, sep, name = key.removeprefix(OPTIM_PREFIX).partition("/")
        if not key.startswith(OPTIM_PREFIX) or not sep or not state or name not in names:
            return f"holds tensor {key!r}, neither a parameter nor optimizer state of one", {}
        if t.dim() != 0 and t.shape != round_params[name].shape:
            return f"holds optimizer state {key!r} of shape {list(t.shape)}", {}
        if not bool(torch.isfinite(t).all()):
            return f"holds non-finite optimizer state {key!r}", {}
    if len(earlier) == 0:
        same = all(torch.equal(params[n], round_params[n]) for n in names)
        if not same:
            return "(its first) does not start from the round's parameters", {}
        return "", {}
    diff = {n: round_params[n].to(torch.float64) - params[n].to(torch.float64) for n in names}
    reached = sketch(diff, seed, buckets)
    committed = earlier.to(torch.float64).sum(dim=0)
    distance = relative_distance(committed, reached)
    if not distance <= SNAPSHOT_TOLERANCE:
        return (
            f"is not where its committed chunks before it lead from the round's parameters "
            f"(relative distance {distance:.3g} > {SNAPSHOT_TOLERANCE:g})",
            {"distance": f"{distance:.6g}", "tolerance": f"{SNAPSHOT_TOLERANCE:g}"},
        )
    return "", {}


def ring_start_problem(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    agreed_checksum: str,
) -> tuple[str, dict[str, str], dict[str, torch.Tensor]]:
    """Why a ring member's upload of its round's starting parameters (``tensors``:
    "param/<name>") is not the state its ring agreed on ("" if it is), the evidence, and the
    parameters (plain names, in ``expected``'s order: the job's, in program order)."""
    params: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        t = tensors.get(PARAM_PREFIX + name)
        if t is None:
            return f"lacks parameter {name!r}", {}, {}
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            return (
                f"holds parameter {name!r} as {t.dtype} {list(t.shape)}; the job's is {dtype} "
                f"{list(shape)}",
                {},
                {},
            )
        params[name] = t
    extra = sorted(k for k in tensors if k.removeprefix(PARAM_PREFIX) not in expected)
    if extra:
        return f"holds tensors that are not the job's parameters ({extra[:3]})", {}, {}
    got = params_checksum(params)
    if got != agreed_checksum:
        return (
            "are not the parameters its ring agreed on for the round (their checksum differs)",
            {"agreed_checksum": agreed_checksum, "uploaded_checksum": got},
            {},
        )
    return "", {}, params
