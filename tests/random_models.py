"""Models whose programs draw random numbers, for the tests of seeded draws (honest randomness
must never look like cheating): `nn.Dropout`, noise from `torch.rand_like`, a feature order
from `torch.randperm`, and an uninitialised `torch.empty` buffer that reaches the loss.

- `RANDOM_CONV_MODEL`: the fault-tolerance conv net (1 x 12 x 12 inputs, 4 classes;
  tests/system/test_fault_tolerance.py `make_dataset`) with all of them;
- `RANDOM_MLP_MODEL`: the tiny MLP (16 features, 4 classes; tests/fixtures) with them.
"""

from __future__ import annotations

RANDOM_CONV_MODEL = """
import torch
from torch import nn


class Noise(nn.Module):
    \"\"\"Uniform noise (torch.rand_like) and a random order of the features (torch.randperm);
    plus an uninitialised buffer times zero, which the agents zero-fill.\"\"\"

    def forward(self, x):
        x = x + 0.05 * (torch.rand_like(x) - 0.5)
        x = x[:, torch.randperm(x.shape[1])]
        return x + 0.0 * torch.empty(x.shape[0], x.shape[1])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.Dropout(0.3),
        nn.Flatten(), Noise(), nn.Dropout(0.2), nn.Linear(16 * 12 * 12, 4),
    )
"""

RANDOM_MLP_MODEL = """
import torch
from torch import nn


class Noise(nn.Module):
    def forward(self, x):
        x = x + 0.05 * (torch.rand_like(x) - 0.5)
        x = x[:, torch.randperm(x.shape[1])]
        return x + 0.0 * torch.empty(x.shape[0], x.shape[1])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), Noise(), nn.Linear(32, 4)
    )
"""
