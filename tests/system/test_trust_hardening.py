"""Trust settings through the real console scripts: `epochmesh-coordinator token create`
refuses a node token for more than one enrollment without a donor (a Sybil factory), and a
data dir made before the first start (0755, files 0644 inside) is made private at start."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.procs import console_script, start_coordinator

pytestmark = pytest.mark.timeout(120)


def token_create(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(console_script("epochmesh-coordinator")), "token", "create", "--data-dir", str(data)]
        + list(args),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_a_many_use_node_token_needs_a_donor(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    for extra in (["--reusable"], ["--uses", "3"]):
        result = token_create(data, "--role", "node", *extra)
        assert result.returncode != 0, result.stdout
        assert result.stdout == ""  # no token printed
        assert "needs --donor NAME" in result.stderr, result.stderr
        assert extra[0] in result.stderr and "Traceback" not in result.stderr
    # With a donor, or for one enrollment, or for users: a token.
    for args in (
        ["--role", "node", "--reusable", "--donor", "alice"],
        ["--role", "node", "--uses", "3", "--donor", "alice"],
        ["--role", "node"],
        ["--role", "node", "--uses", "1"],
        ["--role", "submitter", "--reusable"],
    ):
        result = token_create(data, *args)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stdout.startswith("emt1."), args


# Public by design, in the private data dir: the certificates, the coordinator's addresses and
# its lock (its pid). Everything else must be the coordinator user's alone.
PUBLIC = {"ca.pem", "server.pem", "coordinator.addr", "http.addr", "coordinator.lock"}


def open_files(data: Path) -> list[str]:
    """Files and directories under ``data`` that others may read or enter (`PUBLIC`
    aside)."""
    found = []
    for root, dirs, files in os.walk(data):
        for name in dirs + files:
            path = Path(root, name)
            if (Path(root) == data and name in PUBLIC) or path.is_symlink():
                continue
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                found.append(f"{path.relative_to(data)} {stat.S_IMODE(path.stat().st_mode):o}")
    return found


def test_a_data_dir_made_before_the_first_start_is_made_private(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)  # whatever the umask
    with start_coordinator(data) as coord:
        assert coord.address
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert stat.S_IMODE((data / "coordinator.db").stat().st_mode) == 0o600
        assert open_files(data) == []
    # A data dir of an older version: everything readable by others, blobs included.
    (data / "blobs" / "ab").mkdir(parents=True, exist_ok=True)
    (data / "blobs" / "ab" / "stray").write_bytes(b"x")
    for root, dirs, files in os.walk(data):
        for name in dirs:
            os.chmod(Path(root, name), 0o755)
        for name in files:
            os.chmod(Path(root, name), 0o644)
    os.chmod(data, 0o755)
    assert open_files(data)
    with start_coordinator(data) as coord:
        assert coord.address
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert open_files(data) == []
        assert stat.S_IMODE((data / "blobs" / "ab" / "stray").stat().st_mode) == 0o600
