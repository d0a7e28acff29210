"""The gRPC wiring of the coordinator's services: wrapped method handlers and their registration.

Every RPC handler is wrapped (`service_handlers`): a request that does not parse is answered
INVALID_ARGUMENT; a `CoordinatorError` becomes its status code with its message; the shared
library's input errors (epochmesh.errors SpecError, CodecError, ProgramError) become
INVALID_ARGUMENT; any other exception is logged and answered INTERNAL — the server keeps
serving. With an `Authorizer`, each call is authenticated and role-checked first
(coordinator/trust/auth.py), and the caller's principal is set for the handler's task
(coordinator/core/principal.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from coordinator.core.errors import CoordinatorError, InvalidArgumentError
from coordinator.core.principal import set_principal
from coordinator.trust.auth import Authorizer
from epochmesh.errors import CodecError, ProgramError, SpecError
from epochmesh.v1 import agent_pb2, identity_pb2, job_pb2, market_pb2, scheduler_pb2

log = logging.getLogger(__name__)

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
JOB_SERVICE = job_pb2.DESCRIPTOR.services_by_name["JobService"]
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"]
MARKET_SERVICE = market_pb2.DESCRIPTOR.services_by_name["MarketService"]
IDENTITY_SERVICE = identity_pb2.DESCRIPTOR.services_by_name["IdentityService"]
# The identity service last: a coordinator without TLS does not serve it.
SERVICE_NAMES = tuple(
    s.full_name
    for s in (AGENT_SERVICE, JOB_SERVICE, SCHEDULER_SERVICE, MARKET_SERVICE, IDENTITY_SERVICE)
)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# -- handler wrapping -------------------------------------------------------------------------

# Errors of the shared library that mean "the caller sent bad data".
INPUT_ERRORS = (SpecError, CodecError, ProgramError)


class _Malformed:
    """Stands in for a request whose bytes are not a valid message of the expected type."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def exception(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"malformed {self.type_name} message: {self.error}")


def _deserializer(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            return _Malformed(cls.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


async def _abort_for(exc: Exception, ctx: grpc.aio.ServicerContext, method: str) -> NoReturn:
    if isinstance(exc, INPUT_ERRORS):
        log.debug("%s -> INVALID_ARGUMENT: %s", method, exc)
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, CoordinatorError):
        code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed: %s", method, exc)
        else:
            log.debug("%s -> %s: %s", method, code.name, exc)
        await ctx.abort(code, str(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await ctx.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"
    )
    raise AssertionError("unreachable: abort raises")


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise request.exception()
        yield request


def _wrap(
    method: str,
    fn: Callable[..., Any],
    client_stream: bool,
    server_stream: bool,
    authorizer: Authorizer | None = None,
) -> Any:
    def authorize(ctx: grpc.aio.ServicerContext) -> None:
        if authorizer is not None:
            set_principal(authorizer.check(method, ctx))

    if server_stream:

        async def stream_handler(request: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                authorize(ctx)
                if client_stream:
                    request = _checked_stream(request)
                elif isinstance(request, _Malformed):
                    raise request.exception()
                async for response in fn(request, ctx):
                    yield response
            except grpc.aio.BaseError:
                raise
            except Exception as exc:
                await _abort_for(exc, ctx, method)

        return stream_handler

    async def unary_handler(request: Any, ctx: grpc.aio.ServicerContext) -> Any:
        try:
            authorize(ctx)
            if client_stream:
                request = _checked_stream(request)
            elif isinstance(request, _Malformed):
                raise request.exception()
            return await fn(request, ctx)
        except grpc.aio.BaseError:
            raise
        except Exception as exc:
            await _abort_for(exc, ctx, method)

    return unary_handler


def service_handlers(
    service: ServiceDescriptor, servicer: object, authorizer: Authorizer | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    """Method handlers for ``service`` calling ``servicer.<RpcName>(request, context)``,
    wrapped with the role check (when ``authorizer`` is given), malformed-input checks and
    error mapping."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        fn = getattr(servicer, method.name, None)
        if fn is None:
            raise TypeError(f"{type(servicer).__name__} does not implement {method.name}")
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        full = f"{service.full_name}/{method.name}"
        cs, ss = method.client_streaming, method.server_streaming
        wrapped = _wrap(full, fn, cs, ss, authorizer)
        kwargs: dict[str, Any] = {
            "request_deserializer": _deserializer(req_cls),
            "response_serializer": resp_cls.SerializeToString,
        }
        if cs and ss:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(wrapped, **kwargs)
        elif cs:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(wrapped, **kwargs)
        elif ss:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(wrapped, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(wrapped, **kwargs)
    return handlers


def add_service(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    authorizer: Authorizer | None = None,
) -> None:
    handlers = service_handlers(service, servicer, authorizer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
