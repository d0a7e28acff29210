"""What the coordinator's gRPC server answers, active or standby.

The services are not added to the server directly: `ServingGate` is its first generic handler.
Standing by (or starting), it answers every call but grpc.health.v1 with UNAVAILABLE, details
"standby coordinator; the active coordinator is at HOST:PORT" and the trailing metadata
``epochmesh-active: HOST:PORT`` (clients holding several addresses move on to that one);
active, it hands each call to the servicer `install` gave it. Health is the caller's to set
(NOT_SERVING while standing by). One server and one port for the coordinator's whole life.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from coordinator.api.handlers import HEALTH_SERVICE, service_handlers
from coordinator.trust.auth import Authorizer

ACTIVE_METADATA_KEY = "epochmesh-active"


def standby_details(active_address: str) -> str:
    if not active_address:
        # A coordinator starting (loading its state) answers this too, as does a standby that
        # has not read the lease yet.
        return "coordinator not serving yet: starting, or a standby with no active one known"
    return f"standby coordinator; the active coordinator is at {active_address}"


class ServingGate(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    """Register with ``server.add_generic_rpc_handlers((gate,))`` before any other handler."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._active = False
        self.active_address = ""
        self._refusal = grpc.stream_stream_rpc_method_handler(self._refuse)

    @property
    def active(self) -> bool:
        return self._active

    def install(
        self, service: ServiceDescriptor, servicer: object, authorizer: Authorizer | None = None
    ) -> None:
        """Serve ``service`` through ``servicer`` once the gate opens."""
        for name, handler in service_handlers(service, servicer, authorizer).items():
            self._handlers[f"/{service.full_name}/{name}"] = handler

    def open(self) -> None:
        self._active = True

    def close(self, active_address: str = "") -> None:
        """Stand by again (the lease lost): every call but health refused from now on."""
        self._active = False
        self.active_address = active_address

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)
        if method.startswith(f"/{HEALTH_SERVICE}/"):
            return None
        if not self._active:
            return self._refusal
        # None for what the gate does not hold (reflection): the server's next handler.
        return self._handlers.get(method)

    async def _refuse(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        address = self.active_address
        metadata = ((ACTIVE_METADATA_KEY, address),) if address else ()
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, standby_details(address), trailing_metadata=metadata
        )
