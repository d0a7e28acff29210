"""The console scripts' help: the coordinator's top-level --help lists the server's options
(serve is the default command), and the agent answers --help without importing torch or grpc
(it parses its arguments before the heavy imports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import console_script

pytestmark = pytest.mark.timeout(60)


def test_the_coordinators_help_lists_the_serve_options() -> None:
    out = subprocess.run(
        [str(console_script("epochmesh-coordinator")), "--help"],
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--data-dir", "--listen", "--advertise", "--insecure", "--http-listen", "--debug"):
        assert flag in out.stdout, (flag, out.stdout)
    for command in ("serve", "token", "dev"):
        assert command in out.stdout


def test_serve_and_token_keep_their_own_help() -> None:
    coordinator = str(console_script("epochmesh-coordinator"))
    serve = subprocess.run(
        [coordinator, "serve", "--help"], capture_output=True, text=True, timeout=50
    )
    assert serve.returncode == 0 and "--heartbeat-interval" in serve.stdout
    token = subprocess.run(
        [coordinator, "token", "create", "--help"], capture_output=True, text=True, timeout=50
    )
    assert token.returncode == 0 and "--role" in token.stdout


def test_the_agents_help_imports_neither_torch_nor_grpc() -> None:
    probe = (
        "import sys\n"
        "from node_agent.main import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = sorted(m for m in ('torch', 'grpc', 'numpy') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "--coordinator" in out.stdout and "--debug" in out.stdout
    assert "HEAVY=\n" in out.stderr, out.stderr


def test_a_usage_error_of_the_agent_imports_no_torch() -> None:
    probe = (
        "import sys\n"
        "from node_agent.main import main\n"
        "try:\n"
        "    main(['--coordinator', '127.0.0.1:1'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 2, exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "--data-dir" in out.stderr and out.stderr.rstrip().endswith("False"), out.stderr
