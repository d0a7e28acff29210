"""One job's life on the coordinator: node set, benchmarks, rounds, checkpoints, the result.

The runner is one asyncio task per job that orchestrates its parts (a RoundPlanner, the
ParameterServer, a RoundWriter); every change to the job's ledger, estimator and parameter
server happens on that task, so none of them needs a lock. RPC handlers only drop results into
the open `RoundState` and wake it. The round protocol and the fault rules: docs/job-rounds.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from coordinator.aggregation.param_server import ParameterServer
from coordinator.core.errors import FailedPreconditionError
from coordinator.core.ids import new_task_id
from coordinator.engine import job_allocation, job_tasks
from coordinator.engine.job_pay import JobPay, unobserved_standing
from coordinator.engine.job_state import (
    checkpoint_state,
    load_benchmarks,
    load_job_state,
    new_ledger,
    restore_job_record,
    save_benchmarks,
)
from coordinator.engine.job_tasks import JobShards
from coordinator.engine.ports import JobPort, RingStatePort
from coordinator.engine.rollback import Rollbacks, seat_nodes
from coordinator.engine.round_writer import RoundWriter
from coordinator.engine.verifier import Verifier
from coordinator.market.job_billing import AboveMaxPrice, BudgetExhausted, JobBilling
from coordinator.rounds.ledger import EpochLedger
from coordinator.rounds.node_set import JobNodeSet
from coordinator.rounds.planner import RoundPlanner
from coordinator.rounds.round_state import Part, RoundState
from coordinator.store.checkpoint import CheckpointManifest, tensors_from_bytes
from epochmesh.timeutil import now_ms
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import encode_bundle, to_safetensors

if TYPE_CHECKING:
    from coordinator.engine.host import RunnerHost
    from coordinator.engine.strategy import Aggregation

log = logging.getLogger(__name__)

JS = common_pb2.JobState
TERMINAL = (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED)
# Benchmark tasks get this long, plus the node's lease, before they are asked again.
BENCHMARK_TIMEOUT_S = 120.0
# A stopping runner gets this long to reach a safe point before it is cancelled.
STOP_GRACE_S = 3.0


class JobRunner:
    def __init__(
        self,
        host: RunnerHost,
        job: common_pb2.Job,
        aggregation: Callable[[JobPort], Aggregation],
    ) -> None:
        """``aggregation`` makes the job's round strategy (coordinator/engine/strategies/parameter_server.py or
        coordinator/engine/strategies/ring.py) for this runner."""
        self.host = host
        self.ctx = host.ctx
        self.job = job
        self.job_id = job.job_id
        self.spec = job.spec
        self.changed = asyncio.Condition()
        self.round_state: RoundState | None = None
        self.rounds = aggregation(self)
        self.node_set = JobNodeSet()
        self._round_s = 0.0  # recent rounds' duration (smoothed), for the scheduler's holds
        self.planner = RoundPlanner(
            job.job_id, job.spec, split=self.ctx.config.split, time_boxing=self.rounds.time_boxing
        )
        self.ps: ParameterServer
        self.ledger: EpochLedger
        self.state_names: list[str] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}  # tied weights: {alias: parameter name}
        self.params_payload: tuple[common_pb2.TensorBundle, bytes] | None = None
        self.params_payload_version = -1
        self.shards = JobShards(job)  # the job's shards (which ones a task needs)
        self._state_payload: tuple[tuple[int, bool], common_pb2.TensorBundle, bytes] | None = None
        self.next_round = 1
        self.rounds_applied = 0
        # The params version the job's state was last restored at (Task.restored_version).
        self.restored_version = 0
        self._task: asyncio.Task[None] | None = None
        self.stop_requested = asyncio.Event()  # the coordinator stops: end the open round
        self._wake = asyncio.Event()
        self.billing = JobBilling(
            job,
            self.ctx.credits,
            self.ctx.config.platform_fee_ppm,
            donor_of=self.ctx.registry.donor_of,
        )
        # Paused for its budget: no node is wanted until a top-up sets the event.
        self.budget_paused = False
        self._budget_added = asyncio.Event()
        self.writer = RoundWriter(
            self.ctx,
            job,
            background=self.rounds.writes_in_background,
            on_stored=self.notify,
            on_charged=self.billing.written,
        )
        # The runner is done: its job's last records and events (the terminal state, the nodes'
        # release) are stored, so a watcher that stops now has seen everything.
        self.ended = False
        # Verification (coordinator/engine/verifier.py): a failed check asks for a rollback to the
        # state before this round; the state at the start of recent rounds is kept for it.
        ring_state = self.rounds if isinstance(self.rounds, RingStatePort) else None
        self.verifier = Verifier(self, ring_state=ring_state)
        self.billing.hold = (
            True  # a part's pay waits for its checks (coordinator/engine/verifier.py)
        )
        self.rollback = Rollbacks(self.verifier)
        self.pay = JobPay(self.ctx, job, self.billing, self.writer, self.planner)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._main(), name=f"job-{self.job_id}")
        self.verifier.start()

    async def stop(self) -> None:
        """Stop at the next safe point (the open round is aborted: its slices go back to
        pending); cancel only if that takes longer than STOP_GRACE_S, since a task cancelled
        in the middle of a store write can leave the write half done."""
        self.stop_requested.set()
        self.wake()
        if self._task is not None:
            _, pending = await asyncio.wait({self._task}, timeout=STOP_GRACE_S)
            if pending:
                self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self.verifier.stop()

    def wake(self) -> None:
        self._wake.set()
        rs = self.round_state
        if rs is not None:
            rs.touch()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    @property
    def bench(self) -> dict[str, common_pb2.BenchmarkResult]:
        """The nodes' benchmarks on this job's program (the planner's)."""
        return self.planner.bench

    def round_seconds(self) -> float:
        """How long the job's rounds take lately (0 before the first one closed)."""
        return self._round_s

    def bench_seconds(self, node_id: str) -> float:
        """How long the node's job benchmark took, or has taken so far (0: none asked)."""
        return self.node_set.bench_seconds(node_id, time.monotonic())

    @property
    def nodes(self) -> list[str]:
        """The job's node set, in join order."""
        return self.node_set.members

    @property
    def stopping(self) -> bool:
        """The runner is asked to stop (the coordinator stops): end the open round."""
        return self.stop_requested.is_set()

    @property
    def terminal(self) -> bool:
        return self.job.state in TERMINAL

    async def _main(self) -> None:
        try:
            await self.restore()
            while not self.stop_requested.is_set() and not self.terminal:
                if self.node_set.job_fault_verdict:
                    await self._fail_for_program(self.node_set.job_fault_verdict)
                    continue
                if self.rollback.before is not None:
                    await self._roll_back()
                    continue
                if self.job.epoch >= self.spec.epochs:
                    # The last checks decide whether the result stands.
                    await self.verifier.settle()
                    if self.rollback.before is not None:
                        continue
                    summary = self.verifier.summary()
                    await self.ctx.events.append(
                        "job.verification",
                        job_id=self.job_id,
                        message=(
                            f"verification: {summary['passed']} checks passed, "
                            f"{summary['failed']} failed, {summary['undecided']} undecided"
                        ),
                        attrs=summary,
                    )
                    await self._finish()  # SUCCEEDED (terminal), or a ring job rolled back
                    continue
                nodes = await self._gather_nodes()
                if not nodes:
                    continue
                try:
                    await self.rounds.run_round(nodes)
                except BudgetExhausted as exc:
                    await self._wait_for_budget(str(exc))
                except AboveMaxPrice as exc:
                    for n in exc.nodes:  # the scheduler gives them to no job of this cap
                        await self._drop_node(n, "its price rose above the job's max_price")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("job %s failed", self.job_id)
            await self.fail(f"coordinator error: {type(exc).__name__}: {exc}")
        finally:
            try:
                await self.writer.written()
            except Exception:
                log.exception("job %s: a round record could not be written", self.job_id)
            try:
                await self.writer.checkpoint_written()
            except Exception:
                log.exception("job %s: the last checkpoint could not be written", self.job_id)
            await self.pay.settle_at_exit(self.verifier.accused)
            await self._release_all()
            self.ended = True
            await self.notify()

    # -- restore / init -------------------------------------------------------------------------

    async def restore(self) -> None:
        names, state_dict, self.aliases = await load_job_state(self.ctx, self.job)
        self.state_names = list(state_dict)
        skip = set(names) | set(self.aliases)
        self.buffers = {k: v for k, v in state_dict.items() if k not in skip}
        # In a thread: the process's first optimizer imports torch._dynamo (1 s on a 2-core
        # CPU host, ~3.5 s with CUDA torch on a GPU machine, where it stalled this loop past
        # every node's lease); the loop keeps serving heartbeats meanwhile.
        self.ps = await asyncio.to_thread(
            ParameterServer, self.spec, {n: state_dict[n] for n in names}
        )
        store = self.ctx.store
        latest = await store.latest_checkpoint(self.job_id)
        all_rounds = await store.list_rounds(self.job_id, include_rolled_back=True)
        await self.billing.restore(store, all_rounds)
        self.next_round = (max((r.round for r in all_rounds), default=0)) + 1
        if latest is None:
            self.ledger = new_ledger(self.job, 0)
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
            self.restored_version = version
            self.ledger = EpochLedger.from_state(manifest.ledger)
            self.ledger.abort_open_rounds()
            rolled = await store.rollback_rounds(self.job_id, manifest.round)
            self.rounds_applied = manifest.rounds_applied
            restore_job_record(self.job, manifest, version)
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
            await store.update_job(self.job)
            await self.verifier.restore(manifest.round)
        for key_node, result in (await load_benchmarks(self.ctx.store, self.job_id)).items():
            self.bench[key_node] = result
        self.params_payload = None
        await self.rounds.restored(resumed=latest is not None)
        self.rollback.restored = True

    # -- node set -------------------------------------------------------------------------------

    async def _gather_nodes(self) -> list[str]:
        """The nodes of the next round (benchmarked on this job); waits while there are too
        few (PAUSED below min_nodes)."""
        held = await self.rounds.hold_over()
        if held:
            return held
        nodes = self.node_set
        while (
            not self.stop_requested.is_set() and not self.terminal and not nodes.job_fault_verdict
        ):
            self._wake.clear()
            await self._handle_departures()
            max_nodes = min(self.spec.max_nodes, self.spec.global_batch)
            given = await self.host.nodes_for(self.job_id, refused=nodes.excluded())
            chosen = nodes.choose(given, max_nodes, self.host.reference_rate)
            for n in chosen:
                if n not in self.bench:
                    await self._ask_benchmark(n)
            # Nodes the scheduler no longer gives the job leave at this round boundary (also
            # one that was benchmarked and never joined: its hold would outlive the job).
            for n in nodes.leaving(chosen):
                await self._drop_node(n)
            ready = [n for n in chosen if n in self.bench]
            # A silent node (no heartbeat lately: probably dead, its lease not lapsed yet) sits
            # out; it stays in the job and takes part again once it heartbeats.
            live = [n for n in ready if not self.host.is_silent(n)]
            if len(live) >= self.spec.min_nodes:
                self._drop_ghosts()
                # Benchmarked nodes join now; nodes still benchmarking join a later round.
                joined = [n for n in live if n not in nodes.members]
                for n in joined:
                    await self._join(n)
                if joined:
                    self.planner.rerate_unobserved(nodes.members)
                usable = [n for n in nodes.members if n in live]
                why = self.rounds.cannot_run(usable)
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
            self.writer.start()  # no round goes out now: write the last one's record
            try:
                timeout = min(1.0, self.ctx.registry.heartbeat_interval_s)
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass
        return []

    async def _handle_departures(self) -> None:
        """Nodes whose lease ended since the last round leave the job (see on_node_offline)."""
        departed = self.node_set.take_departures()
        if not departed:
            return
        for node_id, reason in departed.items():
            await self._drop_node(node_id, reason)
        await save_benchmarks(self.ctx.store, self.job_id, self.bench)

    def _drop_ghosts(self) -> None:
        """Give the segments of ledger nodes that are not in the job (restored from a checkpoint
        of an earlier process) to the nodes that are; a ghost that comes back joins afresh."""
        for n in self.ledger.nodes:
            if n not in self.nodes:
                self.ledger.fail_node(n)

    async def _ask_benchmark(self, node_id: str) -> None:
        now = time.monotonic()
        timeout = BENCHMARK_TIMEOUT_S + self.ctx.config.lease_ttl
        if not self.node_set.benchmark_due(node_id, now, timeout):
            return
        task_id = new_task_id("t-")
        task = job_tasks.benchmark_task(self.job, self.spec, task_id)
        self.node_set.asked_benchmark(node_id, task_id, now)
        self.host.enqueue(node_id, task, self.job_id)

    def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        """The node's answer to the benchmark task it was handed (the engine checked the task
        id); one that is no longer awaited is dropped."""
        if node_id not in self.node_set.benchmarking():
            return
        if result.samples_per_second <= 0 or not math.isfinite(result.samples_per_second):
            self.note_failure(node_id, "benchmark reported no throughput")
            return
        self.node_set.benchmark_answered(node_id, time.monotonic())
        self.bench[node_id] = result
        asyncio.get_running_loop().create_task(
            save_benchmarks(self.ctx.store, self.job_id, self.bench)
        )
        self.wake()

    async def _join(self, node_id: str) -> None:
        rate = self.planner.add_node(node_id, len(self.nodes) + 1, self.ps.num_bytes())
        self.node_set.join(node_id)
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

    async def _drop_node(self, node_id: str, reason: str = "") -> None:
        if self.node_set.leave(node_id):
            self.planner.remove_node(node_id)
            if node_id in self.ledger.nodes:
                self.ledger.fail_node(node_id)
            await self.ctx.events.append(
                "job.node_left",
                node_id=node_id,
                job_id=self.job_id,
                message=reason or "node left the job; its unconsumed samples were reassigned",
            )
        self.planner.batches.pop(node_id, None)
        await self.host.release(node_id, self.job_id)

    async def _release_all(self) -> None:
        for n in self.node_set.release_all():
            try:
                await self.host.release(n, self.job_id)
            except Exception:  # the node may be gone; nothing to release then
                log.debug("releasing %s failed", n, exc_info=True)

    def on_node_offline(self, node_id: str) -> None:
        """The node's lease ended (lapsed, Leave, or the same id registered again after a
        restart). Its part of the open round fails now; between rounds it leaves the job, and
        its job benchmark is forgotten so that it is benchmarked again if it comes back."""
        rs = self.round_state
        if rs is not None and node_id in rs.parts and rs.parts[node_id].status == "pending":
            rs.parts[node_id].status = "failed"
            rs.parts[node_id].error = "node went offline"
        reason = ""
        if node_id in self.nodes or node_id in self.bench:
            self.bench.pop(node_id, None)
            reason = "node went offline (lease ended); its unconsumed samples go to the other nodes"
        self.node_set.went_offline(node_id, reason)
        self.wake()

    def note_failure(self, node_id: str, error: str) -> None:
        failures = self.node_set.note_failure(node_id)
        if failures:
            asyncio.get_running_loop().create_task(
                self.ctx.events.append(
                    "job.node_excluded",
                    node_id=node_id,
                    job_id=self.job_id,
                    message=f"{failures} failed tasks in a row; last: {error}",
                )
            )
        self.wake()

    def on_task_failed(
        self, node_id: str, task_id: str, error: str, *, job_fault: bool = False
    ) -> None:
        """A task of this job failed on the node; `job_fault`: by the job's own fault (counted
        by `on_job_fault`, not against the node)."""
        if self.node_set.benchmark_failed(node_id, task_id):
            if not job_fault:
                self.note_failure(node_id, error)
            return
        rs = self.round_state
        if rs is not None:
            part = rs.parts.get(node_id)
            if part is not None and part.task_id == task_id and part.status == "pending":
                part.status = "failed"
                part.error = error[:500]
                if not job_fault:
                    self.note_failure(node_id, error)
                rs.touch()

    def on_job_fault(self, node_id: str, task_id: str, error: str) -> None:
        """A node of this job says one of its tasks failed by the job's fault. Once enough
        distinct nodes say so since the last applied round (see JobNodeSet.job_fault), the job
        fails with the reason; no node is blamed."""
        if task_id not in (self._open_task_ids()):
            return  # stale, or not this node's task
        if self.node_set.job_fault(node_id, error):
            self.wake()

    def benchmark_task_ids(self) -> set[str]:
        return self.node_set.benchmark_task_ids()

    def _open_task_ids(self) -> set[str]:
        ids = self.node_set.benchmark_task_ids()
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
            attrs={f"fault.{n}": why for n, why in sorted(self.node_set.job_faults.items())},
        )
        await self.fail(message)

    # -- rounds ---------------------------------------------------------------------------------

    def plan_parts(self, nodes: list[str]) -> tuple[int, dict[str, Part], float]:
        """Plan the next round on ``nodes`` (see RoundPlanner.plan): (round number, parts by
        node, deadline)."""
        round_id = self.next_round
        self.rollback.keep_snapshot(round_id, self.ps, self.ledger, self.job, self.rounds_applied)
        self.next_round += 1
        parts, deadline = self.planner.plan(round_id, nodes, self.ledger, new_task_id)
        prices = {}
        for n in parts:
            info = self.ctx.registry.get(n)
            prices[n] = info.price_micro_per_hour if info is not None else 0
        try:
            self.billing.price_parts(
                parts,
                prices,
                self.planner.estimator.rates(list(parts)),
                unobserved_standing(self.planner, list(parts), self.nodes),
            )
        except (BudgetExhausted, AboveMaxPrice):
            self.ledger.abort_round(round_id)  # nothing was handed out
            self.next_round -= 1
            raise
        return round_id, parts, deadline

    def fail_silent(self, rs: RoundState) -> None:
        """Fail the pending parts of nodes that stopped heartbeating (dead, cut off, hung): the
        round need not wait for its deadline."""
        for part in rs.outstanding():
            if self.host.is_silent(part.node_id):
                silent_s = self.host.silence_limit_s()
                part.status = "failed"
                part.error = f"no heartbeat for more than {silent_s:.2f}s (node unresponsive)"
                log.info("job %s round %d: %s is silent", self.job_id, rs.round, part.node_id)

    def train_task(self, rs: RoundState, part: Part) -> agent_pb2.Task:
        payload = self.params_payload if self.params_payload_version == rs.version else None
        return job_tasks.train_task(
            self.job,
            self.spec,
            self.shards,
            rs,
            part,
            inner_steps=self.planner.inner_steps,
            verify_chunks=self.verifier.verify_chunks,
            restored_version=self.restored_version,
            payload=payload,
            inline_max_bytes=self.ctx.config.inline_params_max_bytes,
        )

    async def close_round(self, rs: RoundState, t0: float) -> None:
        """The round's applied parts are in (parts of status "applied"): commit their slices
        (the others return to pending), update estimates and stats, record the round, and write
        a checkpoint when one is due."""
        received = sorted(
            (p for p in rs.parts.values() if p.status == "applied"), key=lambda p: p.node_id
        )
        if received:
            self.rounds_applied += 1
            self.node_set.round_applied()
        applied = {p.node_id for p in received}
        self.ctx.registry.count_parts(
            applied=sorted(applied),
            failed=[
                p.node_id for p in rs.parts.values() if p.status in ("failed", "late", "rejected")
            ],
        )
        consumed = {p.node_id: p.samples for p in received if 0 < p.samples < p.assigned}
        self.ledger.commit_round(rs.round, applied, consumed)
        self.verifier.on_round_closed(rs)
        self.planner.confirm_compute(rs)
        self.node_set.observe(rs)
        self.planner.observe(rs)
        est = self.planner.estimator
        self.billing.settle_rates(
            rs.parts.values(),
            {n: est.estimate(n) for n in rs.parts if n in est and est.observations(n) > 0},
        )
        record = rs.record(self.job_id, self.rounds.version, now_ms())
        samples = sum(p.samples for p in received)
        loss = record.loss
        job = self.job
        job.round = self.rounds_applied
        job.params_version = self.rounds.version
        job.samples_done += samples
        if samples:
            job.last_loss = loss
        job.epoch = self.ledger.epoch
        left = self.spec.epochs * job.num_samples - job.samples_done
        job.eta_seconds = self.planner.eta(left, self.nodes, time.monotonic() - rs.started)
        job.updated_ms = now_ms()
        self.round_state = None
        # Parts the round waited for and did without (a best-effort part that is late is the
        # expected case, not news: no event, debug log only).
        dropped = rs.dropped()
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
        checkpoint = bool(received) and self.rounds.want_checkpoint(rs)
        charges = self.billing.charge_round(rs.epoch, rs.round, received)
        # In the background: the record of round r - 1 is in the store before round r + 1 is
        # handed out (see `restore` for the parameter versions this bounds).
        await self.writer.add(record, rs, dropped, charges)
        if self.ledger.complete:
            await self.next_epoch()
        elif checkpoint:
            await self._checkpoint_soon(last_round=rs.round)
        t1 = time.monotonic()
        took = t1 - rs.started
        self._round_s = took if self._round_s == 0 else 0.5 * self._round_s + 0.5 * took
        self.planner.overhead_s = 0.5 * self.planner.overhead_s + 0.5 * (t1 - t0)
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
        self.host.round_finished(
            self.job_id, self.benchmark_task_ids() | self.verifier.open_task_ids()
        )
        await self.notify()

    async def next_epoch(self) -> None:
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

    async def ensure_params_payload(self) -> None:
        if self.params_payload is None or self.params_payload_version != self.ps.version:
            snapshot = self.ps.snapshot()
            self.params_payload = await asyncio.to_thread(encode_bundle, snapshot)
            self.params_payload_version = self.ps.version

    # -- checkpoints, states, result ------------------------------------------------------------

    async def _checkpoint(self, last_round: int) -> None:
        """Write a checkpoint of the state now (after any still being written) and wait; none
        when the parameter server does not hold the job's newest state (see may_checkpoint)."""
        if not self.rounds.may_checkpoint(last_round):
            return
        await self.writer.checkpoint(
            *checkpoint_state(self.ps, self.ledger, self.job, self.rounds_applied, last_round)
        )

    async def _checkpoint_soon(self, last_round: int) -> None:
        """A checkpoint of the state now, written in the background while the next round runs
        (parameter-server mode): the state is copied first, so later rounds cannot change what
        is written; checkpoints are written in order, each after the one before. A crash
        before it is written loses the rounds since the previous one, as between any two
        checkpoints. A runner that writes in line (ring mode checkpoints a state a member
        pushes) writes it now."""
        if not self.writer.background:
            await self._checkpoint(last_round)
            return
        await self.writer.checkpoint_soon(
            *checkpoint_state(self.ps, self.ledger, self.job, self.rounds_applied, last_round)
        )

    async def _set_state(self, state: common_pb2.JobState, message: str) -> None:
        if self.job.state == state and self.job.message == message:
            return
        # Whoever sees the new state (PAUSED, a terminal one) finds every closed round stored.
        try:
            await self.writer.written()
        except Exception:
            log.exception("job %s: a round record could not be written", self.job_id)
        if self.job.state in TERMINAL:
            return  # it ended while this waited (a cancel): an end is final
        previous = self.job.state
        self.job.state, self.job.message, self.job.updated_ms = state, message, now_ms()
        if state in TERMINAL and previous not in TERMINAL:
            # The end and its money in one transaction (coordinator/engine/job_pay.py).
            await self.pay.record_end(previous, self.verifier.accused)
            await self.notify()
            return
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
        if not await self.rounds.may_finish():
            return
        params = self.ps.snapshot()
        # Keyed like make_model().state_dict(): trained parameters (a tied alias gets its
        # parameter's values), buffers as submitted.
        params.update({a: params[p] for a, p in self.aliases.items() if p in params})
        state = {k: params[k] if k in params else self.buffers[k] for k in self.state_names}
        data = await asyncio.to_thread(to_safetensors, state)
        async with self.ctx.blobs.stored(data) as ref:  # named by the job's record below
            self.job.result.CopyFrom(ref)
            self.job.eta_seconds = 0.0
            await self._checkpoint(last_round=self.next_round - 1)
            await self._set_state(
                JS.JOB_STATE_SUCCEEDED,
                f"trained {self.spec.epochs} epochs in {self.rounds_applied} rounds, "
                f"final loss {self.job.last_loss:.4f}",
            )

    async def fail(self, message: str) -> None:
        try:
            await self._set_state(JS.JOB_STATE_FAILED, message)
        except Exception:
            log.exception("could not record the failure of job %s", self.job_id)

    async def _wait_for_budget(self, reason: str) -> None:
        """PAUSED with ``reason`` (it starts "budget"), every node back to the pool, until a
        top-up (or the job stops)."""
        self.budget_paused = True
        self._budget_added.clear()
        await self._set_state(JS.JOB_STATE_PAUSED, reason)
        for n in list(dict.fromkeys([*self.node_set.members, *self.node_set.held])):
            await self._drop_node(n, "the job's budget ran out: the node returns to the pool")
        await self._release_all()  # and any node still benchmarking
        self.host.round_finished(
            self.job_id, self.benchmark_task_ids() | self.verifier.open_task_ids()
        )
        while not self.stop_requested.is_set() and not self.terminal:
            if self._budget_added.is_set():
                break
            self._wake.clear()
            await self._wake.wait()
        self.budget_paused = False

    async def add_budget(self, amount: int) -> None:
        """Top the escrow up by ``amount`` from the tenant (InsufficientCredits when short);
        a job paused for its budget tries again."""
        await self.pay.top_up(amount)
        self._budget_added.set()
        self.wake()

    async def cancel(self) -> None:
        await self._set_state(JS.JOB_STATE_CANCELLED, "cancelled by its submitter")
        self.stop_requested.set()
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
        arrived: float = 0.0,
    ) -> str:
        """Hand a decoded gradient to the open round; returns "" or why it was not taken."""
        rs = self.round_state
        if rs is None:
            return "the round is closed (the update came after its deadline)"
        return rs.take_update(node_id, task_id, num_samples, mean_loss, compute_s, grads, arrived)

    def part_seen(self, node_id: str, task_id: str, what: str) -> None:
        """The node took the task of its open part, or pulled the round's parameters
        (``what``: "delivered" / "pulled"; coordinator/rounds/claims.py)."""
        if self.round_state is not None:
            self.round_state.seen(node_id, task_id, what)

    def on_failure_report(self, req: agent_pb2.ReportProgressRequest) -> None:
        """ReportProgress of one of this job's tasks that failed (else nothing to do)."""
        if req.failed:
            if req.job_fault:
                self.on_job_fault(req.node_id, req.task_id, req.error or "failed")
            self.on_task_failed(
                req.node_id, req.task_id, req.error or "failed", job_fault=req.job_fault
            )

    async def serve_parameters(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        """(version, header, payload) of the parameter server's state for PullParameters: the
        parameters of the current version (plain names), or with include_optimizer_state its
        whole state ("param/<name>", "optim/<key>/<name>", as in a checkpoint)."""
        version = self.ps.version
        kept = self.verifier.payload(req.version) if req.version != version else None
        if kept is not None and not req.include_optimizer_state:
            return req.version, kept[0], kept[1]  # an older version, for a check
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
        await self.ensure_params_payload()
        assert self.params_payload is not None
        header, data = self.params_payload
        return self.params_payload_version, header, data

    def samples_problem(self, node_id: str, task_id: str, num_samples: int) -> str:
        """Why an update's num_samples does not fit the task's open part ("" if it does)."""
        rs = self.round_state
        if rs is None:
            return "the task is not part of the open round"
        return rs.samples_problem(node_id, task_id, num_samples)

    def part_samples(self, node_id: str, task_id: str) -> int | None:
        """The samples of the task's open part (None: not an open part)."""
        rs = self.round_state
        return rs.part_samples(node_id, task_id) if rs is not None else None

    def reject(self, node_id: str, task_id: str, error: str) -> None:
        """The node's update for its open part was refused (bad input)."""
        self._end_part(node_id, task_id, "rejected", error)

    def fail_part(self, node_id: str, task_id: str, error: str) -> None:
        """The node's open part cannot complete (e.g. its update stream broke off)."""
        self._end_part(node_id, task_id, "failed", error)

    def _end_part(self, node_id: str, task_id: str, status: str, error: str) -> None:
        if self.round_state is not None:
            self.round_state.end_part(node_id, task_id, status, error)

    def task_is_live(self, node_id: str, task_id: str) -> bool:
        """Whether the task is one the job still waits for (its benchmark, its open part, or a
        state it asked the node to push)."""
        if self.node_set.is_benchmark_task(node_id, task_id):
            return True
        if self.verifier.is_check_task(node_id, task_id):
            return True
        if self.rounds.wants_checkpoint(node_id, task_id):
            return True
        rs = self.round_state
        return rs is not None and rs.is_open_part(node_id, task_id)

    # -- verification -----------------------------------------------------------------------------

    def check_task(
        self,
        task_id: str,
        round_id: int,
        version: int,
        runs: np.ndarray,
        check: agent_pb2.CheckSpec,
        payload: tuple[common_pb2.TensorBundle, bytes] | None,
        local_batch: int = 0,
    ) -> agent_pb2.Task:
        """A CHECK task of the job (coordinator/engine/job_tasks.py), due in twice its rounds'
        time (at least 5 s)."""
        return job_tasks.check_task(
            self.job,
            self.spec,
            self.shards,
            task_id,
            round_id,
            version,
            runs,
            check,
            payload,
            epoch=self.ledger.epoch,
            deadline_s=max(5.0, 2.0 * self.round_seconds()),
            inline_max_bytes=self.ctx.config.inline_params_max_bytes,
            local_batch=local_batch,
        )

    async def release_pay(self, node_id: str, up_to_round: int) -> None:
        """A check vouched for ``node_id``'s parts up to ``up_to_round``: the pay held for
        them goes to its donor (coordinator/engine/job_pay.py)."""
        await self.pay.release(node_id, up_to_round)

    async def on_verification_failed(
        self, node_id: str, first_round: int | None, reason: str, *, accuse: bool
    ) -> None:
        """A check of ``node_id`` failed: its open part is discarded, an accused node leaves
        the job, the state goes back to before ``first_round`` (its first update not yet
        verified; None: none of its updates was applied) at the next safe point, and the pay
        held for its undone parts is forfeited."""
        rs = self.round_state
        if rs is not None:
            part = rs.parts.get(node_id)
            if part is not None and part.status in ("pending", "received"):
                part.status = "rejected"
                part.error = f"failed verification: {reason}"[:500]
                part.grads = None
                rs.touch()
        if first_round is not None:
            self.undo_from(first_round, f"{node_id}: {reason}")
        if accuse:
            self.node_set.went_offline(node_id, f"quarantined: {reason}"[:300])
        self.wake()
        await self.pay.forfeit(node_id, reason)

    def undo_from(self, round_id: int, reason: str) -> None:
        """Roll the job back to before round ``round_id`` at the next safe point (verification
        found it wrong; an earlier pending rollback point is kept)."""
        self.rollback.undo_from(round_id, reason)
        self.wake()

    def rollback_floor(self) -> int | None:
        """The oldest round a verification rollback may still undo (read-only; the garbage
        collector keeps the newest checkpoint from before it): None when none may be."""
        return self.rollback.floor()

    async def _roll_back(self) -> None:
        """Undo every round from the pending rollback point on (a cheat was applied in it):
        back to the newest kept state from before it (a snapshot, else a checkpoint), those
        rounds' samples pending again (exactly once), later checkpoints forgotten."""
        before = self.rollback.take()
        await self.writer.written()
        await self.writer.checkpoint_written()
        store = self.ctx.store
        state = await self.rollback.state_before(self.ctx, self.job_id, before)
        if state is None:
            await self.fail(f"no checkpoint before round {before} to roll back to")
            return
        tensors, manifest = state
        # Versions after the state were handed out with other parameters: continue past them.
        version = max(self.ps.version, self.rounds.version) + 2
        self.ps.load_state_tensors(tensors, version)
        self.restored_version = version
        await self.rounds.restored(False)  # ring rounds: their members pull it
        self.ledger = EpochLedger.from_state(manifest.ledger)
        self.ledger.abort_open_rounds()
        # The restored ledger knows the nodes of its time: make it know today's.
        seat_nodes(self.ledger, self.nodes, self.planner.estimator.rates(self.nodes))
        rolled = await store.rollback_rounds(self.job_id, manifest.round)
        await store.drop_checkpoints_after(self.job_id, manifest.round)
        self.rollback.rolled_back(manifest.round)
        self.verifier.on_rolled_back(manifest.round)
        self.rounds_applied = manifest.rounds_applied
        restore_job_record(self.job, manifest, version)
        self.params_payload = None
        await self.rollback.announce(self.ctx, self.job_id, manifest.round, rolled, version)
        await store.update_job(self.job)
        await self._checkpoint(last_round=manifest.round)
        await self.notify()

    def allocation(self) -> common_pb2.Allocation:
        """The job's nodes and their shares now (coordinator/engine/job_allocation.py); asked
        for by watchers from the job's submission on, before the runner restored its ledger."""
        ledger: EpochLedger | None = getattr(self, "ledger", None)
        return job_allocation.allocation(
            self.job, self.round_state, self.planner, self.node_set, ledger, self.ctx.registry
        )
