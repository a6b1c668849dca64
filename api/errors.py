"""Protocol errors and the route class that renders them in each protocol's own error format.

Handlers raise :class:`ProtocolError`; request-body validation failures (FastAPI's
``RequestValidationError``) become one too. Each protocol router is built with
:func:`error_route_class` and its renderer, so a TGI route answers ``{"error", "error_type"}`` and a KServe
route ``{"error"}``, whatever went wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from pydantic import ValidationError

log = logging.getLogger(__name__)

VALIDATION_PREFIX = "Input validation error: "
# Parts of a pydantic error location that are not field names: the request part and union member tags.
_NOT_FIELDS = {"body", "str", "int", "float", "bool"}


class ProtocolError(Exception):
    """An error answer: HTTP status, human-readable message, machine-readable type."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def describe_validation_errors(errors: Sequence[Any]) -> str:
    """One readable sentence for the first validation error, naming the offending field."""
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if str(part) not in _NOT_FIELDS and "[" not in str(part)]
    if error.get("type") == "value_error":
        return str(error["ctx"]["error"])
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    if error.get("type") == "missing" and not loc:
        return "the request body is required"
    field = ".".join(loc)
    return f"`{field}`: {error['msg']}" if field else error["msg"]


def validation_error(exc: ValidationError | RequestValidationError, status: int = 422) -> ProtocolError:
    return ProtocolError(status, VALIDATION_PREFIX + describe_validation_errors(exc.errors()), "validation")


def error_route_class(
    render: Callable[[ProtocolError], Response], validation_status: int = 422
) -> type[APIRoute]:
    """An APIRoute subclass whose handlers answer every error through ``render``."""

    class ProtocolRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    return render(validation_error(exc, validation_status))
                except HTTPException as exc:  # FastAPI could not read the body (bad UTF-8, JSON too deep)
                    if exc.status_code != 400:
                        raise
                    message = f"{VALIDATION_PREFIX}the body could not be parsed as JSON: {exc.detail}"
                    return render(ProtocolError(validation_status, message, "validation"))
                except ProtocolError as exc:
                    return render(exc)

            return guarded

    return ProtocolRoute
