"""One job's life on the coordinator: node set, benchmarks, rounds, checkpoints, the result.

This is the parameter-server runner; `coordinator.ring_runner.RingJobRunner` runs ring jobs
with the same node set, planning, ledger, records and checkpoints.

The runner is a single asyncio task per job; every change to the job's ledger, estimator and
parameter server happens on it, so none of them needs a lock. RPC handlers (PushUpdate,
ReportProgress, node events) only drop results into the open `RoundState` and wake it.

A round:
  1. node set: eligible nodes claimed for this job (at most max_nodes, at most global_batch),
     each benchmarked on the job's own program first; fewer than min_nodes -> PAUSED;
  2. plan: b_i from the throughput estimates (largest remainder, capped by each node's max
     batch), slices from the epoch ledger, a deadline from the estimates; in local SGD every
     node runs the same H inner steps of b_i samples, so it gets H*b_i samples (fewer at an
     epoch's end), b_i is planned on each node's per-step time (fixed + per-sample part, see
     coordinator/throughput.py) so that the H steps take every node the same time, and the
     estimates and deadline work in samples. On the parameter server local SGD rounds are
     time-boxed (``time_boxed``): each node gets a box (the latest planned end of the round's
     awaited nodes minus its own communication) and ranges for 1.25 times the steps the box
     is sized for; it steps until the box runs out and pushes the prefix it trained, so a node
     faster than its estimate trains more and nobody waits for a slower one. The rounds left in
     an epoch are sized alike, and an epoch's last round is not boxed (it trains what is left,
     so no short tail round follows a box that ended early); nor is a round that computes for
     less time than it communicates (millisecond boxes are timer noise, and waiting is cheap). A part's sample ranges (tens of
     thousands of index runs in a big local SGD round) stay in numpy and reach the Task and the
     round record as encoded wire bytes, which keeps the event loop free;
  3. wait until every node has pushed its gradient or failed, the deadline passes, or a node
     falls silent (no heartbeat for SILENCE_HEARTBEATS intervals: killed, cut off, hung); a
     deadline that passes before any node delivered is extended (at most twice): the estimates
     were wrong for everyone, e.g. in a first round;
  4. apply: sample-weighted mean of the received gradients (local SGD: pseudo-gradients,
     start - end of the inner steps), one step of the round optimizer (the spec's, or local
     SGD's outer Nesterov SGD); slices of applied nodes commit (a time-boxed part: the prefix
     it trained, the rest back to the head of its node's segment), the others return to
     pending in the same epoch. Updates arrive compressed with the spec's codec (exactly that
     one for every floating tensor, else INVALID_ARGUMENT and a strike);
  5. record the round in one store transaction, written in the background while the next
     round runs (records in order; a checkpoint only after the records it covers); every K
     rounds and at an epoch's end a checkpoint: its state is copied at once and written in
     the background too (checkpoints in order; a ring job writes its records and
     checkpoints in line).

Faults:
  - a node whose lease ends (expiry, Leave, or a re-registration of the same id after a
    restart) leaves the job at the next round boundary: its segment returns to the others, and
    its job benchmark is forgotten, so that a returning agent is benchmarked again and joins
    with a fresh share;
  - a silent node (see 3.) sits out the following rounds until it heartbeats again or its
    lease lapses;
  - fewer than min_nodes usable nodes: the job is PAUSED (an event says why) until enough
    come back;
  - after a coordinator restart the job resumes from its last checkpoint: parameters,
    optimizer state and the ledger as they were then; later rounds are marked rolled back (their
    samples are pending again), round numbers continue after the highest one ever recorded, and
    the parameter version jumps past every version ever handed out, so that no agent mistakes
    the parameters it holds from before the restart for the restored ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from coordinator.allocator import quotas, split_batch
from coordinator.checkpoint import CheckpointManifest, tensors_from_bytes, tensors_to_bytes
from coordinator.ledger import EpochLedger
from coordinator.param_server import ParameterServer
from coordinator.rounds import NodeStats, Part, RoundState, part_record
from coordinator.sample_ranges import (
    TASK_RANGES_FIELD,
    encode_ranges_field,
    head_of_runs,
    index_run_array,
    touched_shards,
)
from coordinator.store import FailedPreconditionError
from coordinator.throughput import MIN_SLACK, ThroughputEstimator
from epochmesh.errors import ProgramError
from epochmesh.program import read_initial_state
from epochmesh.program_inspection import inspect_program_async
from epochmesh.tensors import encode_bundle, to_safetensors
from epochmesh.timeutil import now_ms
from epochmesh.v1 import agent_pb2, common_pb2

if TYPE_CHECKING:
    from coordinator.runner_host import RunnerHost

log = logging.getLogger(__name__)

JS = common_pb2.JobState
TERMINAL = (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED)
# A node that fails this many tasks of a job in a row is left out of that job.
MAX_CONSECUTIVE_FAILURES = 3
# A job fails for its own fault (its program crashed, hung, hit a limit or computed non-finite
# values) once this many distinct nodes report such a fault since its last applied round (or
# every node it has, when it has fewer): one node alone cannot end another tenant's job.
JOB_FAULT_NODES = 2
# A round whose deadline passes before any node delivered waits at most this many times longer.
MAX_DEADLINE_EXTENSIONS = 2
# Time-boxed local SGD rounds (parameter server): each node gets a time box and ranges for
# this much more than the steps the box is sized for; a node faster than its estimate runs more
# steps in the box, a slower one fewer, and nobody waits for the others (see _plan_parts).
TIME_BOX_EXTRA_STEPS = 0.25
# A round's apply (aggregation, optimizer step, encoding the new parameters) that takes less
# than this runs on the event loop: handing it to a worker thread and back costs 1-3 ms on a
# busy host (measured: most of the time between a small model's last update and the next
# round). Longer ones go to a thread, so that the event loop keeps serving. Judged by the
# last apply; the first one by the parameters' size at APPLY_SECONDS_PER_BYTE, ten times the
# ~2 ns per byte measured here for SGD with momentum plus encoding (a 77 KB model: 0.18 ms).
INLINE_APPLY_MAX_S = 0.002
APPLY_SECONDS_PER_BYTE = 20e-9
# Benchmark tasks get this long, plus the node's lease, before they are asked again.
BENCHMARK_TIMEOUT_S = 120.0
BENCH_STATE_PREFIX = "bench/"
# A stopping runner gets this long to reach a safe point before it is cancelled.
STOP_GRACE_S = 3.0


class JobRunner:
    def __init__(self, host: RunnerHost, job: common_pb2.Job) -> None:
        self.host = host
        self.ctx = host.ctx
        self.job = job
        self.job_id = job.job_id
        self.spec = job.spec
        self.changed = asyncio.Condition()
        self.round_state: RoundState | None = None
        self.nodes: list[str] = []  # this job's node set, in join order
        self.bench: dict[str, common_pb2.BenchmarkResult] = {}
        self.bench_pending: dict[str, tuple[str, float]] = {}  # node -> (task_id, asked at)
        self.stats: dict[str, NodeStats] = {}
        self.batches: dict[str, int] = {}
        self.estimator = ThroughputEstimator()
        self.ps: ParameterServer
        self.ledger: EpochLedger
        self.state_names: list[str] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}  # tied weights: {alias: parameter name}
        self.params_payload: tuple[common_pb2.TensorBundle, bytes] | None = None
        self.params_payload_version = -1
        self._shard_starts: np.ndarray | None = None  # the job's shards' starts (a task's shards)
        self._state_payload: tuple[tuple[int, bool], common_pb2.TensorBundle, bytes] | None = None
        self.next_round = 1
        self.rounds_applied = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._checkpoint_task: asyncio.Task[None] | None = None  # see _checkpoint_soon
        self._record_task: asyncio.Task[None] | None = None  # see _close_round
        # The newest round whose record is in the store (None: not known, e.g. after a restart).
        self.stored_round: int | None = None
        # The runner is done: its job's last records and events (the terminal state, the nodes'
        # release) are stored, so a watcher that stops now has seen everything.
        self.ended = False
        self._record_to_write: tuple[common_pb2.RoundRecord, RoundState, list[Part]] | None = None
        self._overhead_s = 0.0
        self._apply_s: float | None = None  # the last round's apply took (see INLINE_APPLY_MAX_S)
        self._departed: dict[str, str] = {}  # node -> why its lease ended (handled between rounds)
        # Late parts of recent rounds (task -> node, samples): an update that still comes tells
        # how fast the node really was; such figures wait here for the next round's planning.
        self._late: dict[str, tuple[str, int, int]] = {}  # task -> (node, samples, steps)
        self._late_figures: list[tuple[str, int, int, float]] = []
        # Job faults reported since the last applied round (node -> reason), and the verdict
        # that ends the job once enough nodes agree (see JOB_FAULT_NODES).
        self._job_faults: dict[str, str] = {}
        self._job_fault_verdict = ""

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._main(), name=f"job-{self.job_id}")

    async def stop(self) -> None:
        """Stop at the next safe point (the open round is aborted: its slices go back to
        pending); cancel only if that takes longer than STOP_GRACE_S, since a task cancelled
        in the middle of a store write can leave the write half done."""
        self._stop.set()
        self.wake()
        if self._task is not None:
            _, pending = await asyncio.wait({self._task}, timeout=STOP_GRACE_S)
            if pending:
                self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def wake(self) -> None:
        self._wake.set()
        rs = self.round_state
        if rs is not None:
            rs.touch()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    @property
    def terminal(self) -> bool:
        return self.job.state in TERMINAL

    async def _main(self) -> None:
        try:
            await self._restore()
            while not self._stop.is_set() and not self.terminal:
                if self._job_fault_verdict:
                    await self._fail_for_program(self._job_fault_verdict)
                    continue
                if self.job.epoch >= self.spec.epochs:
                    await self._finish()  # SUCCEEDED (terminal), or a ring job rolled back
                    continue
                nodes = await self._gather_nodes()
                if not nodes:
                    continue
                await self._run_round(nodes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("job %s failed", self.job_id)
            await self._fail(f"coordinator error: {type(exc).__name__}: {exc}")
        finally:
            try:
                await self._records_written()
            except Exception:
                log.exception("job %s: a round record could not be written", self.job_id)
            try:
                await self._checkpoint_written()
            except Exception:
                log.exception("job %s: the last checkpoint could not be written", self.job_id)
            await self._release_all()
            self.ended = True
            await self.notify()

    # -- restore / init -------------------------------------------------------------------------

    async def _load_state(self) -> tuple[list[str], dict[str, torch.Tensor], dict[str, str]]:
        """Parameter names, initial state and tied-weight aliases of the job.

        They come from the initial state's metadata (written by packaging; the program was
        checked against them at submission), which spares a restarted coordinator the first
        torch.export load (about two seconds). A state without that metadata (a client other
        than the CLI) has its program loaded for the names, in a confined child process
        (epochmesh.program_inspection), never in this process."""
        state_bytes = await self.ctx.blobs.read_bytes(self.job.initial_state.sha256)
        init = await asyncio.to_thread(read_initial_state, state_bytes, require_params=False)
        if init.param_names is not None:
            return list(init.param_names), dict(init.state), dict(init.aliases)
        program = await self.ctx.blobs.read_bytes(self.job.program.sha256)
        inspection = await inspect_program_async(program, state_bytes)
        if not inspection.ok or not inspection.param_names:
            reason = inspection.reason or "it lists no parameters"
            raise ProgramError(f"the job's program could not be loaded again: {reason}")
        return list(inspection.param_names), dict(init.state), dict(init.aliases)

    def _new_ledger(self, epoch: int) -> EpochLedger:
        block = self.job.shards[0].count if self.job.shards else None
        return EpochLedger(self.job.num_samples, epoch, self.spec.seed, block_size=block)

    async def _restore(self) -> None:
        names, state_dict, self.aliases = await self._load_state()
        self.state_names = list(state_dict)
        skip = set(names) | set(self.aliases)
        self.buffers = {k: v for k, v in state_dict.items() if k not in skip}
        self.ps = ParameterServer(self.spec, {n: state_dict[n] for n in names})
        store = self.ctx.store
        latest = await store.latest_checkpoint(self.job_id)
        all_rounds = await store.list_rounds(self.job_id, include_rolled_back=True)
        self.next_round = (max((r.round for r in all_rounds), default=0)) + 1
        if latest is None:
            self.ledger = self._new_ledger(0)
            await self._checkpoint(last_round=0)
        else:
            _, manifest_bytes = latest
            manifest = CheckpointManifest.from_bytes(manifest_bytes)
            tensors = tensors_from_bytes(await self.ctx.blobs.read_bytes(manifest.tensors_sha256))
            # Versions after the checkpoint (rolled back below) were handed out to agents with
            # other parameters: continue past all of them so that a version names one set only.
            # A round's record is written while the next round runs, so one version past the
            # newest recorded one may have been handed out (never two: a round is handed out
            # only once the record before the last is stored).
            newest = max((r.params_version for r in all_rounds), default=0)
            version = max(manifest.params_version, newest) + 2
            self.ps.load_state_tensors(tensors, version)
            self.ledger = EpochLedger.from_state(manifest.ledger)
            self.ledger.abort_open_rounds()
            rolled = await store.rollback_rounds(self.job_id, manifest.round)
            self.rounds_applied = manifest.rounds_applied
            job = self.job
            job.epoch = manifest.epoch
            job.round = manifest.rounds_applied
            job.params_version = version
            job.samples_done = manifest.samples_done
            job.last_loss = manifest.last_loss
            await self.ctx.events.append(
                "job.restored",
                job_id=self.job_id,
                message=(
                    f"resumed from the checkpoint after round {manifest.round} (epoch "
                    f"{manifest.epoch + 1}, {manifest.rounds_applied} rounds applied): "
                    + (
                        f"{rolled} later round(s) rolled back, their samples are pending again"
                        if rolled
                        else "nothing to roll back"
                    )
                ),
                attrs={
                    "checkpoint_round": str(manifest.round),
                    "rolled_back": str(rolled),
                    "params_version": str(version),
                },
            )
            await store.update_job(job)
        for key_node, result in (await self._load_benchmarks()).items():
            self.bench[key_node] = result
        self.params_payload = None

    async def _load_benchmarks(self) -> dict[str, common_pb2.BenchmarkResult]:
        out: dict[str, common_pb2.BenchmarkResult] = {}
        raw = await self.ctx.store.get_job_state(self.job_id, "benchmarks")
        if raw:
            for node_id, data in json.loads(raw.decode()).items():
                out[node_id] = common_pb2.BenchmarkResult.FromString(bytes.fromhex(data))
        return out

    async def _save_benchmarks(self) -> None:
        data = {n: r.SerializeToString().hex() for n, r in self.bench.items()}
        await self.ctx.store.put_job_state(self.job_id, "benchmarks", json.dumps(data).encode())

    # -- node set -------------------------------------------------------------------------------

    async def _gather_nodes(self) -> list[str]:
        """The nodes of the next round (benchmarked on this job); waits while there are too
        few (PAUSED below min_nodes)."""
        while not self._stop.is_set() and not self.terminal and not self._job_fault_verdict:
            self._wake.clear()
            await self._handle_departures()
            max_nodes = min(self.spec.max_nodes, self.spec.global_batch)
            excluded = [n for n, st in self.stats.items() if st.excluded]
            candidates = await self.host.nodes_for(self.job_id, refused=excluded)
            # Nodes already in the job first, then the fastest by reference benchmark.
            current = [n for n in self.nodes if n in candidates]
            others = sorted(
                (n for n in candidates if n not in current),
                key=lambda n: -self.host.reference_rate(n),
            )
            chosen = (current + others)[:max_nodes]
            for n in chosen:
                if n not in self.bench:
                    await self._ask_benchmark(n)
            for n in {*self.nodes, *self.bench_pending, *candidates} - set(chosen):
                await self._drop_node(n)
            ready = [n for n in chosen if n in self.bench]
            # A silent node (no heartbeat lately: probably dead, its lease not lapsed yet) sits
            # out; it stays in the job and takes part again once it heartbeats.
            live = [n for n in ready if not self.host.is_silent(n)]
            if len(live) >= self.spec.min_nodes:
                self._drop_ghosts()
                # Benchmarked nodes join now; nodes still benchmarking join a later round.
                joined = [n for n in live if n not in self.nodes]
                for n in joined:
                    await self._join(n)
                if joined:
                    self._rerate_unobserved()
                usable = [n for n in self.nodes if n in live]
                why = self._cannot_run(usable)
                if not why:
                    await self._set_state(JS.JOB_STATE_RUNNING, "")
                    return usable
                await self._set_state(JS.JOB_STATE_PAUSED, why)
            elif len(chosen) < self.spec.min_nodes:
                await self._set_state(
                    JS.JOB_STATE_PAUSED,
                    self.host.wait_reason(self.job_id)
                    or f"waiting for nodes: {len(chosen)} usable, min_nodes is "
                    f"{self.spec.min_nodes}",
                )
            elif self.job.state == JS.JOB_STATE_QUEUED:
                self.job.message = f"benchmarking {len(chosen) - len(ready)} node(s)"
            self._start_record_write()  # no round goes out now: write the last one's record
            try:
                timeout = min(1.0, self.ctx.registry.heartbeat_interval_s)
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass
        return []

    def _cannot_run(self, nodes: list[str]) -> str:
        """Why a round cannot run on ``nodes`` (enough of them, benchmarked, live): "" if it
        can. The job is PAUSED with this message meanwhile."""
        return ""

    async def _handle_departures(self) -> None:
        """Nodes whose lease ended since the last round leave the job (see on_node_offline)."""
        if not self._departed:
            return
        departed, self._departed = self._departed, {}
        for node_id, reason in departed.items():
            await self._drop_node(node_id, reason)
        await self._save_benchmarks()

    def _drop_ghosts(self) -> None:
        """Give the segments of ledger nodes that are not in the job (restored from a checkpoint
        of an earlier process) to the nodes that are; a ghost that comes back joins afresh."""
        for n in self.ledger.nodes:
            if n not in self.nodes:
                self.ledger.fail_node(n)

    async def _ask_benchmark(self, node_id: str) -> None:
        pending = self.bench_pending.get(node_id)
        now = time.monotonic()
        timeout = BENCHMARK_TIMEOUT_S + self.ctx.config.lease_ttl
        if pending is not None and now - pending[1] < timeout:
            return
        task_id = "t-" + uuid.uuid4().hex[:12]
        b = self.spec.global_batch
        sizes = sorted({max(1, b // 8), max(1, b // 4), max(1, b // 2), b})
        task = agent_pb2.Task(
            task_id=task_id,
            kind=agent_pb2.TASK_KIND_BENCHMARK,
            job_id=self.job_id,
            spec=self.spec,
            program=self.job.program,
            initial_state=self.job.initial_state,
            shards=list(self.job.shards),  # prefetches the dataset before the first round
            benchmark_batch_sizes=sizes,
        )
        self.bench_pending[node_id] = (task_id, now)
        self.host.enqueue(node_id, task, self.job_id)

    def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        if result.samples_per_second <= 0 or not math.isfinite(result.samples_per_second):
            self._note_failure(node_id, "benchmark reported no throughput")
            return
        self.bench_pending.pop(node_id, None)
        self.bench[node_id] = result
        asyncio.get_running_loop().create_task(self._save_benchmarks())
        self.wake()

    def _bench_rate(self, node_id: str, expected_batch: int) -> float:
        """Samples/s at the benchmarked batch size closest to what the node will compute in one
        pass (its batch, or the job's micro_batch when that is smaller)."""
        if self.spec.micro_batch > 0:
            expected_batch = min(expected_batch, self.spec.micro_batch)
        result = self.bench[node_id]
        fits = [p for p in result.points if not p.out_of_memory and p.samples_per_second > 0]
        if not fits:
            return result.samples_per_second
        best = min(fits, key=lambda p: abs(math.log(p.batch_size / max(1, expected_batch))))
        return best.samples_per_second

    def _bench_points(self, node_id: str) -> list[tuple[int, float]]:
        """(batch size, samples/s) of the node's job benchmark: the shape of its step time."""
        result = self.bench[node_id]
        return [
            (p.batch_size, p.samples_per_second)
            for p in result.points
            if not p.out_of_memory and p.samples_per_second > 0
        ]

    def _max_batch(self, node_id: str) -> int:
        result = self.bench.get(node_id)
        cap = result.max_batch_size if result is not None else 0
        if cap > 0 and 0 < self.spec.micro_batch <= cap:
            # One micro-batch fits the node's memory: it accumulates a local batch of any size.
            return self.spec.global_batch
        return cap if cap > 0 else self.spec.global_batch

    async def _join(self, node_id: str) -> None:
        # The batch the node will get, roughly: the global batch over the node set it is
        # expected to share it with (at least min_nodes; more as nodes join).
        peers = max(len(self.nodes) + 1, self.spec.min_nodes)
        expected = max(1, self.spec.global_batch // min(peers, max(1, self.spec.max_nodes)))
        rate = self._bench_rate(node_id, expected)
        result = self.bench[node_id]
        comm = 0.0
        if result.bandwidth_bytes_per_second > 0:
            comm = 2 * self.ps.num_bytes() / result.bandwidth_bytes_per_second
        comm += result.rtt_ms / 1000.0
        self.estimator.add_node(
            node_id, rate, comm, step_points=self._bench_points(node_id), rated_batch=expected
        )
        self.stats.setdefault(node_id, NodeStats())
        self.nodes.append(node_id)
        if node_id in self.ledger.nodes:
            self.ledger.fail_node(node_id)  # a stale segment from before a restart
        if self.ledger.nodes:
            self.ledger.add_node(node_id, rate)
        else:
            self.ledger.assign_segments({node_id: rate})
        await self.ctx.events.append(
            "job.node_joined",
            node_id=node_id,
            job_id=self.job_id,
            message=f"node joined with {rate:.1f} samples/s on this job's model",
            attrs={"samples_per_second": f"{rate:.3f}"},
        )

    def _rerate_unobserved(self) -> None:
        """Nodes not yet observed in a round are rated at the batch they will get now that the
        node set grew (rates depend on the batch: per-step costs weigh more in small ones), so
        that equal nodes that joined one by one get equal shares."""
        expected = max(1, self.spec.global_batch // max(1, len(self.nodes)))
        for n in self.nodes:
            if n in self.estimator and n in self.bench and self.estimator.observations(n) == 0:
                comm = self.estimator.comm_estimate(n)
                self.estimator.add_node(
                    n,
                    self._bench_rate(n, expected),
                    comm,
                    step_points=self._bench_points(n),
                    rated_batch=expected,
                )

    async def _drop_node(self, node_id: str, reason: str = "") -> None:
        if node_id in self.nodes:
            self.nodes.remove(node_id)
            self.estimator.remove_node(node_id)
            if node_id in self.ledger.nodes:
                self.ledger.fail_node(node_id)
            await self.ctx.events.append(
                "job.node_left",
                node_id=node_id,
                job_id=self.job_id,
                message=reason or "node left the job; its unconsumed samples were reassigned",
            )
        self.batches.pop(node_id, None)
        self.bench_pending.pop(node_id, None)
        await self.host.release(node_id, self.job_id)

    async def _release_all(self) -> None:
        for n in list(self.nodes) + list(self.bench_pending):
            try:
                await self.host.release(n, self.job_id)
            except Exception:  # the node may be gone; nothing to release then
                log.debug("releasing %s failed", n, exc_info=True)
        self.nodes.clear()

    def on_node_offline(self, node_id: str) -> None:
        """The node's lease ended (lapsed, Leave, or the same id registered again after a
        restart). Its part of the open round fails now; between rounds it leaves the job, and
        its job benchmark is forgotten so that it is benchmarked again if it comes back."""
        rs = self.round_state
        if rs is not None and node_id in rs.parts and rs.parts[node_id].status == "pending":
            rs.parts[node_id].status = "failed"
            rs.parts[node_id].error = "node went offline"
        self.bench_pending.pop(node_id, None)
        if node_id in self.nodes or node_id in self.bench:
            self.bench.pop(node_id, None)
            self._departed[node_id] = (
                "node went offline (lease ended); its unconsumed samples go to the other nodes"
            )
        self.wake()

    def _note_failure(self, node_id: str, error: str) -> None:
        st = self.stats.setdefault(node_id, NodeStats())
        st.failures_in_a_row += 1
        if st.failures_in_a_row >= MAX_CONSECUTIVE_FAILURES and not st.excluded:
            st.excluded = True
            asyncio.get_running_loop().create_task(
                self.ctx.events.append(
                    "job.node_excluded",
                    node_id=node_id,
                    job_id=self.job_id,
                    message=f"{st.failures_in_a_row} failed tasks in a row; last: {error}",
                )
            )
        self.wake()

    def on_task_failed(
        self, node_id: str, task_id: str, error: str, *, job_fault: bool = False
    ) -> None:
        """A task of this job failed on the node; `job_fault`: by the job's own fault (counted
        by `on_job_fault`, not against the node)."""
        pending = self.bench_pending.get(node_id)
        if pending is not None and pending[0] == task_id:
            self.bench_pending.pop(node_id, None)
            if not job_fault:
                self._note_failure(node_id, error)
            return
        rs = self.round_state
        if rs is not None:
            part = rs.parts.get(node_id)
            if part is not None and part.task_id == task_id and part.status == "pending":
                part.status = "failed"
                part.error = error[:500]
                if not job_fault:
                    self._note_failure(node_id, error)
                rs.touch()

    def on_job_fault(self, node_id: str, task_id: str, error: str) -> None:
        """A node of this job says one of its tasks failed by the job's fault. Once enough
        distinct nodes say so (JOB_FAULT_NODES, or all the job's nodes when it has fewer) since
        the last applied round, the job fails with the reason; no node is blamed."""
        if task_id not in (self._open_task_ids()):
            return  # stale, or not this node's task
        self._job_faults[node_id] = error[:300]
        holders = set(self.nodes) | set(self.bench_pending) | set(self._job_faults)
        needed = max(1, min(JOB_FAULT_NODES, len(holders)))
        if len(self._job_faults) >= needed and not self._job_fault_verdict:
            nodes = ", ".join(sorted(self._job_faults))
            first = next(iter(self._job_faults.values()))
            self._job_fault_verdict = (
                f"the job's program failed on {len(self._job_faults)} node(s) ({nodes}): {first}"
            )
            self.wake()

    def _benchmark_task_ids(self) -> set[str]:
        return {task for task, _ in self.bench_pending.values()}

    def _open_task_ids(self) -> set[str]:
        ids = {task for task, _ in self.bench_pending.values()}
        rs = self.round_state
        if rs is not None:
            ids.update(p.task_id for p in rs.parts.values())
        return ids

    async def _fail_for_program(self, message: str) -> None:
        """End the job for its own program's fault (see on_job_fault)."""
        rs = self.round_state
        if rs is not None:
            self.ledger.abort_round(rs.round)
            self.round_state = None
        log.warning("job %s: %s", self.job_id, message)
        await self.ctx.events.append(
            "job.program_failed",
            job_id=self.job_id,
            message=message,
            attrs={f"fault.{n}": why for n, why in sorted(self._job_faults.items())},
        )
        await self._fail(message)

    # -- rounds ---------------------------------------------------------------------------------

    def _plan_batches(self, nodes: list[str]) -> tuple[dict[str, int], set[str], dict[str, float]]:
        """b_i of each node, the best-effort nodes, and the nodes' time boxes for H steps
        (local SGD only, see :meth:`_plan_local_sgd_batches`; else empty).

        b_i is in proportion to each node's planning rate (largest remainder).
        Best-effort nodes are those whose proportional share is below one sample: split_batch
        still gives them one (so that they stay measured and get their share back when they
        speed up), but a single sample takes them longer than the round takes the others: the
        deadline is not sized for them and the round does not wait for them (if late, their
        sample returns to pending).

        (Per-node fixed costs per round, ``split_batch(fixed_s=...)``, are not used: on a
        shared host the measured time outside compute is mostly waiting for a core behind the
        other nodes, not a cost of the node's own, and planning with it moved samples from fast
        nodes to slow ones.) Local SGD rounds are planned on each node's per-step time instead
        (:meth:`_plan_local_sgd_batches`), fitted from compute seconds the agents time
        themselves, unless the coordinator runs with ``--split equal``."""
        rates = self.estimator.planning_rates(nodes)
        caps = {n: self._max_batch(n) for n in nodes}
        batch = min(self.spec.global_batch, sum(caps.values()))
        if self.ctx.config.split == "equal":
            rates = dict.fromkeys(rates, 1.0)
        elif self.inner_steps > 1:
            return self._plan_local_sgd_batches(nodes, batch, caps)
        fluid = quotas(batch, rates, caps)
        slow = {n for n in nodes if fluid[n] < 1}
        batches = split_batch(batch, rates, caps)
        return batches, (slow if len(slow) < len(nodes) else set()), {}

    def _plan_local_sgd_batches(
        self, nodes: list[str], batch: int, caps: dict[str, int]
    ) -> tuple[dict[str, int], set[str], dict[str, float]]:
        """Local SGD: b_i from each node's per-step time ``a_i + b * c_i`` (see
        coordinator/throughput.py), so that every node's H inner steps take the same time
        (min_time rounding: the slowest finisher sets the round's pace).

        Best-effort nodes: those whose equal-time share is below one sample AND whose round
        (per-round communication + H steps of their b_i) would take more than MIN_SLACK times
        the longest round of the others: waiting for a node that is slow per step costs
        nothing when the round is dominated by time both spend anyway (transfers, RTTs)."""
        h = self.inner_steps
        models = self.estimator.step_models(nodes, batch=batch / max(1, len(nodes)))
        rates = {n: m.rate for n, m in models.items()}
        fixed = {n: m.fixed_s for n, m in models.items()}
        batches = split_batch(batch, rates, caps, rounding="min_time", fixed_s=fixed)
        fluid = quotas(batch, rates, caps, fixed_s=fixed)

        def round_s(n: str) -> float:
            return self.estimator.comm_estimate(n) + h * models[n].step_seconds(batches[n])

        full = [round_s(n) for n in nodes if fluid[n] >= 1]
        limit = MIN_SLACK * max(full) if full else math.inf
        slow = {n for n in nodes if fluid[n] < 1 and round_s(n) > limit}
        slow = slow if len(slow) < len(nodes) else set()
        # Rounds whose compute is shorter than their communication are not boxed: waiting for
        # a slower node costs little there, and a box of a few milliseconds (a small model) is
        # at the mercy of timer and scheduling noise (measured: first rounds of one step).
        awaited = [n for n in nodes if n not in slow] or nodes
        compute = max(h * models[n].step_seconds(batches[n]) for n in awaited)
        if compute < max(self.estimator.comm_estimate(n) for n in awaited):
            return batches, slow, {}
        # The time box: every awaited node's planned round ends at the same moment, the latest
        # of their planned ends; a node's box is that minus its own communication. (Planned
        # on the planning rates: a node not yet observed is known by its job benchmark, which
        # times the device's fastest steps; its discount makes up for that.)
        end = max(round_s(n) for n in awaited)
        boxes = {n: max(end - self.estimator.comm_estimate(n), 1e-3) for n in nodes}
        return batches, slow, boxes

    @property
    def time_boxed(self) -> bool:
        """Whether local SGD rounds are time-boxed: on the parameter server (a ring member's
        weight in the all-reduce is fixed before it steps), with the throughput split."""
        return self.inner_steps > 1 and self.ctx.config.split != "equal"

    @property
    def inner_steps(self) -> int:
        """H: inner steps per round (local SGD), 1 in sync mode."""
        return max(1, self.spec.inner_steps) if self.spec.sync == "local_sgd" else 1

    def _plan_parts(self, nodes: list[str]) -> tuple[int, dict[str, Part], float]:
        """Plan the next round: b_i per node (throughput-weighted, sum = global batch), H*b_i
        samples per node from the ledger (fewer at an epoch's end), and the deadline, sized
        in samples from the estimates. Returns (round number, parts by node, deadline)."""
        self._observe_late_figures()
        self.ledger.rebalance(self.estimator.rates(nodes))
        batches, best_effort, planned_boxes = self._plan_batches(nodes)
        h = self.inner_steps
        steps = dict.fromkeys(batches, h)
        boxes: dict[str, float] = {}
        if self.time_boxed and planned_boxes:
            # Time-boxed: ranges for more steps than planned (a node faster than its estimate
            # goes on stepping); the deadline is sized on the planned steps. The rounds left in
            # the epoch are sized alike (no short tail round paying a whole round's
            # communication for a few steps), and the epoch's last round is not boxed: it
            # trains all that is left, so a slower-than-planned box leaves no tail behind.
            per_step = sum(batches.values())
            left = max(1, round(self.ledger.pending_count / (h * per_step)))
            if left > 1:
                scale = self.ledger.pending_count / (left * h * per_step)
                h = max(1, round(h * scale))
                boxes = {n: t * h / self.inner_steps for n, t in planned_boxes.items()}
                # A node not yet observed is planned at a discount of its benchmark: should the
                # benchmark be right, its box holds that many times more steps than planned;
                # its ranges cover them (a node that runs out of ranges before its box ends
                # idles until the round closes).
                steps = {
                    n: math.ceil(
                        h
                        * (1 + TIME_BOX_EXTRA_STEPS)
                        * self.estimator.estimate(n)
                        / self.estimator.planning_rate(n)
                    )
                    if n in boxes
                    else h
                    for n in batches
                }
            else:
                h = steps_left = -(-self.ledger.pending_count // per_step) + 1
                steps = dict.fromkeys(batches, steps_left)
        round_id = self.next_round
        self.next_round += 1
        if boxes:
            log.info(
                "job %s round %d: time boxes %s for about %d steps of b_i %s",
                self.job_id,
                round_id,
                {n: round(t, 3) for n, t in boxes.items()},
                h,
                batches,
            )
        plan = self.ledger.plan_round(round_id, {n: steps[n] * b for n, b in batches.items()})
        sizes = {n: sum(b - a for a, b in rs) for n, rs in plan.items()}
        planned = {n: min(c, h * batches[n]) for n, c in sizes.items()}
        awaited = {n: b for n, b in planned.items() if n not in best_effort} or planned
        deadline = self.estimator.deadline(awaited, self._overhead_s)
        parts: dict[str, Part] = {}
        for node_id, positions in plan.items():
            samples = sizes[node_id]
            # Sync: the node's batch is what the ledger gave. Local SGD: b_i per inner step,
            # the agent runs ceil(samples / b_i) steps (the last one possibly smaller).
            local_batch = samples if self.inner_steps == 1 else max(1, batches[node_id])
            parts[node_id] = Part(
                node_id=node_id,
                task_id="t-" + uuid.uuid4().hex[:12],
                ranges=index_run_array(self.ledger.positions_to_indices(positions)),
                local_batch=local_batch,
                samples=samples,
                inner_steps=-(-samples // local_batch),
                required=node_id in awaited,
                budget_s=boxes.get(node_id, 0.0),
                assigned=samples,
            )
        self.batches = {n: p.local_batch for n, p in parts.items()}
        return round_id, parts, deadline

    async def _run_round(self, nodes: list[str]) -> None:
        if self.ledger.complete:
            await self._next_epoch()
            return
        round_id, parts, deadline = self._plan_parts(nodes)
        await self._ensure_params_payload()
        rs = RoundState(
            round=round_id,
            epoch=self.ledger.epoch,
            version=self.version,
            deadline_s=deadline,
            parts=parts,
        )
        self.round_state = rs
        for node_id, part in parts.items():
            part.handed_out = time.monotonic()
            self.host.enqueue(node_id, self._train_task(rs, part), self.job_id)
        await self.notify()
        self._start_record_write()  # the previous round's record, now that this one is out
        # Wait for every awaited node (a failure, silence, or the deadline ends the wait for
        # it). Silence is checked a few times per heartbeat interval (not on every wake-up:
        # O(parts) per check).
        end = rs.started + deadline
        check_every = max(0.02, self.ctx.registry.heartbeat_interval_s / 4)
        next_check = rs.started + check_every
        extensions = 0
        while rs.awaited():
            now = time.monotonic()
            left = end - now
            if left <= 0 or self._stop.is_set():
                if self._stop.is_set() or not self._extend_deadline(rs, extensions):
                    break
                extensions += 1
                end += deadline
                rs.deadline_s += deadline
                continue
            if now >= next_check:
                self._fail_silent(rs)
                next_check = now + check_every
                if not rs.awaited():
                    break
            rs.changed.clear()
            try:
                await asyncio.wait_for(rs.changed.wait(), timeout=min(left, next_check - now))
            except TimeoutError:
                continue  # the deadline or a silence check is due: the loop looks again
        rs.closed = True
        waited = time.monotonic() - rs.started
        rs.waited_s = waited
        for part in rs.outstanding():
            self._late[part.task_id] = (part.node_id, part.samples, part.inner_steps)
            part.status = "late"
            part.error = (
                f"missed the {rs.deadline_s:.2f}s deadline"
                if part.required
                else f"best effort (a share below one sample): not done after {waited:.2f}s"
            )
            self.estimator.observe_late(part.node_id, part.samples, waited)
        if self._stop.is_set():
            self.ledger.abort_round(round_id)
            self.round_state = None
            return
        await self._apply_round(rs)

    def _extend_deadline(self, rs: RoundState, extensions: int) -> bool:
        """At the deadline: whether to wait once more as long. Only when no node of the round
        has delivered and none failed or fell silent: a deadline that every node misses says
        that the estimates were wrong (a first round loads programs and data; a benchmark
        without optimizer steps flatters local SGD's inner steps), not that someone lags, and
        closing the round would only throw all of its work away. The late figures feed the
        estimates, so the next deadlines fit."""
        if extensions >= MAX_DEADLINE_EXTENSIONS:
            return False
        parts = list(rs.parts.values())
        if any(p.status != "pending" for p in parts if p.required):
            return False
        live = [p for p in parts if p.required and not self.host.is_silent(p.node_id)]
        if not live:
            return False
        log.info(
            "job %s round %d: no node delivered within the %.2fs deadline; waiting as long "
            "again (%d of %d)",
            self.job_id,
            rs.round,
            rs.deadline_s,
            extensions + 1,
            MAX_DEADLINE_EXTENSIONS,
        )
        return True

    def note_late_update(
        self, node_id: str, task_id: str, num_samples: int, compute_s: float
    ) -> bool:
        """An update of a part that was late (the round closed without it): its gradient is of
        no use, but its compute time measures the node (a best-effort node that became fast
        again gets its share back this way). Returns whether ``task_id`` was such a part."""
        entry = self._late.get(task_id)
        if entry is None or entry[0] != node_id:
            return False
        del self._late[task_id]
        if num_samples == entry[1] > 0 and math.isfinite(compute_s) and compute_s > 0:
            self._late_figures.append((node_id, num_samples, entry[2], compute_s))
        return True

    def _observe_late_figures(self) -> None:
        figures, self._late_figures = self._late_figures, []
        for node_id, samples, steps, compute_s in figures:
            if node_id in self.estimator:
                self.estimator.observe(node_id, samples, compute_s)
                if self.inner_steps > 1:
                    self.estimator.observe_steps(node_id, samples, steps, compute_s)
        # Remember the late parts of the last few rounds only.
        excess = len(self._late) - 4 * max(1, len(self.nodes))
        for task_id in list(self._late)[: max(0, excess)]:
            del self._late[task_id]

    def _fail_silent(self, rs: RoundState) -> None:
        """Fail the pending parts of nodes that stopped heartbeating (dead, cut off, hung): the
        round need not wait for its deadline."""
        for part in rs.outstanding():
            if self.host.is_silent(part.node_id):
                silent_s = self.host.silence_limit_s()
                part.status = "failed"
                part.error = f"no heartbeat for more than {silent_s:.2f}s (node unresponsive)"
                log.info("job %s round %d: %s is silent", self.job_id, rs.round, part.node_id)

    def _train_task(self, rs: RoundState, part: Part) -> agent_pb2.Task:
        if self._shard_starts is None:
            self._shard_starts = np.array([s.start for s in self.job.shards], dtype=np.int64)
        shards = [self.job.shards[int(i)] for i in touched_shards(self._shard_starts, part.ranges)]
        task = agent_pb2.Task(
            task_id=part.task_id,
            kind=agent_pb2.TASK_KIND_TRAIN,
            job_id=self.job_id,
            spec=self.spec,
            program=self.job.program,
            initial_state=self.job.initial_state,
            shards=shards,
            epoch=rs.epoch,
            round=rs.round,
            local_batch=part.local_batch,
            params_version=rs.version,
            deadline_seconds=rs.deadline_s,
            inner_steps=max(self.inner_steps, part.inner_steps),
            compute_budget_seconds=part.budget_s,
        )
        task.MergeFromString(encode_ranges_field(TASK_RANGES_FIELD, part.ranges))
        payload = self.params_payload
        if (
            payload is not None
            and self.params_payload_version == rs.version
            and len(payload[1]) <= self.ctx.config.inline_params_max_bytes
        ):
            # Small models: the parameters travel with the task (no PullParameters round trip
            # between the hand-out and the compute).
            task.params_bundle.CopyFrom(payload[0])
            task.params_data = payload[1]
        return task

    @property
    def version(self) -> int:
        """The parameter version the job's rounds start from (the parameter server's)."""
        return self.ps.version

    async def _apply_round(self, rs: RoundState) -> None:
        t0 = time.monotonic()
        received = sorted(
            (p for p in rs.parts.values() if p.status == "received"), key=lambda p: p.node_id
        )
        if received:
            contributions = [(p.samples, p.grads or {}) for p in received]

            def apply() -> tuple[int, tuple[common_pb2.TensorBundle, bytes], float]:
                # With the next round's parameter payload (every round needs it: inline in its
                # tasks, or served by PullParameters).
                began = time.perf_counter()
                self.ps.apply(contributions)
                payload = encode_bundle(self.ps.snapshot())
                return self.ps.version, payload, time.perf_counter() - began

            if self._apply_s is None:
                self._apply_s = self.ps.num_bytes() * APPLY_SECONDS_PER_BYTE
            if self._apply_s <= INLINE_APPLY_MAX_S:
                version, payload, self._apply_s = apply()
            else:
                version, payload, self._apply_s = await asyncio.to_thread(apply)
            self.params_payload_version, self.params_payload = version, payload
            for p in received:
                p.status = "applied"
                p.grads = None
        await self._close_round(rs, t0)

    def _want_checkpoint(self, rs: RoundState) -> bool:
        """Whether the round just applied ends with a checkpoint (every K applied rounds)."""
        return (
            self.spec.checkpoint_every > 0 and self.rounds_applied % self.spec.checkpoint_every == 0
        )

    async def _close_round(self, rs: RoundState, t0: float) -> None:
        """The round's applied parts are in (parts of status "applied"): commit their slices
        (the others return to pending), update estimates and stats, record the round, and write
        a checkpoint when one is due."""
        received = sorted(
            (p for p in rs.parts.values() if p.status == "applied"), key=lambda p: p.node_id
        )
        if received:
            self.rounds_applied += 1
            self._job_faults.clear()  # the program works: earlier faults were transient
        applied = {p.node_id for p in received}
        consumed = {p.node_id: p.samples for p in received if 0 < p.samples < p.assigned}
        self.ledger.commit_round(rs.round, applied, consumed)
        for p in rs.parts.values():
            st = self.stats.setdefault(p.node_id, NodeStats())
            if p.status == "applied":
                st.failures_in_a_row = 0
                st.compute_s += p.compute_s
                comm = p.comm_s if p.comm_s is not None else max(0.0, p.wall_s - p.compute_s)
                st.communicate_s += comm
                if p.node_id not in self.estimator:
                    continue
                if p.compute_s > 0 and math.isfinite(p.compute_s):
                    self.estimator.observe(p.node_id, p.samples, p.compute_s, comm)
                    if self.inner_steps > 1:
                        self.estimator.observe_steps(
                            p.node_id, p.samples, p.inner_steps, p.compute_s
                        )
                else:  # a figure the estimator cannot use: keep the gradient, skip the rate
                    log.warning(
                        "job %s round %d: %s reported %r compute seconds; rate not updated",
                        self.job_id,
                        rs.round,
                        p.node_id,
                        p.compute_s,
                    )
                    self.estimator.observe(p.node_id, 0, 0.0, comm)
        samples = sum(p.samples for p in received)
        loss = sum(p.mean_loss * p.samples for p in received) / samples if samples else float("nan")
        record = common_pb2.RoundRecord(
            job_id=self.job_id,
            epoch=rs.epoch,
            round=rs.round,
            started_ms=rs.started_ms,
            finished_ms=now_ms(),
            loss=loss,
            params_version=self.version,
            parts=[part_record(p) for p in sorted(rs.parts.values(), key=lambda p: p.node_id)],
            attempts=rs.attempts,
        )
        job = self.job
        job.round = self.rounds_applied
        job.params_version = self.version
        job.samples_done += samples
        if samples:
            job.last_loss = loss
        job.epoch = self.ledger.epoch
        job.eta_seconds = self._eta(time.monotonic() - rs.started)
        job.updated_ms = now_ms()
        self.round_state = None
        # Parts the round waited for and did without (a best-effort part that is late is the
        # expected case, not news: no event, debug log only).
        dropped = sorted(
            (
                p
                for p in rs.parts.values()
                if p.status in ("failed", "rejected") or (p.status == "late" and p.required)
            ),
            key=lambda p: p.node_id,
        )
        dropped_tasks = {p.task_id for p in dropped}
        for p in rs.parts.values():
            if p.status in ("late", "failed", "rejected"):
                log.log(
                    logging.INFO if p.task_id in dropped_tasks else logging.DEBUG,
                    "job %s round %d: %s %s (%s)",
                    self.job_id,
                    rs.round,
                    p.node_id,
                    p.status,
                    p.error,
                )
        checkpoint = bool(received) and self._want_checkpoint(rs)
        if self._defers_records:
            # Written in the background while the next round runs: the record of round r - 1
            # is in the store before round r + 1 is handed out (see `_restore` for the
            # parameter versions this bounds), and a checkpoint after every record it covers.
            await self._records_written()
            self._record_to_write = (record, rs, dropped)  # started once the next round is out
        else:
            await self._write_round(None, record, rs, dropped)
        if self.ledger.complete:
            await self._next_epoch()
        elif checkpoint:
            await self._checkpoint_soon(last_round=rs.round)
        t1 = time.monotonic()
        self._overhead_s = 0.5 * self._overhead_s + 0.5 * (t1 - t0)
        log.info(
            "job %s round %d closed: %d of %d parts applied, %.0f samples/s; last update "
            "%.3fs after the hand-out, round %.3fs, apply+record %.3fs",
            self.job_id,
            rs.round,
            len(received),
            len(rs.parts),
            samples / max(t1 - rs.started, 1e-9),
            max((p.wall_s for p in received), default=0.0),
            t1 - rs.started,
            t1 - t0,
        )
        self.host.round_finished(self.job_id, self._benchmark_task_ids())
        await self.notify()

    @property
    def _defers_records(self) -> bool:
        """Whether round records and checkpoints are written in the background (parameter-
        server mode; a runner that overrides ``_checkpoint``, the ring's, writes both in
        line)."""
        return type(self)._checkpoint is JobRunner._checkpoint

    async def _write_round(
        self,
        previous: asyncio.Task[None] | None,
        record: common_pb2.RoundRecord,
        rs: RoundState,
        dropped: list[Part],
    ) -> None:
        """Store a closed round's record with the job as it is now (and an event for the
        parts it did without), after the record before it. GetRounds and WatchJob show only
        stored records (a round a reader saw survives a crash), so watchers hear of it now."""
        if previous is not None:
            await previous
        async with self.ctx.store.transaction():
            await self.ctx.store.add_round(record)
            await self.ctx.store.update_job(self.job)
            if dropped:
                await self._record_dropped(rs, dropped)
        self.stored_round = record.round
        if self._defers_records:  # else _close_round notifies
            await self.notify()

    def _start_record_write(self) -> None:
        """Start writing the last closed round's record in the background, if not yet (the
        round loop does so right after handing out the next round, so that the write does not
        delay the hand-out)."""
        if self._record_to_write is None:
            return
        record, rs, dropped = self._record_to_write
        self._record_to_write = None
        self._record_task = asyncio.create_task(
            self._write_round(self._record_task, record, rs, dropped),
            name=f"record-{self.job_id}-{rs.round}",
        )

    async def _records_written(self) -> None:
        """Wait until every closed round's record is in the store (each background write
        waits for the one before, so the latest one done means all are done)."""
        self._start_record_write()
        task = self._record_task
        if task is not None:
            await task

    async def _record_dropped(self, rs: RoundState, dropped: list[Part]) -> None:
        """One event per round that closed without some of its parts (their samples are
        pending again): who, why, the deadline and how long the round waited."""
        samples = sum(p.samples for p in dropped)
        what = "; ".join(f"{p.node_id} {p.status} ({p.error})" for p in dropped)
        await self.ctx.events.append(
            "round.incomplete",
            job_id=self.job_id,
            message=(
                f"round {rs.round} closed after {rs.waited_s:.2f}s without {what}; "
                f"their {samples} samples are pending again in epoch {rs.epoch + 1}"
            ),
            attrs={
                "round": str(rs.round),
                "epoch": str(rs.epoch),
                "deadline_s": f"{rs.deadline_s:.3f}",
                "waited_s": f"{rs.waited_s:.3f}",
                "late": ",".join(p.node_id for p in dropped if p.status == "late"),
                "failed": ",".join(p.node_id for p in dropped if p.status != "late"),
                "samples": str(samples),
            },
        )

    def _eta(self, round_s: float) -> float:
        left = self.spec.epochs * self.job.num_samples - self.job.samples_done
        rate = sum(self.estimator.rates(self.nodes).values()) if self.nodes else 0.0
        if rate <= 0:
            return 0.0
        per_round = self.spec.global_batch * self.inner_steps
        return max(0.0, left / min(rate, per_round / max(round_s, 1e-6)))

    async def _next_epoch(self) -> None:
        done = self.ledger.epoch
        await self.ctx.events.append(
            "job.epoch_completed",
            job_id=self.job_id,
            message=f"epoch {done + 1}/{self.spec.epochs} complete, loss {self.job.last_loss:.4f}",
            attrs={"epoch": str(done), "loss": f"{self.job.last_loss:.6f}"},
        )
        self.ledger = self.ledger.next_epoch()
        self.job.epoch = self.ledger.epoch
        await self._checkpoint_soon(last_round=self.next_round - 1)

    async def _ensure_params_payload(self) -> None:
        if self.params_payload is None or self.params_payload_version != self.ps.version:
            snapshot = self.ps.snapshot()
            self.params_payload = await asyncio.to_thread(encode_bundle, snapshot)
            self.params_payload_version = self.ps.version

    # -- checkpoints, states, result ------------------------------------------------------------

    async def _checkpoint(self, last_round: int) -> None:
        """Write a checkpoint of the state now (after any still being written) and wait."""
        await self._checkpoint_written()
        await self._write_checkpoint(*self._checkpoint_state(last_round))

    async def _checkpoint_soon(self, last_round: int) -> None:
        """A checkpoint of the state now, written in the background while the next round runs
        (parameter-server mode): the state is copied first, so later rounds cannot change what
        is written; checkpoints are written in order, each after the one before. A crash
        before it is written loses the rounds since the previous one, as between any two
        checkpoints. A runner that overrides ``_checkpoint`` (ring mode checkpoints a state a
        member pushes) writes it in line."""
        if not self._defers_records:
            await self._checkpoint(last_round)
            return
        await self._checkpoint_written()
        state = self._checkpoint_state(last_round)
        self._checkpoint_task = asyncio.create_task(
            self._write_checkpoint(*state), name=f"checkpoint-{self.job_id}-{last_round}"
        )

    async def _checkpoint_written(self) -> None:
        """Wait for the checkpoint being written in the background, if any (its error, e.g. a
        full disk, is raised here)."""
        task, self._checkpoint_task = self._checkpoint_task, None
        if task is not None:
            await task

    def _checkpoint_state(
        self, last_round: int
    ) -> tuple[dict[str, torch.Tensor], CheckpointManifest]:
        tensors = {k: v.clone() for k, v in self.ps.state_tensors().items()}
        manifest = CheckpointManifest(
            round=last_round,
            epoch=self.ledger.epoch,
            params_version=self.ps.version,
            rounds_applied=self.rounds_applied,
            samples_done=self.job.samples_done,
            tensors_sha256="",
            ledger=self.ledger.to_state(),
            last_loss=self.job.last_loss,
        )
        return tensors, manifest

    async def _write_checkpoint(
        self, tensors: dict[str, torch.Tensor], manifest: CheckpointManifest
    ) -> None:
        # A checkpoint never lands before the records of the rounds it covers (after a restart
        # from it, every round it holds has its record).
        await self._records_written()
        data = await asyncio.to_thread(tensors_to_bytes, tensors)
        ref = await self.ctx.blobs.put_bytes(data)
        manifest.tensors_sha256 = ref.sha256
        async with self.ctx.store.transaction():
            await self.ctx.store.save_checkpoint(self.job_id, manifest.round, manifest.to_bytes())
            await self.ctx.store.update_job(self.job)

    async def _set_state(self, state: int, message: str) -> None:
        if self.job.state == state and self.job.message == message:
            return
        # Whoever sees the new state (PAUSED, a terminal one) finds every closed round stored.
        try:
            await self._records_written()
        except Exception:
            log.exception("job %s: a round record could not be written", self.job_id)
        previous = self.job.state
        self.job.state = state
        self.job.message = message
        self.job.updated_ms = now_ms()
        await self.ctx.store.update_job(self.job)
        if previous != state:
            name = JS.Name(state).removeprefix("JOB_STATE_").lower()
            await self.ctx.events.append(
                f"job.{name}", job_id=self.job_id, message=message or f"job is {name}"
            )
            if previous == JS.JOB_STATE_PAUSED and state == JS.JOB_STATE_RUNNING:
                await self.ctx.events.append(
                    "job.resumed", job_id=self.job_id, message="enough nodes again: it resumes"
                )
        await self.notify()

    async def _finish(self) -> None:
        params = self.ps.snapshot()
        # Keyed like make_model().state_dict(): trained parameters (a tied alias gets its
        # parameter's values), buffers as submitted.
        params.update({a: params[p] for a, p in self.aliases.items() if p in params})
        state = {k: params[k] if k in params else self.buffers[k] for k in self.state_names}
        data = await asyncio.to_thread(to_safetensors, state)
        ref = await self.ctx.blobs.put_bytes(data)
        self.job.result.CopyFrom(ref)
        self.job.eta_seconds = 0.0
        await self._checkpoint(last_round=self.next_round - 1)
        await self._set_state(
            JS.JOB_STATE_SUCCEEDED,
            f"trained {self.spec.epochs} epochs in {self.rounds_applied} rounds, "
            f"final loss {self.job.last_loss:.4f}",
        )

    async def _fail(self, message: str) -> None:
        try:
            await self._set_state(JS.JOB_STATE_FAILED, message)
        except Exception:
            log.exception("could not record the failure of job %s", self.job_id)

    async def cancel(self) -> None:
        await self._set_state(JS.JOB_STATE_CANCELLED, "cancelled by its submitter")
        self._stop.set()
        self.wake()

    # -- RPC-side entry points ------------------------------------------------------------------

    def submit_update(
        self,
        node_id: str,
        task_id: str,
        num_samples: int,
        mean_loss: float,
        compute_s: float,
        grads: Mapping[str, torch.Tensor],
    ) -> str:
        """Hand a decoded gradient to the open round; returns "" or why it was not taken."""
        rs = self.round_state
        if rs is None or rs.closed:
            return "the round is closed (the update came after its deadline)"
        part = rs.parts.get(node_id)
        if part is None or part.task_id != task_id:
            return "the task is not part of the open round"
        if part.status != "pending":
            return f"the task is already {part.status}"
        if num_samples != part.samples:
            problem = self.samples_problem(node_id, task_id, num_samples)
            if problem:
                return problem
            # A time-boxed part: the node trained the first num_samples of its ranges.
            part.ranges = head_of_runs(part.ranges, num_samples)
            part.samples = num_samples
            part.inner_steps = -(-num_samples // part.local_batch)
        part.grads = dict(grads)
        part.mean_loss = mean_loss
        part.compute_s = compute_s
        part.wall_s = time.monotonic() - part.handed_out
        part.status = "received"
        rs.touch()
        return ""

    def on_report(self, req: agent_pb2.ReportProgressRequest) -> None:
        """ReportProgress of one of this job's tasks (only failures matter in PS mode)."""
        if req.failed:
            if req.job_fault:
                self.on_job_fault(req.node_id, req.task_id, req.error or "failed")
            self.on_task_failed(
                req.node_id, req.task_id, req.error or "failed", job_fault=req.job_fault
            )

    async def parameters_payload(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        """(version, header, payload) for PullParameters: the parameters of the current
        version (plain names), or with include_optimizer_state the parameter server's state
        ("param/<name>", "optim/<key>/<name>", as in a checkpoint)."""
        if req.external_round:
            raise FailedPreconditionError(
                "external_round is for ring jobs; this job aggregates on the parameter server"
            )
        version = self.ps.version
        if req.version not in (0, version):
            raise FailedPreconditionError(
                f"parameters version {req.version} is gone; the current version is {version}"
            )
        if req.include_optimizer_state:
            key = (version, True)
            if self._state_payload is None or self._state_payload[0] != key:
                tensors = self.ps.state_tensors()
                header, data = await asyncio.to_thread(encode_bundle, tensors)
                self._state_payload = (key, header, data)
            return version, self._state_payload[1], self._state_payload[2]
        await self._ensure_params_payload()
        assert self.params_payload is not None
        header, data = self.params_payload
        return self.params_payload_version, header, data

    def wants_checkpoint(self, node_id: str, task_id: str) -> bool:
        """Whether a pushed state (UpdateHeader.kind "checkpoint") of this task is expected."""
        return False

    async def submit_checkpoint(
        self, header: agent_pb2.UpdateHeader, tensors: dict[str, torch.Tensor]
    ) -> str:
        """Take a pushed state; returns "" or why it was not taken."""
        return "this job takes no checkpoints from nodes"

    def samples_problem(self, node_id: str, task_id: str, num_samples: int) -> str:
        """Why an update's num_samples does not fit the open part of this task ("" if it does):
        all of the part's samples, or (a time-boxed part) a whole number of its inner steps."""
        rs = self.round_state
        part = rs.parts.get(node_id) if rs is not None else None
        if part is None or part.task_id != task_id:
            return "the task is not part of the open round"
        if num_samples == part.samples:
            return ""
        if part.budget_s > 0 and 0 < num_samples < part.samples:
            if num_samples % part.local_batch == 0:
                return ""
            return (
                f"num_samples is {num_samples}: a time-boxed part trains whole steps of "
                f"{part.local_batch} samples or all {part.samples}"
            )
        return f"num_samples is {num_samples}, the task assigned {part.samples}"

    def expected_samples(self, node_id: str, task_id: str) -> int | None:
        rs = self.round_state
        if rs is None:
            return None
        part = rs.parts.get(node_id)
        if part is None or part.task_id != task_id:
            return None
        return part.samples

    def reject(self, node_id: str, task_id: str, error: str) -> None:
        """The node's update for its open part was refused (bad input)."""
        self._end_part(node_id, task_id, "rejected", error)

    def fail_part(self, node_id: str, task_id: str, error: str) -> None:
        """The node's open part cannot complete (e.g. its update stream broke off)."""
        self._end_part(node_id, task_id, "failed", error)

    def _end_part(self, node_id: str, task_id: str, status: str, error: str) -> None:
        rs = self.round_state
        if rs is None:
            return
        part = rs.parts.get(node_id)
        if part is not None and part.task_id == task_id and part.status == "pending":
            part.status = status
            part.error = error[:500]
            rs.touch()

    def task_is_live(self, node_id: str, task_id: str) -> bool:
        pending = self.bench_pending.get(node_id)
        if pending is not None and pending[0] == task_id:
            return True
        rs = self.round_state
        if rs is None or rs.closed:
            return False
        part = rs.parts.get(node_id)
        return part is not None and part.task_id == task_id and part.status == "pending"

    def allocation(self) -> common_pb2.Allocation:
        out = common_pb2.Allocation(job_id=self.job_id, epoch=self.job.epoch, round=self.job.round)
        rs = self.round_state
        if rs is not None:
            out.round_deadline_seconds = rs.deadline_s
        total = sum(self.batches.values()) or 1
        for n in self.nodes:
            info = self.ctx.registry.get(n)
            bench = self.bench.get(n)
            st = self.stats.get(n, NodeStats())
            seg = self.ledger.segment_of(n)
            na = common_pb2.NodeAllocation(
                node_id=n,
                name=info.name if info is not None else "",
                samples_per_second=self.estimator.estimate(n) if n in self.estimator else 0.0,
                share=self.batches.get(n, 0) / total,
                local_batch=self.batches.get(n, 0),
                max_batch=self._max_batch(n),
                remaining=self.ledger.remaining(n),
                compute_seconds=st.compute_s,
                communicate_seconds=st.communicate_s,
                inner_steps=self.inner_steps,
            )
            if seg is not None:
                na.segment.start, na.segment.stop = seg
            if bench is not None:
                na.rtt_ms = bench.rtt_ms
                na.bandwidth_bytes_per_second = bench.bandwidth_bytes_per_second
            out.nodes.append(na)
        return out
