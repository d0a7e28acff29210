"""What every command receives: parsed arguments, the coordinator, and the output streams."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from client.commands.output import closest
from client.config import ResolvedAddress, load_credentials
from client.render import Style, render_table, table_width, terminal_width
from client.rpc import (
    CONNECT_TIMEOUT_S,
    CliError,
    Coordinator,
    ExitCode,
    find_active,
    speaks_tls,
)
from epochmesh.job_ref import match_jobs
from epochmesh.v1 import common_pb2, job_pb2, market_pb2, scheduler_pb2

# Account kinds a reference may name with a prefix (``tenant:u-62b``); a bare id is a tenant's.
ACCOUNT_KINDS = ("tenant", "donor", "escrow", "held")


def match_account(ref: str, known: Sequence[str]) -> list[str]:
    """The known accounts ``ref`` names: itself when known, else those it is a prefix of
    (``tenant:u-62b`` or, bare, ``u-62b`` among the tenant accounts). Pure."""
    full = ref if ":" in ref or ref in ("mint", "platform") else f"tenant:{ref}"
    if full in known:
        return [full]
    return [a for a in known if a.startswith(full)]


def not_logged_in(address: str, source: str) -> CliError:
    """The error for a command run without credentials: "unreachable" when nothing answers at
    ``address`` or it speaks plaintext (so a wrong address still answers exit 4), else "not
    logged in"."""
    answer = speaks_tls(address, CONNECT_TIMEOUT_S)
    if answer is False:
        return CliError(
            ExitCode.UNREACHABLE,
            f"the coordinator at {address} speaks plaintext (it runs --insecure), and the CLI "
            "talks TLS",
            "pass --insecure to talk to it",
        )
    if answer is None:
        from_where = f" (address from {source})" if source else ""
        return CliError(
            ExitCode.UNREACHABLE,
            f"cannot reach the coordinator at {address}{from_where}: connection failed",
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
        logged in -> exit 7). TLS with the stored credentials unless ``--insecure``. Given
        several addresses, the one whose health is SERVING (the active coordinator)."""
        if self._coordinator is None:
            identity = None
            if not getattr(self.args, "insecure", False):
                identity = load_credentials()
                if identity is None:
                    raise not_logged_in(self.address.address, self.address.source)
            if len(self.address.every) > 1:
                active = find_active(
                    self.address.every, self.address.source, identity, CONNECT_TIMEOUT_S
                )
                self.address = replace(self.address, address=active)
            self._coordinator = Coordinator(
                self.address.address,
                source=self.address.source,
                identity=identity,
                addresses=self.address.every,
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
        """A table on stdout: fitted to a terminal (its ``wrap`` columns wrapped, never cut),
        whole when stdout is a pipe (see client.render)."""
        for line in render_table(headers, rows, width=table_width(self.stdout), **kwargs):
            self.emit(line)
        self.stdout.flush()

    # -- stderr: progress and notes ---------------------------------------------------------
    def note(self, line: str) -> None:
        self.stderr.write(line + "\n")
        self.stderr.flush()

    # -- lookups shared by commands -----------------------------------------------------------
    def get_job(self, ref: str) -> common_pb2.Job:
        """The job named by an id, a unique id prefix, or a unique job name (the rule of
        epochmesh/job_ref.py, which the dashboard follows too)."""
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
        matches = match_jobs(ref, jobs)  # the one rule, as the dashboard's
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

    def known_accounts(self) -> list[str] | None:
        """Every account the coordinator knows, zero balances included; None when the caller
        may not list them (not an operator: the call that names the account then says what
        it may not do)."""
        coord = self.coordinator
        try:
            reply = coord.call(
                "GetBalance",
                coord.market.GetBalance,
                market_pb2.GetBalanceRequest(all=True, known=True),
            )
        except CliError as err:
            if err.code == ExitCode.AUTH:
                return None
            raise
        return sorted(b.account for b in reply.balances)

    def get_account(self, ref: str, *, create: bool = False) -> str:
        """The account named by its name, a bare principal id (its tenant account) or a unique
        prefix of either; an unknown one is NOT_FOUND (exit 3). With ``create`` the reference is
        taken as written (the coordinator opens the account when it does not know it). A reference
        of another kind (``wallet:x``) goes to the coordinator as given, which explains it."""
        ref = ref.strip()
        if not ref:
            raise CliError(ExitCode.USAGE, "empty account", "name an account: tenant:ID or ID")
        kind, sep, _ = ref.partition(":")
        if create or (sep and kind not in ACCOUNT_KINDS):
            return ref  # taken as written: the coordinator opens it or explains the refusal
        known = self.known_accounts()
        if known is None:
            return ref
        matches = match_account(ref, known)
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise CliError(
                ExitCode.USAGE,
                f"{ref!r} matches {len(matches)} accounts ({', '.join(matches[:5])})",
                "give more of the id",
            )
        close = closest(ref if sep else f"tenant:{ref}", known)
        hint = f"did you mean {close}? " if close else ""
        raise CliError(
            ExitCode.NOT_FOUND,
            f"unknown account {ref!r}: no enrolled user, node, job or ledger entry names it",
            f"{hint}list accounts with `epochmesh balance --all --known`; to open a new "
            "account on purpose, add --create",
        )

    def get_tenant(self, ref: str, *, create: bool = False) -> str:
        """The tenant (a principal id) named by its id or a unique prefix (``tenant:`` may
        lead); an unknown one is NOT_FOUND (exit 3); with ``create`` the reference as written."""
        ref = ref.strip().removeprefix("tenant:")
        if not ref:
            raise CliError(
                ExitCode.USAGE,
                "empty tenant",
                "a tenant is the principal id that submits its jobs (see `epochmesh tenant list`)",
            )
        if create:
            return ref
        accounts = self.known_accounts()
        if accounts is None:
            return ref
        known = [a for a in accounts if a.startswith("tenant:")]
        matches = match_account(ref, known)
        if len(matches) == 1:
            return matches[0].removeprefix("tenant:")
        if len(matches) > 1:
            ids = ", ".join(m.removeprefix("tenant:") for m in matches[:5])
            raise CliError(
                ExitCode.USAGE,
                f"{ref!r} matches {len(matches)} tenants ({ids})",
                "give more of the id",
            )
        close = closest(ref, [a.removeprefix("tenant:") for a in known])
        hint = f"did you mean {close}? " if close else ""
        raise CliError(
            ExitCode.NOT_FOUND,
            f"unknown tenant {ref!r}: no enrolled user, job, weight or ledger entry names it",
            f"{hint}tenants are users' principal ids (`epochmesh whoami` shows one's); to "
            "weigh a tenant that does not exist yet, add --create",
        )
