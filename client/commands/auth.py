"""Trust commands: ``login`` (enroll with a join token), ``whoami``, ``dashboard`` (a login URL
for the web dashboard as the stored identity), ``revoke`` (operators)."""

from __future__ import annotations

import argparse

import grpc

from client.commands.context import Context
from client.config import credentials_dir, load_credentials, save_login
from client.rpc import CliError, ExitCode, error_from_rpc
from epochmesh.identity import AUTH_MAX_SKEW_MS, IdentityError, enroll_with_token, make_login_code
from epochmesh.v1 import scheduler_pb2


def cmd_login(ctx: Context) -> int:
    if getattr(ctx.args, "insecure", False):
        raise CliError(ExitCode.USAGE, "login makes no sense with --insecure")
    # Several addresses (an active coordinator and its standbys): enroll with the first that
    # is reachable and not a standby (a standby answers UNAVAILABLE); all are remembered.
    addresses = ctx.address.every
    for i, address in enumerate(addresses):
        last = i == len(addresses) - 1
        try:
            identity = enroll_with_token(address, ctx.args.token, name=ctx.args.name or "")
        except IdentityError as err:
            raise CliError(
                ExitCode.AUTH,
                f"login refused: {err}",
                "ask the operator for a fresh token: epochmesh-coordinator token create",
            ) from None
        except ConnectionError as err:
            if not last:
                continue
            raise CliError(
                ExitCode.UNREACHABLE,
                f"cannot reach the coordinator at {address}: {err}"
                + ("" if len(addresses) == 1 else f" (nor any of {ctx.address.listed})"),
                "check the address: --coordinator HOST:PORT or EPOCHMESH_COORDINATOR",
            ) from None
        except grpc.RpcError as err:
            if not last and err.code() == grpc.StatusCode.UNAVAILABLE:
                continue
            raise error_from_rpc(err, "login", address) from None
        break
    directory = save_login(identity, ctx.address.listed)
    principal = identity.principal
    if ctx.json:
        ctx.emit_json(
            {
                "coordinator": address,
                "principal": principal.id,
                "role": principal.role,
                "credentials": str(directory),
            }
        )
    else:
        ctx.emit(f"logged in to {address} as {principal.role} {principal.id}")
        ctx.note(f"credentials stored in {directory}")
    return ExitCode.OK


def cmd_whoami(ctx: Context) -> int:
    identity = load_credentials()
    if identity is None:
        raise CliError(ExitCode.AUTH, "not logged in", "run `epochmesh login --token TOKEN` first")
    principal = identity.principal
    if ctx.json:
        ctx.emit_json({"principal": principal.id, "role": principal.role})
    else:
        ctx.emit(f"{principal.role} {principal.id} ({credentials_dir()})")
    return ExitCode.OK


DEFAULT_DASHBOARD_PORT = 7080


def dashboard_url(coordinator_address: str, url: str) -> str:
    """The dashboard's base URL: ``url`` if given, else the coordinator's host on the
    default --http-listen port."""
    if url:
        if not url.startswith(("http://", "https://")):
            raise CliError(ExitCode.USAGE, f"invalid --url {url!r}: give http://HOST:PORT")
        return url.rstrip("/")
    host = coordinator_address.rpartition(":")[0] or coordinator_address
    host = host.strip("[]")
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{DEFAULT_DASHBOARD_PORT}"


def cmd_dashboard(ctx: Context) -> int:
    identity = load_credentials()
    if identity is None:
        raise CliError(ExitCode.AUTH, "not logged in", "run `epochmesh login --token TOKEN` first")
    if len(ctx.address.every) > 1 and not ctx.args.url:
        ctx.coordinator  # noqa: B018 - finds the active coordinator among several addresses
    base = dashboard_url(ctx.address.address, ctx.args.url or "")
    code = make_login_code(identity)
    url = f"{base}/login#code={code}"
    expires = AUTH_MAX_SKEW_MS // 1000
    if ctx.json:
        ctx.emit_json({"url": url, "code": code, "expires_in_seconds": expires})
    else:
        ctx.emit(url)
        ctx.note(
            f"open it within {expires // 60} minutes to see the dashboard as "
            f"{identity.principal.role} {identity.principal.id} (it logs in once)"
        )
    return ExitCode.OK


def cmd_revoke(ctx: Context) -> int:
    ref = ctx.args.principal.strip()
    principal = ref if ref.startswith("u-") else ctx.get_node(ref).node_id
    coord = ctx.coordinator
    reply = coord.call(
        "Revoke",
        coord.scheduler.Revoke,
        scheduler_pb2.RevokeRequest(principal=principal, reason=ctx.args.reason or ""),
    )
    if ctx.json:
        ctx.emit_json({"principal": reply.principal, "already_revoked": reply.already_revoked})
    elif reply.already_revoked:
        ctx.emit(f"{reply.principal} was already revoked")
    else:
        ctx.emit(f"revoked {reply.principal}: its certificate is refused from now on")
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "login",
        parents=common,
        help="enroll with a join token and store the credentials",
        description="Enroll with a join token (epochmesh-coordinator token create --role "
        "submitter|operator): a key pair is made here, the coordinator's CA is checked "
        "against the token, and the certificate, key and CA are stored in "
        "$XDG_CONFIG_HOME/epochmesh/credentials for every later command.",
    )
    p.add_argument("--token", required=True, help="the join token")
    p.add_argument("--name", default="", help="a display name sent with the enrollment")
    p.set_defaults(func=cmd_login)

    p = sub.add_parser("whoami", parents=common, help="show the stored identity")
    p.set_defaults(func=cmd_whoami)

    p = sub.add_parser(
        "dashboard",
        parents=common,
        help="print a login URL for the web dashboard as the stored identity",
        description="Print a URL that logs the web dashboard in as the stored identity (your "
        "jobs, with your role): a one-time code signed with your key, good for five minutes.",
    )
    p.add_argument(
        "--url",
        default="",
        help="the dashboard's base URL (default: the coordinator's host, port 7080)",
    )
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser(
        "revoke",
        parents=common,
        help="refuse a node's (or user's) certificate from now on (operators)",
        description="Refuse a node's or user's certificate from now on (operators).",
    )
    p.add_argument("principal", metavar="NODE", help="node id, unique name, or user id u-...")
    p.add_argument("--reason", default="", help="recorded in the event log")
    p.set_defaults(func=cmd_revoke)
