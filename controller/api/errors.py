"""Domain errors to HTTP, in one place.

Services and routes raise a kind of :class:`controller.errors.ControllerError`; the handler here
answers it with the status of its kind and FastAPI's usual body, ``{"detail": "<the message>"}``.
Routes never build an ``HTTPException`` from a message. A value FastAPI cannot check by itself (a
cursor, a time window) is refused with :func:`invalid_query`, in the shape of FastAPI's own
validation errors.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from controller.errors import (
    ConflictError,
    ControllerError,
    DeviceError,
    InvalidError,
    MalformedError,
    NotFoundError,
    TimedOutError,
    TooLargeError,
    UnavailableError,
)
from controller.fleet.pools import PoolInvalidError
from controller.fleet.rollouts import DeploymentInvalidError

log = logging.getLogger(__name__)

# The status of each kind, the most specific kind first (the first that matches wins): an unknown
# camera is a NotFoundError and a DeviceError at once, and is a 404.
STATUS_OF_KIND: tuple[tuple[type[ControllerError], int], ...] = (
    (TooLargeError, 413),
    (MalformedError, 400),
    (NotFoundError, 404),
    (ConflictError, 409),
    (InvalidError, 422),
    (TimedOutError, 504),
    (UnavailableError, 503),
    (DeviceError, 502),
)

# Refusals of a value the request carried that are answered in the shape of FastAPI's validation
# errors, with where the value was: a deployment's selector and waves, and a pool's declaration, are
# in their JSON bodies.
VALIDATION_SHAPED: tuple[tuple[type[ControllerError], tuple[str, ...]], ...] = (
    (DeploymentInvalidError, ("body",)),
    (PoolInvalidError, ("body",)),
)


def status_of(exc: ControllerError) -> int:
    """The HTTP status a domain error is answered with (500 for the bare base class)."""
    for kind, code in STATUS_OF_KIND:
        if isinstance(exc, kind):
            return code
    return 500


def invalid_query(field: str, msg: str) -> RequestValidationError:
    """A query parameter that is wrong in a way FastAPI cannot check by itself: a 422 whose detail
    names it, as FastAPI's own validation errors do (``detail[0].loc == ["query", field]``)."""
    return RequestValidationError([{"loc": ("query", field), "msg": msg, "type": "value_error"}])


async def controller_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Every ``ControllerError`` a route lets through, answered with its kind's status."""
    assert isinstance(exc, ControllerError)
    code = status_of(exc)
    if code == 500:
        log.error("%s %s: %s has no HTTP status of its kind", request.method, request.url.path, type(exc))
    for kind, loc in VALIDATION_SHAPED:
        if isinstance(exc, kind):
            # An error that knows where in the body it is (a pool camera's source) says so, as FastAPI does.
            where = [*loc, *getattr(exc, "loc", ())]
            return JSONResponse(
                {"detail": [{"loc": where, "msg": str(exc), "type": "value_error"}]}, status_code=code
            )
    return JSONResponse({"detail": str(exc)}, status_code=code)


def register_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ControllerError, controller_error_handler)
