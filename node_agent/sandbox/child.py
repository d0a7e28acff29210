"""The program child: runs one job's exported program for the agent, confined.

Forked by the program zygote (node_agent.sandbox.zygote: a fresh interpreter with a minimal
environment that has imported torch) and running `run` there; or, when no zygote can serve,
started by node_agent.sandbox.host as ``python -m node_agent.sandbox.child FD``. Never forked
from the agent, so it never holds the node's key, certificate or tokens. Its end of a socket
pair to the agent is its only channel (node_agent.sandbox.wire). It confines itself
(epochmesh.program.confine: resource limits, Landlock, seccomp), answers "ready", then serves:

- ``load``: the program and initial state (memfds), the state region (memfd + layout): checks
  and loads the program (epochmesh.program.archive, the same allow-list as everywhere), and binds its
  parameters and buffers to the shared state region, so that the agent's optimizer steps and
  parameter loads are the program's (on a GPU: copied in before and out after each step);
- ``grads``: the region (float32, one slot per parameter) the gradients are written to;
- ``arena``: a region the agent writes batches into;
- ``step``: loss and gradients (or the loss alone) of the batch described by arena slots,
  optionally with the peak tensor memory of the step; with a ``seed``, torch's generators are
  seeded with it first (node_agent.sandbox.seeding);
- ``chunk_grads``: the region (one float32 gradient layout per chunk, ``stride`` bytes apart)
  that ``chunks`` writes to;
- ``chunks``: the loss and gradient of each of several slices of the batch on its own (a
  verified part's chunks, issue 20), each in micro-batches of at most ``micro_batch`` samples
  accumulated as the agent's trainer does (`accumulated_loss_and_grads`), in one request: one
  round trip instead of one per chunk; with ``seeds`` (one per chunk), each micro-batch k of
  chunk i runs with the generators seeded ``micro_seed(seeds[i], k)``, so that a checker that
  recomputes a chunk draws the worker's dropout masks and noise;
- ``probe``: try something confinement must stop and say what happened.

Errors are answered ({"ok": false, "kind", "error"}); after running out of memory the child
exits, since the program's state may be half-updated.

Test hooks, honoured only with EPOCHMESH_TEST_HOOKS=1 in the environment (the agent passes it
on from its own): the ``probe`` op, and a step's ``fault`` (crash, hang, alloc), which makes
that step crash, hang or allocate without bound.
"""

from __future__ import annotations

import errno
import glob
import importlib
import logging
import math
import os
import socket
import sys
import time
from typing import Any

import torch

from epochmesh.errors import ProgramError
from epochmesh.program.archive import TrainableProgram
from epochmesh.program.confine import (
    ARCHES,
    Confinement,
    confine_self,
    data_bytes,
    runtime_read_paths,
)
from node_agent.core.measure import CpuMemoryMeter, is_out_of_memory
from node_agent.sandbox.seeding import micro_seed, seed_generators, valid_seed
from node_agent.sandbox.wire import (
    ALIGN,
    Layout,
    Region,
    WireError,
    read_message,
    send_message,
)

log = logging.getLogger("epochmesh.program_child")

TEST_HOOKS_ENV = "EPOCHMESH_TEST_HOOKS"


class ProgramRunner:
    """The loaded program and the shared regions it works in."""

    def __init__(self) -> None:
        self.program: TrainableProgram | None = None
        self.state_views: dict[str, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}
        self.arena: Region | None = None
        self.chunk_region: Region | None = None
        self.mirror = False  # device memory is not the shared region: copy in and out
        self.hooks = os.environ.get(TEST_HOOKS_ENV) == "1"

    # -- setup ----------------------------------------------------------------------------------

    def load(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != 3:
            raise WireError("load needs the program, initial state and state regions")
        program_region, init_region, state_region = (Region.attach(fd) for fd in fds)
        program = _read(program_region, msg.get("program_bytes"))
        init = _read(init_region, msg.get("init_bytes"))
        for region in (program_region, init_region, state_region):
            region.close_fd()
        device = torch.device(str(msg.get("device", "cpu")))
        prog = TrainableProgram.from_bytes(program, init, device)
        del program, init
        layout = Layout.from_json(msg.get("layout"), state_region.size)
        views = state_region.views(layout)
        live = prog.live_tensors()
        canonical = {id(t): k for k, t in reversed(list(live.items()))}
        for name, view in views.items():
            t = live.get(name)
            if t is None or canonical[id(t)] != name:
                raise ProgramError(f"the state region names {name!r}, which the program lacks")
            if t.dtype != view.dtype or tuple(t.shape) != tuple(view.shape):
                raise ProgramError(f"state {name!r} does not match the program's tensor")
        missing = {k for k, t in live.items() if canonical[id(t)] == k} - set(views)
        if missing:
            raise ProgramError(f"the state region lacks {sorted(missing)[:5]}")
        self.mirror = device.type != "cpu"
        with torch.no_grad():
            for name, view in views.items():
                if self.mirror:
                    live[name].copy_(view)
                else:
                    live[name].data = view
        self.program = prog
        self.state_views = views
        return {
            "param_names": prog.param_names,
            "buffer_names": prog.buffer_names,
            "state_names": prog.state_names,
            "num_user_inputs": prog.num_user_inputs,
        }

    def grads(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        prog = self._program()
        if len(fds) != 1:
            raise WireError("grads needs one region")
        region = Region.attach(fds[0])
        region.close_fd()
        layout = Layout.from_json(msg.get("layout"), region.size)
        views = region.views(layout)
        if list(views) != prog.param_names or any(
            v.dtype != torch.float32 or v.shape != prog.live_tensors()[k].shape
            for k, v in views.items()
        ):
            raise ProgramError("the gradient region does not match the program's parameters")
        self.grad_views = views
        return {}

    def set_arena(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != 1:
            raise WireError("arena needs one region")
        self.arena = Region.attach(fds[0])
        self.arena.close_fd()
        return {}

    def set_chunk_grads(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != 1:
            raise WireError("chunk_grads needs one region")
        self.chunk_region = Region.attach(fds[0])
        self.chunk_region.close_fd()
        return {}

    # -- compute --------------------------------------------------------------------------------

    def _batch(self, msg: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.arena is None:
            raise WireError("no arena")
        inputs = list(
            self.arena.views(Layout.from_json(msg.get("inputs"), self.arena.size)).values()
        )
        targets = list(
            self.arena.views(Layout.from_json(msg.get("targets"), self.arena.size)).values()
        )
        return inputs, targets

    def step(self, msg: dict[str, Any]) -> dict[str, Any]:
        prog = self._program()
        if self.arena is None:
            raise WireError("no arena")
        if self.hooks and msg.get("fault"):
            _test_fault(str(msg["fault"]))
        inputs, targets = self._batch(msg)
        with_grads = bool(msg.get("grads", True))
        seed = msg.get("seed")
        if seed is not None and not valid_seed(seed):
            raise WireError("malformed step request: a bad seed")
        meter = CpuMemoryMeter() if msg.get("track_memory") else None
        if self.mirror:
            self._copy_in()

        def run() -> float:
            if seed is not None:
                seed_generators(seed, prog.device)
            if not with_grads:
                return prog.loss(inputs, targets)
            loss, grads = prog.loss_and_grads(inputs, targets)
            with torch.no_grad():
                for name, g in grads.items():
                    self.grad_views[name].copy_(g)
            return loss

        loss = meter.track(run) if meter is not None else run()
        if self.mirror:
            self._copy_out()
        out: dict[str, Any] = {"loss": loss if math.isfinite(loss) else str(loss)}
        if meter is not None:
            out["peak"] = meter.peak_bytes()
        return out

    def chunks(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Each chunk's mean loss and gradient, written to the chunk region at chunk i x
        stride (the gradient region's layout shifted there)."""
        prog = self._program()
        region = self.chunk_region
        if region is None or not self.grad_views:
            raise WireError("no chunk region")
        if self.hooks and msg.get("fault"):
            _test_fault(str(msg["fault"]))
        inputs, targets = self._batch(msg)
        n = int(inputs[0].shape[0]) if inputs else 0
        bounds = msg.get("bounds")
        stride = msg.get("stride")
        micro = msg.get("micro_batch", 0)
        seeds = msg.get("seeds")
        specs = [(k, torch.float32, tuple(v.shape)) for k, v in self.grad_views.items()]
        if (
            not isinstance(bounds, list)
            or not all(
                isinstance(b, list)
                and len(b) == 2
                and all(type(x) is int for x in b)
                and 0 <= b[0] < b[1] <= n
                for b in bounds
            )
            or type(stride) is not int
            or stride < Layout.of(specs).size
            or stride % ALIGN
            or len(bounds) * stride > region.size
            or type(micro) is not int
            or micro < 0
            or (
                seeds is not None
                and (
                    not isinstance(seeds, list)
                    or len(seeds) != len(bounds)
                    or not all(valid_seed(x) for x in seeds)
                )
            )
        ):
            raise WireError("malformed chunks request")
        meter = CpuMemoryMeter() if msg.get("track_memory") else None
        if self.mirror:
            self._copy_in()

        def run() -> list[float]:
            losses = []
            for i, (start, end) in enumerate(bounds):
                views = region.views(Layout.of(specs, start=i * stride))
                losses.append(
                    self._accumulate(
                        prog,
                        [t[start:end] for t in inputs],
                        [t[start:end] for t in targets],
                        micro,
                        views,
                        None if seeds is None else seeds[i],
                    )
                )
            return losses

        losses = meter.track(run) if meter is not None else run()
        if self.mirror:
            self._copy_out()
        out: dict[str, Any] = {"losses": [x if math.isfinite(x) else str(x) for x in losses]}
        if meter is not None:
            out["peak"] = meter.peak_bytes()
        return out

    @staticmethod
    def _accumulate(
        prog: TrainableProgram,
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        micro_batch: int,
        out: dict[str, torch.Tensor],
        seed: int | None = None,
    ) -> float:
        """The slice's mean loss, its gradient written to ``out`` (float32): the arithmetic of
        node_agent.training.compute.accumulated_loss_and_grads over one `step` per micro-batch (each
        micro-batch's gradient taken as float32 on the CPU, then weighted and summed there),
        so that a chunk computed here equals one computed call by call. With a ``seed``,
        micro-batch k runs with the generators seeded ``micro_seed(seed, k)``."""
        n = int(inputs[0].shape[0]) if inputs else 0
        if micro_batch <= 0 or n <= micro_batch:
            if seed is not None:
                seed_generators(micro_seed(seed, 0), prog.device)
            loss, grads = prog.loss_and_grads(inputs, targets)
            with torch.no_grad():
                for name, g in grads.items():
                    out[name].copy_(g)
            return loss
        total = 0.0
        for k, start in enumerate(range(0, n, micro_batch)):
            end = min(n, start + micro_batch)
            if seed is not None:
                seed_generators(micro_seed(seed, k), prog.device)
            loss, grads = prog.loss_and_grads(
                [t[start:end] for t in inputs], [t[start:end] for t in targets]
            )
            weight = (end - start) / n
            total += loss * weight
            with torch.no_grad():
                for name, g in grads.items():
                    g32 = g.detach().to("cpu", torch.float32)
                    if start == 0:
                        out[name].copy_(g32 * weight)
                    else:
                        out[name].add_(g32, alpha=weight)
        return total

    def _copy_in(self) -> None:
        live = self._program().live_tensors()
        with torch.no_grad():
            for name, view in self.state_views.items():
                live[name].copy_(view, non_blocking=True)

    def _copy_out(self) -> None:
        prog = self._program()
        live = prog.live_tensors()
        with torch.no_grad():
            for name in prog.buffer_names:
                if name in self.state_views:
                    self.state_views[name].copy_(live[name])

    def _program(self) -> TrainableProgram:
        if self.program is None:
            raise WireError("no program loaded")
        return self.program


def _test_fault(kind: str) -> None:
    """Tests only: fail this step by crashing, hanging or allocating without bound."""
    if kind == "crash":
        import ctypes

        ctypes.string_at(0)
    elif kind == "hang":
        while True:
            pass
    elif kind == "alloc":
        hoard = []
        while True:
            hoard.append(torch.ones(1 << 26))


def _read(region: Region, size: Any) -> bytes:
    if type(size) is not int or not 0 <= size <= region.size:
        raise WireError("a region's byte count is out of range")
    return bytes(region.view_bytes(size))


def probe(msg: dict[str, Any]) -> dict[str, Any]:
    """Tests only: try what confinement must stop; the answer says what happened."""
    what = msg.get("what")
    try:
        if what == "read":
            with open(str(msg.get("path")), "rb") as f:
                f.read(1)
        elif what == "socket":
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.connect(("127.0.0.1", int(msg.get("port", 1))))
            s.close()
        elif what == "alloc":
            hoard = torch.ones(int(msg.get("bytes", 0)) // 4)
            hoard.add_(1)
        elif what == "syscall":  # by name (confine's table) or number, integer arguments
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            nr = msg.get("nr")
            if type(nr) is not int:
                nr = ARCHES[os.uname().machine].nr[str(msg.get("name"))]
            args = (ctypes.c_long(int(a)) for a in msg.get("args", []))
            if libc.syscall(ctypes.c_long(nr), *args) < 0:
                return {"outcome": f"refused: {errno.errorcode[ctypes.get_errno()]}"}
        else:
            return {"outcome": f"unknown probe {what!r}"}
    except Exception as e:  # the point: report whatever stopped it
        return {"outcome": f"refused: {type(e).__name__}: {e}"}
    return {"outcome": "allowed"}


def serve(sock: socket.socket, runner: ProgramRunner) -> None:
    hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    while True:
        try:
            msg, fds = read_message(sock)
        except WireError:
            return  # the agent went away
        op = msg.get("op")
        started = _cpu_clocks()
        try:
            if op == "load":
                out = runner.load(msg, fds)
            elif op == "grads":
                out = runner.grads(msg, fds)
            elif op == "arena":
                out = runner.set_arena(msg, fds)
            elif op == "step":
                out = runner.step(msg)
            elif op == "chunk_grads":
                out = runner.set_chunk_grads(msg, fds)
            elif op == "chunks":
                out = runner.chunks(msg)
            elif op == "probe" and hooks:
                out = probe(msg)
            elif op == "exit":
                return
            else:
                raise WireError(f"unknown op {op!r}")
        except Exception as e:
            fatal = is_out_of_memory(e)
            kind = "memory" if fatal else ("value" if isinstance(e, ValueError) else "error")
            reply = {"ok": False, "kind": kind, "error": f"{type(e).__name__}: {_first(e)}"}
            send_message(sock, reply)
            if fatal:
                return
            continue
        out.update(ok=True, cpu=_cpu_since(started))
        send_message(sock, out)


def _cpu_clocks() -> tuple[float, float]:
    return time.process_time(), time.thread_time()


def _cpu_since(started: tuple[float, float]) -> float:
    """CPU seconds since `started` (_cpu_clocks): the process's (every thread), but at least
    this thread's. Once the agent has set RLIMIT_CPU, the kernel reads the process's clock from
    its group timer, which advances at scheduler ticks: a step of a sample or two reads 0 there,
    while the thread's own clock is exact."""
    process, thread = _cpu_clocks()
    return max(process - started[0], thread - started[1])


def _first(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:500]
    return ""


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (kill -9 included): a busy program must not
    outlive the agent (the zygote dies with the agent)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def preload() -> None:
    """Import what loading a program needs while files may still be opened: torch.export.load's
    modules, whose import touches a cache folder (torch._dynamo) that confinement would refuse.
    Runs no torch op (no thread pool starts) and touches no GPU."""
    for name in ("torch._export.serde.serialize", "torch.export.pt2_archive"):
        importlib.import_module(name)


def warm_up_device_libraries(device: str) -> tuple[str, ...]:
    """On a CUDA device, open the driver and the libraries torch loads lazily (cuBLAS and
    cuBLASLt at the first matrix products, cuDNN at the first convolution, with their backward
    kernels) while files may still be opened: after confinement (Landlock, the open-file and
    memory limits) a program's first step could not load them. A 1x1 convolution, two
    products (plain and with a bias) and their gradients, then a synchronize. Returns what it
    opened, e.g. ("cuda:0", "cublas", "cudnn 90100"); on a CPU nothing (no torch op runs)."""
    if not device.startswith("cuda"):
        return ()
    dev = torch.device(device)
    if dev.index is not None:
        torch.cuda.set_device(dev)  # the context on this device, not on cuda:0
    opened = [str(dev) if dev.index is not None else f"cuda:{torch.cuda.current_device()}"]
    x = torch.randn(2, 3, 4, 4, device=dev, requires_grad=True)
    w = torch.randn(3, 3, device=dev, requires_grad=True)
    b = torch.zeros(3, device=dev, requires_grad=True)
    rows = x.flatten(2).transpose(1, 2)  # (2, 16, 3)
    loss = (rows @ w).square().mean() + torch.nn.functional.linear(rows, w, b).square().mean()
    opened.append("cublas")
    cudnn = torch.backends.cudnn
    if cudnn.is_available() and cudnn.enabled:  # type: ignore[no-untyped-call]
        k = torch.randn(3, 3, 1, 1, device=dev, requires_grad=True)
        loss = loss + torch.nn.functional.conv2d(x, k).square().mean()
        opened.append(f"cudnn {cudnn.version()}")  # type: ignore[no-untyped-call]
    loss.backward()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize(dev)
    return tuple(opened)


def run(fd: int, parent: int) -> int:
    """A child's life on its socket `fd` to the agent, in a fresh interpreter (main) or in a
    process just forked from the zygote (node_agent.sandbox.zygote), whose pid is `parent`:
    die with the parent, confine, answer "ready", serve until the agent is done."""
    die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above
        return 1
    sock = socket.socket(fileno=fd)
    hello, _ = read_message(sock)
    threads = hello.get("threads")
    device = str(hello.get("device", "cpu"))
    libraries = warm_up_device_libraries(device)  # before confinement; nothing on a CPU
    preload()  # already done in the zygote

    memory = hello.get("memory_bytes")
    budget = memory if type(memory) is int and memory > 0 else None
    base = data_bytes()  # the agent may lower the limit later: base + a smaller budget
    report = confine_self(
        Confinement(
            memory_bytes=base + budget if budget else None,
            open_files=int(hello.get("open_files", 64)),
            read_paths=runtime_read_paths(),
            device_paths=tuple(glob.glob("/dev/nvidia*")) if device.startswith("cuda") else (),
        )
    )
    if type(threads) is int and threads > 0:
        torch.set_num_threads(threads)  # after confinement: its pool starts under Landlock
    ready = {
        "ok": True,
        "confinement": report.describe(),
        "pid": os.getpid(),
        "data_base": base,
        "device_libraries": list(libraries),
    }
    send_message(sock, ready)
    serve(sock, ProgramRunner())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="program child: %(message)s")
    return run(int(args[0]), parent=os.getppid())


if __name__ == "__main__":
    sys.exit(main())
