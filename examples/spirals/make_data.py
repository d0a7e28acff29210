"""Write train.safetensors beside this file: 1536 points on two interleaved spirals.

x: float32 (N, 2) coordinates, y: int64 (N,) the spiral each point lies on. The points are the
same on every run (a fixed seed). Usage: python make_data.py [OUT.safetensors]
"""

import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SAMPLES = 1536


def spirals(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    t = torch.rand(n, generator=g) * 2 * math.pi + 0.5
    angle = t + math.pi * y
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (2 * math.pi)
    x = x + 0.02 * torch.randn(n, 2, generator=g)
    return x.float(), y.long()


def main(out: Path) -> None:
    x, y = spirals(SAMPLES)
    save_file({"x": x, "y": y}, str(out))
    sys.stderr.write(f"wrote {out}: {SAMPLES} samples\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("train.safetensors"))
