"""The job pays for its own faults, not the donors (issue 17), with real processes.

- A job whose loss is NaN on 3 agents ends FAILED with the reason; no node gets a strike, nobody
  is quarantined, and the agents go on serving.
- A program that crashes its child (a test hook of the child: the bug the allow-list missed)
  fails that task; the agent lives on, restarts the child and trains the job to its end with
  every sample of every epoch trained exactly once; no strike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochmesh.v1 import common_pb2
from node_agent.sandbox.host import TEST_FAULT_FILE
from tests.fixtures import write_mlp_job
from tests.fixtures.hostile import NAN_LOSS, write_model
from tests.procs import STEADY_LEASES, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_training import (
    applied_parts,
    cli,
    indices,
    load_rounds,
    submit,
    wait_job_state,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    with start_coordinator(tmp_path / "coord", *STEADY_LEASES) as coord:
        yield coord.address


def wait_benchmarked(address: str, count: int) -> None:
    wait_until(
        lambda: len([n for n in list_nodes(address) if n.benchmark.samples_per_second]) == count,
        timeout=180,
        message="agents did not register and benchmark",
    )


def wait_state(address: str, job_id: str, state: str, timeout: float = 180) -> dict:
    return wait_job_state(address, job_id, state, timeout)


def check_no_strikes(address: str) -> None:
    for node in list_nodes(address):
        assert node.strikes == 0, node
        assert node.state != common_pb2.NODE_STATE_QUARANTINED, node


def test_a_nan_loss_job_fails_with_its_reason_and_no_donor_is_blamed(
    coordinator: str, tmp_path: Path
) -> None:
    agents = [AgentProc(coordinator, tmp_path / f"agent-{i}", "--name", f"a{i}") for i in range(3)]
    try:
        wait_benchmarked(coordinator, 3)
        job_dir = tmp_path / "job"
        job_toml = write_mlp_job(job_dir, overrides={"cluster": {"min_nodes": 3}})
        write_model(job_dir, NAN_LOSS)
        job_id = submit(coordinator, job_toml)
        job = wait_state(coordinator, job_id, "failed")
        assert "program failed on" in job["message"] and "non-finite" in job["message"], job
        check_no_strikes(coordinator)
        events = cli(coordinator, "events", "--job", job_id, "--output", "json")
        assert events.returncode == 0, events.stderr
        kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines() if line.strip()]
        assert "job.program_failed" in kinds and "node.strike" not in kinds
        assert all(a.running() for a in agents)
        assert "(the job's fault)" in agents[0].log_text() + agents[1].log_text()
    finally:
        for a in agents:
            a.kill9()


def test_a_crashing_program_fails_its_task_and_the_agent_lives_on(
    coordinator: str, tmp_path: Path
) -> None:
    hooks = {"EPOCHMESH_TEST_HOOKS": "1"}
    crashy = AgentProc(coordinator, tmp_path / "crashy", "--name", "crashy", env=hooks)
    steady = AgentProc(coordinator, tmp_path / "steady", "--name", "steady")
    try:
        wait_benchmarked(coordinator, 2)
        num_samples, epochs = 512, 12
        job_toml = write_mlp_job(
            tmp_path / "job",
            num_samples=num_samples,
            overrides={"train": {"epochs": epochs}, "cluster": {"min_nodes": 1}},
        )
        job_id = submit(coordinator, job_toml)
        # Once both train (a crash while crashy holds the job alone is the job's fault by every
        # node's word: the job fails), crashy's program's next step crashes its child (SIGSEGV).
        wait_until(
            lambda: all(": gradient of" in a.log_text() for a in (crashy, steady)),
            timeout=120,
            message="the two agents did not both train",
        )
        (tmp_path / "crashy" / TEST_FAULT_FILE).write_text("crash")
        wait_state(coordinator, job_id, "succeeded")
        log = crashy.log_text()
        assert "reporting failure (the job's fault)" in log and "segmentation fault" in log, log
        assert crashy.running() and steady.running()
        check_no_strikes(coordinator)
        rounds = load_rounds(coordinator, job_id)
        per_epoch: dict[int, list[int]] = {}
        for rnd in rounds:
            for part in applied_parts(rnd):
                per_epoch.setdefault(rnd["epoch"], []).extend(indices(part))
        assert sorted(per_epoch) == list(range(epochs))
        for seen in per_epoch.values():
            assert sorted(seen) == list(range(num_samples))
        failed = [
            i
            for i, rnd in enumerate(rounds)
            for p in rnd["parts"]
            if p["node_id"] == crashy.node_id() and p["status"] == "failed"
        ]
        # The crash lands in the program's next call: a round's part, or a check the node ran
        # for another's part (verification; not a round of its own, so no failed part).
        in_check = any(
            "[task c-" in line and "reporting failure (the job's fault)" in line
            for line in log.splitlines()
        )
        assert failed or in_check, "the crash landed neither in a round nor in a check"
        after = failed[0] + 1 if failed else len(rounds) // 2  # the crash came early
        later = {p["node_id"] for rnd in rounds[after:] for p in applied_parts(rnd)}
        assert crashy.node_id() in later  # it trained again, in a fresh child
    finally:
        crashy.kill9()
        steady.kill9()
