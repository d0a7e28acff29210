"""``epochmesh plot``: a loss / throughput chart of a job's rounds, drawn with matplotlib.

matplotlib is an optional extra (``pip install 'epochmesh[plot]'``); without it the command
stops with a clear message (exit 2) before it contacts the coordinator.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from client.rpc import CliError, ExitCode
from epochmesh.v1 import common_pb2


def require_matplotlib() -> None:
    """Raises a usage error (exit 2) saying how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise CliError(
            ExitCode.USAGE,
            f"plot needs matplotlib, which is not installed ({err})",
            "install the optional extra: pip install 'epochmesh[plot]'",
        ) from None


def round_series(
    rounds: list[common_pb2.RoundRecord],
) -> tuple[list[int], list[float], list[float], dict[str, list[tuple[int, float]]]]:
    """Per round: number, loss, total samples/s (wall clock); per node: (round, samples/s)."""
    xs: list[int] = []
    losses: list[float] = []
    totals: list[float] = []
    per_node: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rounds:
        xs.append(r.round)
        losses.append(r.loss)
        applied = [p for p in r.parts if p.status in ("", "applied")]
        wall = (r.finished_ms - r.started_ms) / 1000
        samples = sum(p.local_batch for p in applied)
        totals.append(samples / wall if wall > 0 else float("nan"))
        for p in applied:
            if p.seconds > 0:
                per_node[p.node_id].append((r.round, p.local_batch / p.seconds))
    return xs, losses, totals, dict(per_node)


def plot_rounds(job: common_pb2.Job, rounds: list[common_pb2.RoundRecord], out: Path) -> None:
    """Writes the chart: loss per round on top, samples/s per node and in total below."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, losses, totals, per_node = round_series(rounds)
    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    try:
        title = f"{job.name or job.job_id} ({job.job_id})" if job.name else job.job_id
        fig.suptitle(f"epochmesh job {title}")
        ax_loss.plot(xs, losses, color="tab:blue", linewidth=1.4)
        if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
            ax_loss.set_yscale("log")
        ax_loss.set_ylabel("loss")
        ax_loss.grid(True, alpha=0.3)
        # Mark epoch boundaries.
        last_epoch = None
        for r in rounds:
            if last_epoch is not None and r.epoch != last_epoch:
                for ax in (ax_loss, ax_rate):
                    ax.axvline(r.round - 0.5, color="grey", alpha=0.3, linestyle=":")
            last_epoch = r.epoch
        ax_rate.plot(xs, totals, color="black", linewidth=1.6, label="total (wall clock)")
        for node_id, points in sorted(per_node.items()):
            ax_rate.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                linewidth=1.0,
                alpha=0.8,
                label=node_id,
            )
        ax_rate.set_xlabel("round")
        ax_rate.set_ylabel("samples/s")
        ax_rate.grid(True, alpha=0.3)
        ax_rate.legend(loc="best", fontsize="small", ncol=2)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
