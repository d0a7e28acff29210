"""What every command receives: parsed arguments, the coordinator, and the output streams."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from client.commands.output import closest
from client.config import ResolvedAddress
from client.render import Style, render_table, terminal_width
from client.rpc import CliError, Coordinator, ExitCode
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2


@dataclass
class Context:
    args: argparse.Namespace
    address: ResolvedAddress
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    _coordinator: Coordinator | None = None

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator, connected on first use (unreachable -> CliError exit 4)."""
        if self._coordinator is None:
            self._coordinator = Coordinator(self.address.address, source=self.address.source)
        return self._coordinator.connect()

    def close(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()

    @property
    def json(self) -> bool:
        return getattr(self.args, "output", "table") == "json"

    @property
    def out_style(self) -> Style:
        return Style.for_stream(self.stdout)

    @property
    def err_style(self) -> Style:
        return Style.for_stream(self.stderr)

    @property
    def width(self) -> int:
        return terminal_width(self.stdout)

    # -- stdout: data ---------------------------------------------------------------------
    def emit(self, line: str = "") -> None:
        self.stdout.write(line + "\n")

    def emit_json(self, data: Any) -> None:
        """One JSON document (``--output json``)."""
        self.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
        self.stdout.flush()

    def emit_json_line(self, data: Any) -> None:
        """One JSON object per line (rounds, events, logs, watch)."""
        self.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
        self.stdout.flush()

    def emit_table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        **kwargs: Any,
    ) -> None:
        for line in render_table(headers, rows, width=self.width, **kwargs):
            self.emit(line)
        self.stdout.flush()

    # -- stderr: progress and notes ---------------------------------------------------------
    def note(self, line: str) -> None:
        self.stderr.write(line + "\n")
        self.stderr.flush()

    # -- lookups shared by commands -----------------------------------------------------------
    def get_job(self, ref: str) -> common_pb2.Job:
        """The job named by an id, a unique id prefix, or a unique job name."""
        coord = self.coordinator
        ref = ref.strip()
        if not ref:
            raise CliError(ExitCode.USAGE, "empty job id", "list jobs with `epochmesh status`")
        try:
            return coord.call("GetJob", coord.jobs.GetJob, job_pb2.GetJobRequest(job_id=ref))
        except CliError as err:
            if err.code not in (ExitCode.NOT_FOUND, ExitCode.USAGE):
                raise
        jobs = list(
            coord.call("ListJobs", coord.jobs.ListJobs, job_pb2.ListJobsRequest(limit=10_000)).jobs
        )
        matches = [j for j in jobs if j.job_id.startswith(ref) or j.name == ref]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            ids = ", ".join(j.job_id for j in matches[:5])
            raise CliError(
                ExitCode.USAGE,
                f"{ref!r} matches {len(matches)} jobs ({ids})",
                "give the full job id",
            )
        known = [j.job_id for j in jobs] + [j.name for j in jobs if j.name]
        close = closest(ref, known)
        hint = f"did you mean {close}? " if close else ""
        raise CliError(
            ExitCode.NOT_FOUND,
            f"unknown job {ref!r}",
            f"{hint}list jobs with `epochmesh status`",
        )

    def get_node(self, ref: str) -> common_pb2.NodeInfo:
        """The node named by its id or unique name."""
        coord = self.coordinator
        ref = ref.strip()
        if not ref:
            raise CliError(ExitCode.USAGE, "empty node id", "list nodes with `epochmesh nodes`")
        try:
            return coord.call(
                "GetNode", coord.scheduler.GetNode, scheduler_pb2.GetNodeRequest(node_id=ref)
            )
        except CliError as err:
            if err.code not in (ExitCode.NOT_FOUND, ExitCode.USAGE):
                raise
        nodes = list(
            coord.call(
                "ListNodes", coord.scheduler.ListNodes, scheduler_pb2.ListNodesRequest()
            ).nodes
        )
        matches = [n for n in nodes if n.node_id.startswith(ref)]
        if len(matches) == 1:
            return matches[0]
        known = [n.node_id for n in nodes] + [n.name for n in nodes if n.name]
        close = closest(ref, known)
        hint = f"did you mean {close}? " if close else ""
        raise CliError(
            ExitCode.NOT_FOUND,
            f"unknown node {ref!r}",
            f"{hint}list nodes with `epochmesh nodes`",
        )
