"""SchedulerService.QuoteJob: gathers what `coordinator.market.quote_estimate.estimate` needs
(the nodes that could take a job, the live jobs and who holds which node, the steps measured
so far and the fixed costs recorded rounds show) and answers with its estimate.

Measured steps: the applied parts of the last RATE_ROUNDS rounds of the RECENT_JOBS newest
succeeded jobs and of the live ones, one point per node and local batch (the median compute
seconds), with the node's reference benchmark and the program's FLOPs when known.

The program's FLOPs per sample are the coordinator's own count (`TrainingEngine.program_flops`:
the program check of the uploaded program and initial state the request names, remembered per
program in coordinator/market/program_flops.py, as every submitted job's are): the figure a
client sends is not used, so a client cannot skew its own quote nor, through the calibration
of jobs run with its program, anyone else's.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence

from coordinator.accounting.billing import per_credit
from coordinator.core.errors import FailedPreconditionError, InvalidArgumentError
from coordinator.core.ids import require_sha256
from coordinator.core.principal import current_principal_id
from coordinator.engine.api import TrainingEngine
from coordinator.market.program_flops import known_flops
from coordinator.market.quote_estimate import (
    QUICK_REFERENCE_BATCHES,
    Cluster,
    Estimate,
    History,
    Measured,
    Node,
    Program,
    QuotedJob,
    bench_seconds,
    default_overhead,
    estimate,
    job_history,
    step_model,
)
from coordinator.nodes.kinds import node_kind
from coordinator.nodes.registry import NodeRegistry
from coordinator.scheduling.cluster_scheduler import Holding, JobRequest, tier_of
from coordinator.store.base import Store
from epochmesh.quote import REFERENCE_FLOPS_PER_SAMPLE, max_price_of
from epochmesh.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

RECENT_JOBS = 10  # ended jobs whose rounds calibrate a quote
RATE_ROUNDS = 20  # of a job: its last rounds' applied parts are its measured steps
FAR_MS = 2**62  # a live job's nodes stay with it in the quote's scheduler pass

JS = common_pb2.JobState


def _check(req: scheduler_pb2.QuoteJobRequest) -> None:
    spec = req.spec
    if spec.global_batch <= 0:
        raise InvalidArgumentError("spec.global_batch must be > 0")
    if spec.epochs <= 0:
        raise InvalidArgumentError("spec.epochs must be > 0")
    if req.num_samples <= 0:
        raise InvalidArgumentError("num_samples must be > 0")
    for name, value in (("flops_per_sample", req.flops_per_sample),):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"{name} must be a finite number >= 0")
    if req.state_bytes < 0:
        raise InvalidArgumentError("state_bytes must not be negative")
    if req.program_sha256:
        require_sha256(req.program_sha256, "program_sha256")
    if req.initial_state_sha256:
        require_sha256(req.initial_state_sha256, "initial_state_sha256")
    try:
        tier_of(spec.priority)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def quote_node(info: common_pb2.NodeInfo) -> Node:
    b = info.benchmark
    return Node(
        node_id=info.node_id,
        kind=node_kind(info),
        reference_rate=b.samples_per_second,
        price=max(0, info.price_micro_per_hour),
        max_batch=max(0, b.max_batch_size),
        bandwidth=b.bandwidth_bytes_per_second,
        rtt_s=b.rtt_ms / 1000 if math.isfinite(b.rtt_ms) and b.rtt_ms > 0 else 0.0,
        quick_bench=tuple(sorted(p.batch_size for p in b.points)) == QUICK_REFERENCE_BATCHES,
    )


def _live(engine: TrainingEngine) -> tuple[Cluster, list[common_pb2.Job]]:
    jobs = []
    holdings: dict[str, Holding] = {}
    live_jobs = []
    for job, plan in engine.queue():
        spec = job.spec
        live_jobs.append(job)
        jobs.append(
            JobRequest(
                job_id=job.job_id,
                tenant=job.owner,
                tier=tier_of(spec.priority),
                min_nodes=spec.min_nodes,
                max_nodes=max(spec.min_nodes, min(spec.max_nodes, spec.global_batch)),
                submitted_ms=job.created_ms,
                remaining_samples=float(max(0, spec.epochs * job.num_samples - job.samples_done)),
                max_price=max_price_of(spec),
                per_credit=per_credit(spec),
            )
        )
        for n in plan.nodes:
            holdings[n] = Holding(job.job_id, FAR_MS, FAR_MS)
    weights = engine.scheduling.weights
    cluster = Cluster(
        jobs=jobs, job_rates=engine.job_rates(), holdings=holdings, weights=dict(weights)
    )
    return cluster, live_jobs


def _steps(
    job: common_pb2.Job,
    rounds: Sequence[common_pb2.RoundRecord],
    registry: NodeRegistry,
    known: Mapping[str, float],
) -> list[Measured]:
    """The job's measured steps: per node and local batch, the median compute seconds of
    its applied parts in ``rounds``."""
    by_step: dict[tuple[str, int], list[float]] = {}
    for r in rounds:
        for p in r.parts:
            if p.status == "applied" and p.local_batch > 0 and p.seconds > 0:
                by_step.setdefault((p.node_id, p.local_batch), []).append(p.seconds)
    sha = job.program.sha256
    out = []
    for (node_id, batch), seconds in by_step.items():
        info = registry.get(node_id)
        if info is None or info.benchmark.samples_per_second <= 0:
            continue
        out.append(
            Measured(
                kind=node_kind(info),
                program=sha,
                flops_per_sample=known.get(sha, 0.0),
                batch=batch,
                seconds=statistics.median(seconds),
                reference_rate=info.benchmark.samples_per_second,
            )
        )
    return out


async def _recorded(
    store: Store,
    registry: NodeRegistry,
    known: Mapping[str, float],
    live: Sequence[common_pb2.Job],
) -> tuple[History, list[Measured]]:
    """The fixed costs of the recently ended jobs, and the steps measured in them and in the
    live jobs."""
    ended = await store.list_jobs(states=[JS.JOB_STATE_SUCCEEDED], limit=RECENT_JOBS)
    spans = []
    measured = []
    for job in ended:
        rounds = await store.list_rounds(job.job_id)
        if not rounds:
            continue
        compute = sum(
            max((p.seconds for p in r.parts if p.status == "applied"), default=0.0) for r in rounds
        )
        steps = _steps(job, rounds[-RATE_ROUNDS:], registry, known)
        measured += steps
        spans.append(
            (
                job.created_ms,
                rounds[0].started_ms,
                rounds[-1].finished_ms,
                len(rounds),
                compute,
                _bench(job, rounds, registry, known, steps),
                max(0, job.initial_state.size),
                statistics.median(
                    sum(1 for p in r.parts if p.status == "applied") or 1 for r in rounds
                ),
            )
        )
    for job in live:
        rounds = await store.list_rounds(job.job_id)
        measured += _steps(job, rounds[-RATE_ROUNDS:], registry, known)
    nodes = [quote_node(i) for i in registry.eligible_nodes()]
    return job_history(spans, default_overhead(nodes)[1]), measured


def _bench(
    job: common_pb2.Job,
    rounds: Sequence[common_pb2.RoundRecord],
    registry: NodeRegistry,
    known: Mapping[str, float],
    steps: Sequence[Measured],
) -> float:
    """The predicted seconds of the job benchmark its first round's nodes ran (0: its FLOPs
    unknown)."""
    program = Program(known.get(job.program.sha256, 0.0), job.program.sha256)
    if program.flops_per_sample <= 0:
        return 0.0
    out = 0.0
    for p in rounds[0].parts:
        info = registry.get(p.node_id)
        if info is not None:
            node = quote_node(info)
            model = step_model(node.kind, program, steps)
            out = max(out, bench_seconds(node, model, program.flops_per_sample))
    return out


def response(
    est: Estimate, infos: Mapping[str, common_pb2.NodeInfo], history: History
) -> scheduler_pb2.QuoteJobResponse:
    chosen = {n.node_id: n for n in est.nodes}

    def finite(x: float) -> float:
        return x if math.isfinite(x) else 0.0

    nodes = []
    for node_id, (rate, source) in sorted(est.rates.items()):
        info = infos[node_id]
        c = chosen.get(node_id)
        nodes.append(
            scheduler_pb2.QuoteNode(
                node_id=node_id,
                name=info.name,
                price_micro_per_hour=max(0, info.price_micro_per_hour),
                samples_per_second=rate,
                rate_source=source,
                reference_samples_per_second=info.benchmark.samples_per_second,
                local_batch=c.local_batch if c is not None else 0,
                chosen=c is not None,
            )
        )
    return scheduler_pb2.QuoteJobResponse(
        nodes=nodes,
        fits=est.fits,
        reason=est.reason,
        rounds=est.rounds,
        checkpoints=est.checkpoints,
        start_seconds=finite(est.start_s),
        round_compute_seconds=finite(est.round_compute_s),
        round_overhead_seconds=finite(est.round_overhead_s),
        checkpoint_seconds=finite(est.checkpoint_s),
        epoch_seconds=finite(est.epoch_seconds),
        total_seconds=finite(est.total_seconds),
        epoch_cost_micro=est.epoch_cost,
        total_cost_micro=est.total_cost,
        fee_micro=est.fee,
        overhead_source=est.overhead_source,
        recorded_jobs=history.jobs,
        reference_flops_per_sample=REFERENCE_FLOPS_PER_SAMPLE,
    )


async def quote_job(
    req: scheduler_pb2.QuoteJobRequest,
    registry: NodeRegistry,
    store: Store,
    engine: TrainingEngine,
    now_ms: int,
    fee_ppm: int = 0,
) -> scheduler_pb2.QuoteJobResponse:
    """The quote of the job ``req`` describes, for the calling tenant, with the coordinator's
    platform fee (``fee_ppm``) on every part."""
    _check(req)
    spec = req.spec
    flops = 0.0
    if req.program_sha256 and req.initial_state_sha256:
        flops = await engine.program_flops(
            common_pb2.BlobRef(sha256=req.program_sha256),
            common_pb2.BlobRef(sha256=req.initial_state_sha256),
        )
    known = await known_flops(store)
    flops = flops or known.get(req.program_sha256, 0.0)
    infos = {i.node_id: i for i in registry.eligible_nodes()}
    cluster, live_jobs = _live(engine)
    history, measured = await _recorded(store, registry, known, live_jobs)
    if flops <= 0 and not any(m.program == req.program_sha256 for m in measured if m.program):
        raise FailedPreconditionError(
            "the coordinator has not counted this program's FLOPs: upload the program and its "
            "initial state and name both in the request (epochmesh quote JOB.toml does)"
        )
    job = QuotedJob(
        tenant=current_principal_id() or "",
        priority=tier_of(spec.priority),
        min_nodes=spec.min_nodes,
        max_nodes=max(spec.min_nodes, min(spec.max_nodes, spec.global_batch)),
        global_batch=spec.global_batch,
        epochs=spec.epochs,
        num_samples=req.num_samples,
        checkpoint_every=spec.checkpoint_every,
        max_price=max_price_of(spec),
        per_credit=per_credit(spec),
    )
    program = Program(flops, req.program_sha256, req.state_bytes)
    est = estimate(
        now_ms,
        job,
        program,
        [quote_node(i) for i in infos.values()],
        cluster,
        measured,
        history,
        fee_ppm,
    )
    reply = response(est, infos, history)
    reply.flops_per_sample = flops
    return reply
