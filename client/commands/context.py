"""What every command receives: parsed arguments, the coordinator, and the output streams."""

from __future__ import annotations

import argparse
import json
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from client.commands.output import closest
from client.config import ResolvedAddress, load_credentials
from client.render import Style, render_table, terminal_width
from client.rpc import CONNECT_TIMEOUT_S, CliError, Coordinator, ExitCode
from epochmesh.identity import fetch_server_certificate
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2


def not_logged_in(address: str, source: str) -> CliError:
    """The error for a command run without credentials: "unreachable" when nothing speaks
    TLS at ``address`` (so a wrong address still answers exit 4), else "not logged in"."""
    try:
        fetch_server_certificate(address, timeout=CONNECT_TIMEOUT_S)
    except ssl.SSLError:
        return CliError(
            ExitCode.UNREACHABLE,
            f"cannot reach the coordinator at {address} over TLS (it does not speak TLS)",
            "if it runs with --insecure, pass --insecure",
        )
    except (OSError, ValueError) as err:
        from_where = f" (address from {source})" if source else ""
        return CliError(
            ExitCode.UNREACHABLE,
            f"cannot reach the coordinator at {address}{from_where}: {err}",
            "start it with `epochmesh-coordinator`, or point the CLI at it with "
            "--coordinator HOST:PORT or EPOCHMESH_COORDINATOR",
        )
    return CliError(
        ExitCode.AUTH,
        f"not logged in to the coordinator at {address}",
        "run `epochmesh login --token TOKEN` with a token from "
        "`epochmesh-coordinator token create --role submitter` (or --insecure)",
    )


@dataclass
class Context:
    args: argparse.Namespace
    address: ResolvedAddress
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    _coordinator: Coordinator | None = None

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator, connected on first use (unreachable -> CliError exit 4; not
        logged in -> exit 7). TLS with the stored credentials unless ``--insecure``."""
        if self._coordinator is None:
            identity = None
            if not getattr(self.args, "insecure", False):
                identity = load_credentials()
                if identity is None:
                    raise not_logged_in(self.address.address, self.address.source)
            self._coordinator = Coordinator(
                self.address.address, source=self.address.source, identity=identity
            )
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
            job: common_pb2.Job = coord.call(
                "GetJob", coord.jobs.GetJob, job_pb2.GetJobRequest(job_id=ref)
            )
            return job
        except CliError as err:
            if err.code not in (ExitCode.NOT_FOUND, ExitCode.USAGE):
                raise
        jobs: list[common_pb2.Job] = list(
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
            node: common_pb2.NodeInfo = coord.call(
                "GetNode", coord.scheduler.GetNode, scheduler_pb2.GetNodeRequest(node_id=ref)
            )
            return node
        except CliError as err:
            if err.code not in (ExitCode.NOT_FOUND, ExitCode.USAGE):
                raise
        nodes: list[common_pb2.NodeInfo] = list(
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
