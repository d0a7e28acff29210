"""epochmesh.program.inspection: the verdict on a child's exit (pure, table-driven), and real
confined children loading a good, a malformed, a hanging and a misbehaving program."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.inspection import (
    MAX_ANSWER_BYTES,
    READY,
    TEST_FAULT_ENV,
    ChildExit,
    InspectionLimits,
    PendingInspection,
    TrialBatch,
    Verdict,
    _Output,
    child_env,
    inspect_program,
    judge,
    one_line,
)
from epochmesh.spec import load_spec
from tests.fixtures import make_classification, write_mlp_job
from tests.fixtures.hostile_programs import HUGE_POWER, with_shape_expression

pytestmark = pytest.mark.timeout(120)

LIMITS = InspectionLimits(timeout_s=30.0)
BUDGET = 3 << 30


def ended(
    answer: object = None,
    returncode: int = 0,
    *,
    started: bool = True,
    timed_out: bool = False,
    stderr: bytes = b"",
) -> ChildExit:
    line = answer if isinstance(answer, bytes) else b"" if answer is None else json.dumps(answer)
    raw = line.encode() if isinstance(line, str) else line
    return ChildExit(started, returncode, timed_out, raw, stderr, 1.5)


ACCEPTED = {"ok": True, "params": ["0.weight", "0.bias"], "losses": [1.25, 1.5]}


@pytest.mark.parametrize(
    ("child", "verdict", "reason"),
    [
        (ended(ACCEPTED), Verdict.ACCEPTED, ""),
        (ended(timed_out=True), Verdict.TIMED_OUT, "loading the program took longer than 30 s"),
        (
            ended(ACCEPTED, timed_out=True),
            Verdict.TIMED_OUT,
            "loading the program took longer than 30 s",
        ),
        (
            ended({"ok": False, "kind": "refused", "error": "forbidden op\nmore\x1b[31m"}),
            Verdict.REFUSED,
            "forbidden op",
        ),
        (
            ended({"ok": False, "kind": "batch", "batch": 2, "error": "bad shape"}),
            Verdict.BATCH_FAILED,
            "bad shape",
        ),
        (
            ended({"ok": False, "kind": "memory", "error": "x"}),
            Verdict.OUT_OF_MEMORY,
            "loading the program exceeded its memory limit (3.0 GiB)",
        ),
        (
            ended(returncode=-signal.SIGSEGV),
            Verdict.CRASHED,
            "the program crashed its inspection (segmentation fault)",
        ),
        (
            ended(returncode=-signal.SIGABRT),
            Verdict.CRASHED,
            "the program crashed its inspection (aborted)",
        ),
        (
            ended(returncode=-signal.SIGABRT, stderr=b"terminate called: std::bad_alloc\n"),
            Verdict.OUT_OF_MEMORY,
            "loading the program exceeded its memory limit (3.0 GiB)",
        ),
        # An accepting answer from a child that then crashed is not an acceptance.
        (
            ended(ACCEPTED, returncode=-signal.SIGSEGV),
            Verdict.CRASHED,
            "the program crashed its inspection (segmentation fault)",
        ),
        (
            ended(b"not json", returncode=0),
            Verdict.NO_ANSWER,
            "the program's inspection ended without an answer (exit status 0)",
        ),
        (
            ended([1, 2], returncode=1),
            Verdict.NO_ANSWER,
            "the program's inspection ended without an answer (exit status 1)",
        ),
        (
            ended(started=False, returncode=1),
            Verdict.UNAVAILABLE,
            "the program inspection could not start (exit status 1)",
        ),
        (
            ended(started=False, timed_out=True, returncode=-9),
            Verdict.UNAVAILABLE,
            "the program inspection could not start (no answer within 120 s)",
        ),
    ],
)
def test_judge(child: ChildExit, verdict: Verdict, reason: str) -> None:
    result = judge(child, LIMITS, BUDGET)
    assert result.verdict is verdict
    assert result.reason == reason
    assert "\n" not in result.reason


def test_judge_keeps_only_well_formed_fields() -> None:
    good = judge(ended(ACCEPTED), LIMITS, BUDGET)
    assert good.param_names == ("0.weight", "0.bias") and good.losses == (1.25, 1.5)
    odd = judge(ended({"ok": True, "params": ["a b", "x"], "losses": ["1"]}), LIMITS, BUDGET)
    assert odd.ok and odd.param_names == () and odd.losses == ()
    nested = b"[" * 100_000 + b"]" * 100_000
    assert judge(ended(nested), LIMITS, BUDGET).verdict is Verdict.NO_ANSWER


def test_output_keeps_a_short_answer_after_the_ready_line() -> None:
    ready: list[bool] = []
    out = _Output(lambda: ready.append(True))
    for piece in (READY[:2], READY[2:] + b'\n{"ok"', b": true}\nignored\n"):
        out.feed(piece)
    assert ready == [True] and out.answer() == b'{"ok": true}'

    flood = _Output(lambda: None)
    flood.feed(READY + b"\n")
    for _ in range(8):
        flood.feed(b"x" * (MAX_ANSWER_BYTES // 4))
    flood.feed(b"\n")
    assert flood.answer() == b"" and len(flood.data) <= MAX_ANSWER_BYTES + 16

    silent = _Output(lambda: None)
    silent.feed(b'{"ok": true}\n')
    assert not silent.ready and silent.answer() == b""


def test_one_line() -> None:
    assert one_line("\n  first \nsecond") == "first"
    assert one_line("a\x00b\x1b[2J") == "a?b?[2J"
    assert one_line("x" * 1000, 20) == "x" * 17 + "..."


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), num_samples=16)
    return build_job(load_spec(job), verify=False, cache=ExportCache.default())


def test_a_good_program_loads_and_runs_its_trial_batches(packed: PackedJob) -> None:
    data = make_classification(16)
    trial = TrialBatch(inputs=[data["x"]], targets=[data["y"]], sizes=(1, 2))
    result = inspect_program(packed.program, packed.initial_state, LIMITS, trial=trial)
    assert result.ok, result.reason
    assert result.param_names == tuple(packed.state_names)
    assert len(result.losses) == 2 and all(0 < v < 10 for v in result.losses)


def test_a_trial_batch_the_program_rejects(packed: PackedJob) -> None:
    trial = TrialBatch(inputs=[torch.zeros(2, 15)], targets=[torch.zeros(2).long()], sizes=(1,))
    result = inspect_program(packed.program, packed.initial_state, LIMITS, trial=trial)
    assert result.verdict is Verdict.BATCH_FAILED and result.batch_size == 1
    assert "rejected the batch" in result.reason


def test_a_malformed_program_is_refused(packed: PackedJob) -> None:
    result = inspect_program(b"PK\x03\x04 not a zip", packed.initial_state, LIMITS)
    assert result.verdict is Verdict.REFUSED
    assert "not a torch.export archive" in result.reason


def test_a_hanging_load_is_killed_at_the_time_limit(
    packed: PackedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TEST_FAULT_ENV, "hang")  # the child sleeps instead of answering
    with PendingInspection() as pending:  # the limit counts from the child being ready
        result = pending.run(packed.program, packed.initial_state, InspectionLimits(timeout_s=1.5))
    assert result.verdict is Verdict.TIMED_OUT
    assert result.reason == "loading the program took longer than 1.5 s"


def test_a_power_in_a_shape_expression_is_refused_before_sympy_sees_it(packed: PackedJob) -> None:
    hostile = with_shape_expression(packed.program, HUGE_POWER)
    result = inspect_program(hostile, packed.initial_state, LIMITS)
    assert result.verdict is Verdict.REFUSED
    assert repr(HUGE_POWER) in result.reason and "powers are refused" in result.reason


@pytest.mark.parametrize(
    ("fault", "verdict", "reason"),
    [
        ("segv", Verdict.CRASHED, "the program crashed its inspection (segmentation fault)"),
        ("flood", Verdict.NO_ANSWER, "ended without an answer (exit status 0)"),
    ],
)
def test_a_misbehaving_child(
    packed: PackedJob,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    verdict: Verdict,
    reason: str,
) -> None:
    monkeypatch.setenv(TEST_FAULT_ENV, fault)
    result = inspect_program(packed.program, packed.initial_state, LIMITS)
    assert result.verdict is verdict
    assert reason in result.reason


def test_the_child_gets_no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPOCHMESH_TOKEN", "emt1.secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    env = child_env()
    assert "secret" not in json.dumps(env)
    assert set(env) <= {
        "LANG",
        "LC_ALL",
        TEST_FAULT_ENV,
        "PATH",
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }
