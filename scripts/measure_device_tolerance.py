"""How far a gradient computed on one device is from the same gradient computed on another.

Verification by recomputation (issue 20) compares a node's gradient with another node's
recomputation of it, within a tolerance that must be measured for each pair of devices, not
guessed. For three models (the tests' MLP, the benchmark's conv net, the demo's transformer),
each of `--batches` random micro-batches at `--batch` samples: loss and gradient in float32 on
the CPU and on each CUDA device (with torch's default TF32 setting for convolutions and with
TF32 off), and the same device twice. Per pair: the largest relative L2 distance between the
two gradients (|g1 - g2| / |g1|), the smallest cosine similarity, the largest relative loss
difference. One JSON line (`--out FILE` also writes it there).

`--local-steps K` measures what a local SGD check compares instead: from the same parameters
and inner optimizer state (after a few warm-up steps, so that momentum and AdamW's moments are
not zero), K inner steps on K micro-batches on each device, with SGD (momentum 0.9) and with
AdamW; per pair the largest relative L2 distance between the parameter differences
(start - end), as "<model>/<optimizer>".

    .venv/bin/python scripts/measure_device_tolerance.py     # CPU only: CPU vs CPU (also at 1
                                                              # thread against all of them)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def mlp() -> tuple[nn.Module, Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)
    )
    return model, lambda n, g: (
        torch.randn(n, 32, generator=g),
        torch.randint(0, 10, (n,), generator=g),
    )


def conv() -> tuple[nn.Module, Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.Tanh(), nn.Conv2d(32, 64, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 8),
    )  # fmt: skip
    return model, lambda n, g: (
        torch.randn(n, 1, 24, 24, generator=g),
        torch.randint(0, 8, (n,), generator=g),
    )


def transformer() -> tuple[
    nn.Module, Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
]:
    spec = importlib.util.spec_from_file_location("zen_model", ROOT / "examples/zen/model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    ctx = module.CONTEXT
    return module.make_model(), lambda n, g: (
        torch.randint(0, module.VOCAB, (n, ctx), generator=g),
        torch.randint(0, module.VOCAB, (n, ctx), generator=g),
    )


MODELS = {"mlp": mlp, "conv": conv, "transformer": transformer}


def gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str
) -> tuple[float, torch.Tensor]:
    """Loss and the flattened float64 gradient of a copy of `model` on `device`."""
    m = model.to(device)  # the same parameters: moved there, then back
    m.zero_grad()
    out = m(x.to(device))
    loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.to(device).reshape(-1))
    loss.backward()
    flat = torch.cat([p.grad.detach().reshape(-1).double().cpu() for p in m.parameters()])
    m.to("cpu")
    return float(loss.detach()), flat


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
WARMUP_STEPS = 3


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    out = model(x)
    loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.detach())


def warmed(
    model: nn.Module, optimizer: str, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[nn.Module, dict]:
    """A copy of ``model`` after WARMUP_STEPS steps on the CPU, and its optimizer's state."""
    m = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](m.parameters())
    for x, y in batches:
        _step(m, opt, x, y)
    return m, copy.deepcopy(opt.state_dict())


def local_delta(
    model: nn.Module,
    optimizer: str,
    state: dict,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: str,
) -> tuple[float, torch.Tensor]:
    """Mean loss and start - end (float64, flattened) of ``len(batches)`` inner steps on
    ``device`` from ``model`` and optimizer ``state``."""
    m = copy.deepcopy(model).to(device)
    opt = OPTIMIZERS[optimizer](m.parameters())
    opt.load_state_dict(copy.deepcopy(state))  # moved to the parameters' device
    start = flat_params(m)
    losses = [_step(m, opt, x.to(device), y.to(device)) for x, y in batches]
    return sum(losses) / len(losses), start - flat_params(m)


def measure_local(args: argparse.Namespace, cudas: list[str]) -> dict[str, object]:
    """The --local-steps figures, per model and inner optimizer."""
    out: dict[str, object] = {}
    tf32_default = torch.backends.cudnn.allow_tf32
    for name, make in MODELS.items():
        model, data = make()
        for optimizer in OPTIMIZERS:
            g = torch.Generator().manual_seed(1)
            pairs: dict[str, list[dict[str, float]]] = {}
            for _ in range(args.batches):
                warm = [data(args.batch, g) for _ in range(WARMUP_STEPS)]
                start, state = warmed(model, optimizer, warm)
                steps = [data(args.batch, g) for _ in range(args.local_steps)]
                cpu = local_delta(start, optimizer, state, steps, "cpu")
                again = local_delta(start, optimizer, state, steps, "cpu")
                pairs.setdefault("cpu_vs_cpu", []).append(compare(cpu, again))
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                one = local_delta(start, optimizer, state, steps, "cpu")
                torch.set_num_threads(threads)
                pairs.setdefault("cpu_1_thread_vs_cpu", []).append(compare(cpu, one))
                for dev in cudas:
                    torch.backends.cudnn.allow_tf32 = tf32_default
                    default = local_delta(start, optimizer, state, steps, dev)
                    pairs.setdefault("cpu_vs_cuda", []).append(compare(cpu, default))
                    pairs.setdefault("cuda_vs_cuda", []).append(
                        compare(default, local_delta(start, optimizer, state, steps, dev))
                    )
            out[f"{name}/{optimizer}"] = {k: worst(v) for k, v in pairs.items()}
    return out


def compare(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> dict[str, float]:
    (la, ga), (lb, gb) = a, b
    norm = float(ga.norm())
    return {
        "rel_l2": float((ga - gb).norm()) / norm if norm else 0.0,
        "cosine": float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)),
        "rel_loss": abs(la - lb) / abs(la) if la else 0.0,
    }


def worst(rows: list[dict[str, float]]) -> dict[str, float]:
    return {
        "max_rel_l2": max(r["rel_l2"] for r in rows),
        "min_cosine": min(r["cosine"] for r in rows),
        "max_rel_loss": max(r["rel_loss"] for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--local-steps",
        type=int,
        default=0,
        help="measure local SGD chunks of this many inner steps instead of single gradients",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cudas = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    result: dict[str, object] = {
        "torch": torch.__version__,
        "devices": ["cpu", *(torch.cuda.get_device_name(d) for d in cudas)],
        "batch": args.batch,
        "batches": args.batches,
        "models": {},
    }
    if args.local_steps > 0:
        result["local_steps"] = args.local_steps
        result["models"] = measure_local(args, cudas)
    tf32_default = torch.backends.cudnn.allow_tf32
    for name, make in MODELS.items() if args.local_steps <= 0 else ():
        model, data = make()
        g = torch.Generator().manual_seed(1)
        pairs: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.batches):
            x, y = data(args.batch, g)
            cpu = gradient(model, x, y, "cpu")
            pairs.setdefault("cpu_vs_cpu", []).append(compare(cpu, gradient(model, x, y, "cpu")))
            # Agents run with different thread counts (--threads): 1 thread against the many.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            one = gradient(model, x, y, "cpu")
            torch.set_num_threads(threads)
            pairs.setdefault("cpu_1_thread_vs_cpu", []).append(compare(cpu, one))
            for dev in cudas:
                torch.backends.cudnn.allow_tf32 = tf32_default
                torch.backends.cuda.matmul.allow_tf32 = False  # torch's default
                default = gradient(model, x, y, dev)
                pairs.setdefault("cpu_vs_cuda", []).append(compare(cpu, default))
                pairs.setdefault("cuda_vs_cuda", []).append(
                    compare(default, gradient(model, x, y, dev))
                )
                torch.backends.cudnn.allow_tf32 = False
                strict = gradient(model, x, y, dev)
                pairs.setdefault("cpu_vs_cuda_no_tf32", []).append(compare(cpu, strict))
                torch.backends.cudnn.allow_tf32 = tf32_default
        result["models"][name] = {k: worst(v) for k, v in pairs.items()}  # type: ignore[index]
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return (
        0
        if all(
            math.isfinite(v)
            for m in result["models"].values()
            for p in m.values()
            for v in p.values()  # type: ignore[union-attr]
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
