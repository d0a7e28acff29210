"""Loading an untrusted exported program in a confined child process, and the plumbing of such
children (a request on stdin; a ready line, then one bounded JSON answer line, on stdout).

`inspect_program` (blocking, for the CLI) and `ProgramInspector` / `inspect_program_async`
(asyncio, for the coordinator) start ``python -m epochmesh.program.inspection`` (a fresh
interpreter, never a fork: minimal environment, no inherited descriptors, a temporary working
directory, its own session, nice +10), hand it the program and initial state on stdin and kill
it at the time limit. The child imports torch, says it is ready, reads its input, confines
itself (`epochmesh.program.confine`), checks and loads the program (`validate_program_archive`,
`TrainableProgram.from_bytes`), optionally runs trial batches, and answers. The result is an
`Inspection`: a `Verdict` and a one-line reason; a crash, a limit hit or a timeout of the child
is a verdict like a refusal. Nothing the child writes is trusted beyond the answer line's few
typed fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import IO, TYPE_CHECKING, Any, BinaryIO

from epochmesh.program.confine import Confinement, confine_self, data_bytes, runtime_read_paths
from epochmesh.program.workdirs import inspection_workdir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Tests only: the inspection child misbehaves after loading, instead of answering: "segv" (a
# segmentation fault), "abort" (SIGABRT), "hang" (sleeps), "flood" (writes megabytes without a
# line end). Passed on from the environment of the process that starts the child.
TEST_FAULT_ENV = "EPOCHMESH_TEST_INSPECTION_FAULT"

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_BASE_BYTES = 2 << 30
MEMORY_PER_INPUT_BYTE = 4  # memory budget per byte handed over (program, state, trial data)
DEFAULT_CONCURRENCY = 2
START_TIMEOUT_S = 120.0  # a fresh interpreter importing torch on a busy machine
CHILD_NICENESS = 10
MAX_ANSWER_BYTES = 256 << 10
MAX_HEADER_BYTES = 64 << 10
STDERR_TAIL_BYTES = 4 << 10
MAX_REASON_CHARS = 300
MAX_FLOPS_PER_SAMPLE = 1e18  # a FLOP count above this is not believed
REAP_TIMEOUT_S = 5.0  # after an exit or a kill: how long the pipes may take to close
READY = b"ready"
_FEED_CHUNK = 1 << 20  # a file part goes to a child in pieces of at most this

# What an inspection child gets of the environment (nothing else: no tokens, no credentials).
_PASSED_ENV = ("LANG", "LC_ALL", TEST_FAULT_ENV)
_MODULE = "epochmesh.program.inspection"
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")
_SIGNALS = {
    signal.SIGSEGV: "segmentation fault",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGILL: "illegal instruction",
    signal.SIGFPE: "arithmetic fault",
    signal.SIGKILL: "killed by SIGKILL: a resource limit or the system's out-of-memory killer",
    signal.SIGXCPU: "CPU-time limit hit",
    signal.SIGXFSZ: "tried to write a file",
    signal.SIGSYS: "forbidden system call",
}
_MEMORY_HINTS = (b"MemoryError", b"bad_alloc", b"can't allocate memory", b"not enough memory")


class Verdict(StrEnum):
    ACCEPTED = "accepted"
    REFUSED = "refused"  # the checks refused the program or its initial state
    BATCH_FAILED = "batch_failed"  # a trial batch failed (Inspection.batch_size)
    CRASHED = "crashed"  # killed by a signal while working: segmentation fault, abort, ...
    TIMED_OUT = "timed_out"
    OUT_OF_MEMORY = "out_of_memory"
    NO_ANSWER = "no_answer"  # exited without a valid answer
    UNAVAILABLE = "unavailable"  # the child did not start (not the program's fault)


@dataclass(frozen=True)
class InspectionLimits:
    """What one inspection may use. Memory: `memory_base_bytes` + `memory_per_input_byte` x the
    bytes handed over, beyond what the child holds once torch is imported and its input read."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # wall clock, from handing the program over
    memory_base_bytes: int = DEFAULT_MEMORY_BASE_BYTES
    memory_per_input_byte: int = MEMORY_PER_INPUT_BYTE

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError("the inspection time limit must be positive")
        if self.memory_base_bytes <= 0 or self.memory_per_input_byte < 0:
            raise ValueError("the inspection memory limit must be positive")

    def memory_budget(self, input_bytes: int) -> int:
        return self.memory_base_bytes + self.memory_per_input_byte * input_bytes

    @property
    def cpu_seconds(self) -> int:
        """CPU seconds beyond start-up (a backstop: the wall-clock limit normally acts first)."""
        return math.ceil(self.timeout_s) + 5


@dataclass(frozen=True)
class TrialBatch:
    """Samples to run through the loaded program (loss and gradients), as batches of the first
    `sizes` samples."""

    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Inspection:
    verdict: Verdict
    reason: str = ""  # one line, unless accepted
    param_names: tuple[str, ...] = ()  # when accepted (empty for very many parameters)
    losses: tuple[float, ...] = ()  # of the trial batches, in their order
    batch_size: int = 0  # the trial batch that failed (BATCH_FAILED)
    # FLOPs of a training step per sample, counted when asked (0.0: not asked, or not countable)
    flops_per_sample: float = 0.0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.ACCEPTED


@dataclass(frozen=True)
class FilePart:
    """A request blob read from an open file as it is handed over, 1 MiB at a time: a caller
    never holds the whole blob (`size` bytes from the file's position; the caller closes it)."""

    file: BinaryIO
    size: int


Payload = bytes | FilePart


def payload_size(part: Payload) -> int:
    return part.size if isinstance(part, FilePart) else len(part)


@dataclass(frozen=True)
class ChildExit:
    """How a child ended and what it said."""

    started: bool  # it said it was ready
    returncode: int  # negative: killed by that signal
    timed_out: bool  # killed by the parent at its time limit (start-up or work)
    answer: bytes  # its answer line (b"" when absent or over MAX_ANSWER_BYTES)
    stderr_tail: bytes
    seconds: float  # from handing the request over (or from the start, if never ready)


# ---------------------------------------------------------------------------------------------
# Judging a child's exit (pure)


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """The first non-empty line of `text`, printable characters only, at most `limit` long."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def signal_description(sig: int) -> str:
    """'segmentation fault', 'aborted', ...: what a child killed by `sig` did."""
    try:
        known = signal.Signals(sig)
    except ValueError:
        return f"signal {sig}"
    return _SIGNALS.get(known, f"killed by {known.name}")


def exit_description(returncode: int) -> str:
    """'segmentation fault', 'exit status 3', ...: how a child ended."""
    return signal_description(-returncode) if returncode < 0 else f"exit status {returncode}"


def read_answer(line: bytes) -> dict[str, Any] | None:
    """A child's answer line as a JSON object with a boolean "ok", or None."""
    if not line or len(line) > MAX_ANSWER_BYTES:
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or type(obj.get("ok")) is not bool:
        return None
    return obj


def judge(
    ended: ChildExit,
    limits: InspectionLimits,
    memory_budget: int,
    task: str = "loading the program",
) -> Inspection:
    """The verdict on an inspection child's exit, with its one-line reason."""
    seconds = ended.seconds
    if not ended.started:
        why = (
            f"no answer within {START_TIMEOUT_S:g} s"
            if ended.timed_out
            else exit_description(ended.returncode)
        )
        return Inspection(
            Verdict.UNAVAILABLE, f"the program inspection could not start ({why})", seconds=seconds
        )
    if ended.timed_out:
        return Inspection(
            Verdict.TIMED_OUT, f"{task} took longer than {limits.timeout_s:g} s", seconds=seconds
        )
    answer = read_answer(ended.answer)
    out_of_memory = Inspection(
        Verdict.OUT_OF_MEMORY,
        f"{task} exceeded its memory limit ({memory_budget / (1 << 30):.1f} GiB)",
        seconds=seconds,
    )
    if answer is not None and answer["ok"] and ended.returncode == 0:
        return _accepted(answer, seconds)
    if answer is not None and not answer["ok"]:
        kind = answer.get("kind")
        error = one_line(str(answer.get("error", ""))) or "no reason given"
        if kind == "memory":
            return out_of_memory
        batch = answer.get("batch")
        if kind == "batch" and type(batch) is int and batch > 0:
            return Inspection(Verdict.BATCH_FAILED, error, batch_size=batch, seconds=seconds)
        return Inspection(Verdict.REFUSED, error, seconds=seconds)
    if ended.returncode < 0:
        sig = -ended.returncode
        if sig in (signal.SIGABRT, signal.SIGKILL) and any(
            h in ended.stderr_tail for h in _MEMORY_HINTS
        ):
            return out_of_memory
        return Inspection(
            Verdict.CRASHED,
            f"the program crashed its inspection ({signal_description(sig)})",
            seconds=seconds,
        )
    return Inspection(
        Verdict.NO_ANSWER,
        f"the program's inspection ended without an answer (exit status {ended.returncode})",
        seconds=seconds,
    )


def _accepted(answer: Mapping[str, Any], seconds: float) -> Inspection:
    params = answer.get("params")
    names: tuple[str, ...] = ()
    if isinstance(params, list) and all(isinstance(p, str) and _NAME.match(p) for p in params):
        names = tuple(params)
    raw = answer.get("losses")
    losses: tuple[float, ...] = ()
    if isinstance(raw, list) and all(type(v) in (int, float) for v in raw):
        losses = tuple(float(v) for v in raw)
    flops = answer.get("flops")
    counted = float(flops) if isinstance(flops, int | float) and type(flops) is not bool else 0.0
    if not (math.isfinite(counted) and 0.0 <= counted <= MAX_FLOPS_PER_SAMPLE):
        counted = 0.0
    return Inspection(
        Verdict.ACCEPTED,
        param_names=names,
        losses=losses,
        seconds=seconds,
        flops_per_sample=counted,
    )


# ---------------------------------------------------------------------------------------------
# The wire: a request is a JSON header line, then the blobs it lists


def encode_request(header: Mapping[str, Any], blobs: Sequence[Payload]) -> list[Payload]:
    """The pieces to write to a child's stdin; the child reads them with `read_request`."""
    head = dict(header)
    head["blob_bytes"] = [payload_size(b) for b in blobs]
    return [json.dumps(head).encode() + b"\n", *blobs]


def _file_chunks(part: FilePart) -> Iterator[bytes]:
    """A file part's bytes in chunks; a file shorter than its size ends them early (the child
    then reads a short request and answers nothing)."""
    left = part.size
    while left > 0:
        chunk = part.file.read(min(left, _FEED_CHUNK))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def read_request(stream: BinaryIO) -> tuple[dict[str, Any], list[bytes]]:
    """Child side: the header and blobs of a request (its parent is trusted)."""
    header = json.loads(stream.readline(MAX_HEADER_BYTES))
    blobs = []
    for size in header["blob_bytes"]:
        data = stream.read(size)
        if len(data) != size:
            raise EOFError("the request ended early")
        blobs.append(data)
    return header, blobs


def answer_channel() -> IO[bytes]:
    """Child side: the original stdout, for the ready line and the answer alone; whatever else
    the process writes to stdout (Python or native code) goes to stderr from now on."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def send_ready(channel: IO[bytes]) -> None:
    channel.write(READY + b"\n")
    channel.flush()


def send_answer(channel: IO[bytes], answer: Mapping[str, Any]) -> None:
    channel.write(json.dumps(answer).encode() + b"\n")
    channel.flush()


def child_env(passed: Sequence[str] = _PASSED_ENV) -> dict[str, str]:
    """A minimal environment for a child: the same imports as this process, one thread."""
    env = {k: os.environ[k] for k in passed if k in os.environ}
    env["PATH"] = "/usr/bin:/bin"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    return env


class _Output:
    """A child's stdout: the ready line, then the answer line, kept only while short."""

    def __init__(self, on_ready: Callable[[], None]) -> None:
        self.data = bytearray()
        self.ready = False
        self._on_ready = on_ready

    def feed(self, chunk: bytes) -> None:
        room = len(READY) + 1 + MAX_ANSWER_BYTES + 1 - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if not self.ready and self.data.startswith(READY + b"\n"):
            self.ready = True
            self._on_ready()

    def answer(self) -> bytes:
        if not self.ready:
            return b""
        rest = self.data[len(READY) + 1 :]
        end = rest.find(b"\n")
        return bytes(rest[:end]) if 0 <= end <= MAX_ANSWER_BYTES else b""


class _Tail:
    """The last bytes a child writes to stderr (for logs only)."""

    def __init__(self) -> None:
        self.data = b""

    def feed(self, chunk: bytes) -> None:
        self.data = (self.data + chunk)[-STDERR_TAIL_BYTES:]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Children, blocking


class ChildProcess:
    """A child started now (a fresh interpreter in its own session, stdin, stdout and stderr
    piped) that says it is ready (`send_ready`), reads one request and answers one line.
    `send` hands it the request, `finish` waits for its exit, killing it at the time limits.
    Close it (or use it as a context manager) so that it never outlives its use."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None
    ) -> None:
        self._spawned_at = time.monotonic()
        self._sent_at: float | None = None
        self._ready_at: float | None = None
        self._started = threading.Event()  # ready, or stdout closed
        self._out = _Output(self._mark_ready)
        self._err = _Tail()
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            close_fds=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            self._thread(self._read_stdout, self.proc.stdout),
            self._thread(_drain, self.proc.stderr, self._err.feed),
        ]

    def _mark_ready(self) -> None:
        self._ready_at = time.monotonic()
        self._started.set()

    def _read_stdout(self, stream: IO[bytes]) -> None:
        _drain(stream, self._out.feed)
        self._started.set()

    @staticmethod
    def _thread(target: Callable[..., None], *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True, name="epochmesh-child-io")
        t.start()
        return t

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, parts: Sequence[Payload]) -> None:
        """Write the request (in a thread: the child may still be importing); close stdin."""
        assert self.proc.stdin is not None
        self._sent_at = time.monotonic()
        self._threads.append(self._thread(_write_all, self.proc.stdin, parts))

    def finish(
        self, timeout_s: float | None, start_timeout_s: float = START_TIMEOUT_S
    ) -> ChildExit:
        """Wait for the exit. The child gets `start_timeout_s` from its start to be ready, then
        `timeout_s` (None: no limit) from the later of ready and `send`; then it is killed."""
        remaining = self._spawned_at + start_timeout_s - time.monotonic()
        if not self._started.wait(max(0.0, remaining)):
            self.kill()
            return self._exit(timed_out=True)
        if not self._out.ready:
            return self._exit(timed_out=False)
        try:
            if timeout_s is None:
                self.proc.wait()
            else:
                begin = max(self._sent_at or time.monotonic(), self._ready_at or 0.0)
                self.proc.wait(max(0.0, begin + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return self._exit(timed_out=True)
        return self._exit(timed_out=False)

    def _exit(self, *, timed_out: bool) -> ChildExit:
        returncode = self.proc.wait()
        for t in self._threads:
            t.join(REAP_TIMEOUT_S)
        begin = self._sent_at if self._out.ready and self._sent_at else self._spawned_at
        return ChildExit(
            started=self._out.ready,
            returncode=returncode,
            timed_out=timed_out,
            answer=self._out.answer(),
            stderr_tail=self._err.data,
            seconds=time.monotonic() - begin,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc.pid)

    def close(self) -> None:
        self.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drain(stream: IO[bytes], sink: Callable[[bytes], None]) -> None:
    with contextlib.suppress(OSError, ValueError):
        while chunk := stream.read1(1 << 16):  # type: ignore[attr-defined]
            sink(chunk)


def _write_all(stream: IO[bytes], parts: Sequence[Payload]) -> None:
    with contextlib.suppress(OSError, ValueError):  # the child died or closed its stdin
        for part in parts:
            for chunk in _file_chunks(part) if isinstance(part, FilePart) else (part,):
                stream.write(chunk)
        stream.flush()
    with contextlib.suppress(OSError, ValueError):
        stream.close()


# ---------------------------------------------------------------------------------------------
# Children, asyncio


class AsyncChild:
    """`ChildProcess` for an event loop: nothing blocks the loop or its default thread pool.
    Cancelling `run` kills the child."""

    def __init__(self, proc: asyncio.subprocess.Process, cwd: tempfile.TemporaryDirectory[str]):
        self.proc = proc
        self._cwd = cwd
        self._spawned_at = time.monotonic()
        self._ready = asyncio.Event()
        self._started = asyncio.Event()  # ready, or stdout closed
        self._out = _Output(self._ready.set)
        self._err = _Tail()
        self._readers = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(_drain_async(proc.stderr, self._err.feed)),
        ]

    @classmethod
    async def start(cls, argv: Sequence[str], env: Mapping[str, str] | None) -> AsyncChild:
        """Start a child in a fresh temporary working directory."""
        cwd = inspection_workdir()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(env) if env is not None else None,
                cwd=cwd.name,
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            cwd.cleanup()
            raise
        return cls(proc, cwd)

    async def _read_stdout(self) -> None:
        await _drain_async(self.proc.stdout, self._out.feed)
        self._started.set()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Whether the child said it was ready within `timeout_s` of its start."""
        waiter = asyncio.create_task(self._ready.wait())
        done = asyncio.create_task(self._started.wait())
        try:
            remaining = self._spawned_at + timeout_s - time.monotonic()
            await asyncio.wait(
                {waiter, done},
                timeout=max(0.0, remaining),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiter.cancel()
            done.cancel()
        return self._out.ready

    async def run(self, parts: Sequence[Payload], timeout_s: float | None) -> ChildExit:
        """Hand over the request and wait for the exit; see `ChildProcess.finish`."""
        sent_at = time.monotonic()
        feeder = asyncio.create_task(self._feed(parts))
        try:
            if not await self.wait_ready():
                timed_out = self.alive
                self.kill()
                return await self._exit(timed_out=timed_out, begin=self._spawned_at)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.kill()
                return await self._exit(timed_out=True, begin=sent_at)
            return await self._exit(timed_out=False, begin=sent_at)
        finally:
            feeder.cancel()
            if self.alive:  # cancelled
                self.kill()

    async def _feed(self, parts: Sequence[Payload]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(ConnectionError, OSError):
            for part in parts:
                if not isinstance(part, FilePart):
                    stdin.write(part)
                    await stdin.drain()
                    continue
                chunks = _file_chunks(part)
                while chunk := await asyncio.to_thread(next, chunks, b""):
                    stdin.write(chunk)
                    await stdin.drain()
            stdin.close()

    async def _exit(self, *, timed_out: bool, begin: float) -> ChildExit:
        returncode = await self.proc.wait()
        await asyncio.wait(self._readers, timeout=REAP_TIMEOUT_S)
        return ChildExit(
            started=self._out.ready,
            returncode=returncode,
            timed_out=timed_out,
            answer=self._out.answer(),
            stderr_tail=self._err.data,
            seconds=time.monotonic() - begin,
        )

    def kill(self) -> None:
        if self.alive:
            _kill_group(self.proc.pid)

    async def close(self) -> None:
        self.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), REAP_TIMEOUT_S)
        for t in self._readers:
            t.cancel()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._cwd.cleanup()


async def _drain_async(stream: asyncio.StreamReader | None, sink: Callable[[bytes], None]) -> None:
    assert stream is not None
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await stream.read(1 << 16):
            sink(chunk)


# ---------------------------------------------------------------------------------------------
# Inspections


def _argv() -> list[str]:
    return [sys.executable, "-m", _MODULE]


def _inspection_request(
    program: Payload,
    state: Payload,
    limits: InspectionLimits,
    trial: TrialBatch | None,
    count_flops: bool = False,
) -> tuple[list[Payload], int]:
    blobs: list[Payload] = [program, state]
    header: dict[str, Any] = {
        "cpu_seconds": limits.cpu_seconds,
        "sizes": [],
        "count_flops": count_flops,
    }
    if trial is not None:
        from epochmesh.wire.tensors import to_safetensors

        n = max(trial.sizes)
        tensors = {f"input.{i}": t[:n] for i, t in enumerate(trial.inputs)}
        tensors.update({f"target.{i}": t[:n] for i, t in enumerate(trial.targets)})
        blobs.append(to_safetensors(tensors))
        header.update(
            sizes=list(trial.sizes), num_inputs=len(trial.inputs), num_targets=len(trial.targets)
        )
    budget = limits.memory_budget(sum(payload_size(b) for b in blobs))
    header["memory_budget"] = budget
    return encode_request(header, blobs), budget


def _log_result(result: Inspection, ended: ChildExit) -> None:
    if result.verdict in (Verdict.ACCEPTED, Verdict.REFUSED, Verdict.BATCH_FAILED):
        log.info("program inspection: %s in %.1f s", result.verdict, ended.seconds)
        return
    log.warning(
        "program inspection: %s after %.1f s (%s); its stderr ends %r",
        result.verdict,
        ended.seconds,
        result.reason,
        ended.stderr_tail[-600:].decode(errors="replace"),
    )


class PendingInspection:
    """An inspection child started ahead of time: it imports torch while the caller works on;
    `run` hands it the program. One `run` per object; close it when done."""

    def __init__(self) -> None:
        self._cwd = inspection_workdir()
        self._child = ChildProcess(_argv(), env=child_env(), cwd=self._cwd.name)

    def run(
        self,
        program: bytes,
        state: bytes,
        limits: InspectionLimits | None = None,
        *,
        trial: TrialBatch | None = None,
        task: str = "loading the program",
    ) -> Inspection:
        limits = limits or InspectionLimits()
        parts, budget = _inspection_request(program, state, limits, trial)
        self._child.send(parts)
        ended = self._child.finish(limits.timeout_s)
        result = judge(ended, limits, budget, task)
        _log_result(result, ended)
        return result

    def close(self) -> None:
        self._child.close()
        self._cwd.cleanup()

    def __enter__(self) -> PendingInspection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inspect_program(
    program: bytes,
    state: bytes,
    limits: InspectionLimits | None = None,
    *,
    trial: TrialBatch | None = None,
    task: str = "loading the program",
) -> Inspection:
    """Check and load `program` with `state` in a confined child (blocking)."""
    with PendingInspection() as pending:
        return pending.run(program, state, limits, trial=trial, task=task)


async def inspect_program_async(
    program: bytes, state: bytes, limits: InspectionLimits | None = None
) -> Inspection:
    """Check and load `program` with `state` in a fresh confined child, without blocking the
    event loop (a service inspecting programs often wants a `ProgramInspector`)."""
    child = await AsyncChild.start(_argv(), child_env())
    try:
        return await _run_inspection(child, program, state, limits or InspectionLimits())
    finally:
        await child.close()


async def _run_inspection(
    child: AsyncChild, program: Payload, state: Payload, limits: InspectionLimits
) -> Inspection:
    parts, budget = _inspection_request(program, state, limits, None, count_flops=True)
    ended = await child.run(parts, limits.timeout_s)
    result = judge(ended, limits, budget)
    _log_result(result, ended)
    return result


class ProgramInspector:
    """Inspections for a service: at most `concurrency` children at once, and (with `spare`)
    one child kept started, torch imported, for the next inspection (started after the first;
    about 300 MB of memory while it waits). Close it when the service stops."""

    def __init__(
        self,
        limits: InspectionLimits | None = None,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        spare: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError("inspection concurrency must be at least 1")
        self.limits = limits or InspectionLimits()
        self.keep_spare = spare
        self._slots = asyncio.Semaphore(concurrency)
        self._spare: asyncio.Task[AsyncChild] | None = None
        self._closed = False

    async def inspect(self, program: Payload, state: Payload) -> Inspection:
        """Check `program` with `state`; a `FilePart` is read as it is handed over."""
        async with self._slots:
            child = await self._take_child()
            try:
                return await _run_inspection(child, program, state, self.limits)
            finally:
                await child.close()
                self.warm_up()

    def warm_up(self) -> None:
        """Start the spare child now, if it is kept and not already there."""
        if self.keep_spare and not self._closed and self._spare is None:
            self._spare = asyncio.create_task(AsyncChild.start(_argv(), child_env()))

    async def wait_warm(self) -> bool:
        """Start the spare if needed and wait until it is ready; whether it is."""
        self.warm_up()
        if self._spare is None:
            return False
        child = await self._spare
        return await child.wait_ready()

    async def _take_child(self) -> AsyncChild:
        task, self._spare = self._spare, None
        if task is not None:
            with contextlib.suppress(OSError):
                child = await task
                if child.alive:
                    return child
                await child.close()
        return await AsyncChild.start(_argv(), child_env())

    async def close(self) -> None:
        self._closed = True
        task, self._spare = self._spare, None
        if task is not None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await (await task).close()


# ---------------------------------------------------------------------------------------------
# The child


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or any(h.decode() in text for h in _MEMORY_HINTS)


def _inspect(
    program: bytes, state: bytes, trial: bytes | None, header: Mapping[str, Any]
) -> dict[str, Any]:
    from epochmesh.errors import CodecError, ProgramError
    from epochmesh.program.archive import TrainableProgram, validate_program_archive
    from epochmesh.wire.tensors import from_safetensors

    try:
        validate_program_archive(program)
        prog = TrainableProgram.from_bytes(program, state, "cpu", validate=False)
    except ProgramError as e:
        return {"ok": False, "kind": "refused", "error": str(e)}
    except Exception as e:  # anything else loading raises is a refusal too
        if _is_out_of_memory(e):
            return {"ok": False, "kind": "memory", "error": str(e)[:500]}
        return {"ok": False, "kind": "refused", "error": f"{type(e).__name__}: {e}"[:500]}
    del program, state
    losses: list[float] = []
    if trial is not None:
        try:
            data = from_safetensors(trial)
        except CodecError as e:
            return {"ok": False, "kind": "refused", "error": f"trial batch: {e}"}
        inputs = [data[f"input.{i}"] for i in range(int(header["num_inputs"]))]
        targets = [data[f"target.{i}"] for i in range(int(header["num_targets"]))]
        for size in header["sizes"]:
            try:
                loss, _ = prog.loss_and_grads(
                    [t[:size] for t in inputs], [t[:size] for t in targets]
                )
            except Exception as e:
                if _is_out_of_memory(e):
                    return {"ok": False, "kind": "memory", "error": str(e)[:500]}
                text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                return {"ok": False, "kind": "batch", "batch": size, "error": text[:500]}
            losses.append(loss)
    params = prog.param_names if sum(len(p) + 4 for p in prog.param_names) < 128 << 10 else []
    flops = _count_flops(prog) if header.get("count_flops") is True else 0.0
    return {"ok": True, "params": params, "losses": losses, "flops": flops}


def _count_flops(prog: Any) -> float:
    """The loaded program's FLOPs per sample on zeros of its declared shapes (0.0 when they
    cannot be counted: a quote then has no figure for it; the program is not refused)."""
    from epochmesh.program.flops import declared_flops_per_sample

    try:
        return declared_flops_per_sample(prog)
    except Exception as e:  # a count is advice: nothing it raises refuses the program
        log.warning("FLOPs not counted: %s", one_line(f"{type(e).__name__}: {e}"))
        return 0.0


def _test_fault(channel: IO[bytes]) -> None:
    import ctypes

    fault = os.environ.get(TEST_FAULT_ENV, "")
    if fault == "segv":
        ctypes.string_at(0)
    elif fault == "abort":
        os.abort()
    elif fault == "hang":
        while True:
            time.sleep(1)
    elif fault == "flood":
        for _ in range(64):
            channel.write(b"x" * (1 << 16))
        channel.flush()


def main() -> int:
    os.nice(CHILD_NICENESS)
    channel = answer_channel()
    logging.basicConfig(level=logging.WARNING, format="program inspection: %(message)s")
    import torch

    torch.set_num_threads(1)
    # torch.export.load's modules, imported while files are open: their import touches a cache
    # folder (torch._dynamo) that confinement would refuse.
    for name in (
        "torch._export.serde.serialize",
        "torch.export.pt2_archive",
        "epochmesh.program.archive",
        "epochmesh.program.flops",
        "ctypes",
    ):
        importlib.import_module(name)
    send_ready(channel)
    try:
        header, blobs = read_request(sys.stdin.buffer)
    except (ValueError, KeyError, EOFError, OSError) as e:
        log.error("no request: %s", e)
        return 3
    program, state = blobs[0], blobs[1]
    trial = blobs[2] if len(blobs) > 2 else None
    del blobs
    used = resource.getrusage(resource.RUSAGE_SELF)
    confine_self(
        Confinement(
            memory_bytes=data_bytes() + int(header["memory_budget"]),
            cpu_seconds=math.ceil(used.ru_utime + used.ru_stime) + int(header["cpu_seconds"]),
            read_paths=runtime_read_paths(),
        )
    )
    reply = _inspect(program, state, trial, header)
    _test_fault(channel)
    send_answer(channel, reply)
    os._exit(0)  # no interpreter teardown: nothing left to do, and nothing to crash in


if __name__ == "__main__":
    sys.exit(main())
