"""A round's update on the agent: gradients, local SGD steps, verification chunks, compression.

- `compute_update(ctx, job, task)`: the round's update from the parameters the job holds now
  (the caller makes sure they are the round's version):
  * sync mode: the gradient of the mean loss over the task's samples (one step);
  * local_sgd (DiLoCo): H inner steps with the job's inner optimizer (kept on the agent per
    job across rounds; built afresh after a round whose steps failed), step k on the k-th
    `local_batch`-sized slice of the task's samples in order (the last slice may be smaller
    near an epoch's end), then the pseudo-gradient
    Δ = start − end per parameter. The program's parameters are put back to the start values,
    so the agent still holds the round's version afterwards.
  Every step goes through the slowdown controller; compute_s is the device time of all steps.
- `job_error_feedback` / `encode_update`: the update in the spec's codec, int8 and topk through
  a per-job ErrorFeedback (ERROR_FEEDBACK_CODECS).

Verification (docs/verification-protocol.md): when the task asks for `verify_chunks`, the
part's samples are cut into chunks (`epochmesh.verification.chunk_bounds`), each chunk's mean
loss and gradient is computed on its own (the job's micro_batch applying within a chunk; a
confined program does all chunks in one request to its child), and the update is their
sample-weighted sum (float32, chunks in order). A local SGD part's chunks are runs of
consecutive inner steps: the state (parameters and inner optimizer state) is copied before the
first step of each piece of a grid (`epochmesh.verification.local_sgd_grid`), the pieces
reached are grouped into chunks once it stopped (`grouped_local_chunks`), a chunk's "gradient"
is its start parameters minus the next chunk's, and each commitment carries the SHA-256 of its
start state; a checker runs a drawn chunk's steps again from that state
(`recompute_local_chunk`).

Random draws (node_agent.sandbox.seeding): every forward unit (a chunk,
the whole part when it is not chunked, an inner step of local SGD) runs with torch's generators
seeded from (job, round, the node whose part it is, the unit's sample indices)
(node_agent.sandbox.seeding.SeedScope), and its k-th micro-batch from ``micro_seed(seed, k)``:
a checker (which passes the checked node's id) draws the worker's dropout masks and noise.

The round's `Tamper` (``ctx.tamper``, node_agent.training.tamper; HONEST but in tests) is
called at its hooks: whether the round computes only a share of its part (the partial paths of
`update_in_thread`), and what is sent instead of the computed update (chunks and update
changed together).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch

from epochmesh.dataset import ranges_to_indices
from epochmesh.optim import (
    OPTIM_PREFIX,
    PARAM_PREFIX,
    build_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
    optimizer_step,
    state_tensors,
)
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.verification import (
    chunk_bounds,
    local_sgd_grid,
    local_sgd_groups,
    state_digest,
)
from epochmesh.wire.compression import ErrorFeedback
from epochmesh.wire.tensors import encode_bundle
from node_agent.core.slowdown import SlowdownController
from node_agent.sandbox.host import (
    DEFAULT_STEP_TIMEOUT_S,
    MIN_STEP_TIMEOUT_S,
    NONFINITE,
    ConfinedProgram,
    ProgramFault,
)
from node_agent.sandbox.seeding import SeedScope, micro_seed, seed_generators
from node_agent.training.context import TaskContext
from node_agent.training.jobs import (
    ChunkGradients,
    ComputedUpdate,
    LoadedJob,
    Program,
)

log = logging.getLogger(__name__)

# Codecs whose residual the agent carries over to the next round (error feedback). topk needs
# it (most of each update is held back); for int8 it removes the rounding bias over rounds at
# the cost of one float32 copy of the parameters. fp16/bf16 round finely enough to go without.
ERROR_FEEDBACK_CODECS = ("topk", "int8")

# Inner steps' samples are gathered in chunks of up to this many bytes (prefetched_batches).
PREFETCH_BYTES = 32 << 20

KIND_GRADIENT = "gradient"
KIND_PSEUDO_GRADIENT = "pseudo_gradient"

Batch = tuple[list[torch.Tensor], list[torch.Tensor]]


# -- computing an update (pure parts first) -----------------------------------------------------


def is_local_sgd(spec: common_pb2.JobSpec) -> bool:
    return spec.sync == "local_sgd"


def inner_step_slices(
    indices: Sequence[int], local_batch: int, inner_steps: int
) -> list[list[int]]:
    """The inner steps' samples: consecutive `local_batch`-sized slices of `indices` in order,
    the last one possibly smaller. ValueError when there are no samples or more than
    `inner_steps` slices' worth."""
    if local_batch < 1:
        raise ValueError(f"local_batch must be >= 1 (got {local_batch})")
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be >= 1 (got {inner_steps})")
    if not indices:
        raise ValueError("the task names no samples")
    steps = math.ceil(len(indices) / local_batch)
    if steps > inner_steps:
        raise ValueError(
            f"task names {len(indices)} samples, more than inner_steps {inner_steps} x "
            f"local_batch {local_batch}"
        )
    return [list(indices[i : i + local_batch]) for i in range(0, len(indices), local_batch)]


def seeded_loss_and_grads(
    program: Program,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    seed: int | None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """``program.loss_and_grads`` with torch's generators seeded ``seed`` first (None: as
    they are): a confined program's child seeds its own, an in-process program's are seeded
    here."""
    if isinstance(program, ConfinedProgram):
        return program.loss_and_grads(inputs, targets, seed=seed)
    if seed is not None:
        seed_generators(seed, getattr(program, "device", torch.device("cpu")))
    return program.loss_and_grads(inputs, targets)


def accumulated_loss_and_grads(
    program: Program,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    micro_batch: int = 0,
    seed: int | None = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The batch's mean loss and its gradient, computed in consecutive chunks of at most
    ``micro_batch`` samples (gradient accumulation; 0, or a batch no larger: one pass).

    Each chunk's gradient (of its mean loss) is weighted by its share of the batch's samples,
    so the result is the whole batch's gradient up to float rounding, for any loss that is a
    mean over samples (the built-in ones are) and a model whose samples do not interact (batch
    norm sees a chunk's statistics, as with any gradient accumulation). A node's memory then
    holds one chunk's activations, and a CPU's caches a working set that fits them.

    ``seed`` (the unit's, `SeedScope.seed`): chunk k runs with the generators seeded
    ``micro_seed(seed, k)``, as the program child's batched chunk call does."""
    n = int(inputs[0].shape[0]) if inputs else 0

    def seed_of(k: int) -> int | None:
        return None if seed is None else micro_seed(seed, k)

    if micro_batch <= 0 or n <= micro_batch:
        return seeded_loss_and_grads(program, inputs, targets, seed_of(0))
    total_loss = 0.0
    acc: dict[str, torch.Tensor] = {}
    for k, start in enumerate(range(0, n, micro_batch)):
        end = min(n, start + micro_batch)
        loss, grads = seeded_loss_and_grads(
            program, [t[start:end] for t in inputs], [t[start:end] for t in targets], seed_of(k)
        )
        weight = (end - start) / n
        total_loss += loss * weight
        for name, g in grads.items():
            if name in acc:
                acc[name].add_(g, alpha=weight)
            else:
                acc[name] = g * weight
    return total_loss, acc


def gradient_step(
    program: Program,
    batch: Batch,
    slowdown: SlowdownController,
    micro_batch: int = 0,
    seed: int | None = None,
) -> ComputedUpdate:
    """Sync mode: the gradient of the mean loss over one batch (parameters untouched), in
    chunks of at most ``micro_batch`` samples (see `accumulated_loss_and_grads`; ``seed``:
    the batch's)."""
    inputs, targets = batch
    loss, grads = slowdown.timed_step(
        lambda: accumulated_loss_and_grads(program, inputs, targets, micro_batch, seed)
    )
    return ComputedUpdate(
        kind=KIND_GRADIENT,
        tensors={k: g.detach().to("cpu", torch.float32) for k, g in grads.items()},
        mean_loss=loss,
        compute_s=slowdown.last_device_seconds,
        num_samples=int(inputs[0].shape[0]) if inputs else 0,
    )


def chunk_losses_and_grads(
    program: Program,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    bounds: Sequence[tuple[int, int]],
    micro_batch: int = 0,
    seeds: Sequence[int] | None = None,
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each slice [start, end) of the batch's mean loss and gradient on its own, through
    `accumulated_loss_and_grads` (a confined program: all of them in one request to its child,
    with the same arithmetic); ``seeds``: each slice's seed."""
    if seeds is not None and len(seeds) != len(bounds):
        raise ValueError(f"{len(seeds)} seeds for {len(bounds)} chunks")
    if isinstance(program, ConfinedProgram):
        return program.chunked_loss_and_grads(inputs, targets, bounds, micro_batch, seeds)
    return [
        accumulated_loss_and_grads(
            program,
            [t[a:b] for t in inputs],
            [t[a:b] for t in targets],
            micro_batch,
            None if seeds is None else seeds[i],
        )
        for i, (a, b) in enumerate(bounds)
    ]


def combine_chunks(
    chunks: ChunkGradients, weighted: bool = True
) -> tuple[float, dict[str, torch.Tensor]]:
    """The part's mean loss and gradient from its chunks': sum_i (n_i / n) x chunk i (or, not
    ``weighted``, the plain sum: local SGD's chunks are parameter differences), in float32 and
    in chunk order (the loss as epochmesh.verification.commitment_problem weighs it)."""
    n = sum(chunks.samples)
    if n <= 0 or not chunks.grads:
        raise ValueError("no chunks to combine")
    acc: dict[str, torch.Tensor] = {}
    for samples, grads in zip(chunks.samples, chunks.grads, strict=True):
        weight = samples / n if weighted else 1.0
        for name, g in grads.items():
            if name in acc:
                acc[name].add_(g, alpha=weight)
            else:
                acc[name] = g * weight
    loss = sum(x * m for x, m in zip(chunks.losses, chunks.samples, strict=True)) / n
    return loss, acc


def update_from_chunks(
    chunks: ChunkGradients, compute_s: float, kind: str = KIND_GRADIENT
) -> ComputedUpdate:
    """The update of a chunked part: the weighted sum of its chunks (sync mode), or their sum
    (local SGD's pseudo-gradient)."""
    loss, tensors = combine_chunks(chunks, weighted=kind == KIND_GRADIENT)
    return ComputedUpdate(
        kind=kind,
        tensors=tensors,
        mean_loss=loss,
        compute_s=compute_s,
        num_samples=sum(chunks.samples),
        chunks=chunks,
    )


def compute_chunks(
    program: Program,
    batch: Batch,
    slowdown: SlowdownController,
    micro_batch: int,
    verify_chunks: int,
    count: int | None = None,
    seeds: Sequence[int] | None = None,
) -> tuple[ChunkGradients, float]:
    """The part's chunks (`chunk_bounds`): all their sample counts, and the loss and gradient
    of the first ``count`` of them (default: all), in one slowed step; with its device
    seconds. ``seeds``: every chunk's (`chunk_seeds`)."""
    inputs, targets = batch
    n = int(inputs[0].shape[0]) if inputs else 0
    bounds = chunk_bounds(n, verify_chunks)
    if not bounds:
        raise ValueError("the task names no samples to cut into chunks")
    todo = bounds if count is None else bounds[: max(1, count)]
    todo_seeds = None if seeds is None else list(seeds)[: len(todo)]
    results = slowdown.timed_step(
        lambda: chunk_losses_and_grads(program, inputs, targets, todo, micro_batch, todo_seeds)
    )
    chunks = ChunkGradients(
        samples=[b - a for a, b in bounds],
        losses=[loss for loss, _ in results],
        grads=[
            {k: g.detach().to("cpu", torch.float32) for k, g in gr.items()} for _, gr in results
        ],
    )
    return chunks, slowdown.last_device_seconds


def chunked_gradient_step(
    program: Program,
    batch: Batch,
    slowdown: SlowdownController,
    micro_batch: int,
    verify_chunks: int,
    seeds: Sequence[int] | None = None,
) -> ComputedUpdate:
    """Sync mode with verification: the part cut into chunks, each chunk's loss and gradient
    computed on its own, the update their sample-weighted sum (`update_from_chunks`)."""
    chunks, compute_s = compute_chunks(
        program, batch, slowdown, micro_batch, verify_chunks, seeds=seeds
    )
    return update_from_chunks(chunks, compute_s)


def chunk_seeds(scope: SeedScope, indices: Sequence[int], verify_chunks: int) -> list[int]:
    """The seed of each chunk (`chunk_bounds`) of a part of samples ``indices``: of its own
    samples, as a checker recomputing that chunk alone seeds it."""
    return [scope.seed(indices[a:b]) for a, b in chunk_bounds(len(indices), verify_chunks)]


def prefetched_batches(
    slices: Sequence[Sequence[int]],
    get_batch: Callable[[Sequence[int]], Batch],
    chunk_bytes: int = PREFETCH_BYTES,
) -> Iterator[Batch]:
    """The batches of `slices` in order, gathered a chunk of consecutive slices at a time
    (one gather of up to `chunk_bytes` of samples, then views of it): a gather per inner step
    costs ~0.25 ms of Python and indexing, several percent of a small model's step."""
    i = 0
    per_sample = 0
    while i < len(slices):
        if per_sample <= 0:
            j = i + 1  # the first slice alone: it tells how big a sample is
        else:
            budget = max(1, chunk_bytes // per_sample)
            j, n = i, 0
            while j < len(slices) and (j == i or n + len(slices[j]) <= budget):
                n += len(slices[j])
                j += 1
        chunk = [int(x) for sl in slices[i:j] for x in sl]
        inputs, targets = get_batch(chunk)
        if per_sample <= 0 and chunk:
            per_sample = max(1, sum(t[:1].numel() * t.element_size() for t in inputs + targets))
        off = 0
        for sl in slices[i:j]:
            n = len(sl)
            yield [t[off : off + n] for t in inputs], [t[off : off + n] for t in targets]
            off += n
        i = j


def local_sgd_steps(
    program: Program,
    optimizer: torch.optim.Optimizer,
    slices: Sequence[Sequence[int]],
    get_batch: Callable[[Sequence[int]], Batch],
    slowdown: SlowdownController,
    check_cancelled: Callable[[], None] = lambda: None,
    budget_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    micro_batch: int = 0,
    chunk_steps: Sequence[tuple[int, int]] = (),
    scope: SeedScope | None = None,
) -> ComputedUpdate:
    """Local SGD's inner loop: one optimizer step per slice (its gradient in chunks of at most
    ``micro_batch`` samples), then Δ = start − end. ``scope``: each step's random draws are
    seeded from its slice's samples (`SeedScope.seed`), so that a checker that runs a chunk's
    steps again draws the same.

    ``chunk_steps`` (verification: `local_sgd_grid`): the state (parameters and optimizer
    state) is kept before the first step of each of these pieces, and the update carries the
    pieces (`local_chunks`) of the steps that ran (the caller groups them into chunks).

    ``budget_s`` > 0 time-boxes the loop: it stops before the next step when that step would
    end further past ``budget_s`` seconds of stepping than short of it (judged by the mean
    step so far), after at least one step; the update then covers the slices stepped (a
    prefix). The update's ``compute_s`` is the loop's wall time (the emulated device's padded
    steps, batch views, the loop itself, which a slowed device's padding absorbs): what the
    coordinator plans rounds and time boxes on.

    The program's parameters are back at their start values afterwards (also when a step
    raises); the optimizer's state keeps what the steps put into it.
    """
    params = program.parameters()
    names = program.param_names
    start = program.get_parameters()
    total_loss = 0.0
    samples = 0
    steps = 0
    chunk_at = {first for first, _ in chunk_steps}
    states: list[dict[str, torch.Tensor]] = []
    chunk_losses: list[float] = []
    chunk_samples: list[int] = []
    chunks: ChunkGradients | None = None
    began = last_end = clock()
    try:
        for k, (idx, (inputs, targets)) in enumerate(
            zip(slices, prefetched_batches(slices, get_batch), strict=False)
        ):
            if budget_s > 0 and k > 0:
                stepped = clock() - began
                if stepped + 0.5 * stepped / k > budget_s:
                    break
            check_cancelled()
            if k in chunk_at:
                states.append(training_state(program, optimizer))
                chunk_losses.append(0.0)
                chunk_samples.append(0)

            seed = None if scope is None else scope.seed(idx)

            def step(
                inputs: list[torch.Tensor] = inputs,
                targets: list[torch.Tensor] = targets,
                seed: int | None = seed,
            ) -> float:
                loss, grads = accumulated_loss_and_grads(
                    program, inputs, targets, micro_batch, seed
                )
                optimizer_step(optimizer, params, names, grads)
                return loss

            # The loop's own time since the last step (batch views, this code) runs on the host
            # while the emulated device computes: the step's padding absorbs it.
            loss = slowdown.timed_step(step, overlap_s=clock() - last_end)
            last_end = clock()
            if not math.isfinite(loss):
                raise ProgramFault(
                    f"the job's program computed a non-finite loss ({loss}) at inner step {k}",
                    NONFINITE,
                )
            total_loss += loss * len(idx)
            samples += len(idx)
            steps += 1
            if states:
                chunk_losses[-1] += loss * len(idx)
                chunk_samples[-1] += len(idx)
        stepped = clock() - began
        with torch.no_grad():
            delta = {
                k: (start[k] - p.detach()).to("cpu", torch.float32)
                for k, p in zip(names, params, strict=True)
            }
            if states:
                end = {
                    k: p.detach().to("cpu", copy=True) for k, p in zip(names, params, strict=True)
                }
                chunks = local_chunks(
                    states,
                    end,
                    chunk_samples,
                    [x / max(1, n) for x, n in zip(chunk_losses, chunk_samples, strict=True)],
                )
    finally:
        for p in params:
            p.grad = None
        program.set_parameters(start)
    return ComputedUpdate(
        kind=KIND_PSEUDO_GRADIENT,
        tensors=delta,
        mean_loss=total_loss / max(1, samples),
        compute_s=stepped,
        num_samples=samples,
        steps=steps,
        chunks=chunks,
    )


def training_state(program: Program, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A copy of the program's parameters and ``optimizer``'s state, named as a checkpoint
    ("param/<name>", "optim/<key>/<name>"; CPU tensors)."""
    names = program.param_names
    params = {
        n: p.detach().to("cpu", copy=True) for n, p in zip(names, program.parameters(), strict=True)
    }
    optim = {
        k: t.detach().to("cpu", copy=True)
        for k, t in optimizer_state_tensors(optimizer, names).items()
    }
    return state_tensors(params, optim)


def split_training_state(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters by name, optimizer state by "<key>/<name>") of a `training_state`."""
    params = {
        k.removeprefix(PARAM_PREFIX): t for k, t in state.items() if k.startswith(PARAM_PREFIX)
    }
    optim = {
        k.removeprefix(OPTIM_PREFIX): t for k, t in state.items() if k.startswith(OPTIM_PREFIX)
    }
    return params, optim


def local_chunks(
    starts: list[dict[str, torch.Tensor]],
    end: dict[str, torch.Tensor],
    samples: list[int],
    losses: list[float],
) -> ChunkGradients:
    """A local SGD part's chunks from the states its chunks started from and its end
    parameters: chunk i's "gradient" is its start parameters minus the next chunk's (the last:
    minus ``end``), float32, so that they add up to the part's pseudo-gradient; each start's
    digest is what the node commits."""
    firsts = [split_training_state(s)[0] for s in starts] + [end]
    grads = [
        {n: (a[n] - b[n]).to(torch.float32) for n in a}
        for a, b in zip(firsts[:-1], firsts[1:], strict=True)
    ]
    return ChunkGradients(
        samples=list(samples),
        losses=list(losses),
        grads=grads,
        starts=starts,
        digests=[state_digest(s) for s in starts],
    )


def recompute_local_chunk(
    program: Program,
    spec: common_pb2.JobSpec,
    state: dict[str, torch.Tensor],
    slices: Sequence[Sequence[int]],
    get_batch: Callable[[Sequence[int]], Batch],
    slowdown: SlowdownController,
    scope: SeedScope | None = None,
) -> ComputedUpdate:
    """A checker's recomputation of a local SGD chunk: its steps on ``slices`` from ``state``
    (the checked node's parameters and inner optimizer state at the chunk's start) with a
    fresh inner optimizer of the spec that state is loaded into, each step's draws seeded in
    the checked node's ``scope``. The program holds the start parameters afterwards (the
    caller's job no longer holds its version)."""
    names = program.param_names
    params, optim = split_training_state(state)
    missing = [n for n in names if n not in params]
    if missing or len(params) != len(names):
        raise ValueError(
            f"the snapshot's parameters do not fit the program (missing {missing[:3]})"
        )
    program.set_parameters({n: params[n] for n in names})
    optimizer = build_optimizer(spec, program.parameters())
    load_optimizer_state_tensors(optimizer, names, optim)
    return local_sgd_steps(
        program, optimizer, slices, get_batch, slowdown, micro_batch=spec.micro_batch, scope=scope
    )


def inner_optimizer(job: LoadedJob, spec: common_pb2.JobSpec) -> torch.optim.Optimizer:
    """The job's inner optimizer, built on first use and kept (with its state) across rounds."""
    if job.inner_optimizer is None:
        job.inner_optimizer = build_optimizer(spec, job.program.parameters())
    return job.inner_optimizer


def step_timeout(task: agent_pb2.Task) -> float:
    """How long one call of the task's program may take before its child counts as hung: twice
    the task's deadline (from the node's measured speed), at least MIN_STEP_TIMEOUT_S."""
    if task.deadline_seconds > 0:
        return max(MIN_STEP_TIMEOUT_S, 2.0 * task.deadline_seconds)
    return DEFAULT_STEP_TIMEOUT_S


def require_finite(update: ComputedUpdate) -> ComputedUpdate:
    """The update, checked before anything is sent: a non-finite loss or tensor is the job's
    fault (ProgramFault), reported as such instead of pushed (where it would cost the node a
    strike)."""
    if not math.isfinite(update.mean_loss):
        raise ProgramFault(
            f"the job's program computed a non-finite loss ({update.mean_loss})", NONFINITE
        )
    for name, t in update.tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ProgramFault(
                f"the job's {update.kind} for {name!r} is not finite (the training diverged)",
                NONFINITE,
            )
    return update


def update_in_thread(
    ctx: TaskContext,
    job: LoadedJob,
    task: agent_pb2.Task,
    *,
    verify: bool = False,
) -> ComputedUpdate:
    """The task's update from the parameters the job holds now (see the module docstring),
    checked to be finite; runs on the compute thread. ``verify``: cut a sync part into the
    task's verify_chunks (parameter-server rounds). The round's tamper is ``ctx.tamper``."""
    return require_finite(_compute(ctx, job, task, verify=verify))


def _compute(
    ctx: TaskContext,
    job: LoadedJob,
    task: agent_pb2.Task,
    *,
    verify: bool = False,
) -> ComputedUpdate:
    tamper = ctx.tamper
    if isinstance(job.program, ConfinedProgram):
        job.program.timeout_s = step_timeout(task)
    indices = ranges_to_indices(task.ranges)
    spec = task.spec
    partly = tamper.partial(task.round)
    scope = SeedScope(task.job_id, int(task.round), ctx.node_id)
    if not is_local_sgd(spec):
        if len(indices) != task.local_batch:
            raise ValueError(
                f"task names {len(indices)} samples but local_batch {task.local_batch}"
            )
        chunked = verify and task.verify_chunks > 0
        if chunked and partly:
            total = len(chunk_bounds(len(indices), task.verify_chunks))
            chunks, compute_s = compute_chunks(
                job.program,
                job.dataset.get_batch(indices),
                ctx.slowdown,
                spec.micro_batch,
                task.verify_chunks,
                count=tamper.share(total),
                seeds=chunk_seeds(scope, indices, task.verify_chunks),
            )
            chunks.losses, chunks.grads = tamper.filled_chunks(chunks.losses, chunks.grads, total)
            update = update_from_chunks(chunks, compute_s)
        elif chunked:
            update = chunked_gradient_step(
                job.program,
                job.dataset.get_batch(indices),
                ctx.slowdown,
                spec.micro_batch,
                task.verify_chunks,
                chunk_seeds(scope, indices, task.verify_chunks),
            )
        elif partly:
            part = indices[: tamper.share(len(indices))]
            update = gradient_step(
                job.program,
                job.dataset.get_batch(part),
                ctx.slowdown,
                spec.micro_batch,
                scope.seed(part),
            )
            update.num_samples = len(indices)  # claimed
        else:
            update = gradient_step(
                job.program,
                job.dataset.get_batch(indices),
                ctx.slowdown,
                spec.micro_batch,
                scope.seed(indices),
            )
        return tamper.sent(job, task, update)

    slices = inner_step_slices(indices, task.local_batch, task.inner_steps or spec.inner_steps)
    if job.follow_restore(task):
        ctx.log.info(
            "round %d: the job's state was restored (version %d): a fresh inner optimizer",
            task.round,
            task.restored_version,
        )
    opt = inner_optimizer(job, spec)
    chunk_steps = local_sgd_grid(len(slices), task.verify_chunks) if verify else []
    todo = slices
    if partly and chunk_steps:  # the first chunks' steps only; the rest made up below
        chunk_steps = chunk_steps[: tamper.share(len(chunk_steps))]
        todo = slices[: chunk_steps[-1][1]]
    elif partly:
        todo = slices[: tamper.share(len(slices))]
    budget = ctx.time_box(task.compute_budget_seconds)
    if 0 < budget <= task.compute_budget_seconds - 0.01:
        ctx.log.info(
            "round %d: time box %.2fs instead of %.2fs (the task waited for the agent's "
            "work before it)",
            task.round,
            budget,
            task.compute_budget_seconds,
        )
    try:
        update = local_sgd_steps(
            job.program,
            opt,
            todo,
            job.dataset.get_batch,
            ctx.slowdown,
            ctx.check_cancelled,
            0.0 if partly else budget,
            micro_batch=spec.micro_batch,
            chunk_steps=chunk_steps,
            scope=scope,
        )
    except BaseException:
        # The steps that ran changed the optimizer's state (after a diverging step: inf or NaN
        # momentum, which would fail every later round at its first step): the next round
        # starts with a fresh inner optimizer.
        job.inner_optimizer = None
        raise
    if partly and update.chunks is not None:
        update = tamper.filled_local_update(update, slices, task.verify_chunks)
    elif partly:
        update.num_samples, update.steps = len(indices), len(slices)  # claimed
    update = tamper.sent(job, task, update)
    if update.chunks is None:
        return update
    # The pieces it reached, grouped into the chunks it commits (a new update: a tamper may
    # keep the pieces of this one for the next round).
    return replace(update, chunks=grouped_local_chunks(update.chunks, task.verify_chunks))


def grouped_local_chunks(pieces: ChunkGradients, verify_chunks: int) -> ChunkGradients:
    """A local SGD part's chunks from the pieces of its grid it reached
    (`epochmesh.verification.local_sgd_groups`): each chunk starts where its first piece
    started, holds their samples, their sample-weighted loss and the sum of their parameter
    differences."""
    groups = local_sgd_groups(len(pieces.grads), verify_chunks)
    samples = [sum(pieces.samples[a:b]) for a, b in groups]
    losses = [
        sum(n * x for n, x in zip(pieces.samples[a:b], pieces.losses[a:b], strict=True))
        / max(1, total)
        for (a, b), total in zip(groups, samples, strict=True)
    ]
    grads = []
    for a, b in groups:
        summed = {n: t.clone() for n, t in pieces.grads[a].items()}
        for piece in pieces.grads[a + 1 : b]:
            for n, t in piece.items():
                summed[n].add_(t)
        grads.append(summed)
    return ChunkGradients(
        samples=samples,
        losses=losses,
        grads=grads,
        starts=[pieces.starts[a] for a, _ in groups],
        digests=[pieces.digests[a] for a, _ in groups],
    )


async def compute_update(
    ctx: TaskContext,
    job: LoadedJob,
    task: agent_pb2.Task,
    *,
    verify: bool = False,
) -> ComputedUpdate:
    """:func:`update_in_thread` on the compute thread."""
    return await ctx.run_compute(partial(update_in_thread, verify=verify), ctx, job, task)


# -- compression --------------------------------------------------------------------------------


def job_error_feedback(job: LoadedJob, spec: common_pb2.JobSpec) -> ErrorFeedback | None:
    """The job's error feedback for the spec's codec (None for codecs that go without)."""
    codec = spec.compression or "none"
    if codec not in ERROR_FEEDBACK_CODECS:
        return None
    ratio = spec.topk_ratio if spec.topk_ratio > 0 else 0.01
    ef = job.error_feedback
    if ef is None or ef.codec != codec or ef.ratio != ratio:
        ef = job.error_feedback = ErrorFeedback(codec, ratio)
    return ef


def encode_update(
    update: ComputedUpdate, spec: common_pb2.JobSpec, error_feedback: ErrorFeedback | None
) -> tuple[common_pb2.TensorBundle, bytes]:
    """The update as a bundle in the spec's codec (floating tensors; others travel raw)."""
    return encode_bundle(
        update.tensors,
        spec.compression or "none",
        topk_ratio=spec.topk_ratio if spec.topk_ratio > 0 else 0.01,
        error_feedback=error_feedback,
    )
