"""A job's program in its confined child (node_agent.sandbox.host), with real child processes.

- It computes what the program computes in-process, bit for bit, and sees the agent's
  parameter changes (optimizer steps on the shared parameters) without copies.
- The child cannot read a file such as the agent's key, cannot open a network socket, gets no
  credentials in its environment, and is stopped at its memory limit; a crash or a hang of the
  child is a ProgramFault and the next call runs in a fresh child from the same state.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.spec import load_spec
from node_agent.sandbox.host import (
    CRASHED,
    HUNG,
    REFUSED,
    ChildLimits,
    ConfinedProgram,
    ProgramFault,
    ProgramHosts,
    ProgramMemoryError,
    load_confined,
)
from node_agent.sandbox.spawn import Zygote
from tests.fixtures import write_mlp_job
from tests.fixtures.hostile_programs import sparse_program

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"))
    return build_job(load_spec(job), cache=ExportCache.default())


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("EPOCHMESH_TEST_HOOKS", "1")
    yield monkeypatch


def batch(n: int = 8, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 16, generator=g)], [torch.randint(0, 4, (n,), generator=g)]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """What forks the module's children (as the agent's ProgramHosts owns one)."""
    zygote = Zygote()
    yield zygote
    zygote.stop()


def confined(
    job: PackedJob,
    zygote: Zygote,
    memory: int | None = 256 << 20,
    fault_file: Path | None = None,
) -> ConfinedProgram:
    limits = ChildLimits(memory, threads=1, fault_file=fault_file)
    return ConfinedProgram(job.program, job.initial_state, limits, zygote)


def test_same_gradients_and_shared_parameters(zygote: Zygote, job: PackedJob) -> None:
    prog = confined(job, zygote)
    ref = TrainableProgram.from_bytes(job.program, job.initial_state)
    try:
        assert prog.param_names == ref.param_names and prog.state_names == ref.state_names
        opt = torch.optim.SGD(prog.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            inputs, targets = batch(seed=step)
            loss, grads = prog.loss_and_grads(inputs, targets)
            ref_loss, ref_grads = ref.loss_and_grads(inputs, targets)
            assert loss == ref_loss
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
            for o, p, names in ((opt, prog, grads), (ref_opt, ref, ref_grads)):
                for name, t in zip(p.param_names, p.parameters(), strict=True):
                    t.grad = names[name]
                o.step()
        assert prog.loss(*batch(seed=9)) == ref.loss(*batch(seed=9))
        state = ref.state_dict()
        assert all(torch.equal(prog.state_dict()[k], state[k]) for k in state)
        with pytest.raises(ValueError, match="takes 2 tensors"):
            prog.loss_and_grads(*batch()[0:1], [])
    finally:
        prog.close()


def test_the_child_holds_no_credentials_and_cannot_reach_files_or_the_network(
    zygote: Zygote, job: PackedJob, hooks: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = tmp_path / "agent" / "key.pem"
    key.parent.mkdir()
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    hooks.setenv("EPOCHMESH_TOKEN", "emt1.secret")
    prog = confined(job, zygote)
    try:
        assert "Landlock ABI" in prog.confinement, prog.confinement
        assert "seccomp filter" in prog.confinement, prog.confinement
        assert "earlier thread" not in prog.confinement, prog.confinement  # all under Landlock
        pid = prog.pid
        assert pid is not None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0].decode() for e in environ if e}
        allowed = {"PATH", "PYTHONPATH", "LANG", "LC_ALL", "EPOCHMESH_TEST_HOOKS"}
        assert names <= allowed | {"OPENBLAS_NUM_THREADS"}, names
        assert prog.probe(what="read", path=str(key)).startswith("refused: PermissionError")
        port = listener.getsockname()[1]
        assert prog.probe(what="socket", port=port).startswith("refused: PermissionError")
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()
        assert prog.loss(*batch()) > 0  # still serving
    finally:
        prog.close()
        listener.close()


def test_the_child_is_stopped_at_its_memory_limit_and_replaced(
    zygote: Zygote, job: PackedJob, hooks: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault = tmp_path / "fault"
    prog = confined(job, zygote, memory=256 << 20, fault_file=fault)
    try:
        first = prog.loss(*batch())
        pid = prog.pid
        fault.write_text("alloc")
        with pytest.raises(ProgramMemoryError, match="memory limit"):
            prog.loss(*batch())
        assert prog.pid is None and not Path(f"/proc/{pid}").exists()
        assert prog.loss(*batch()) == first  # a fresh child, the same state
        assert prog.restarts == 1
    finally:
        prog.close()


def test_a_crash_or_a_hang_is_a_fault_and_the_next_call_works(
    zygote: Zygote, job: PackedJob, hooks: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault = tmp_path / "fault"
    prog = confined(job, zygote, fault_file=fault)
    try:
        first = prog.loss(*batch())
        fault.write_text("crash")
        with pytest.raises(ProgramFault, match="segmentation fault") as crash:
            prog.loss(*batch())
        assert crash.value.kind == CRASHED
        assert prog.loss(*batch()) == first
        prog.timeout_s = 2.0
        fault.write_text("hang")
        t0 = time.monotonic()
        with pytest.raises(ProgramFault, match="did not answer") as hang:
            prog.loss(*batch())
        assert hang.value.kind == HUNG and time.monotonic() - t0 < 10
        prog.timeout_s = 60.0
        assert prog.loss(*batch()) == first
        assert prog.restarts == 2
    finally:
        prog.close()


def test_the_job_benchmark_tightens_the_memory_limit_of_this_child_and_the_next(
    zygote: Zygote, job: PackedJob, hooks: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault = tmp_path / "fault"
    prog = confined(job, zygote, memory=1 << 30, fault_file=fault)
    big = 400 << 20
    try:
        first = prog.loss(*batch())
        assert prog.probe(what="alloc", bytes=big) == "allowed"
        prog.limit_memory(64 << 20)  # what a job benchmark allows this job (tiny MLP)
        assert "allocate" in prog.probe(what="alloc", bytes=big)
        assert prog.loss(*batch()) == first  # the job itself still fits
        prog.limit_memory(512 << 20)  # a looser figure never loosens it
        assert "allocate" in prog.probe(what="alloc", bytes=big)
        fault.write_text("crash")
        with pytest.raises(ProgramFault, match="segmentation fault"):
            prog.loss(*batch())
        assert prog.loss(*batch()) == first
        assert prog.restarts == 1
        assert "allocate" in prog.probe(what="alloc", bytes=big)  # the new child: the same limit
    finally:
        prog.close()


def test_the_agent_keeps_each_jobs_memory_limit_for_its_later_loads(job: PackedJob) -> None:
    hosts = ProgramHosts("cpu", threads=1, memory_budget=1 << 30)
    try:
        loaded = hosts.load(job.program, job.initial_state, job_id="a")
        loose = loaded.memory_limit_bytes
        assert loose is not None and loose > 1 << 30
        hosts.limit_job_memory("a", 64 << 20, loaded)
        tight = loaded.memory_limit_bytes
        assert tight is not None and tight < 128 << 20
        assert hosts.load(job.program, job.initial_state, job_id="a").memory_limit_bytes == tight
        assert hosts.load(job.program, job.initial_state, job_id="b").memory_limit_bytes == loose
        hosts.limit_job_memory("b", 4 << 30)  # never above the device's figure
        assert hosts.load(job.program, job.initial_state, job_id="b").memory_limit_bytes == loose
    finally:
        hosts.close_all()


def test_a_program_off_the_allow_list_is_refused_by_the_agent_before_it_runs() -> None:
    program, state = sparse_program()  # as a stored job from a client that skipped the checks
    with pytest.raises(ProgramFault, match=r"refused on this node: .*aten\.\w*sparse") as e:
        load_confined(program, state, ChildLimits(256 << 20, threads=1))
    assert e.value.kind == REFUSED


def test_the_childs_cpu_time_counts_even_tiny_steps(zygote: Zygote, job: PackedJob) -> None:
    # The slowdown emulation multiplies this figure: /proc's 10 ms ticks would read 0 for
    # steps of a sample or two, and the emulated straggler would not slow down.
    prog = confined(job, zygote)
    try:
        before = prog.cpu_seconds()
        for _ in range(5):
            prog.loss(*batch(1))
        assert 0.0 < prog.cpu_seconds() - before < 5.0
    finally:
        prog.close()
