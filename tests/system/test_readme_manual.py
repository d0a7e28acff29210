"""The README's "Your own cluster" section, run as written.

Its ```sh blocks, in order, become one bash script (``set -euo pipefail``) that runs from the
repository's root in a fresh HOME, XDG_CONFIG_HOME and XDG_CACHE_HOME, with the venv's bin
first on PATH (as ``source .venv/bin/activate`` leaves it) and the README's coordinator port
replaced by a free loopback one. A trap stops the background processes the script started.
The manual works when the script exits 0 and the model it downloaded is there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "<!-- manual-test"
SECTION = "## Your own cluster"
README_ADDRESS = "127.0.0.1:7070"

# On any exit: stop every background job the manual started and wait for it, so that no
# coordinator or agent outlives the test.
PROLOGUE = """set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true' EXIT
"""


def manual_blocks(text: str) -> list[str]:
    """The ```sh blocks of the section that follows the manual-test marker, in order."""
    start = text.index(MARKER)
    section = text[text.index(SECTION, start) :]
    following = re.search(r"^## ", section[len(SECTION) :], flags=re.M)
    if following:
        section = section[: len(SECTION) + following.start()]
    return re.findall(r"^```sh\n(.*?)^```", section, flags=re.M | re.S)


def test_the_manual_section_has_its_steps() -> None:
    blocks = manual_blocks(README.read_text())
    script = "\n".join(blocks)
    for step in (
        "epochmesh-coordinator serve",
        "token create",
        "epochmesh-agent",
        "login",
        "make_data.py",
        "epochmesh submit",
        "epochmesh watch",
        "epochmesh download",
    ):
        assert step in script, f"the manual lost its step {step!r}"
    assert README_ADDRESS in script


@pytest.mark.timeout(300)
def test_readme_manual_runs_as_written(tmp_path: Path) -> None:
    blocks = manual_blocks(README.read_text())
    address = f"127.0.0.1:{free_port()}"
    script = PROLOGUE + "\n".join(block.replace(README_ADDRESS, address) for block in blocks)
    (tmp_path / "manual.sh").write_text(script)

    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EPOCHMESH_") and k not in ("VIRTUAL_ENV", "XDG_CACHE_HOME")
    }
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CACHE_HOME=str(home / ".cache"),
        VIRTUAL_ENV=str(Path(sys.executable).parent.parent),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        NO_COLOR="1",
    )
    proc = subprocess.run(
        ["bash", str(tmp_path / "manual.sh")],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=280,
    )
    cluster = home / "epochmesh-cluster"
    logs = "".join(
        f"\n--- {log.name} (last lines) ---\n" + "\n".join(log.read_text().splitlines()[-20:])
        for log in sorted(cluster.glob("*.log"))
    )
    assert proc.returncode == 0, (
        f"the manual failed (exit {proc.returncode})\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-4000:]}{logs}"
    )
    model = cluster / "result" / "model.safetensors"
    assert model.is_file(), f"no downloaded model at {model}\n{proc.stdout[-2000:]}"
    assert load_file(str(model)), "the downloaded model holds no tensors"


def test_readme_links_resolve() -> None:
    """Every relative link of the README names a file of the repository."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if "://" not in link and not link.startswith("#")]
    assert relative, "the README links to no docs"
    missing = [link for link in relative if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, f"README links to missing files: {missing}"
