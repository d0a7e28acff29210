"""Where the coordinator is: the CLI's address resolution and its config file.

Resolution order (the first that is set wins):

1. ``--coordinator HOST:PORT`` on the command line;
2. the ``EPOCHMESH_COORDINATOR`` environment variable;
3. ``coordinator = "HOST:PORT"`` in the config file
   ``$XDG_CONFIG_HOME/epochmesh/config.toml`` (``~/.config/epochmesh/config.toml`` when
   ``XDG_CONFIG_HOME`` is unset or empty);
4. ``127.0.0.1:7070``.

Each may name several coordinators, ``HOST:PORT,HOST:PORT`` (an active one and its standbys on
one database): the CLI then asks each one's health and talks to the one that serves
(`epochmesh.coordinators`).

Credentials: ``epochmesh login --token T`` stores ``ca.pem``, ``cert.pem`` and ``key.pem``
(0600) in ``$XDG_CONFIG_HOME/epochmesh/credentials/`` and the coordinator's address in the
config file; every later command uses them (`load_credentials`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from client.rpc import CliError, ExitCode
from epochmesh.coordinators import AddressError, parse_addresses
from epochmesh.fsutil import write_private
from epochmesh.identity import Identity, IdentityError

DEFAULT_COORDINATOR = "127.0.0.1:7070"
ENV_COORDINATOR = "EPOCHMESH_COORDINATOR"
CONFIG_KEYS = ("coordinator",)


@dataclass(frozen=True)
class ResolvedAddress:
    address: str  # the coordinator to talk to: the first address until the active one is known
    source: str  # "--coordinator", "EPOCHMESH_COORDINATOR", the config file's path, or "default"
    addresses: tuple[str, ...] = ()  # every address given (one or more)

    @property
    def every(self) -> tuple[str, ...]:
        return self.addresses or (self.address,)

    @property
    def listed(self) -> str:
        """The addresses as given, for messages and the config file."""
        return ",".join(self.every)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The CLI's config file, following the XDG base directory rules."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "epochmesh" / "config.toml"


def credentials_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where ``epochmesh login`` keeps the user's certificate, key and the coordinator's CA."""
    return config_path(env).parent / "credentials"


def load_credentials(env: Mapping[str, str] | None = None) -> Identity | None:
    """The stored identity, or None when not logged in."""
    directory = credentials_dir(env)
    if not Identity.exists(directory):
        return None
    try:
        return Identity.load(directory)
    except IdentityError as err:
        raise CliError(
            ExitCode.AUTH, f"cannot read credentials: {err}", "log in again: epochmesh login"
        ) from None


def save_login(identity: Identity, address: str, env: Mapping[str, str] | None = None) -> Path:
    """Store credentials (0600) and remember ``address`` (one or a comma-separated list) in the
    config file."""
    directory = credentials_dir(env)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    identity.save(directory)
    path = config_path(env)
    write_private(path, f'coordinator = "{address}"\n'.encode(), mode=0o644)
    return directory


def load_config(path: Path) -> dict[str, object]:
    """Reads the config file; a missing file is an empty config, a broken one a usage error."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise CliError(ExitCode.USAGE, f"cannot read config file {path}: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CliError(
            ExitCode.USAGE,
            f"config file {path} is not valid TOML: {err}",
            f'fix it or remove it; it holds e.g. coordinator = "{DEFAULT_COORDINATOR}"',
        ) from None
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise CliError(
            ExitCode.USAGE,
            f"config file {path}: unknown key {unknown[0]!r}",
            f"known keys: {', '.join(CONFIG_KEYS)}",
        )
    return data


def validate_addresses(text: str, source: str) -> tuple[str, ...]:
    """Checks ``HOST:PORT[,HOST:PORT...]``; returns the addresses in order."""
    try:
        return parse_addresses(text)
    except AddressError as err:
        raise CliError(
            ExitCode.USAGE,
            f"{err} (from {source})",
            "write it as HOST:PORT, e.g. 127.0.0.1:7070, or several as HOST:PORT,HOST:PORT",
        ) from None


def _resolved(text: str, source: str) -> ResolvedAddress:
    addresses = validate_addresses(text, source)
    return ResolvedAddress(addresses[0], source, addresses)


def resolve_coordinator(flag: str | None, env: Mapping[str, str] | None = None) -> ResolvedAddress:
    """Applies the resolution order above and validates the winner."""
    env = os.environ if env is None else env
    if flag:
        return _resolved(flag, "--coordinator")
    from_env = env.get(ENV_COORDINATOR, "").strip()
    if from_env:
        return _resolved(from_env, ENV_COORDINATOR)
    path = config_path(env)
    config = load_config(path)
    value = config.get("coordinator")
    if value is not None:
        if not isinstance(value, str):
            raise CliError(
                ExitCode.USAGE,
                f"config file {path}: coordinator must be a string",
                f'write e.g. coordinator = "{DEFAULT_COORDINATOR}"',
            )
        return _resolved(value, str(path))
    return ResolvedAddress(DEFAULT_COORDINATOR, "default")
