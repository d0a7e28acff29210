"""A job's program, run in a confined child process (node_agent.sandbox.child).

`ConfinedProgram` offers the agent what `epochmesh.program.archive.TrainableProgram` offers (names,
live parameters for optimizers, state, loss and gradients of a batch), but the program itself
runs in a child that never holds the node's key, certificate or tokens, has no network, and
runs under resource limits (epochmesh.program.confine). Parameters and buffers live in shared memory
that the agent owns (a memfd): the agent's optimizer steps and parameter loads change what the
child computes with, without copies; batches go through a shared arena and gradients come
back through a shared region; only small JSON messages cross the socket pair.

Children are started by node_agent.sandbox.spawn: forked by the zygote of the program's owner
(`ProgramHosts.zygote`, node_agent.sandbox.zygote), which keeps the agent's key, certificate and
tokens out of every child's memory, else (no zygote serves, or the program was given none) as
a fresh interpreter.

A crash, a limit hit, a hang (no answer within `timeout_s`) or an error of the child raises
`ProgramFault`: the task fails with the reason, and the next call starts a fresh child, which
loads the program again and finds the state where the agent left it. A non-finite loss or
gradient is a `ProgramFault` too: the job's fault, not the node's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import select
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch

from epochmesh.errors import ProgramError
from epochmesh.program.archive import (
    ALIASES_METADATA_KEY,
    PARAMS_METADATA_KEY,
    assign_tensors,
    read_initial_state,
)
from epochmesh.program.confine import (
    address_space_bytes,
    describe_exit,
    set_address_space_limit,
    set_cpu_limit,
)
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import to_safetensors
from node_agent.core.measure import MEMORY_HEADROOM, Point, fitting, linear_fit
from node_agent.sandbox.spawn import (
    START_TIMEOUT_S,
    TEST_HOOKS_ENV,
    Zygote,
    child_env,
    log_lines,
    spawn_child,
)
from node_agent.sandbox.wire import (
    ALIGN,
    Layout,
    Region,
    WireError,
    read_message,
    send_message,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Tests only (with EPOCHMESH_TEST_HOOKS=1): a file in the agent's data dir whose content (crash,
# hang or alloc) the next step of a program passes to its child, which then fails so.
TEST_FAULT_FILE = "test-program-fault"

CHILD_OVERHEAD_BYTES = 512 << 20
JOB_MEMORY_FACTOR = 2  # measured tensor memory -> the child's memory limit after a benchmark
LOAD_TIMEOUT_S = 300.0  # loading a large exported program
DEFAULT_STEP_TIMEOUT_S = 120.0
MIN_STEP_TIMEOUT_S = 10.0
CPU_SLACK_S = 30.0
MAX_REPORTED_CPU_S = 1e6  # a child's CPU figure for one request beyond this is nonsense
# A CPU child's address space (RLIMIT_AS) beyond its memory limit and the regions it was given:
# per torch thread, glibc's malloc arena (64 MiB, reserved unused) and a stack (8 MiB), with
# room to spare; in all, libraries opened late.
THREAD_ADDRESS_BYTES = 128 << 20
ADDRESS_SLACK_BYTES = 512 << 20
STOP_GRACE_S = 5.0  # the agent's shutdown: how long children get to exit before SIGKILL

# Kinds of ProgramFault.
CRASHED = "crashed"
HUNG = "hung"
MEMORY = "memory"
NONFINITE = "nonfinite"
REFUSED = "refused"
FAILED = "failed"


class ProgramFault(Exception):
    """The job's program failed on this node (see the module docstring): the job's fault."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


class ProgramMemoryError(ProgramFault, MemoryError):
    """The program ran out of its child's memory limit (a benchmark takes it as out of memory)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, MEMORY)


@dataclass
class ChildLimits:
    """What a program child may use."""

    memory_bytes: int | None = None  # private memory beyond its start-up use (RLIMIT_DATA)
    threads: int | None = None  # torch threads (also the CPU seconds per wall second allowed)
    device: str = "cpu"
    fault_file: Path | None = None  # tests only: see TEST_FAULT_FILE


class ProgramChild:
    """One child process and its socket; every failure to answer becomes a ProgramFault."""

    def __init__(self, limits: ChildLimits, zygote: Zygote | None = None) -> None:
        self.limits = limits
        env = child_env()
        forked = zygote.fork_child(env) if zygote is not None else None
        started = forked or spawn_child(env)
        self.proc, self.sock, stderr = started
        self.pid = self.proc.pid
        threading.Thread(
            target=log_lines, args=(stderr, self.pid), daemon=True, name="child-log"
        ).start()
        self._cpu = 0.0
        self.confinement = ""
        hello = {
            "op": "hello",
            "device": limits.device,
            "threads": limits.threads or torch.get_num_threads(),
            "memory_bytes": limits.memory_bytes or 0,
        }
        ready = self.request(hello, timeout_s=START_TIMEOUT_S)
        self.confinement = str(ready.get("confinement", ""))[:200]
        base = ready.get("data_base")
        self.data_base = base if type(base) is int and base >= 0 else 0
        self._shared_bytes = 0  # regions sent to it, which it maps (counted by RLIMIT_AS)
        self._address_base: int | None = None
        if limits.device.startswith("cpu") and limits.memory_bytes is not None:
            # Not on a GPU: its driver reserves far more address space than it uses.
            with contextlib.suppress(OSError, ValueError):
                self._address_base = address_space_bytes(self.pid)
                self._limit_address_space()
                self.confinement += ", address space capped"
        log.info("program child %d started (%s)", self.pid, self.confinement)

    def _limit_address_space(self) -> None:
        """RLIMIT_AS (soft; the child cannot move it): what it had mapped when ready, its memory
        limit, the regions it was given, and room for its threads. Counts what RLIMIT_DATA does
        not: shared mappings (MAP_SHARED | MAP_ANONYMOUS)."""
        if self._address_base is None or self.limits.memory_bytes is None:
            return
        threads = self.limits.threads or torch.get_num_threads()
        limit = (
            self._address_base
            + self.limits.memory_bytes
            + self._shared_bytes
            + (threads + 4) * THREAD_ADDRESS_BYTES
            + ADDRESS_SLACK_BYTES
        )
        with contextlib.suppress(OSError, ValueError):  # it is exiting
            set_address_space_limit(self.pid, limit)

    def request(
        self, message: dict[str, Any], fds: Sequence[int] = (), *, timeout_s: float
    ) -> dict[str, Any]:
        """Send a message, wait for the answer; ProgramFault for a dead, hung or failing child
        (it is killed then)."""
        if self.proc.poll() is None:
            # A backstop behind the wall-clock timeout below (which stops a hung child): CPU
            # for the whole timeout on every thread, plus slack (a limit of just that was
            # seen to fire early on a busy host).
            threads = self.limits.threads or torch.get_num_threads()
            try:
                set_cpu_limit(self.pid, CPU_SLACK_S + 2 * timeout_s * max(1, threads))
            except (OSError, ValueError):
                pass  # it is exiting
            if fds and self._address_base is not None:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        self._shared_bytes += os.fstat(fd).st_size
                self._limit_address_space()
        try:
            send_message(self.sock, message, fds)
        except OSError:
            raise self._dead() from None
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            self.kill()
            raise ProgramFault(
                f"the job's program did not answer within {timeout_s:.0f} s (hung); stopped it",
                HUNG,
            )
        try:
            reply, extra = read_message(self.sock)
        except (WireError, OSError):
            raise self._dead() from None
        for fd in extra:  # the child has no business sending descriptors
            os.close(fd)
        cpu = reply.get("cpu")
        if type(cpu) is float and 0.0 <= cpu < MAX_REPORTED_CPU_S:
            self._cpu += cpu
        if reply.get("ok") is True:
            return reply
        kind = reply.get("kind")
        error = str(reply.get("error", "unknown error"))[:500]
        if kind == "memory":
            self.kill()
            raise ProgramMemoryError(
                f"the job's program ran out of its memory limit ({error}); stopped it"
            )
        if kind == "value":
            raise ValueError(error)
        raise ProgramFault(f"the job's program failed: {error}", FAILED)

    def _dead(self) -> ProgramFault:
        try:
            code: int | None = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        self.sock.close()
        how = describe_exit(code) if code is not None else "stopped answering"
        return ProgramFault(f"the job's program {how}", CRASHED)

    def lower_memory_limit(self, memory_bytes: int) -> None:
        """Lower the child's memory limit (RLIMIT_DATA) to its start-up use + `memory_bytes`,
        from outside (it cannot change its own limits); never raises it."""
        limit = self.data_base + memory_bytes
        with contextlib.suppress(OSError, ValueError):  # it is exiting
            _, hard = resource.prlimit(self.pid, resource.RLIMIT_DATA)
            if hard == resource.RLIM_INFINITY or limit < hard:
                resource.prlimit(self.pid, resource.RLIMIT_DATA, (limit, limit))
        if self.limits.memory_bytes is None or memory_bytes < self.limits.memory_bytes:
            self.limits = replace(self.limits, memory_bytes=memory_bytes)
            self._limit_address_space()

    def cpu_seconds(self) -> float:
        """CPU time the child spent on the requests it answered (its own process_time figures:
        /proc counts in 10 ms ticks, coarser than a small step, and would add its start-up)."""
        return self._cpu

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("program child %d did not die", self.pid)
        self.sock.close()

    def close(self) -> None:
        """Ask the child to exit, without waiting (a thread reaps it, killing it if it lingers):
        callable from the agent's event loop."""
        if self.proc.poll() is None:
            try:
                send_message(self.sock, {"op": "exit"})
            except OSError:
                pass
            threading.Thread(target=self._reap, name=f"reap-{self.pid}", daemon=True).start()
        else:
            self.sock.close()

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def stop_by(self, deadline: float) -> None:
        """Wait until the monotonic `deadline` for the child to exit (after `close`), then kill
        it (through its pidfd: never another process that took its pid)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


class ConfinedProgram:
    """TrainableProgram's interface over a program child (see the module docstring)."""

    def __init__(
        self,
        program: bytes,
        initial_state: bytes,
        limits: ChildLimits,
        zygote: Zygote | None = None,
    ) -> None:
        """``zygote``: what forks its children (None: each starts as a fresh interpreter)."""
        init = read_initial_state(initial_state, require_params=False)
        self.device = torch.device(limits.device)
        # room for the program's own bytes, loaded there
        self._program_room = 4 * (len(program) + len(initial_state))
        if limits.memory_bytes is not None:
            limits = replace(limits, memory_bytes=limits.memory_bytes + self._program_room)
        self.limits = limits
        self.zygote = zygote
        self.timeout_s = DEFAULT_STEP_TIMEOUT_S
        self.aliases = dict(init.aliases)
        # From the initial state's metadata (packaging writes it), else from the first load.
        self._declared_params = list(init.param_names) if init.param_names is not None else None
        self.param_names: list[str] = []
        self.state_names: list[str] = list(init.state)
        self.buffer_names: list[str] = []
        self.num_user_inputs = 0
        self._program = Region.create("program", len(program))
        self._program.write(0, program)
        self._init = Region.create("initial-state", len(initial_state))
        self._init.write(0, initial_state)
        self._sizes = (len(program), len(initial_state))
        own = [k for k in self.state_names if k not in self.aliases]
        self._state_layout = Layout.of((k, init.state[k].dtype, init.state[k].shape) for k in own)
        self._state = Region.create("state", self._state_layout.size)
        self._tensors = self._state.views(self._state_layout)
        with torch.no_grad():
            for k in own:
                self._tensors[k].copy_(init.state[k])
        for alias, canonical in self.aliases.items():
            self._tensors[alias] = self._tensors[canonical]
        self._grad_layout: Layout | None = None
        self._grads: Region | None = None
        self._grad_views: dict[str, torch.Tensor] = {}
        self._arena: Region | None = None
        # Chunked calls (chunked_loss_and_grads): one gradient layout per chunk, grown as needed.
        self._chunk_grads: Region | None = None
        self._child: ProgramChild | None = None
        self._lock = threading.Lock()
        self.track_memory = False
        self.last_peak_bytes = 0
        self.restarts = -1
        self._cpu_of_dead = 0.0
        self._start()

    # -- the child ------------------------------------------------------------------------------

    def _start(self) -> ProgramChild:
        if self._child is not None and self._child.alive:
            return self._child
        if self._child is not None:
            self._cpu_of_dead += self._child.cpu_seconds()
        self.restarts += 1
        child = ProgramChild(self.limits, self.zygote)
        self._child = child
        try:
            reply = child.request(
                {
                    "op": "load",
                    "program_bytes": self._sizes[0],
                    "init_bytes": self._sizes[1],
                    "device": str(self.device),
                    "layout": self._state_layout.to_json(),
                },
                [self._program.fd, self._init.fd, self._state.fd],
                timeout_s=LOAD_TIMEOUT_S,
            )
        except ValueError as e:
            child.kill()
            raise ProgramFault(f"the job's program was refused on this node: {e}", REFUSED) from e
        except ProgramFault as e:
            child.kill()
            raise ProgramFault(f"loading the job's program failed: {e}", e.kind) from e
        try:
            self._take_names(reply)
        except ProgramFault:
            child.kill()
            raise
        assert self._grad_layout is not None and self._grads is not None
        child.request(
            {"op": "grads", "layout": self._grad_layout.to_json()},
            [self._grads.fd],
            timeout_s=MIN_STEP_TIMEOUT_S,
        )
        if self._arena is not None:
            child.request({"op": "arena"}, [self._arena.fd], timeout_s=MIN_STEP_TIMEOUT_S)
        if self._chunk_grads is not None:
            child.request(
                {"op": "chunk_grads"}, [self._chunk_grads.fd], timeout_s=MIN_STEP_TIMEOUT_S
            )
        return child

    def _take_names(self, reply: dict[str, Any]) -> None:
        """The parameter names of the child's first load (checked against the initial state's
        metadata and tensors); later loads must name the same."""
        names = reply.get("param_names")
        own = {k for k in self.state_names if k not in self.aliases}
        if (
            not isinstance(names, list)
            or not all(isinstance(n, str) and n in own for n in names)
            or len(set(names)) != len(names)
            or not all(self._tensors[n].is_floating_point() for n in names)
        ):
            raise ProgramFault("the program names parameters its initial state lacks", REFUSED)
        expected = self._declared_params if self._grad_layout is None else self.param_names
        if expected is not None and names != expected:
            raise ProgramFault("the program's parameters differ from its initial state's", REFUSED)
        inputs = reply.get("num_user_inputs")
        self.num_user_inputs = inputs if type(inputs) is int and inputs > 0 else 0
        if self._grad_layout is not None:
            return
        self.param_names = list(names)
        params = set(names)
        self.buffer_names = [k for k in self.state_names if k not in params | set(self.aliases)]
        for k in self.param_names:
            self._tensors[k].requires_grad_(True)
        self._grad_layout = Layout.of(
            (k, torch.float32, self._tensors[k].shape) for k in self.param_names
        )
        self._grads = Region.create("grads", self._grad_layout.size)
        self._grad_views = self._grads.views(self._grad_layout)

    @property
    def confinement(self) -> str:
        return self._child.confinement if self._child is not None else ""

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None and self._child.alive else None

    def limit_memory(self, memory_bytes: int) -> None:
        """Tighten the memory limit to `memory_bytes` beyond start-up (plus room for the
        program's own bytes), for this child and the ones after it; a looser figure than the
        current one changes nothing."""
        total = memory_bytes + self._program_room
        with self._lock:
            if self.limits.memory_bytes is not None and total >= self.limits.memory_bytes:
                return
            self.limits = replace(self.limits, memory_bytes=total)
            if self._child is not None and self._child.alive:
                self._child.lower_memory_limit(total)

    @property
    def memory_limit_bytes(self) -> int | None:
        """The current limit beyond the child's start-up use."""
        return self.limits.memory_bytes

    def cpu_seconds(self) -> float:
        """CPU time of every child this program ran in (for the slowdown's compute clock)."""
        child = self._child
        return self._cpu_of_dead + (child.cpu_seconds() if child is not None else 0.0)

    def close(self) -> ProgramChild | None:
        """Ask the child to exit (a thread reaps it); returns it, for a caller that waits."""
        with self._lock:
            child, self._child = self._child, None
            if child is not None:
                self._cpu_of_dead += child.cpu_seconds()
                child.close()
        return child

    def probe(self, **message: Any) -> str:
        """Tests only (EPOCHMESH_TEST_HOOKS=1): ask the child to try something."""
        with self._lock:
            reply = self._start().request({"op": "probe", **message}, timeout_s=60.0)
        return str(reply.get("outcome", ""))

    # -- state ----------------------------------------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        return [self._tensors[k] for k in self.param_names]

    def get_parameters(self) -> dict[str, torch.Tensor]:
        return {k: self._tensors[k].detach().clone() for k in self.param_names}

    def set_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        self._assign(params, self.param_names, "parameters")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._tensors[k].detach().clone() for k in self.state_names}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._assign(state, self.state_names, "state")

    def state_bytes(self) -> bytes:
        meta = {PARAMS_METADATA_KEY: json.dumps(self.param_names)}
        if self.aliases:
            meta[ALIASES_METADATA_KEY] = json.dumps(self.aliases)
        return to_safetensors(self.state_dict(), metadata=meta)

    def _assign(self, values: Mapping[str, torch.Tensor], names: list[str], what: str) -> None:
        assign_tensors(self._tensors, values, names, what, skip=self.aliases)

    # -- compute --------------------------------------------------------------------------------

    def _place(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Write the batch into the arena (grown as needed); its layout as JSON."""
        specs = [(str(i), t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
        layout = Layout.of(specs)
        if self._arena is None or self._arena.size < layout.size:
            self._arena = Region.create("arena", max(layout.size * 2, 1 << 20))
            if self._child is not None and self._child.alive:
                self._child.request({"op": "arena"}, [self._arena.fd], timeout_s=30.0)
        views = self._arena.views(layout)
        with torch.no_grad():
            for slot, t in zip(layout.slots, tensors, strict=True):
                views[slot.name].copy_(t.detach().to("cpu"))
        return layout.to_json()

    def _step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        grads: bool,
        seed: int | None = None,
    ) -> float:
        args = [*inputs, *targets]
        if self.num_user_inputs and len(args) != self.num_user_inputs:
            raise ValueError(
                f"the program takes {self.num_user_inputs} tensors (inputs then targets), "
                f"got {len(inputs)} + {len(targets)}"
            )
        with self._lock:
            child = self._start()
            placed = self._place(args)
            n_in = len(inputs)
            layout = placed["slots"]
            message: dict[str, Any] = {
                "op": "step",
                "inputs": {"slots": layout[:n_in], "size": placed["size"]},
                "targets": {"slots": layout[n_in:], "size": placed["size"]},
                "grads": grads,
                "track_memory": self.track_memory,
            }
            if seed is not None:
                message["seed"] = int(seed)
            fault = self._test_fault()
            if fault:
                message["fault"] = fault
            reply = child.request(message, timeout_s=self.timeout_s)
        peak = reply.get("peak")
        self.last_peak_bytes = peak if type(peak) is int and peak >= 0 else 0
        return _loss_of(reply.get("loss"))

    def _test_fault(self) -> str:
        path = self.limits.fault_file
        if path is None or os.environ.get(TEST_HOOKS_ENV) != "1":
            return ""
        try:
            kind = path.read_text().strip()
            path.unlink()
        except OSError:
            return ""
        log.warning("test hook: the program's next step will %s", kind)
        return kind

    def loss_and_grads(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        seed: int | None = None,
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """Mean loss of the batch and its gradients (float32 CPU copies); ProgramFault for a
        non-finite loss (the trainer checks the gradients of the whole update). With a
        ``seed``, the child seeds torch's generators with it first
        (node_agent.sandbox.seeding)."""
        loss = self._step(inputs, targets, grads=True, seed=seed)
        return loss, {k: v.clone() for k, v in self._grad_views.items()}

    def loss(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        return self._step(inputs, targets, grads=False)

    def chunked_loss_and_grads(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        bounds: Sequence[tuple[int, int]],
        micro_batch: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[float, dict[str, torch.Tensor]]]:
        """The mean loss and gradient (float32 CPU copies) of each slice [start, end) of the
        batch on its own, in micro-batches of at most ``micro_batch`` samples accumulated as
        node_agent.training.compute.accumulated_loss_and_grads does: the same numbers as one such call
        per slice, in one request to the child (a verified part's chunks, issue 20: twelve
        round trips to the child cost more than the small models' compute). ProgramFault for
        a non-finite loss. ``seeds``: one per slice, the seed of its random draws (micro-batch
        k of slice i draws under ``micro_seed(seeds[i], k)``, as
        accumulated_loss_and_grads does)."""
        args = [*inputs, *targets]
        if self.num_user_inputs and len(args) != self.num_user_inputs:
            raise ValueError(
                f"the program takes {self.num_user_inputs} tensors (inputs then targets), "
                f"got {len(inputs)} + {len(targets)}"
            )
        n = int(inputs[0].shape[0]) if inputs else 0
        spans = [(int(a), int(b)) for a, b in bounds]
        if not all(0 <= a < b <= n for a, b in spans):
            raise ValueError(f"chunk bounds {spans[:4]}... do not fit a batch of {n}")
        if not spans:
            return []
        if seeds is not None and len(seeds) != len(spans):
            raise ValueError(f"{len(seeds)} seeds for {len(spans)} chunks")
        with self._lock:
            child = self._start()
            assert self._grad_layout is not None
            stride = -(-self._grad_layout.size // ALIGN) * ALIGN
            size = stride * len(spans)
            if self._chunk_grads is None or self._chunk_grads.size < size:
                if self._chunk_grads is not None:
                    self._chunk_grads.close_fd()
                self._chunk_grads = Region.create("chunk-grads", size)
                child.request(
                    {"op": "chunk_grads"}, [self._chunk_grads.fd], timeout_s=MIN_STEP_TIMEOUT_S
                )
            placed = self._place(args)
            n_in = len(inputs)
            layout = placed["slots"]
            message: dict[str, Any] = {
                "op": "chunks",
                "inputs": {"slots": layout[:n_in], "size": placed["size"]},
                "targets": {"slots": layout[n_in:], "size": placed["size"]},
                "bounds": [list(b) for b in spans],
                "stride": stride,
                "micro_batch": max(0, int(micro_batch)),
                "track_memory": self.track_memory,
            }
            if seeds is not None:
                message["seeds"] = [int(x) for x in seeds]
            fault = self._test_fault()
            if fault:
                message["fault"] = fault
            reply = child.request(message, timeout_s=self.timeout_s)
            peak = reply.get("peak")
            self.last_peak_bytes = peak if type(peak) is int and peak >= 0 else 0
            losses = reply.get("losses")
            if not isinstance(losses, list) or len(losses) != len(spans):
                raise ProgramFault("the job's program answered without its chunks' losses", FAILED)
            specs = [(k, torch.float32, self._tensors[k].shape) for k in self.param_names]
            out: list[tuple[float, dict[str, torch.Tensor]]] = []
            for i, raw in enumerate(losses):
                loss = _loss_of(raw)
                views = self._chunk_grads.views(Layout.of(specs, start=i * stride))
                out.append((loss, {k: v.clone() for k, v in views.items()}))
        return out


def _loss_of(raw: Any) -> float:
    """A loss the child answered (non-finite ones come as strings); ProgramFault when it is
    missing or not finite."""
    loss = raw
    if isinstance(loss, str):
        loss = float(loss) if loss in ("nan", "inf", "-inf") else None
    if not isinstance(loss, int | float) or isinstance(loss, bool):
        raise ProgramFault("the job's program answered without a loss", FAILED)
    if not math.isfinite(loss):
        raise ProgramFault(f"the job's program computed a non-finite loss ({loss})", NONFINITE)
    return float(loss)


def load_confined(
    program: bytes, initial_state: bytes, limits: ChildLimits, zygote: Zygote | None = None
) -> ConfinedProgram:
    """A ConfinedProgram; ProgramFault when the program is refused or its child fails."""
    try:
        return ConfinedProgram(program, initial_state, limits, zygote)
    except ProgramError as e:
        raise ProgramFault(f"the job's program was refused on this node: {e}", REFUSED) from e


class ChildMemoryMeter:
    """node_agent.training.benchmark's MemoryMeter for a confined program: the child counts the peak
    tensor memory of a tracked step (as CpuMemoryMeter does in-process)."""

    def __init__(self, program_of: Callable[[], ConfinedProgram]) -> None:
        self._program_of = program_of
        self._peak = 0

    def reset(self) -> None:
        self._peak = 0

    def track(self, fn: Callable[[], T]) -> T:
        prog = self._program_of()
        prog.track_memory = True
        try:
            result = fn()
        finally:
            prog.track_memory = False
        self._peak = max(self._peak, prog.last_peak_bytes)
        return result

    def peak_bytes(self) -> int:
        return self._peak


def child_memory_budget(device: common_pb2.Device, memory_limit_bytes: int | None) -> int:
    """Private memory a program child may use beyond its start-up use, before the program's
    own bytes: on a CPU what a batch may use there (--memory-limit, else MEMORY_HEADROOM of the
    machine's memory), on a GPU a quarter of the host's memory (activations live on the
    device); plus CHILD_OVERHEAD_BYTES for the allocator and scratch space."""
    if device.kind in ("cpu", ""):
        budget = memory_limit_bytes or int(device.total_memory_bytes * MEMORY_HEADROOM)
    else:
        budget = psutil.virtual_memory().total // 4
    if budget <= 0:
        budget = psutil.virtual_memory().total // 2
    return budget + CHILD_OVERHEAD_BYTES


def job_memory_budget(points: Sequence[Point], max_batch: int) -> int | None:
    """Memory a program child needs for a job after its benchmark (CPU devices): twice the
    tensor memory the benchmark measured (or its memory line reaches) at the largest batch the
    node will be given, plus CHILD_OVERHEAD_BYTES; None without a usable measurement."""
    fits = [p for p in fitting(points) if p.peak_memory_bytes > 0]
    if not fits or max_batch < 1:
        return None
    peak = max(p.peak_memory_bytes for p in fits)
    line = linear_fit([p.batch_size for p in fits], [p.peak_memory_bytes for p in fits])
    if line is not None:
        intercept, slope = line
        peak = max(peak, int(intercept + slope * max_batch))
    return JOB_MEMORY_FACTOR * peak + CHILD_OVERHEAD_BYTES


class ProgramHosts:
    """The agent's confined programs: loads them with the agent's limits, their children forked
    by its `zygote` (started by the first child), sums their CPU time (the slowdown's compute
    clock), stops them all and the zygote at shutdown."""

    def __init__(
        self,
        device: str,
        threads: int | None,
        memory_budget: int | None,
        fault_file: Path | None = None,
    ) -> None:
        self.device = device
        self.threads = threads
        self.memory_budget = memory_budget
        self.fault_file = fault_file
        self.zygote = Zygote()
        self._programs: list[ConfinedProgram] = []
        self._job_budgets: dict[str, int] = {}
        self._cpu_of_closed = 0.0
        self._lock = threading.Lock()

    def limit_job_memory(
        self, job_id: str, budget: int | None, loaded: ConfinedProgram | None = None
    ) -> None:
        """After a job's benchmark: its programs' memory limit, never above the device's, for
        `loaded` and every later load of the job (CPU devices; on a GPU the batch lives in
        device memory and the benchmark does not measure the child's host memory)."""
        if budget is None or not job_id or not self.device.startswith("cpu"):
            return
        if self.memory_budget is not None:
            budget = min(budget, self.memory_budget)
        with self._lock:
            self._job_budgets[job_id] = budget
        if loaded is not None:
            loaded.limit_memory(budget)
        log.info("job %s: its program's memory limit is now %d MiB", job_id, budget >> 20)

    def load(self, program: bytes, initial_state: bytes, job_id: str = "") -> ConfinedProgram:
        with self._lock:
            budget = self._job_budgets.get(job_id, self.memory_budget)
        limits = ChildLimits(
            memory_bytes=budget,
            threads=self.threads,
            device=self.device,
            fault_file=self.fault_file,
        )
        prog = load_confined(program, initial_state, limits, self.zygote)
        with self._lock:
            self._programs.append(prog)
        return prog

    def release(self, prog: ConfinedProgram) -> None:
        """Stop a program the agent no longer keeps."""
        prog.close()
        with self._lock:
            if prog in self._programs:
                self._programs.remove(prog)
                self._cpu_of_closed += prog.cpu_seconds()

    def cpu_seconds(self) -> float:
        with self._lock:
            programs = list(self._programs)
            closed = self._cpu_of_closed
        return closed + sum(p.cpu_seconds() for p in programs)

    def close_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every program, then the zygote (at the agent's shutdown): each child is asked to
        exit and, still there after `grace_s`, killed through its pidfd. (Should the agent die
        instead, its children die with it: their parent-death signal, which seccomp keeps
        them from undoing.)"""
        with self._lock:
            programs, self._programs = self._programs, []
        children = [c for c in (p.close() for p in programs) if c is not None]
        deadline = time.monotonic() + grace_s
        for child in children:
            child.stop_by(deadline)
        self.zygote.stop()
