"""``epochmesh watch JOB``: follow a job until it ends.

On a TTY (stderr) a block is redrawn in place on every update: the job line (state, epoch,
round), a progress bar with loss and ETA, the loss sparkline, and the node table (samples/s,
share, local batch b_i). Otherwise one plain line is written per new round (and per state
change), so that a log of it stays readable. With ``--output json`` every update is one JSON
line on stdout and nothing is drawn.

Exit code: 0 when the job succeeded, 5 when it failed or was cancelled, 130 on Ctrl-C. A lost
connection is retried for ``--reconnect`` seconds, resuming after the last round seen; given
several coordinator addresses, on the one that serves by then (a standby that took over).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass, field

import grpc

from client.commands.context import Context
from client.commands.output import (
    TERMINAL_JOB_STATES,
    epoch_text,
    has_loss,
    job_fraction,
    job_state_name,
    to_dict,
)
from client.render import (
    LiveBlock,
    Style,
    fmt_duration,
    fmt_loss,
    fmt_rate,
    is_tty,
    progress_bar,
    render_table,
    sparkline,
    terminal_width,
)
from client.rpc import CliError, ExitCode, error_from_rpc
from epochmesh.v1 import common_pb2, job_pb2

log = logging.getLogger(__name__)

SPARK_WIDTH = 48


@dataclass
class NodeRow:
    node_id: str
    name: str
    samples_per_second: float
    share: float
    local_batch: int


@dataclass
class WatchState:
    """What the watcher knows of the job, folded from the stream of JobUpdates."""

    job: common_pb2.Job | None = None
    allocation: common_pb2.Allocation | None = None
    last_round: int = 0
    losses: list[float] = field(default_factory=list)
    last_record: common_pb2.RoundRecord | None = None
    # (monotonic seconds, samples_done) at the first snapshot: the ETA fallback's origin.
    origin: tuple[float, int] | None = None
    # node_id -> name, remembered from allocations (round records carry ids only).
    names: dict[str, str] = field(default_factory=dict)

    def apply(
        self, update: job_pb2.JobUpdate, now: float | None = None
    ) -> list[common_pb2.RoundRecord]:
        """Folds one update in; returns the rounds it added (in order, never twice)."""
        now = time.monotonic() if now is None else now
        if update.HasField("job"):
            self.job = update.job
            if self.origin is None:
                self.origin = (now, update.job.samples_done)
        if update.HasField("allocation") and update.allocation.job_id:
            self.allocation = update.allocation
            self.names.update({n.node_id: n.name for n in update.allocation.nodes if n.name})
        added: list[common_pb2.RoundRecord] = []
        for record in sorted(update.rounds, key=lambda r: r.round):
            if record.round <= self.last_round:
                continue
            self.last_round = record.round
            self.losses.append(record.loss)
            self.last_record = record
            added.append(record)
        return added

    @property
    def finished(self) -> bool:
        return self.job is not None and self.job.state in TERMINAL_JOB_STATES

    def eta_seconds(self, now: float | None = None) -> float:
        """The coordinator's ETA; else one from the samples committed while watching. NaN
        unless the job runs: a paused or queued job has no ETA (it waits for credits or
        nodes), an ended one none left."""
        job = self.job
        if job is None or job.state != common_pb2.JOB_STATE_RUNNING:
            return float("nan")
        if job.eta_seconds > 0:
            return job.eta_seconds
        if self.origin is None:
            return float("nan")
        now = time.monotonic() if now is None else now
        t0, s0 = self.origin
        done = job.samples_done - s0
        if done <= 0 or now <= t0:
            return float("nan")
        return (job.samples_total - job.samples_done) / (done / (now - t0))

    def eta_text(self, now: float | None = None) -> str:
        """``4m05s``; ``done`` once ended, ``paused`` while paused, ``-`` when unknown."""
        if self.finished:
            return "done"
        if self.job is not None and self.job.state == common_pb2.JOB_STATE_PAUSED:
            return "paused"
        eta = self.eta_seconds(now)
        return fmt_duration(eta) if math.isfinite(eta) else "-"

    def epoch_fraction(self) -> float:
        job = self.job
        if job is None or job.num_samples <= 0:
            return 0.0
        if job.state == common_pb2.JOB_STATE_SUCCEEDED:
            return 1.0
        in_epoch = job.samples_done - job.epoch * job.num_samples
        return min(1.0, max(0.0, in_epoch / job.num_samples))

    def node_rows(self) -> list[NodeRow]:
        """Per node throughput and share: from the allocation, else from the last round."""
        alloc = self.allocation
        if alloc is not None and alloc.nodes:
            return [
                NodeRow(n.node_id, n.name, n.samples_per_second, n.share, n.local_batch)
                for n in alloc.nodes
            ]
        record = self.last_record
        if record is None:
            return []
        total = sum(p.local_batch for p in record.parts) or 1
        return [
            NodeRow(
                p.node_id,
                self.names.get(p.node_id, ""),
                p.local_batch / p.seconds if p.seconds > 0 else 0.0,
                p.local_batch / total,
                p.local_batch,
            )
            for p in record.parts
        ]


def _title(job: common_pb2.Job) -> str:
    return job.job_id + (f" ({job.name})" if job.name else "")


def render_screen(
    state: WatchState, width: int, style: Style, *, ascii_only: bool = False
) -> list[str]:
    """The TTY block: job line, progress line, loss sparkline, node table."""
    job = state.job
    if job is None:
        return ["waiting for the job's first update..."]
    lines = [
        f"job {_title(job)}  {style.state(job_state_name(job.state))}  "
        f"epoch {epoch_text(job)} ({state.epoch_fraction() * 100:.0f}%)  round {job.round}"
    ]
    fraction = job_fraction(job)
    loss = fmt_loss(job.last_loss) if has_loss(job) else "-"
    eta_text = state.eta_text()
    lines.append(
        f"{progress_bar(fraction, 30)} {fraction * 100:5.1f}%  loss {style.paint(loss, 'bold')}"
        f"  eta {eta_text}"
    )
    if state.losses:
        spark = sparkline(state.losses, min(SPARK_WIDTH, max(8, width - 30)), ascii_only=ascii_only)
        finite = [x for x in state.losses if math.isfinite(x)]
        low = f"  min {fmt_loss(min(finite))}" if finite else ""
        lines.append(f"loss {style.paint(spark, 'cyan')}{low}")
    if job.message:
        lines.append(f"note: {job.message}")
    rows = state.node_rows()
    if rows:
        table = render_table(
            ["NODE", "NAME", "SAMPLES/S", "SHARE", "B_I"],
            [
                [
                    r.node_id,
                    r.name or "-",
                    fmt_rate(r.samples_per_second),
                    f"{r.share * 100:.1f}%",
                    str(r.local_batch),
                ]
                for r in rows
            ],
            right=(2, 3, 4),
            flex=1,
            width=width,
        )
        lines.extend(table)
    else:
        lines.append("no nodes working on it yet")
    return lines


def plain_line(state: WatchState) -> str:
    """The non-TTY line written per new round."""
    job = state.job
    if job is None:
        return "waiting for the job's first update"
    parts = [
        f"{job.job_id} {job_state_name(job.state)}",
        f"epoch {epoch_text(job)}",
        f"round {job.round}",
        f"{job_fraction(job) * 100:.1f}%",
        f"loss {fmt_loss(job.last_loss) if has_loss(job) else '-'}",
        f"eta {state.eta_text()}",
    ]
    nodes = ", ".join(
        f"{r.name or r.node_id} {fmt_rate(r.samples_per_second)}/s {r.share * 100:.0f}% "
        f"b={r.local_batch}"
        for r in state.node_rows()
    )
    line = "  ".join(parts)
    return f"{line}  nodes: {nodes}" if nodes else line


class WatchView:
    """Draws updates on stderr: a live block on a TTY, plain lines otherwise."""

    def __init__(self, ctx: Context, *, quiet: bool = False) -> None:
        self.ctx = ctx
        self.quiet = quiet
        self.tty = is_tty(ctx.stderr)
        self.block = LiveBlock(ctx.stderr) if self.tty else None
        self.style = ctx.err_style
        self.ascii = "utf" not in (getattr(ctx.stderr, "encoding", "") or "").lower()
        self._last_state: int | None = None
        self._printed_any = False

    def show(self, state: WatchState, added: list[common_pb2.RoundRecord]) -> None:
        if self.quiet or state.job is None:
            return
        if self.block is not None:
            width = terminal_width(self.ctx.stderr) - 1
            self.block.update(render_screen(state, width, self.style, ascii_only=self.ascii))
            return
        job = state.job
        if self._last_state != job.state:
            if self._last_state is None:
                self.ctx.note(
                    f"watching {_title(job)}: {job.spec.epochs} epochs of {job.num_samples} "
                    f"samples, global batch {job.spec.global_batch}"
                )
            self.ctx.note(f"{job.job_id} state {job_state_name(job.state)}")
            self._last_state = job.state
        if added or not self._printed_any:
            self.ctx.note(plain_line(state))
            self._printed_any = True

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self.block is not None:
            self.block.finish()
        self.ctx.note(text)

    def finish(self) -> None:
        if self.block is not None:
            self.block.finish()


def watch_job(ctx: Context, job_id: str, *, reconnect_s: float = 60.0) -> int:
    """Follows the job until it ends; returns the exit code (0, or 5 for failed/cancelled)."""
    coord = ctx.coordinator
    state = WatchState()
    view = WatchView(ctx, quiet=ctx.json)
    lost_since: float | None = None
    try:
        while True:
            call = coord.jobs.WatchJob(
                job_pb2.WatchJobRequest(job_id=job_id, since_round=state.last_round)
            )
            try:
                for update in call:
                    lost_since = None
                    added = state.apply(update)
                    if ctx.json:
                        ctx.emit_json_line(to_dict(update))
                    view.show(state, added)
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise error_from_rpc(err, "WatchJob", coord.address) from None
                now = time.monotonic()
                lost_since = now if lost_since is None else lost_since
                if now - lost_since > reconnect_s:
                    raise error_from_rpc(err, "WatchJob", coord.address) from None
                view.message(f"lost the coordinator ({err.code().name}); reconnecting...")
                lost = coord.address
                try:
                    # Given several addresses: the one that serves now (a standby took over).
                    if coord.follow():
                        log.warning(
                            "following the active coordinator at %s (was %s)", coord.address, lost
                        )
                        continue
                except CliError:
                    pass  # none serves yet: try again until --reconnect runs out
                if coord.address == lost:
                    time.sleep(1.0)
                continue
            finally:
                call.cancel()
            if state.finished:
                break
            # The stream ended but the job goes on (coordinator restarting?): look and resume.
            job = coord.call("GetJob", coord.jobs.GetJob, job_pb2.GetJobRequest(job_id=job_id))
            state.job = job
            if state.finished:
                break
            time.sleep(0.5)
    finally:
        view.finish()
    job = state.job
    assert job is not None
    if job.state == common_pb2.JOB_STATE_SUCCEEDED:
        if not ctx.json:
            view.message(
                f"job {job.job_id} succeeded after {job.round} rounds"
                + (f", final loss {fmt_loss(job.last_loss)}" if has_loss(job) else "")
                + f"; download it with `epochmesh download {job.job_id} -o DIR`"
            )
        return ExitCode.OK
    why = f": {job.message}" if job.message else ""
    raise CliError(
        ExitCode.JOB_FAILED,
        f"job {job.job_id} {job_state_name(job.state)}{why}",
        f"see its events with `epochmesh logs {job.job_id}`",
    )


def cmd_watch(ctx: Context) -> int:
    job = ctx.get_job(ctx.args.job)
    return watch_job(ctx, job.job_id, reconnect_s=ctx.args.reconnect)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "watch",
        parents=common,
        help="follow a job until it ends",
        description="Follow a job: progress, loss, ETA and the nodes working on it. Exits 0 "
        "when the job succeeds, 5 when it fails or is cancelled. With --output json: one JSON "
        "line per update on stdout.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument(
        "--reconnect",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to retry a lost connection (default 60)",
    )
    p.set_defaults(func=cmd_watch)
