"""A small MLP that tells two interleaved spirals apart: the quick-start example.

This file runs on the submitter's machine only: `epochmesh submit` calls make_model(), exports
the model and its loss with torch.export, and uploads the exported program. Donors never run it.
"""

from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 2),
    )
