"""``epochmesh``: the command line for job submitters and cluster operators.

``main()`` is the console script. It parses the arguments, resolves the coordinator address
(``client.config``), runs the command and turns every failure into a one-line ``error:``
message (plus a ``hint:``) and a stable exit code (``client.rpc.ExitCode``); ``--debug``
adds the traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence

from epochmesh.grpc_logs import grpc_imported, quiet_grpc_core


def quiet_grpc_logs(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Silences gRPC's own C-core log lines (e.g. a TLS handshake failure's
    ``ssl_transport_security.cc`` line) unless ``--debug`` is among the arguments: the CLI
    explains failures in its own words (`epochmesh.grpc_logs.quiet_grpc_core`, as the
    coordinator and the agent do)."""
    quiet_grpc_core("--debug" in argv, environ)


if not grpc_imported():  # the console script: nothing has imported gRPC yet
    quiet_grpc_logs(sys.argv[1:], os.environ)

# ruff: noqa: E402 - gRPC is imported once its verbosity is set (above)
import argparse
import importlib.metadata
import logging
import re
import traceback
from typing import NoReturn

import grpc

from client.commands import (
    auth,
    blobs,
    cluster,
    jobs,
    market,
    market_offers,
    nodes,
    queue,
    submit,
    watch,
)
from client.commands.context import Context
from client.commands.output import closest
from client.config import DEFAULT_COORDINATOR, ENV_COORDINATOR, resolve_coordinator
from client.render import disable_color
from client.rpc import EXIT_CODES_HELP, CliError, ExitCode, error_from_rpc

log = logging.getLogger("epochmesh")

EPILOG = f"""\
the coordinator's address comes from, in order: --coordinator HOST:PORT, the
{ENV_COORDINATOR} environment variable, `coordinator = "HOST:PORT"` in
$XDG_CONFIG_HOME/epochmesh/config.toml (~/.config/epochmesh/config.toml),
else {DEFAULT_COORDINATOR}. Several coordinators sharing one database (an active one and
standbys) are given as HOST:PORT,HOST:PORT: the CLI talks to the one whose health serves.

credentials: `epochmesh login --token TOKEN` enrolls (TLS, a key made here) and
stores the certificate under $XDG_CONFIG_HOME/epochmesh/credentials; every
command then uses it. --insecure talks plaintext to an --insecure coordinator.

output: data goes to stdout, progress and messages to stderr. --output json prints
one JSON document (status, nodes, stats, allocation, ...) or JSON lines, one object
per line (rounds, events, logs, watch). NO_COLOR disables colors.

{EXIT_CODES_HELP}
"""

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class _Parser(argparse.ArgumentParser):
    """argparse with a closest-match suggestion for a mistyped command or choice."""

    def error(self, message: str) -> NoReturn:
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            close = closest(match.group(1), choices)
            if close:
                message += f"; did you mean {close!r}?"
        self.print_usage(sys.stderr)
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\n")


def _version() -> str:
    try:
        return importlib.metadata.version("epochmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epochmesh",
        description="Submit training jobs to an epochmesh coordinator and operate its cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_shared_options(parser, top=True)
    parser.add_argument("--version", action="version", version=f"epochmesh {_version()}")

    # The shared options again on every command, so they may come after its name too. SUPPRESS
    # keeps a value given before the command from being reset by the subcommand's default.
    common = argparse.ArgumentParser(add_help=False)
    add_shared_options(common, top=False)

    sub: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser
    )
    submit.register(sub, [common])
    jobs.register(sub, [common])
    watch.register(sub, [common])
    nodes.register(sub, [common])
    cluster.register(sub, [common])
    queue.register(sub, [common])
    auth.register(sub, [common])
    market.register(sub, [common])
    market_offers.register(sub, [common])
    blobs.register(sub, [common])
    _share_everywhere(parser)
    return parser


def add_shared_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command accepts, before or after its name: with ``top`` (the
    ``epochmesh`` parser itself) their defaults, else none (argparse.SUPPRESS)."""

    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--output",
        choices=("table", "json"),
        default=default("table"),
        help="output format: human-readable table (default) or json",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=default(None),
        help=f"coordinator address, or several as HOST:PORT,HOST:PORT (an active coordinator "
        f"and its standbys) (default: ${ENV_COORDINATOR}, config file, {DEFAULT_COORDINATOR})",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="debug logs, gRPC's own log lines and tracebacks",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=default(False),
        help="plaintext gRPC without credentials (for an --insecure coordinator)",
    )
    parser.add_argument(
        "--no-color", action="store_true", default=default(False), help="never use colors"
    )


SHARED_OPTIONS = ("--output", "--coordinator", "--debug", "--insecure", "--no-color")


def subparsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of ``parser``'s commands (one level)."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if child not in found:
                    found.append(child)
    return found


def _share_everywhere(parser: argparse.ArgumentParser) -> None:
    """Gives every command parser below ``parser`` the shared options it lacks (a group such
    as ``credits`` or ``tenant`` registers without them)."""
    for child in subparsers_of(parser):
        if not any(o in child._option_string_actions for o in SHARED_OPTIONS):
            add_shared_options(child, top=False)
        _share_everywhere(child)


def _print_error(err: CliError) -> None:
    sys.stderr.write(f"error: {err.message}\n")
    if err.hint:
        sys.stderr.write(f"hint: {err.hint}\n")
    sys.stderr.flush()


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="epochmesh: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    if args.no_color:
        disable_color()
    if not args.command:
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    ctx: Context | None = None
    try:
        address = resolve_coordinator(args.coordinator)
        ctx = Context(args=args, address=address)
        log.debug("coordinator %s (from %s)", address.address, address.source)
        return int(args.func(ctx))
    except CliError as err:
        if args.debug:
            traceback.print_exc()
        _print_error(err)
        return err.code
    except grpc.RpcError as err:  # a call that escaped the wrappers
        if args.debug:
            traceback.print_exc()
        where = ctx.address.address if ctx else "?"
        mapped = error_from_rpc(err, args.command, where)
        _print_error(mapped)
        return mapped.code
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`epochmesh events | head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return ExitCode.OK
    except Exception as err:  # noqa: BLE001 - the last line of defence: no tracebacks
        if args.debug:
            traceback.print_exc()
        _print_error(
            CliError(
                ExitCode.INTERNAL,
                f"internal error: {type(err).__name__}: {err}",
                "run again with --debug for the traceback, and report it",
            )
        )
        return ExitCode.INTERNAL
    finally:
        if ctx is not None:
            ctx.close()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
