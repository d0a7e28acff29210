"""The built-in reference model the agent benchmarks at start (and for jobs, until a job's
exported program can be run): a small MLP classifier with an SGD step, a few milliseconds per
step on a laptop CPU at batch 256 (SGD with momentum).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

IN_FEATURES = 128
HIDDEN = 256
CLASSES = 10
LR = 0.01
MOMENTUM = 0.9


def build_reference_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a step's wall time is its compute time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_step_factory(device: str, seed: int = 0) -> Callable[[int], Callable[[], None]]:
    """A `make_step(batch_size) -> step()` for the benchmark: one forward, backward and SGD step
    of the reference model on random data of that batch size, on `device`."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_reference_model().to(dev)
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    loss_fn = nn.CrossEntropyLoss()

    def sgd_step() -> None:  # SGD with momentum, written out (no torch.optim import needed)
        with torch.no_grad():
            for p, buf in zip(params, momentum, strict=True):
                if p.grad is not None:
                    buf.mul_(MOMENTUM).add_(p.grad)
                    p.add_(buf, alpha=-LR)
                    p.grad = None

    def make_step(batch_size: int) -> Callable[[], None]:
        inputs = torch.randn(batch_size, IN_FEATURES, generator=gen).to(dev)
        targets = torch.randint(0, CLASSES, (batch_size,), generator=gen).to(dev)

        def step() -> None:
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            sgd_step()
            synchronize(dev)

        return step

    return make_step
