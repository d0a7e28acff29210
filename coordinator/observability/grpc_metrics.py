"""gRPC server metrics through one server interceptor: calls by method and status code,
latency per method, and message bytes received and sent per method (counted where grpc
deserializes requests and serializes responses, so a stream's every message counts).

Only methods that have a handler get a label (an unknown method is counted as
``method="unknown"``): a caller cannot grow the label set.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# The methods whose bytes are the training updates: received from nodes, and parameters sent.
UPDATE_IN_METHODS = frozenset({"/epochmesh.v1.AgentService/PushUpdate"})
UPDATE_OUT_METHODS = frozenset(
    {"/epochmesh.v1.AgentService/PullParameters", "/epochmesh.v1.AgentService/NextTask"}
)


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status a call ended with: the code the handler set or aborted with, else OK for a
    normal return, CANCELLED for a cancelled call and UNKNOWN for an escaped exception."""
    code = context.code()
    name: str
    if isinstance(code, grpc.StatusCode):
        name = code.name
        return name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                name = status.name
                return name
    if exc is None:
        return "OK"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


# grpc ships no types: its interceptor base is Any to mypy.
class GrpcMetrics(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The interceptor and the metrics it keeps (registered in ``registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "epochmesh_grpc_calls",
            "gRPC calls handled, by method and status code",
            ("method", "code"),
            registry=registry,
        )
        self.latency = Histogram(
            "epochmesh_grpc_call_seconds",
            "Time from a call's start to its end (a stream: its whole life), by method",
            ("method",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.received = Counter(
            "epochmesh_grpc_received_bytes",
            "Bytes of request messages received, by method",
            ("method",),
            registry=registry,
        )
        self.sent = Counter(
            "epochmesh_grpc_sent_bytes",
            "Bytes of response messages sent, by method",
            ("method",),
            registry=registry,
        )
        self.update_bytes = Counter(
            "epochmesh_update_bytes",
            "Training update bytes: in = nodes' updates (PushUpdate), out = parameters and "
            "tasks sent to nodes (PullParameters, NextTask)",
            ("direction",),
            registry=registry,
        )
        self._unknown = self.calls.labels("unknown", "UNIMPLEMENTED")
        # method -> (the handler it wrapped, the wrapped handler): the services' handlers are
        # made once, so each method is wrapped once and a call costs a lookup, not new
        # closures and label lookups.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            self._unknown.inc()
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _counting(self, method: str) -> tuple[Callable[[int], None], Callable[[int], None]]:
        received, sent = self.received.labels(method), self.sent.labels(method)
        upd_in = self.update_bytes.labels("in") if method in UPDATE_IN_METHODS else None
        upd_out = self.update_bytes.labels("out") if method in UPDATE_OUT_METHODS else None

        def on_in(n: int) -> None:
            received.inc(n)
            if upd_in is not None:
                upd_in.inc(n)

        def on_out(n: int) -> None:
            sent.inc(n)
            if upd_out is not None:
                upd_out.inc(n)

        return on_in, on_out

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        on_in, on_out = self._counting(method)
        deserialize = handler.request_deserializer
        serialize = handler.response_serializer

        def request_deserializer(data: bytes) -> Any:
            on_in(len(data))
            return deserialize(data) if deserialize is not None else data

        def response_serializer(message: Any) -> bytes:
            data = serialize(message) if serialize is not None else message
            on_out(len(data))
            return bytes(data)

        latency = self.latency.labels(method)
        calls = self.calls
        by_code: dict[str, Any] = {}  # status code -> this method's counter for it

        def done(
            context: grpc.aio.ServicerContext, start: float, exc: BaseException | None
        ) -> None:
            latency.observe(time.perf_counter() - start)
            code = _code_of(context, exc)
            counter = by_code.get(code)
            if counter is None:
                counter = by_code[code] = calls.labels(method, code)
            counter.inc()

        kwargs = {
            "request_deserializer": request_deserializer,
            "response_serializer": response_serializer,
        }
        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    response = await inner(request, context)
                except BaseException as exc:
                    done(context, start, exc)
                    raise
                done(context, start, None)
                return response

            if handler.unary_unary is not None:
                return grpc.unary_unary_rpc_method_handler(unary_response, **kwargs)
            return grpc.stream_unary_rpc_method_handler(unary_response, **kwargs)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream_response(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                produced = inner_stream(request, context)
                if inspect.isasyncgen(produced) or hasattr(produced, "__aiter__"):
                    async for response in produced:
                        yield response
                else:  # a handler that writes with context.write() and returns
                    await produced
            except BaseException as exc:
                done(context, start, exc)
                raise
            done(context, start, None)

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(stream_response, **kwargs)
        return grpc.stream_stream_rpc_method_handler(stream_response, **kwargs)
