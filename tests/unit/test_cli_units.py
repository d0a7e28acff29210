"""Unit tests of the CLI's pure parts: address resolution, rendering, JSON form, watch state."""

from __future__ import annotations

import io
import json
from pathlib import Path

import grpc
import pytest

from client.commands.auth import dashboard_url
from client.commands.output import (
    closest,
    edit_distance,
    job_state_name,
    node_state_name,
    parse_node_states,
    to_dict,
)
from client.commands.queue import TenantRow, parse_priority, queue_rows, tenant_rows
from client.commands.watch import WatchState, plain_line, render_screen
from client.config import DEFAULT_COORDINATOR, config_path, resolve_coordinator
from client.render import (
    LiveBlock,
    ProgressLine,
    Style,
    color_enabled,
    fmt_bytes,
    fmt_duration,
    fmt_rate,
    progress_bar,
    render_table,
    sparkline,
    strip_ansi,
    truncate,
    truncate_visible,
)
from client.rpc import CliError, ExitCode, exit_code_for
from client.upload import blob_ref, upload_requests
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2

# -- address resolution ------------------------------------------------------------------


def test_flag_beats_env_beats_config_beats_default(tmp_path: Path) -> None:
    cfg = tmp_path / "epochmesh" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text('coordinator = "10.0.0.3:7000"\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path), "EPOCHMESH_COORDINATOR": "10.0.0.2:7000"}
    assert resolve_coordinator("10.0.0.1:7000", env).address == "10.0.0.1:7000"
    got = resolve_coordinator(None, env)
    assert (got.address, got.source) == ("10.0.0.2:7000", "EPOCHMESH_COORDINATOR")
    env.pop("EPOCHMESH_COORDINATOR")
    got = resolve_coordinator(None, env)
    assert (got.address, got.source) == ("10.0.0.3:7000", str(cfg))
    cfg.unlink()
    got = resolve_coordinator(None, env)
    assert (got.address, got.source) == (DEFAULT_COORDINATOR, "default")


def test_config_path_follows_xdg(tmp_path: Path) -> None:
    assert config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == (
        tmp_path / "epochmesh" / "config.toml"
    )
    # A relative XDG_CONFIG_HOME is invalid per the spec and ignored.
    assert config_path({"XDG_CONFIG_HOME": "rel"}) == (
        Path.home() / ".config" / "epochmesh" / "config.toml"
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("coordinator = [", "not valid TOML"),
        ('coordinatr = "a:1"', "unknown key 'coordinatr'"),
        ("coordinator = 5", "must be a string"),
        ('coordinator = "no-port"', "bad coordinator address"),
    ],
)
def test_bad_config_file_is_a_usage_error(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "epochmesh" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text(text)
    with pytest.raises(CliError) as info:
        resolve_coordinator(None, {"XDG_CONFIG_HOME": str(tmp_path)})
    assert info.value.code == ExitCode.USAGE
    assert needle in info.value.message


@pytest.mark.parametrize("bad", ["localhost", ":7070", "host:0", "host:99999", "host:x"])
def test_bad_flag_address(bad: str) -> None:
    with pytest.raises(CliError) as info:
        resolve_coordinator(bad, {})
    assert info.value.code == ExitCode.USAGE
    assert "HOST:PORT" in info.value.hint


def test_ipv6_address_accepted() -> None:
    assert resolve_coordinator("[::1]:7070", {}).address == "[::1]:7070"


# -- error mapping -------------------------------------------------------------------------


def test_status_codes_map_to_documented_exit_codes() -> None:
    assert exit_code_for(grpc.StatusCode.UNAVAILABLE) == 4
    assert exit_code_for(grpc.StatusCode.DEADLINE_EXCEEDED) == 4
    assert exit_code_for(grpc.StatusCode.NOT_FOUND) == 3
    assert exit_code_for(grpc.StatusCode.FAILED_PRECONDITION) == 6
    assert exit_code_for(grpc.StatusCode.INVALID_ARGUMENT) == 2
    assert exit_code_for(grpc.StatusCode.INTERNAL) == 1
    assert exit_code_for(grpc.StatusCode.UNIMPLEMENTED) == 1


def test_exit_codes_are_in_the_help_epilog() -> None:
    from client.main import build_parser

    text = build_parser().format_help()
    for code in ExitCode:
        assert f"\n  {int(code)} " in text


# -- suggestions -----------------------------------------------------------------------------


def test_edit_distance_counts_transpositions_as_one() -> None:
    assert edit_distance("stauts", "status") == 1
    assert edit_distance("status", "status") == 0
    assert edit_distance("", "abc") == 3
    assert closest("stauts", ["stats", "status"]) == "status"
    assert closest("zzzzzz", ["stats", "status"]) is None


def test_state_parsing_suggests() -> None:
    assert parse_node_states("online, busy") == [
        common_pb2.NODE_STATE_ONLINE,
        common_pb2.NODE_STATE_BUSY,
    ]
    with pytest.raises(CliError) as info:
        parse_node_states("cordonned")
    assert info.value.code == ExitCode.USAGE
    assert "did you mean cordoned?" in info.value.hint


# -- rendering -----------------------------------------------------------------------------


def test_table_is_aligned_and_fits_width() -> None:
    rows = [
        ["n-0123456789", "a" * 60, "online", "123.4"],
        ["n-abcdefabcd", "short", "offline", "5.0"],
    ]
    lines = render_table(["NODE", "NAME", "STATE", "RATE"], rows, right=(3,), flex=1, width=50)
    assert all(len(line) <= 50 for line in lines)
    assert lines[1].split()[1].endswith("...")
    # Columns start at the same offsets in every line.
    offsets = [line.index("online") if "online" in line else None for line in lines]
    assert lines[0].index("STATE") == offsets[1] == lines[2].index("offline")
    # Right-aligned numbers end in the same column.
    assert lines[1].rstrip().endswith("123.4") and lines[2].rstrip().endswith("5.0")
    assert len(lines[1].rstrip()) == len(lines[2].rstrip())


def test_table_paint_does_not_break_alignment() -> None:
    style = Style(True)
    lines = render_table(
        ["A", "STATE"], [["x", "online"], ["yy", "failed"]], paint={1: style.state}
    )
    assert "\x1b[" in lines[1]
    plain = [strip_ansi(line) for line in lines]
    assert plain[1].index("online") == plain[2].index("failed") == plain[0].index("STATE")


def test_no_color_and_non_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert color_enabled(Tty(), {}) is True
    assert color_enabled(Tty(), {"NO_COLOR": "1"}) is False
    assert color_enabled(Tty(), {"NO_COLOR": ""}) is True  # empty means unset (no-color.org)
    assert color_enabled(Tty(), {"TERM": "dumb"}) is False
    assert color_enabled(io.StringIO(), {}) is False
    assert Style(False).paint("x", "red") == "x"


def test_truncate() -> None:
    assert truncate("abcdef", 10) == "abcdef"
    assert truncate("abcdefghijkl", 8) == "abcde..."
    colored = "\x1b[31m" + "x" * 20 + "\x1b[0m"
    cut = truncate_visible(colored, 5)
    assert strip_ansi(cut) == "xxxxx" and cut.endswith("\x1b[0m")


def test_sparkline() -> None:
    falling = [10.0 - i for i in range(10)]
    line = sparkline(falling, 40)
    assert len(line) == 10 and line[0] == "█" and line[-1] == "▁"
    assert list(line) == sorted(line, reverse=True)
    assert len(sparkline([float(i) for i in range(1000)], 30)) == 30
    assert sparkline([1.0, 1.0], 10) == "▅▅"
    assert sparkline([], 10) == ""
    assert sparkline([float("nan"), 1.0, 2.0], 10, ascii_only=True) == "_#"


def test_formatters() -> None:
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 * 2**20) == "3.0 MiB"
    assert fmt_duration(5) == "5s" and fmt_duration(125) == "2m05s"
    assert fmt_duration(3 * 3600 + 60) == "3h01m" and fmt_duration(float("nan")) == "-"
    assert fmt_rate(12345) == "12.3k" and fmt_rate(0) == "-"
    assert progress_bar(0.5, 10) == "[#####-----]"


def test_progress_line_plain_mode_is_throttled_and_escape_free() -> None:
    out = io.StringIO()
    line = ProgressLine(out, tty=False, plain_step=0.25)
    for i in range(101):
        line.update(f"upload {i}%", i / 100)
    line.done("uploaded")
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert lines == [
        "upload 0%",
        "upload 25%",
        "upload 50%",
        "upload 75%",
        "upload 100%",
        "uploaded",
    ]


def test_progress_line_tty_mode_rewrites_in_place() -> None:
    out = io.StringIO()
    line = ProgressLine(out, tty=True, tty_interval=0.0)
    line.update("a", 0.1)
    line.update("b", 0.2)
    line.done("c")
    assert out.getvalue() == "\r\x1b[2Ka\r\x1b[2Kb\r\x1b[2Kc\n"


def test_live_block_moves_up_by_its_height() -> None:
    out = io.StringIO()
    block = LiveBlock(out)
    block.update(["one", "two"])
    block.update(["three"])
    assert out.getvalue() == ("\x1b[2Kone\n\x1b[2Ktwo\n\x1b[J" + "\x1b[2A\r\x1b[2Kthree\n\x1b[J")


# -- JSON form -------------------------------------------------------------------------------


def test_to_dict_uses_numbers_short_enums_and_range_pairs() -> None:
    record = common_pb2.RoundRecord(
        job_id="j-1",
        epoch=2,
        round=7,
        started_ms=2**40,
        loss=0.5,
        parts=[
            common_pb2.RoundPart(
                node_id="n-1",
                local_batch=20,
                ranges=[
                    common_pb2.SampleRange(start=0, stop=10),
                    common_pb2.SampleRange(start=30, stop=40),
                ],
                mean_loss=0.4,
                seconds=0.1,
                status="applied",
            )
        ],
    )
    data = json.loads(json.dumps(to_dict(record)))
    assert data["round"] == 7 and data["started_ms"] == 2**40
    part = data["parts"][0]
    assert part["local_batch"] == 20 and part["ranges"] == [[0, 10], [30, 40]]
    job = to_dict(common_pb2.Job(state=common_pb2.JOB_STATE_RUNNING, last_loss=float("nan")))
    assert job["state"] == "running" and job["last_loss"] is None
    node = to_dict(common_pb2.NodeInfo(labels={"zone": "eu"}, state=common_pb2.NODE_STATE_BUSY))
    assert node["labels"] == {"zone": "eu"} and node["state"] == "busy"
    assert job_state_name(common_pb2.JOB_STATE_CANCELLED) == "cancelled"
    assert node_state_name(common_pb2.NODE_STATE_QUARANTINED) == "quarantined"


# -- uploads ---------------------------------------------------------------------------------


def test_upload_requests_resume_from_offset_in_bounded_chunks() -> None:
    data = bytes(range(256)) * 10_000  # 2.56 MB
    ref = blob_ref(data)
    seen: list[int] = []
    reqs = list(upload_requests(ref, data, 1000, seen.append))
    assert reqs[0].WhichOneof("part") == "header"
    assert reqs[0].header.offset == 1000 and reqs[0].header.size == len(data)
    chunks = [r.chunk for r in reqs[1:]]
    assert all(len(c.data) <= MAX_CHUNK_BYTES for c in chunks)
    assert chunks[0].offset == 1000
    assert b"".join(c.data for c in chunks) == data[1000:]
    assert sum(seen) == len(data) - 1000


# -- watch -----------------------------------------------------------------------------------


def _update(
    round_no: int, loss: float, state: int = common_pb2.JOB_STATE_RUNNING
) -> job_pb2.JobUpdate:
    job = common_pb2.Job(
        job_id="j-abc",
        name="mlp",
        state=state,
        spec=common_pb2.JobSpec(epochs=4, global_batch=64),
        num_samples=1000,
        samples_total=4000,
        samples_done=round_no * 64,
        epoch=(round_no * 64) // 1000,
        round=round_no,
        last_loss=loss,
        eta_seconds=42.0,
    )
    alloc = common_pb2.Allocation(
        job_id="j-abc",
        nodes=[
            common_pb2.NodeAllocation(
                node_id="n-fast", name="fast", samples_per_second=400, share=0.8, local_batch=51
            ),
            common_pb2.NodeAllocation(
                node_id="n-slow", name="slow", samples_per_second=100, share=0.2, local_batch=13
            ),
        ],
    )
    rec = common_pb2.RoundRecord(job_id="j-abc", round=round_no, loss=loss)
    return job_pb2.JobUpdate(job=job, allocation=alloc, rounds=[rec])


def test_watch_state_dedupes_rounds_and_renders() -> None:
    state = WatchState()
    assert len(state.apply(_update(1, 2.0))) == 1
    assert len(state.apply(_update(1, 2.0))) == 0  # replayed round after a reconnect
    for r in range(2, 10):
        state.apply(_update(r, 2.0 / r))
    assert state.last_round == 9 and len(state.losses) == 9
    screen = render_screen(state, 80, Style(False))
    text = "\n".join(screen)
    assert "j-abc (mlp)" in text and "running" in text and "epoch 1/4" in text
    assert "round 9" in text and "eta 42s" in text and "loss 0.2222" in text
    assert any(line.startswith("loss ") and "█" in line for line in screen)
    assert "fast" in text and "80.0%" in text and "51" in text
    assert all(len(line) <= 80 for line in screen)
    line = plain_line(state)
    assert "round 9" in line and "fast 400/s 80% b=51" in line and "\x1b" not in line
    state.apply(_update(10, 0.1, common_pb2.JOB_STATE_SUCCEEDED))
    assert state.finished


def test_watch_eta_fallback_from_observed_progress() -> None:
    state = WatchState()
    upd = _update(1, 1.0)
    upd.job.eta_seconds = 0
    state.apply(upd, now=100.0)
    upd2 = _update(11, 1.0)  # 640 more samples in 10 s -> 64 samples/s
    upd2.job.eta_seconds = 0
    state.apply(upd2, now=110.0)
    remaining = 4000 - 11 * 64
    assert state.eta_seconds(now=110.0) == pytest.approx(remaining / 64)


def test_priority_parsing_normalizes_and_suggests() -> None:
    assert parse_priority(" High ") == "high"
    with pytest.raises(CliError) as info:
        parse_priority("lwo")
    assert info.value.code == ExitCode.USAGE
    assert "did you mean low?" in info.value.hint and "high, normal, low" in info.value.hint


def test_tenant_rows_join_weights_and_live_jobs() -> None:
    reply = scheduler_pb2.GetQueueResponse(
        jobs=[
            scheduler_pb2.QueueEntry(job_id="j-1", tenant="u-a", nodes_held=2, fair_share=1.5),
            scheduler_pb2.QueueEntry(job_id="j-2", tenant="u-a", nodes_held=1, fair_share=0.5),
            scheduler_pb2.QueueEntry(job_id="j-3", tenant="u-b", waiting=True),
        ],
        tenant_weights={"u-a": 3.0, "u-idle": 0.5},
    )
    assert tenant_rows(reply) == [
        TenantRow("u-a", 3.0, True, 2, 3, 2.0),
        TenantRow("u-b", 1.0, False, 1, 0, 0.0),
        TenantRow("u-idle", 0.5, True, 0, 0, 0.0),
    ]
    (row,) = queue_rows(reply.jobs[:1])
    assert row == ["j-1", "-", "u-a", "normal", "unspecified", "1.50", "2/0", "-"]


def test_the_dashboard_url_is_the_coordinators_host_or_the_one_given() -> None:
    assert dashboard_url("10.0.0.5:7070", "") == "http://10.0.0.5:7080"
    assert dashboard_url("[::1]:7070", "") == "http://[::1]:7080"
    assert dashboard_url("c.example:7070", "https://dash.example/") == "https://dash.example"
    with pytest.raises(CliError) as info:
        dashboard_url("c.example:7070", "dash.example:80")
    assert info.value.code == ExitCode.USAGE and "http://HOST:PORT" in info.value.message
