"""The coordinator's domain errors, each naming the gRPC status it is answered with.

The coordinator's modules raise the `CoordinatorError` subclasses below; the gRPC layer
(coordinator/api/handlers.py `service_handlers`) turns each into the status code named by its
``code`` attribute, with the exception's message as details.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of the errors the coordinator answers with a specific gRPC status."""

    code = "INTERNAL"


class InvalidArgumentError(CoordinatorError):
    code = "INVALID_ARGUMENT"


class NotFoundError(CoordinatorError):
    code = "NOT_FOUND"


class AlreadyExistsError(CoordinatorError):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(CoordinatorError):
    code = "FAILED_PRECONDITION"


class AbortedError(CoordinatorError):
    code = "ABORTED"


class ResourceExhaustedError(CoordinatorError):
    code = "RESOURCE_EXHAUSTED"


class DataLossError(CoordinatorError):
    code = "DATA_LOSS"


class DeadlineExceededError(CoordinatorError):
    code = "DEADLINE_EXCEEDED"


class UnavailableError(CoordinatorError):
    code = "UNAVAILABLE"


class UnimplementedError(CoordinatorError):
    code = "UNIMPLEMENTED"


class UnauthenticatedError(CoordinatorError):
    code = "UNAUTHENTICATED"


class PermissionDeniedError(CoordinatorError):
    code = "PERMISSION_DENIED"


class StoreError(CoordinatorError):
    """The store cannot be used (e.g. its schema is newer than this program)."""

    code = "INTERNAL"


class FencedError(StoreError):
    """A write refused because this coordinator no longer holds the lease: nothing was
    written, and the caller may retry against the active coordinator."""

    code = "UNAVAILABLE"
