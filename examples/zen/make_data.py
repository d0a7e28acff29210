"""Write train.safetensors: every 32-character window of The Zen of Python and its next chars."""

import codecs
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CONTEXT = 32


def zen_text() -> str:
    import this  # noqa: F401  (importing prints the Zen; its text is in this.s, rot13)

    return codecs.decode(sys.modules["this"].s, "rot13")


def main(out: Path) -> None:
    text = zen_text().encode("ascii")
    data = torch.tensor(list(text), dtype=torch.long)
    n = len(data) - CONTEXT
    x = torch.stack([data[i : i + CONTEXT] for i in range(n)])
    y = torch.stack([data[i + 1 : i + CONTEXT + 1] for i in range(n)])
    save_file({"x": x, "y": y}, str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("train.safetensors"))
