"""Tests only: an agent that cheats on its updates (fault injection for verification, issue 20).

Switched on by the environment variable ``EPOCHMESH_TEST_CHEAT`` (not an option: it is no
part of the agent's interface), ``"KIND"`` or ``"KIND:FROM_ROUND"``: from task.round
FROM_ROUND on (default 0: every round) the agent's parameter-server updates are wrong in one
of these ways:

- ``scaled``: every chunk gradient (and so the update) x SCALE;
- ``flipped``: every chunk gradient x -1;
- ``random``: every chunk gradient replaced by Gaussian noise of the same L2 norm (per
  tensor, so the whole gradient's norm is kept too), seeded from the round;
- ``lazy``: only the first ceil(k/4) chunks are computed (the others' compute is really
  skipped); each skipped chunk claims the mean of the computed chunks' gradients and losses;
- ``stale``: an earlier round's chunk gradients and losses (what the agent computed then: the
  latest part of as many chunks) are sent again; a round with none kept that fits is honest;
- ``slowclaim``: its updates are honest, but every job benchmark it reports claims CLAIM_RATE
  samples/s (at every batch size): a node that says it is slow asks to be paid more per
  sample (the coordinator bills a claim only from above: coordinator/accounting/billing.py);
- ``contribution`` (ring members only; honest elsewhere): its chunks, update and report are
  honest, but it puts SCALE x its contribution into the all-reduce and computes its evidence of
  the round (epochmesh.ring.evidence) from the honest one, as if that had been sent.

The cheater is a smart one: its update is always the sample-weighted sum of the chunk
gradients it will sketch (the trainer rebuilds it from them), so it passes the consistency
check of the sketches and only a recomputation (or screening) catches it. Without chunks
(an unverified job) the same is done to the whole update (lazy: a quarter of the samples
computed, all of them claimed).

A `Cheat` is a node_agent.training.tamper.Tamper: node_agent.main installs the one the
environment asks for (the worker hands it to every task as ``ctx.tamper``), and the training
code calls its hooks (node_agent.training.compute: lazy while computing, the other update cheats
through `apply_cheat` after the honest computation; node_agent.training.ring_round: the
contribution). The transformations below are pure; the hooks log every round they cheat in
(`note_cheat`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from epochmesh.optim import (
    state_tensors,
)
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import (
    local_sgd_grid,
    state_digest,
)
from node_agent.training.compute import (
    KIND_PSEUDO_GRADIENT,
    split_training_state,
    update_from_chunks,
)
from node_agent.training.jobs import (
    ChunkGradients,
    ComputedUpdate,
    LoadedJob,
)

log = logging.getLogger(__name__)

CHEAT_ENV = "EPOCHMESH_TEST_CHEAT"

SCALED = "scaled"
FLIPPED = "flipped"
RANDOM = "random"
LAZY = "lazy"
STALE = "stale"
CONTRIBUTION = "contribution"
SLOW_CLAIM = "slowclaim"
# The samples/s a slowclaim cheater's job benchmarks claim.
CLAIM_RATE = 1e-5
# The cheats on a part's update (and its chunks); CONTRIBUTION is a ring member's cheat on what
# it puts into the all-reduce.
UPDATE_KINDS = (SCALED, FLIPPED, RANDOM, LAZY, STALE)
KINDS = (*UPDATE_KINDS, CONTRIBUTION, SLOW_CLAIM)

SCALE = 100.0
# A lazy cheater computes this share of its chunks (or samples), at least one.
LAZY_SHARE = 4

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Cheat:
    kind: str
    from_round: int = 0

    def active_at(self, round_: int) -> bool:
        return round_ >= self.from_round

    def describe(self) -> str:
        when = f"from round {self.from_round}" if self.from_round > 0 else "every round"
        return f"{self.kind} updates {when}"

    # -- the Tamper's hooks (node_agent.training.tamper) --------------------------------------

    def partial(self, round_: int) -> bool:
        """Lazy, from its round on: a quarter of the part computed (noted in the log)."""
        lazy = self.kind == LAZY and self.active_at(round_)
        if lazy:
            note_cheat(LAZY, round_)
        return lazy

    def share(self, total: int) -> int:
        return lazy_count(total)

    def filled_chunks(
        self, losses: Sequence[float], grads: Sequence[Mapping[str, torch.Tensor]], total: int
    ) -> tuple[list[float], list[Grads]]:
        return fill_skipped(losses, grads, total)

    def filled_local_update(
        self, update: ComputedUpdate, slices: Sequence[Sequence[int]], verify_chunks: int
    ) -> ComputedUpdate:
        return lazy_local_chunks(update, slices, verify_chunks)

    def sent(self, job: LoadedJob, task: agent_pb2.Task, update: ComputedUpdate) -> ComputedUpdate:
        return apply_cheat(self, job, task, update)

    def benchmarked(self, result: common_pb2.BenchmarkResult) -> common_pb2.BenchmarkResult:
        """Slowclaim: the job benchmark claims CLAIM_RATE samples/s (noted in the log)."""
        if self.kind != SLOW_CLAIM:
            return result
        note_cheat(SLOW_CLAIM, 0)
        return slow_claim(result)

    def contribution_factor(self, round_: int) -> float:
        """Contribution, from its round on: SCALE (noted in the log); else 1.0."""
        if self.kind == CONTRIBUTION and self.active_at(round_):
            note_cheat(CONTRIBUTION, round_)
            return SCALE
        return 1.0


@lru_cache(maxsize=8)
def parse_cheat(text: str) -> Cheat:
    """``"KIND"`` or ``"KIND:FROM_ROUND"``; ValueError with a clear message otherwise."""
    kind, sep, start = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(
            f"{CHEAT_ENV}={text!r}: the kind must be one of {', '.join(KINDS)} "
            "(optionally followed by :FROM_ROUND)"
        )
    from_round = 0
    if sep:
        try:
            from_round = int(start.strip())
        except ValueError:
            raise ValueError(
                f"{CHEAT_ENV}={text!r}: FROM_ROUND must be a whole number >= 0"
            ) from None
        if from_round < 0:
            raise ValueError(f"{CHEAT_ENV}={text!r}: FROM_ROUND must be a whole number >= 0")
    return Cheat(kind, from_round)


def cheat_from_environment(environ: Mapping[str, str] | None = None) -> Cheat | None:
    """The cheat the environment asks for (None: an honest agent); ValueError when its value
    is not valid."""
    text = (os.environ if environ is None else environ).get(CHEAT_ENV, "")
    if not text.strip():
        return None
    return parse_cheat(text)


# -- transformations (pure) -------------------------------------------------------------------


def slow_claim(result: common_pb2.BenchmarkResult) -> common_pb2.BenchmarkResult:
    """``result`` claiming CLAIM_RATE samples/s overall and at every measured batch size."""
    out = common_pb2.BenchmarkResult()
    out.CopyFrom(result)
    out.samples_per_second = CLAIM_RATE
    for point in out.points:
        if point.samples_per_second > 0:
            point.samples_per_second = CLAIM_RATE
    return out


def scaled(grads: Mapping[str, torch.Tensor], factor: float) -> Grads:
    return {k: g * factor for k, g in grads.items()}


def noise_like(grads: Mapping[str, torch.Tensor], generator: torch.Generator) -> Grads:
    """Gaussian noise with each tensor's shape, dtype and L2 norm (so the whole gradient's
    norm too); tensors drawn in sorted name order."""
    out: Grads = {}
    for name in sorted(grads):
        g = grads[name]
        noise = torch.randn(g.shape, generator=generator, dtype=torch.float64)
        norm = float(noise.norm())
        target = float(g.double().norm())
        if norm > 0.0:
            noise *= target / norm
        out[name] = noise.to(g.dtype)
    return {k: out[k] for k in grads}


def round_generator(round_: int, salt: int = 0) -> torch.Generator:
    """The random cheat's generator for a round (deterministic, so tests can reproduce it)."""
    return torch.Generator().manual_seed((int(round_) * 1_000_003 + salt) & 0x7FFF_FFFF_FFFF_FFFF)


def randomized(grads: Sequence[Mapping[str, torch.Tensor]], round_: int) -> list[Grads]:
    """Every gradient replaced by noise of its norms, from the round's generator."""
    gen = round_generator(round_)
    return [noise_like(g, gen) for g in grads]


def lazy_count(total: int) -> int:
    """How many of ``total`` chunks (or samples) a lazy cheater computes: ceil(total/4)."""
    if total <= 0:
        return 0
    return max(1, math.ceil(total / LAZY_SHARE))


def fill_skipped(
    losses: Sequence[float], grads: Sequence[Mapping[str, torch.Tensor]], total: int
) -> tuple[list[float], list[Grads]]:
    """The computed chunks, then ``total - len(grads)`` more that each claim the mean of the
    computed chunks' gradients and losses."""
    if not grads or len(losses) != len(grads):
        raise ValueError("a lazy cheater needs at least one computed chunk")
    if len(grads) > total:
        raise ValueError(f"{len(grads)} chunks computed, more than the {total} of the part")
    out_losses = [float(x) for x in losses]
    out_grads = [dict(g) for g in grads]
    if len(grads) == total:
        return out_losses, out_grads
    mean_loss = sum(out_losses) / len(out_losses)
    mean: Grads = {}
    for name in grads[0]:
        acc = grads[0][name].clone()
        for g in grads[1:]:
            acc.add_(g[name])
        mean[name] = acc / len(grads)
    for _ in range(total - len(grads)):
        out_losses.append(mean_loss)
        out_grads.append({k: v.clone() for k, v in mean.items()})
    return out_losses, out_grads


def cheat_chunks(
    cheat: Cheat,
    round_: int,
    losses: Sequence[float],
    grads: Sequence[Mapping[str, torch.Tensor]],
    previous: tuple[Sequence[float], Sequence[Mapping[str, torch.Tensor]]] | None = None,
) -> tuple[list[float], list[Grads]]:
    """The chunks' losses and gradients a cheater sends instead of the honest ones (scaled,
    flipped, random, stale; lazy is done while computing, see `fill_skipped`). ``previous``:
    the previous round's honest chunks (stale); without them, or with another number of
    chunks, the honest ones are sent."""
    out_losses = [float(x) for x in losses]
    if cheat.kind == SCALED:
        return out_losses, [scaled(g, SCALE) for g in grads]
    if cheat.kind == FLIPPED:
        return out_losses, [scaled(g, -1.0) for g in grads]
    if cheat.kind == RANDOM:
        return out_losses, randomized(grads, round_)
    if cheat.kind == STALE and previous is not None and len(previous[1]) == len(grads):
        return [float(x) for x in previous[0]], [dict(g) for g in previous[1]]
    return out_losses, [dict(g) for g in grads]


def cheat_update(
    cheat: Cheat,
    round_: int,
    loss: float,
    tensors: Mapping[str, torch.Tensor],
    previous: tuple[float, Mapping[str, torch.Tensor]] | None = None,
) -> tuple[float, Grads]:
    """`cheat_chunks` for an update without chunks (one "chunk": the whole update)."""
    prev = None if previous is None else ([previous[0]], [previous[1]])
    losses, grads = cheat_chunks(cheat, round_, [loss], [tensors], prev)
    return losses[0], grads[0]


def derived_starts(
    starts: list[dict[str, torch.Tensor]], grads: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """A cheater's chunks: the start states that fit chunks ``grads`` it made up: the first
    chunk's start as it was, then the parameters each chunk's made-up difference leads to (the
    optimizer state of the nearest honest start)."""
    params0, _ = split_training_state(starts[0])
    acc = {n: t.to(torch.float32).clone() for n, t in params0.items()}
    out = [starts[0]]
    for i in range(1, len(grads)):
        for n, g in grads[i - 1].items():
            acc[n] -= g
        _, optim = split_training_state(starts[min(i, len(starts) - 1)])
        out.append(
            state_tensors({n: t.to(params0[n].dtype).clone() for n, t in acc.items()}, optim)
        )
    return out


def lazy_local_chunks(
    update: ComputedUpdate, slices: Sequence[Sequence[int]], verify_chunks: int
) -> ComputedUpdate:
    """A lazy local SGD cheater's update: the chunks it stepped, then made-up ones
    for the rest of its planned steps (`fill_skipped`), with start states that fit them."""
    assert update.chunks is not None
    bounds = local_sgd_grid(len(slices), verify_chunks)
    sizes = [sum(len(s) for s in slices[a:b]) for a, b in bounds]
    losses, grads = fill_skipped(update.chunks.losses, update.chunks.grads, len(bounds))
    return made_up_local_update(update, sizes, losses, grads, len(slices))


def made_up_local_update(
    update: ComputedUpdate,
    samples: list[int],
    losses: list[float],
    grads: list[dict[str, torch.Tensor]],
    steps: int,
) -> ComputedUpdate:
    """A local SGD update of made-up chunks (their sum), with start states and
    digests that fit them (`derived_starts`)."""
    assert update.chunks is not None
    starts = derived_starts(update.chunks.starts, grads)
    chunks = ChunkGradients(samples, losses, grads, starts, [state_digest(x) for x in starts])
    made_up = update_from_chunks(chunks, update.compute_s, KIND_PSEUDO_GRADIENT)
    made_up.steps = steps
    return made_up


def apply_cheat(
    cheat: Cheat, job: LoadedJob, task: agent_pb2.Task, update: ComputedUpdate
) -> ComputedUpdate:
    """The update a cheater sends instead of ``update``, its chunks and its update changed
    together (the update stays the weighted sum of the chunks it will sketch). The stale cheat keeps every round's honest computation for the next, and
    sends the honest one when it has none that fits (its first round, another chunk count)."""
    previous = job.previous
    if cheat.kind == STALE:
        count = len(update.chunks.grads) if update.chunks is not None else 0
        previous = job.earlier.get(count, previous)
        job.previous = job.earlier[count] = update
    if not cheat.active_at(task.round) or cheat.kind in (LAZY, CONTRIBUTION, SLOW_CLAIM):
        return update  # lazy: done while computing
    if cheat.kind == STALE and not _fits(previous, update):
        return update
    note_cheat(cheat.kind, task.round)
    if update.chunks is not None:
        prev = previous.chunks if previous is not None else None
        losses, grads = cheat_chunks(
            cheat,
            task.round,
            update.chunks.losses,
            update.chunks.grads,
            (prev.losses, prev.grads) if prev is not None else None,
        )
        if update.chunks.starts:  # local SGD
            samples = list(update.chunks.samples)
            return made_up_local_update(update, samples, losses, grads, update.steps)
        chunks = ChunkGradients(list(update.chunks.samples), losses, grads)
        cheated = update_from_chunks(chunks, update.compute_s)
        cheated.kind, cheated.steps = update.kind, update.steps
        return cheated
    loss, tensors = cheat_update(
        cheat,
        task.round,
        update.mean_loss,
        update.tensors,
        (previous.mean_loss, previous.tensors) if previous is not None else None,
    )
    return ComputedUpdate(
        kind=update.kind,
        tensors=tensors,
        mean_loss=loss,
        compute_s=update.compute_s,
        num_samples=update.num_samples,
        steps=update.steps,
    )


def note_cheat(kind: str, round_: int) -> None:
    """The agent's log names every round it cheated in (scripts/bench_verify.py
    counts a cheater's rounds to quarantine from the first; a stale cheater without a fitting
    earlier part sends an honest one)."""
    log.warning("test cheat %s: round %d cheated", kind, round_)


def _fits(previous: ComputedUpdate | None, update: ComputedUpdate) -> bool:
    """Whether a stale cheater can send ``previous`` in place of ``update``: same kind, and as
    many chunks (or none in both)."""
    if previous is None or previous.kind != update.kind:
        return False
    if previous.chunks is None or update.chunks is None:
        return previous.chunks is None and update.chunks is None
    return len(previous.chunks.grads) == len(update.chunks.grads)
