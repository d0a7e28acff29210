"""Task dispatch: what the agent does with each Task that NextTask hands out.

- TASK_KIND_BENCHMARK: fetch the job's blobs (program, initial state, shards) through the
  cache, load the exported program (epochmesh.program.archive) and benchmark its loss-and-gradients
  step on batches drawn from the shards at the task's batch sizes (the reference model when
  the task names no program), measure the network, answer with
  ReportBenchmark(task_id, result with job_id).
- TASK_KIND_TRAIN with `task.ring` (ring members of an aggregation = "ring" job):
  `node_agent.training.ring_round.run_ring_task(ctx, task, ctx.peer)` (ring all-reduce between agents;
  an agent started with --no-peer reports such a task failed). Any other TRAIN task
  (parameter-server mode, and --no-peer nodes of a ring job, which the coordinator aggregates):
  `node_agent.training.ps_round.run_train_task(ctx, task)`.
- TASK_KIND_CHECK (verification, issue 20): `node_agent.training.check_task.run_check_task(ctx, task)`
  recomputes one chunk of another node's part and answers ReportCheck.
- Any other kind is reported failed.

A handler that raises is reported failed with the error's message (ReportProgress failed=True;
for a CHECK task ReportCheck failed=True, the answer the coordinator waits for);
an exception never ends the agent. A ProgramFault (the job's program crashed, hung, hit a limit
or computed a non-finite loss or gradient) is reported with job_fault=True: the job's fault. A cancelled task (TaskCancelled) is reported failed with
"abandoned: <reason>", so that the coordinator can hand its work to another node.

`TaskContext` (node_agent.training.context) is everything a handler may use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch

from epochmesh.optim import build_optimizer, optimizer_step
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.link.connection import (
    Expired,
    Stopped,
    describe,
)
from node_agent.sandbox.host import (
    ChildMemoryMeter,
    ProgramFault,
    ProgramHosts,
    job_memory_budget,
)
from node_agent.training import check_task, ps_round, ring_round
from node_agent.training.benchmark import (
    BenchmarkCancelled,
    StepFactory,
    benchmark_model,
    build_result,
)
from node_agent.training.context import TaskCancelled, TaskContext
from node_agent.training.reference_model import reference_step_factory

log = logging.getLogger(__name__)


# -- dispatch -----------------------------------------------------------------------------------


async def dispatch_task(ctx: TaskContext) -> None:
    """Run one task to its end; never raises except CancelledError (and Stopped)."""
    task = ctx.task
    kind = (
        agent_pb2.TaskKind.Name(task.kind)
        if task.kind in agent_pb2.TaskKind.values()
        else task.kind
    )
    ctx.log.info("starting %s for job %s", kind, task.job_id or "-")
    start = time.monotonic()
    try:
        if task.kind == agent_pb2.TASK_KIND_BENCHMARK:
            await run_benchmark_task(ctx)
        elif task.kind == agent_pb2.TASK_KIND_TRAIN:
            await run_train_task(ctx)
        elif task.kind == agent_pb2.TASK_KIND_CHECK:
            await run_check_task(ctx)
        else:
            await ctx.report_failure(f"unsupported task kind {kind}")
            return
    except (TaskCancelled, BenchmarkCancelled):
        await ctx.report_failure(f"abandoned: {ctx.cancel_reason or 'cancelled'}")
        return
    except Stopped:
        raise
    except Expired as exc:
        await ctx.report_failure(f"deadline passed: {exc}")
        return
    except ProgramFault as exc:
        await ctx.report_failure(str(exc), job_fault=True)
        return
    except grpc.aio.AioRpcError as exc:
        await ctx.report_failure(f"coordinator call failed: {describe(exc)}")
        return
    except Exception as exc:
        ctx.log.exception("task failed")
        await ctx.report_failure(f"{type(exc).__name__}: {exc}")
        return
    ctx.log.info("done in %.2fs", time.monotonic() - start)


async def run_train_task(ctx: TaskContext) -> None:
    if ctx.task.ring.node_ids:
        if ctx.peer is None:
            await ctx.report_failure(
                "this agent runs no PeerService (--no-peer) and cannot be a ring member"
            )
            return
        await ring_round.run_ring_task(ctx, ctx.task, ctx.peer)
        return
    await ps_round.run_train_task(ctx, ctx.task)


async def run_check_task(ctx: TaskContext) -> None:
    await check_task.run_check_task(ctx, ctx.task)


# -- benchmark tasks ----------------------------------------------------------------------------


def _refs(task: agent_pb2.Task) -> list[common_pb2.BlobRef]:
    refs = [task.program, task.initial_state, *(s.blob for s in task.shards)]
    return [r for r in refs if r.sha256]


def program_step_factory(
    task: agent_pb2.Task,
    program: Path,
    initial_state: Path,
    shards: list[Path],
    programs: ProgramHosts,
    loaded: list[Any] | None = None,
) -> StepFactory:
    """Load the job's exported program (into a confined child) and its shards; `make_step(b)`
    then computes the loss and gradients of b samples drawn (cyclically) from the shards, as a
    TRAIN round would (in a local SGD job also an optimizer step, at learning rate 0).
    `loaded` (a list) receives (program, dataset), for the trainer to keep."""
    from epochmesh.dataset import ShardedDataset

    if not shards:
        raise ValueError("the benchmark task names no shard to draw sample batches from")
    prog = programs.load(program.read_bytes(), initial_state.read_bytes())
    dataset = ShardedDataset(
        [(s.start, s.count, path) for s, path in zip(task.shards, shards, strict=True)],
        inputs=list(task.spec.inputs),
        targets=list(task.spec.targets),
    )
    available = [i for start, stop in dataset.ranges for i in range(start, stop)]
    if loaded is not None:
        loaded[:] = [prog, dataset]
    # Local SGD: a round's inner step also runs the node's optimizer; so does the benchmark's
    # step, with a learning rate of 0 (same arithmetic, parameters unchanged: the program is
    # kept for training).
    inner: torch.optim.Optimizer | None = None
    if task.spec.sync == "local_sgd":
        frozen = common_pb2.JobSpec()
        frozen.CopyFrom(task.spec)
        frozen.lr = 0.0
        inner = build_optimizer(frozen, prog.parameters())
    params = prog.parameters()
    names = prog.param_names

    def make_step(batch_size: int) -> Callable[[], None]:
        indices = [available[i % len(available)] for i in range(batch_size)]
        inputs, targets = dataset.get_batch(indices)

        def step() -> None:
            _, grads = prog.loss_and_grads(inputs, targets)
            if inner is not None:
                optimizer_step(inner, params, names, grads)

        return step

    return make_step


def job_step_factory(
    ctx: TaskContext,
    program: Path | None,
    initial_state: Path | None,
    shards: list[Path],
    loaded: list[Any] | None = None,
) -> tuple[Callable[[], StepFactory], str]:
    """How to build the job's training step on ctx.device, and a description for the logs.

    A task without a program (or initial state) benchmarks the built-in reference model.
    `loaded`: see program_step_factory.
    """
    if program is None or initial_state is None:
        return partial(reference_step_factory, ctx.device), "reference model"
    return (
        partial(
            program_step_factory, ctx.task, program, initial_state, shards, ctx.programs, loaded
        ),
        "job's program (confined)",
    )


def _keep_for_training(ctx: TaskContext, job_id: str, loaded: list[Any]) -> bool:
    """Hand the benchmark's loaded program and shards to the trainer (see
    node_agent.training.jobs.LoadedJobs.adopt); False when it did not take them."""
    if len(loaded) != 2:
        return False
    if ctx.jobs.adopt(ctx.programs, job_id, loaded[0], loaded[1]):
        log.debug("job %s: the benchmark's program is kept for training", job_id)
        return True
    return False


async def run_benchmark_task(ctx: TaskContext) -> None:
    task = ctx.task
    for shard in task.shards:
        if not shard.blob.sha256:
            raise ValueError(f"shard at sample {shard.start} has no blob reference")
    paths: dict[str, Path] = {}
    for ref in _refs(task):
        paths[ref.sha256] = await ctx.fetch_blob(ref)
    program = paths.get(task.program.sha256) if task.program.sha256 else None
    state = paths.get(task.initial_state.sha256) if task.initial_state.sha256 else None
    shards = [paths[s.blob.sha256] for s in task.shards]
    ctx.check_cancelled()
    loaded: list[Any] = []
    build, what = job_step_factory(ctx, program, state, shards, loaded)
    meter = ChildMemoryMeter(lambda: loaded[0]) if program is not None else None
    plan = ctx.job_benchmark.with_batch_sizes(task.benchmark_batch_sizes)
    ctx.log.info("benchmarking the %s at batch sizes %s", what, list(plan.batch_sizes))
    kept = False
    try:
        points = await ctx.run_compute(
            partial(
                benchmark_model,
                build,
                ctx.device,
                plan,
                ctx.slowdown,
                memory_limit_bytes=ctx.memory_limit_bytes,
                should_stop=ctx.cancelled.is_set,
                meter=meter,
            )
        )
        ctx.check_cancelled()
        if task.job_id:
            kept = _keep_for_training(ctx, task.job_id, loaded)
    finally:
        if loaded and not kept:
            ctx.programs.release(loaded[0])
    rtt_ms, bandwidth = await ctx.connection.measure_network()
    result = build_result(
        points,
        ctx.device_info,
        slowdown=ctx.slowdown.factor,
        memory_limit_bytes=ctx.memory_limit_bytes,
        rtt_ms=rtt_ms,
        bandwidth=bandwidth,
        job_id=task.job_id,
    )
    if task.job_id:
        result = ctx.tamper.benchmarked(result)
    if program is not None and task.job_id:
        budget = job_memory_budget(points, result.max_batch_size)
        ctx.programs.limit_job_memory(task.job_id, budget, loaded[0] if kept else None)
    await ctx.call(
        "ReportBenchmark",
        lambda: agent_pb2.ReportBenchmarkRequest(
            node_id=ctx.node_id, lease_id=ctx.lease_id, task_id=task.task_id, result=result
        ),
    )
    ctx.log.info(
        "benchmark reported: %.1f samples/s, max batch %d",
        result.samples_per_second,
        result.max_batch_size,
    )
