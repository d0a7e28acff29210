"""A real PostgreSQL server for the tests: one per test process, one fresh database per test.

- ``pg_server`` (session fixture): finds PostgreSQL's programs (PATH, or Debian's
  /usr/lib/postgresql/<version>/bin, newest first), runs ``initdb`` in a temporary directory
  and starts ``postgres`` on a free 127.0.0.1 port with its unix socket in that directory,
  durability off (fsync, synchronous_commit: the tests kill coordinators, never the server).
  As root, the server runs as the system user ``epochmesh-pg`` (created with ``useradd
  --system`` when missing), which owns the directory: PostgreSQL refuses to run as root. It is
  stopped at the end of the session (with pytest-xdist, each worker starts its own). Where
  PostgreSQL is not installed, the tests that need it skip, saying so (scripts/test.sh
  installs it).
- ``pg_url`` (function fixture): a new empty database (``CREATE DATABASE``) and its URL,
  ``postgresql://postgres@127.0.0.1:PORT/NAME``, dropped after the test.

Import both into a test module: ``from tests.pg import pg_server, pg_url  # noqa: F401``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_USER = "epochmesh-pg"
SUPERUSER = "postgres"
_PROGRAMS = ("initdb", "pg_ctl", "postgres", "psql")


def find_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl, postgres and psql, or None."""
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        versions = [p for p in debian.iterdir() if p.name.replace(".", "").isdigit()]
        versions.sort(key=lambda p: float(p.name), reverse=True)
        candidates.extend(p / "bin" for p in versions)
    for directory in candidates:
        if all((directory / name).exists() for name in _PROGRAMS):
            return directory
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The user the server runs as when we are root (created if missing); None otherwise."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(PG_USER)


class PgServer:
    """A throwaway PostgreSQL cluster (see the module docstring)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.user = _server_user()
        # Beside /tmp as root: the server's user must be able to reach its directory.
        base = "/tmp" if self.user is not None else None
        self.root = Path(tempfile.mkdtemp(prefix="epochmesh-pg-", dir=base))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log = self.root / "server.log"
        self.port = 0
        self._names = itertools.count(1)
        self._running = False

    def _as_server_user(self, *argv: str) -> list[str]:
        if self.user is None:
            return list(argv)
        return ["runuser", "-u", self.user.pw_name, "--", *argv]

    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._as_server_user(*argv), check=True, capture_output=True, text=True, timeout=timeout
        )

    def start(self) -> PgServer:
        self.socket_dir.mkdir()
        if self.user is not None:
            for path in (self.root, self.socket_dir):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            timeout=120,
        )
        last: subprocess.CalledProcessError | None = None
        for _ in range(3):  # a port taken between choosing it and binding it: another
            self.port = _free_port()
            options = (
                f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1"
                " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
                " -c max_connections=300 -c shared_buffers=32MB"
            )
            try:
                self._run(
                    str(self.bin_dir / "pg_ctl"),
                    "start",
                    "-w",
                    "-t",
                    "60",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    options,
                    timeout=90,
                )
            except subprocess.CalledProcessError as exc:
                last = exc
                continue
            self._running = True
            return self
        raise RuntimeError(f"PostgreSQL did not start: {last and last.stderr}\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._running:
            self._running = False
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self._run(
                    str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate"
                )
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run one statement with psql; its output (tuples only)."""
        done = subprocess.run(
            [
                str(self.bin_dir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                SUPERUSER,
                "-d",
                database,
                "-v",
                "ON_ERROR_STOP=1",
                "-qAtc",
                statement,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout

    def create_database(self) -> str:
        """A new empty database; its name."""
        name = f"t{os.getpid()}_{next(self._names)}"
        self.sql(f"CREATE DATABASE {name} TEMPLATE template0")
        return name

    def drop_database(self, name: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


_SERVER: PgServer | None = None


def shared_server() -> PgServer:
    """This process's server, started on first use (pytest.skip where PostgreSQL is missing)."""
    global _SERVER
    if _SERVER is None:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            pytest.skip(
                "PostgreSQL is not installed (no initdb/pg_ctl/postgres/psql on PATH or in "
                "/usr/lib/postgresql/*/bin): scripts/test.sh installs it with apt-get"
            )
        server = PgServer(bin_dir)
        try:
            server.start()
        except BaseException:
            server.stop()
            raise
        atexit.register(server.stop)
        _SERVER = server
    return _SERVER


def stop_shared_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    yield shared_server()
    stop_shared_server()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.create_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)
