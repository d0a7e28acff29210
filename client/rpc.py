"""Talking to the coordinator from the CLI: the channel, the stubs and the error mapping.

Every failure the user can cause or meet ends as a :class:`CliError` carrying one of the stable
exit codes of :class:`ExitCode`, a one-line message and, where useful, a hint saying what to do.
``client.main`` prints those as ``error: ...`` / ``hint: ...`` on stderr, never a traceback.

gRPC status codes map to exit codes as follows:

========================================  ==========================
UNAUTHENTICATED, PERMISSION_DENIED        7 not authorized
UNAVAILABLE, DEADLINE_EXCEEDED            4 coordinator unreachable
NOT_FOUND                                 3 not found
FAILED_PRECONDITION, ALREADY_EXISTS       6 precondition
INVALID_ARGUMENT, OUT_OF_RANGE,           2 invalid input
RESOURCE_EXHAUSTED
anything else                             1 internal / unexpected
========================================  ==========================
"""

from __future__ import annotations

import enum
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from epochmesh.grpc_util import sync_channel
from epochmesh.identity import Identity, fetch_server_certificate, secure_sync_channel
from epochmesh.v1 import job_pb2_grpc, market_pb2_grpc, scheduler_pb2_grpc

log = logging.getLogger(__name__)

# How long the CLI waits for the channel to connect before it calls the coordinator unreachable.
CONNECT_TIMEOUT_S = 3.0
# How long the TLS probe after a failed connection may take (a mismatch answers at once).
PROBE_TIMEOUT_S = 2.0
# Deadline of one unary call once connected (streams have none: they last as long as the job).
CALL_TIMEOUT_S = 30.0
# Given several addresses, how long `Coordinator.follow` waits for one of them to serve after the
# active one was lost (a standby takes over within seconds), and how often it asks.
FOLLOW_TIMEOUT_S = 30.0
FOLLOW_POLL_S = 0.5
# RPCs that only read: asked again on the active coordinator after a takeover.
READ_PREFIXES = ("Get", "List", "Quote", "Watch")


class ExitCode(enum.IntEnum):
    """Stable exit codes of the ``epochmesh`` CLI (documented in ``epochmesh --help``)."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    NOT_FOUND = 3
    UNREACHABLE = 4
    JOB_FAILED = 5
    PRECONDITION = 6
    AUTH = 7
    INTERRUPTED = 130


EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    internal or unexpected error (run again with --debug for a traceback)
  2    usage error, invalid input: bad arguments, bad job spec, missing file or extra
  3    not found: unknown job or node
  4    coordinator unreachable, or it did not answer in time
  5    the job failed or was cancelled (watch, submit --watch)
  6    precondition: e.g. download before the job finished, cancel of a finished job,
       quote of a job that too few of the nodes on offer fit
  7    not authorized: not logged in (epochmesh login), wrong role, revoked, or not
       your job
  130  interrupted (Ctrl-C)"""


@dataclass
class CliError(Exception):
    """A user-facing failure: one line of message, an optional hint, and the exit code."""

    code: ExitCode
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return self.message


_STATUS_TO_EXIT: dict[grpc.StatusCode, ExitCode] = {
    grpc.StatusCode.UNAVAILABLE: ExitCode.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ExitCode.UNREACHABLE,
    grpc.StatusCode.NOT_FOUND: ExitCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ExitCode.PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS: ExitCode.PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT: ExitCode.USAGE,
    grpc.StatusCode.OUT_OF_RANGE: ExitCode.USAGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ExitCode.USAGE,
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.AUTH,
    grpc.StatusCode.PERMISSION_DENIED: ExitCode.AUTH,
}


def exit_code_for(status: grpc.StatusCode) -> ExitCode:
    return _STATUS_TO_EXIT.get(status, ExitCode.INTERNAL)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line


def error_from_rpc(err: grpc.RpcError, what: str, address: str) -> CliError:
    """Turns a failed call into a CliError with a one-line message and a hint."""
    status: grpc.StatusCode = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = _first_line(err.details() if hasattr(err, "details") else "") or status.name
    code = exit_code_for(status)
    if status == grpc.StatusCode.UNAVAILABLE:
        return CliError(
            code,
            f"lost the coordinator at {address} during {what}: {details}",
            "check that epochmesh-coordinator is running, then try again",
        )
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(
            code,
            f"the coordinator at {address} did not answer {what} in time",
            "it may be overloaded; try again",
        )
    if "http2 header" in details.lower():  # something else answers on that port
        return CliError(
            ExitCode.UNREACHABLE,
            f"the server at {address} is not an epochmesh coordinator ({details})",
            "check the address: --coordinator HOST:PORT or EPOCHMESH_COORDINATOR",
        )
    if status == grpc.StatusCode.UNIMPLEMENTED:
        return CliError(
            code,
            f"the coordinator at {address} does not support {what}: {details}",
            "upgrade or restart the coordinator with the training engine enabled",
        )
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            code,
            f"{what} refused: {details}",
            "log in again with `epochmesh login --token TOKEN` (a token from "
            "`epochmesh-coordinator token create --role submitter`)",
        )
    if status == grpc.StatusCode.PERMISSION_DENIED:
        # The coordinator says what was refused and why, in the user's words.
        return CliError(
            code, details, "`epochmesh whoami` shows who you are logged in as, and your role"
        )
    if code == ExitCode.INTERNAL:
        return CliError(
            code,
            f"{what} failed ({status.name}): {details}",
            "see the coordinator's log; run again with --debug for details",
        )
    return CliError(code, details)


def speaks_tls(address: str, timeout: float) -> bool | None:
    """Whether the server at ``address`` completes a TLS handshake (True), answers but not with
    TLS (False), or cannot be reached at all (None)."""
    try:
        fetch_server_certificate(address, timeout=timeout)
    except ssl.SSLError:
        return False
    except (OSError, ValueError):
        return None
    return True


def tls_mismatch(address: str, *, tls: bool, timeout: float) -> CliError | None:
    """After a failed connection: the error for a coordinator that runs but speaks the other
    protocol (TLS while the CLI runs --insecure, or plaintext while it uses TLS), found by a
    quick TLS probe; None when the probe finds no such mismatch."""
    answer = speaks_tls(address, timeout)
    if answer is None:
        return None
    if answer and not tls:
        return CliError(
            ExitCode.UNREACHABLE,
            f"the coordinator at {address} speaks TLS, and --insecure talks plaintext",
            "log in with a token (`epochmesh login --token TOKEN`, a token from "
            "`epochmesh-coordinator token create --role submitter`), or drop --insecure",
        )
    if not answer and tls:
        return CliError(
            ExitCode.UNREACHABLE,
            f"the coordinator at {address} speaks plaintext (it runs --insecure), and the CLI "
            "talks TLS",
            "pass --insecure to talk to it",
        )
    return None


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ServerStream(Iterator[T_co], Protocol[T_co]):
    """A server-streaming call as gRPC returns it: its messages, and `cancel()`."""

    def cancel(self) -> bool: ...


# After a failed connection attempt, how long a retry may take before we give up early.
_FAILURE_GRACE_S = 0.5


def _wait_for_ready(channel: grpc.Channel, timeout: float) -> grpc.ChannelConnectivity:
    """Waits until the channel is READY; returns early (within a short grace) when the
    connection attempt fails, e.g. connection refused, so a wrong address answers fast."""
    changed = threading.Condition()
    seen: list[grpc.ChannelConnectivity] = []

    def on_change(state: grpc.ChannelConnectivity) -> None:
        with changed:
            seen.append(state)
            changed.notify_all()

    channel.subscribe(on_change, try_to_connect=True)
    try:
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        with changed:
            while True:
                last = seen[-1] if seen else grpc.ChannelConnectivity.IDLE
                if last == grpc.ChannelConnectivity.READY:
                    return last
                now = time.monotonic()
                if last == grpc.ChannelConnectivity.TRANSIENT_FAILURE and failed_at is None:
                    failed_at = now
                if failed_at is not None and now - failed_at >= _FAILURE_GRACE_S:
                    return grpc.ChannelConnectivity.TRANSIENT_FAILURE
                if now >= deadline:
                    return last
                limit = deadline if failed_at is None else failed_at + _FAILURE_GRACE_S
                changed.wait(timeout=max(0.01, min(limit, deadline) - now))
    finally:
        channel.unsubscribe(on_change)


def find_active(
    addresses: Sequence[str], source: str, identity: Identity | None, timeout: float
) -> str:
    """The address of the serving coordinator among several (an active one and its standbys):
    each one's health is asked at once; CliError(UNREACHABLE) naming every address's answer
    when none serves."""
    from epochmesh.coordinators import find_active_sync

    def open_channel(address: str) -> grpc.Channel:
        if identity is None:
            return sync_channel(address)
        return secure_sync_channel(address, identity)

    active, probes = find_active_sync(addresses, open_channel, timeout)
    if active is not None:
        return active
    from_where = f" (addresses from {source})" if source else ""
    raise CliError(
        ExitCode.UNREACHABLE,
        f"no active coordinator among {', '.join(addresses)}{from_where}: "
        + "; ".join(p.describe() for p in probes),
        "a standby takes over within seconds when the active one is gone: try again, or check "
        "that at least one coordinator runs",
    )


class Coordinator:
    """A connected channel to the coordinator with the submitter and operator stubs.

    ``connect()`` waits at most ``connect_timeout`` seconds for the channel and raises
    ``CliError(UNREACHABLE)`` when it is not ready, so a wrong address answers within seconds.
    With ``identity`` the channel is TLS with that client certificate, else plaintext
    (``--insecure``). ``addresses``: every coordinator address given (an active one and its
    standbys), which `follow` chooses from after a lost connection.
    """

    def __init__(
        self,
        address: str,
        *,
        source: str = "",
        connect_timeout: float = CONNECT_TIMEOUT_S,
        call_timeout: float = CALL_TIMEOUT_S,
        identity: Identity | None = None,
        addresses: Sequence[str] = (),
        follow_timeout: float = FOLLOW_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.tls = identity is not None
        self.addresses = tuple(addresses) or (address,)
        self.follow_timeout = follow_timeout
        self._identity = identity
        self._open(address)

    def _open(self, address: str) -> None:
        """A new channel and stubs to ``address`` (not connected yet)."""
        identity = self._identity
        self.address = address
        self.channel: grpc.Channel = (
            sync_channel(address) if identity is None else secure_sync_channel(address, identity)
        )
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.scheduler = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.market = market_pb2_grpc.MarketServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self._connected = False

    def follow(self) -> bool:
        """After a lost connection, given several addresses: waits (``follow_timeout`` at most)
        until one of them serves, and talks to that one from now on; True when it is another
        address than before (calls are then made through a new channel). With one address,
        False at once: a retry goes to the same address. CliError(UNREACHABLE), naming every
        address's answer, when none serves in time."""
        if len(self.addresses) < 2:
            return False
        deadline = time.monotonic() + self.follow_timeout
        while True:
            try:
                active = find_active(
                    self.addresses, self.source, self._identity, self.connect_timeout
                )
                break
            except CliError:
                if time.monotonic() + FOLLOW_POLL_S >= deadline:
                    raise
                time.sleep(FOLLOW_POLL_S)
        if active == self.address:
            return False
        self.channel.close()
        self._open(active)
        self.connect()
        return True

    def connect(self) -> Coordinator:
        if self._connected:
            return self
        state = _wait_for_ready(self.channel, self.connect_timeout)
        if state != grpc.ChannelConnectivity.READY:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # it answered, or refused
                mismatch = tls_mismatch(self.address, tls=self.tls, timeout=PROBE_TIMEOUT_S)
                if mismatch is not None:
                    raise mismatch
            from_where = f" (address from {self.source})" if self.source else ""
            why = (
                "connection failed"
                if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE
                else f"no answer within {self.connect_timeout:g}s"
            )
            raise CliError(
                ExitCode.UNREACHABLE,
                f"cannot reach the coordinator at {self.address}{from_where}: {why}",
                "start it with `epochmesh-coordinator`, or point the CLI at it with "
                "--coordinator HOST:PORT or EPOCHMESH_COORDINATOR",
            )
        self._connected = True
        return self

    def call(self, what: str, method: Callable[..., T], request: Any) -> T:
        """Calls a unary method with the call deadline; failures become CliError. Given
        several addresses, a read (Get..., List..., Quote...) that finds its coordinator gone
        follows the active one (`follow`) and is asked there once more; a change is not
        repeated (it may have been applied before the connection went)."""
        self.connect()
        try:
            return method(request, timeout=self.call_timeout)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or len(self.addresses) < 2:
                raise error_from_rpc(err, what, self.address) from None
            lost = self.address
            where = self._locate(method)
            if not self.follow():
                raise error_from_rpc(err, what, self.address) from None
            log.warning("following the active coordinator at %s (was %s)", self.address, lost)
            if where is None or not where[1].startswith(READ_PREFIXES):
                raise CliError(
                    ExitCode.UNREACHABLE,
                    f"the coordinator at {lost} went away during {what}; "
                    f"{self.address} is active now",
                    "check whether it took effect there (e.g. `epochmesh jobs`), then run the "
                    "command again if it did not",
                ) from None
        again: Callable[..., T] = getattr(self._stubs()[where[0]], where[1])
        try:
            return again(request, timeout=self.call_timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err, what, self.address) from None

    def _stubs(self) -> tuple[Any, ...]:
        return (self.jobs, self.scheduler, self.market)

    def _locate(self, method: object) -> tuple[int, str] | None:
        """(which of `_stubs`, RPC name) holding ``method`` on this channel."""
        for i, stub in enumerate(self._stubs()):
            for name, value in vars(stub).items():
                if value is method:
                    return i, name
        return None

    def stream(
        self, what: str, method: Callable[..., ServerStream[T]], request: Any
    ) -> Iterator[T]:
        """Iterates a server stream (no deadline); failures become CliError."""
        self.connect()
        call = method(request)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err, what, self.address) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
