"""Device discovery: the GPUs (or the CPU) this node offers, as `common_pb2.Device` messages.

With CUDA, every visible GPU is a device (name, total memory, compute capability, driver);
without, the CPU is the one device (model name, usable cores, memory). The agent trains on one
selected device: `auto` means cuda:0 when CUDA is available, else cpu.

The mapping from raw properties to the wire message is pure (`cpu_device`, `cuda_device`,
`select_device`, ...), so CPU-only tests run exactly the code a GPU machine runs, fed with data.
Only `discover_devices` touches torch, /proc and nvidia-smi.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


class CudaProperties(Protocol):
    """The fields of `torch.cuda.get_device_properties(i)` the agent uses."""

    @property
    def name(self) -> str: ...

    @property
    def total_memory(self) -> int: ...

    @property
    def major(self) -> int: ...

    @property
    def minor(self) -> int: ...


@dataclass(frozen=True)
class Discovered:
    """What discovery found: every device to register, and the one the agent trains on."""

    devices: list[common_pb2.Device]
    selected: common_pb2.Device
    torch_device: str  # "cpu" or "cuda:N", as torch.device() accepts it


class DeviceError(ValueError):
    """The requested device does not exist on this machine."""


# -- pure mapping ---------------------------------------------------------------------------------


def cpu_model_name(cpuinfo: str | None, fallback: str = "") -> str:
    """The CPU model from /proc/cpuinfo text ("model name", or "Hardware"/"Processor" on ARM)."""
    if cpuinfo:
        for key in ("model name", "hardware", "processor", "cpu model"):
            for line in cpuinfo.splitlines():
                name, sep, value = line.partition(":")
                if sep and name.strip().lower() == key and value.strip():
                    value = value.strip()
                    if key == "processor" and value.isdigit():
                        continue  # x86 "processor : 0" is an index, not a name
                    return " ".join(value.split())
    return fallback.strip() or "cpu"


def cpu_device(name: str, cores: int, memory_bytes: int) -> common_pb2.Device:
    return common_pb2.Device(
        kind="cpu",
        index=0,
        name=name,
        total_memory_bytes=int(memory_bytes),
        cores=int(cores),
    )


def format_driver(driver_version: str | None, runtime_version: str | None) -> str:
    """E.g. "driver 550.54.15, CUDA 12.4"; whichever part is unknown is left out."""
    parts = []
    if driver_version:
        parts.append(f"driver {driver_version}")
    if runtime_version:
        parts.append(f"CUDA {runtime_version}")
    return ", ".join(parts)


def cuda_device(index: int, props: CudaProperties, driver: str) -> common_pb2.Device:
    return common_pb2.Device(
        kind="cuda",
        index=int(index),
        name=str(props.name),
        total_memory_bytes=int(props.total_memory),
        compute_capability=f"{props.major}.{props.minor}",
        driver=driver,
    )


def select_device(spec: str, cuda_count: int) -> str:
    """The torch device string for `--device` given how many GPUs are visible.

    auto -> cuda:0 when a GPU is visible, else cpu; cuda:N must name a visible GPU.
    """
    if spec == "auto":
        return "cuda:0" if cuda_count > 0 else "cpu"
    if spec == "cpu":
        return "cpu"
    if spec.startswith("cuda:"):
        try:
            index = int(spec.removeprefix("cuda:"))
        except ValueError:
            raise DeviceError(f"bad device {spec!r}: expected cuda:N") from None
        if cuda_count == 0:
            raise DeviceError(f"--device {spec}: CUDA is not available on this machine")
        if not 0 <= index < cuda_count:
            raise DeviceError(
                f"--device {spec}: only {cuda_count} GPU(s) visible (cuda:0..cuda:{cuda_count - 1})"
            )
        return spec
    raise DeviceError(f"bad device {spec!r}: expected auto, cpu or cuda:N")


def assemble(spec: str, cpu: common_pb2.Device, gpus: list[common_pb2.Device]) -> Discovered:
    """Choose the registered devices and the training device from what was found.

    Training on a GPU registers every GPU; training on the CPU (no GPU, or --device cpu)
    registers the CPU only, so the scheduler never counts a GPU the agent will not use.
    """
    torch_device = select_device(spec, len(gpus))
    if torch_device == "cpu":
        return Discovered(devices=[cpu], selected=cpu, torch_device="cpu")
    index = int(torch_device.removeprefix("cuda:"))
    selected = next(d for d in gpus if d.index == index)
    return Discovered(devices=list(gpus), selected=selected, torch_device=torch_device)


# -- probing this machine -------------------------------------------------------------------------


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def discover_cpu() -> common_pb2.Device:
    try:
        cpuinfo: str | None = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = None
    name = cpu_model_name(cpuinfo, fallback=platform.processor() or platform.machine())
    return cpu_device(name, usable_cores(), psutil.virtual_memory().total)


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, when it is installed (None otherwise)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %s", exc)
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def discover_cuda(torch: Any) -> list[common_pb2.Device]:
    """Every visible GPU; [] on a CPU-only build or machine."""
    try:
        if not torch.cuda.is_available():
            return []
        count = int(torch.cuda.device_count())
    except Exception as exc:  # a broken driver must not stop a CPU agent
        log.warning("CUDA unavailable: %s", exc)
        return []
    driver = format_driver(nvidia_driver_version(), getattr(torch.version, "cuda", None))
    return [cuda_device(i, torch.cuda.get_device_properties(i), driver) for i in range(count)]


def discover_devices(spec: str) -> Discovered:
    """Probe this machine and apply `--device`. Raises DeviceError for an impossible request."""
    import torch

    gpus = discover_cuda(torch) if spec != "cpu" else []
    return assemble(spec, discover_cpu(), gpus)
