"""Checkpoints: parameters + optimizer state (safetensors blob) and the ledger position.

A checkpoint is two things written in order: the tensors as a content-addressed safetensors
blob (written to a temporary file, fsynced, renamed), then a manifest row in the store that
names that blob together with the round, epoch, parameter version and ledger state, committed
in one SQLite transaction with the job record. A crash between the two leaves an unreferenced
blob, never a manifest that points at missing or half-written tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


@dataclass
class CheckpointManifest:
    round: int  # last round number applied before the checkpoint (0 = none)
    epoch: int
    params_version: int
    rounds_applied: int
    samples_done: int
    tensors_sha256: str
    ledger: dict[str, Any]
    last_loss: float = float("nan")

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, allow_nan=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> CheckpointManifest:
        return cls(**json.loads(data.decode()))


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)
