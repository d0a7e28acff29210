"""The CLI's rough edges, pure parts: the table renderer (whole when piped, wrapped reasons on a
terminal), the argparse tree (shared options everywhere, help for every option), gRPC's log
verbosity, account prefixes, refusals in words, and states and costs shown as they are."""

from __future__ import annotations

import argparse
import io

import pytest

from client.commands.context import Context, match_account
from client.commands.jobs import _status_one, cost_text
from client.commands.output import node_status
from client.commands.watch import WatchState, plain_line, render_screen
from client.config import ResolvedAddress
from client.main import SHARED_OPTIONS, build_parser, quiet_grpc_logs, subparsers_of
from client.render import Style, render_table, table_width
from coordinator.market.accounts import Sightings, known_accounts, known_tenants
from coordinator.trust.auth import ACTIONS, POLICY, refusal
from epochmesh.v1 import common_pb2, job_pb2

pytestmark = pytest.mark.timeout(30)

REASON = "running: holds 2 of the 3 nodes it wants; waits for a third at its next round"


# -- tables ---------------------------------------------------------------------------------------


def test_without_a_width_nothing_is_cut() -> None:
    rows = [["j-1", "a-rather-long-job-name", "tenant-x", REASON]]
    lines = render_table(["JOB", "NAME", "TENANT", "REASON"], rows, flex=1, wrap=(3,), width=None)
    assert lines[1].endswith(REASON) and "a-rather-long-job-name" in lines[1]
    assert "..." not in "\n".join(lines)


def test_on_a_terminal_the_reason_wraps_and_the_flex_column_is_cut_first() -> None:
    rows = [["j-1", "a-rather-long-job-name", "t", REASON], ["j-2", "b", "t", "queued"]]
    lines = render_table(["JOB", "NAME", "TENANT", "REASON"], rows, flex=1, wrap=(3,), width=50)
    assert all(len(line) <= 50 for line in lines), lines
    start = lines[0].index("REASON")
    assert "..." in lines[1]  # the name gave way
    first_row = [lines[1]] + [ln for ln in lines[2:] if not ln.strip().startswith("j-")]
    reason_lines = [ln[start:] for ln in first_row if len(ln) > start]
    assert " ".join(reason_lines).split() == REASON.split()
    # Continuation lines leave the other columns blank; the next row starts on its own line.
    assert all(not ln[:start].strip() for ln in first_row[1:])
    assert lines[-1].startswith("j-2") and lines[-1].endswith("queued")


def test_a_wrapped_column_that_is_not_last_keeps_the_columns_after_it_aligned() -> None:
    lines = render_table(["REASON", "N"], [[REASON, "7"]], right=(1,), wrap=(0,), width=40)
    assert all(len(line) <= 40 for line in lines)
    assert lines[1].endswith("7") and len(lines) > 2
    assert " ".join(line[: lines[0].rindex("N") - 2] for line in lines[1:]).split() == (
        REASON.split()
    )


def test_paint_applies_to_wrapped_tables_too() -> None:
    lines = render_table(
        ["STATE", "REASON"],
        [["running", REASON]],
        wrap=(1,),
        width=40,
        paint={0: lambda t: f"<{t}>"},
    )
    assert lines[1].startswith("<running>")


def test_a_table_on_a_pipe_has_no_width_unless_columns_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_width(io.StringIO()) is None
    monkeypatch.setenv("COLUMNS", "123")
    assert table_width(io.StringIO()) == 123


# -- the argparse tree ----------------------------------------------------------------------------


def _tree(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for child in subparsers_of(parser):
        found.extend(_tree(child))
    return found


def test_every_option_of_every_command_has_help() -> None:
    missing = [
        f"{p.prog}: {'/'.join(a.option_strings) or a.dest}"
        for p in _tree(build_parser())
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction)
        and a.help != argparse.SUPPRESS
        and not (a.help or "").strip()
        and (a.option_strings or a.dest not in ("command",))
    ]
    assert not missing, missing


def test_every_command_takes_the_shared_options() -> None:
    for parser in _tree(build_parser()):
        for option in SHARED_OPTIONS:
            assert option in parser._option_string_actions, (parser.prog, option)


@pytest.mark.parametrize(
    "argv",
    [
        ["--output", "json", "status"],
        ["status", "--output", "json"],
        ["--output", "json", "credits", "grant", "u-1", "1"],
        ["credits", "--output", "json", "grant", "u-1", "1"],
        ["credits", "grant", "u-1", "1", "--output", "json"],
        ["--output", "json", "tenant", "list"],
    ],
)
def test_output_before_or_after_the_command(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).output == "json"


def test_shared_flags_before_the_command_survive_the_commands_defaults() -> None:
    args = build_parser().parse_args(
        ["--debug", "--insecure", "--no-color", "--coordinator", "h:1", "nodes"]
    )
    assert (args.debug, args.insecure, args.no_color, args.coordinator) == (
        True,
        True,
        True,
        "h:1",
    )
    plain = build_parser().parse_args(["nodes"])
    assert (plain.output, plain.debug, plain.coordinator) == ("table", False, None)


# -- gRPC's own logs ------------------------------------------------------------------------------


def test_grpc_logs_are_quiet_unless_debug_or_the_user_chose() -> None:
    env: dict[str, str] = {}
    quiet_grpc_logs(["status"], env)
    assert env == {"GRPC_VERBOSITY": "NONE"}
    env = {}
    quiet_grpc_logs(["status", "--debug"], env)
    assert env == {}
    env = {"GRPC_VERBOSITY": "debug"}
    quiet_grpc_logs(["status"], env)
    assert env == {"GRPC_VERBOSITY": "debug"}


# -- accounts -------------------------------------------------------------------------------------


def test_account_references_match_a_known_account_or_a_prefix() -> None:
    known = ["donor:n-abc", "mint", "tenant:u-62b3dc18ab", "tenant:u-62b3dc19cd", "tenant:u-77"]
    assert match_account("u-62b3dc18", known) == ["tenant:u-62b3dc18ab"]
    assert match_account("tenant:u-62b3dc18", known) == ["tenant:u-62b3dc18ab"]
    assert match_account("u-62b3dc1", known) == ["tenant:u-62b3dc18ab", "tenant:u-62b3dc19cd"]
    assert match_account("u-77", known) == ["tenant:u-77"]
    assert match_account("donor:n-a", known) == ["donor:n-abc"]
    assert match_account("foo", known) == []
    assert match_account("n-abc", known) == []  # bare ids name tenant accounts


def test_known_accounts_come_from_what_exists() -> None:
    seen = Sightings(
        ledger_accounts=["mint", "tenant:u-paid"],
        principals={"u-alice": "submitter", "u-op": "operator", "n-1": "node"},
        job_owners=["u-owner", ""],
        weighted_tenants=["u-heavy"],
        node_ids=["n-2"],
        donors=["acme"],
    )
    known = known_accounts(seen)
    assert known == {
        "mint",
        "tenant:u-paid",
        "tenant:u-alice",
        "tenant:u-op",
        "donor:n-1",
        "tenant:u-owner",
        "tenant:u-heavy",
        "donor:n-2",
        "donor:acme",
    }
    assert known_tenants(known) == ["u-alice", "u-heavy", "u-op", "u-owner", "u-paid"]
    assert known_accounts(Sightings()) == frozenset()


# -- refusals -------------------------------------------------------------------------------------


def test_every_rpc_has_a_phrase_and_refusals_read_as_sentences() -> None:
    assert set(POLICY) <= set(ACTIONS)
    assert all(phrase and not phrase.endswith(".") for phrase in ACTIONS.values())
    assert refusal("epochmesh.v1.SchedulerService/GetQueue", "submitter").startswith(
        "only operators can see the whole queue and the tenants' weights (you are logged in as "
        "a submitter; GetQueue needs the operator role)"
    )
    assert refusal("epochmesh.v1.JobService/SubmitJob", "node").startswith(
        "only submitters and operators can submit jobs (you are logged in as a node"
    )
    assert refusal("epochmesh.v1.AgentService/NextTask", "submitter").startswith(
        "only nodes (agents) and operators can take training tasks"
    )
    assert "an operator" in refusal("epochmesh.v1.Nope/Nothing", "operator")


# -- states and costs -----------------------------------------------------------------------------


def _job(state: int, **fields: int | float) -> common_pb2.Job:
    job = common_pb2.Job(
        job_id="j-abc",
        state=state,
        spec=common_pb2.JobSpec(epochs=2, global_batch=8, budget_micro=10_000_000),
        num_samples=100,
        samples_total=200,
        samples_done=100,
        round=5,
        spent_micro=2_400_000,
        escrow_micro=7_600_000,
        eta_seconds=42.0,
    )
    for name, value in fields.items():
        setattr(job, name, value)
    return job


def _status(job: common_pb2.Job) -> str:
    out = io.StringIO()
    ctx = Context(
        args=argparse.Namespace(output="table"),
        address=ResolvedAddress("127.0.0.1:1", "test"),
        stdout=out,
        stderr=io.StringIO(),
    )
    _status_one(ctx, job)
    return out.getvalue()


def test_a_finished_job_shows_what_it_cost() -> None:
    for state in (
        common_pb2.JOB_STATE_SUCCEEDED,
        common_pb2.JOB_STATE_FAILED,
        common_pb2.JOB_STATE_CANCELLED,
    ):
        assert cost_text(_job(state)) == "2.4 credits"
        text = _status(_job(state))
        assert "so far" not in text and "escrow" not in text
        assert any(line.split() == ["cost", "2.4", "credits"] for line in text.splitlines())
    live = cost_text(_job(common_pb2.JOB_STATE_RUNNING))
    assert live == "2.4 credits so far, about 4.8 in total; 7.6 left in its escrow"


def test_only_a_running_job_has_an_eta() -> None:
    assert "eta" in _status(_job(common_pb2.JOB_STATE_RUNNING))
    for state in (common_pb2.JOB_STATE_PAUSED, common_pb2.JOB_STATE_QUEUED):
        assert "eta" not in _status(_job(state)), state

    state = WatchState()
    state.apply(job_pb2.JobUpdate(job=_job(common_pb2.JOB_STATE_PAUSED)))
    assert state.eta_text() == "paused"
    assert "eta paused" in plain_line(state)
    assert "eta paused" in "\n".join(render_screen(state, 80, Style(False)))
    state.apply(job_pb2.JobUpdate(job=_job(common_pb2.JOB_STATE_RUNNING)))
    assert state.eta_text() == "42s"
    state.apply(job_pb2.JobUpdate(job=_job(common_pb2.JOB_STATE_SUCCEEDED)))
    assert state.eta_text() == "done"


def test_a_revoked_node_reads_revoked_whatever_its_state() -> None:
    for state in (common_pb2.NODE_STATE_CORDONED, common_pb2.NODE_STATE_OFFLINE):
        assert node_status(common_pb2.NodeInfo(state=state, revoked=True)) == "revoked"
    assert node_status(common_pb2.NodeInfo(state=common_pb2.NODE_STATE_CORDONED)) == "cordoned"
    assert Style(True).state("revoked") != "revoked"  # colored like offline
