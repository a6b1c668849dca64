"""Protocol errors, each protocol's status for a pipeline failure (:class:`Protocol`), and the route class that
renders them in each protocol's own error format.

Handlers raise :class:`ProtocolError`; request-body validation failures (FastAPI's
``RequestValidationError``) become one too. Each protocol router is built with
:func:`error_route_class` and its renderer, so a TGI route answers ``{"error", "error_type"}`` and a KServe
route ``{"error"}``, whatever went wrong. The route class also checks the API keys (when API_KEYS is set)
on every POST route, i.e. every inference and control route of every protocol; GET routes (health, info,
metadata, model lists) stay open.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from common.connection import REDIS_ERRORS

log = logging.getLogger(__name__)

OpenApiResponses = dict[int | str, dict[str, Any]]
"""A route's ``responses``, its answers described in the OpenAPI document (FastAPI's type for them)."""

VALIDATION_PREFIX = "Input validation error: "
# Parts of a pydantic error location that are not field names: the request part and union member tags.
_NOT_FIELDS = {"body", "str", "int", "float", "bool"}


class ProtocolError(Exception):
    """An error answer: HTTP status, human-readable message, machine-readable type, and the request field at
    fault when known (OpenAI's error body names it as ``param``)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param


class PipelineError(Exception):
    """A request the pipeline could not complete. ``error_type`` says why; each adapter maps it to its
    protocol's status: ``generation`` (the worker failed), ``overloaded`` (queue or connection limit),
    ``incomplete_generation`` (a timeout), ``unavailable`` (Redis unreachable), ``stopping`` (stopService was
    called: 503 on every protocol), ``validation`` (a request id already in flight)."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type


# The statuses KServe v2 and OpenAI both give each pipeline failure: 400 a bad request, 500 a failed generation,
# 503 retry later, 499 (nginx's) a client that left. TGI's differ (api/tgi_format.py).
REST_STATUSES: Mapping[str, int] = MappingProxyType({
    "validation": 400,
    "generation": 500,
    "incomplete_generation": 500,
    "overloaded": 503,
    "unavailable": 503,
    "stopping": 503,
    "client_disconnected": 499,
})


@dataclass(frozen=True)
class Protocol:
    """What differs between protocols once a body is translated: the status of each pipeline failure
    (``validation`` included) and the few rules their specs set differently."""

    statuses: Mapping[str, int]
    # A prompt over the token limit: the message ({field}, {limit}, {count}) and its machine-readable code.
    too_long: str = "`{field}` must have at most {limit} tokens. Given: {count}"
    too_long_code: str = "validation"
    # KServe (SPEC.md section 2): top_k >= the vocabulary and max_new_tokens > maxIterTimes are errors;
    # elsewhere top_k is clamped to the vocabulary and max_new_tokens capped at maxIterTimes.
    strict_limits: bool = False
    # An unset top_k: the model's default (generation_config.json, then config.json), or off.
    model_default_top_k: bool = True

    def invalid(self, message: str, field: str | None = None, code: str = "validation") -> ProtocolError:
        """A request this protocol refuses, with its validation status and the field at fault."""
        return ProtocolError(self.statuses["validation"], VALIDATION_PREFIX + message, code, field)

    def failure(self, exc: PipelineError) -> ProtocolError:
        """A pipeline failure with this protocol's status for its type (500 when it has none), and the
        validation prefix on a validation failure (a request id already in flight)."""
        message = VALIDATION_PREFIX + exc.message if exc.error_type == "validation" else exc.message
        return ProtocolError(self.statuses.get(exc.error_type, 500), message, exc.error_type)


def _field(error: Any) -> str:
    """The dotted path of the field a pydantic error is about ("" for the body as a whole, and for JSON that
    does not parse, whose location is a character position)."""
    if error.get("type") == "json_invalid":
        return ""
    return ".".join(str(p) for p in error.get("loc", ()) if str(p) not in _NOT_FIELDS and "[" not in str(p))


def _most_specific(errors: Sequence[Any]) -> Any:
    """The first error, or where a union's members all failed (one error each, under the same field), the one
    that matched the value's type and got furthest into it: for a list given to ``str | list[Item]``, the
    list's or the item's error, not "should be a valid string"."""
    first = errors[0]
    parent = tuple(first.get("loc", ()))[:-1]
    siblings = [e for e in errors if tuple(e.get("loc", ()))[: len(parent)] == parent]
    # a branch whose type did not match ("string_type", "model_type") is the wrong branch, not the mistake
    return max(siblings, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))


def describe_validation_errors(errors: Sequence[Any], body_sent: bool = False) -> str:
    """One readable sentence for the first validation error, naming the offending field. ``body_sent``: the
    request had a body (FastAPI reports a JSON ``null`` body as missing, like no body at all)."""
    error = _most_specific(errors)
    field = _field(error)
    if error.get("type") == "value_error":
        return str(error["ctx"]["error"])
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    if error.get("type") == "extra_forbidden":
        return f"`{field}` is not a supported parameter"
    if error.get("type") == "missing" and not field:
        return "Input should be a valid dictionary" if body_sent else "the request body is required"
    return f"`{field}`: {error['msg']}" if field else error["msg"]


def validation_error(
    exc: ValidationError | RequestValidationError, status: int = 422, body_sent: bool = False
) -> ProtocolError:
    errors = exc.errors()
    message = VALIDATION_PREFIX + describe_validation_errors(errors, body_sent)
    return ProtocolError(status, message, "validation", _field(_most_specific(errors)) or None)


class BodyTooLarge(HTTPException):
    """The request body is larger than maxRequestLength (an HTTPException, so FastAPI passes it on)."""

    def __init__(self, limit_mb: int) -> None:
        super().__init__(413, f"the request body exceeds {limit_mb} MB (maxRequestLength)")


class LimitedRequest(Request):
    """A request whose body is read at most up to ``maxRequestLength`` (SPEC.md), never further."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit_mb = self.app.state.ctx.settings.max_request_length
            limit = limit_mb * 1024 * 1024
            declared = self.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BodyTooLarge(limit_mb)
            chunks, size = [], 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit_mb)
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body


class HeaderLimit:
    """ASGI middleware answering 431 (in the path's protocol format, from ``render``) to a request whose header
    fields take more than ``maxHeaderBytes``, each counted as ``name: value`` and its line end: uvicorn's httptools
    parser takes headers of any size, where front ends stop at a bound (nginx 32 KB, h11 16 KB)."""

    def __init__(self, app: ASGIApp, limit: int, render: Callable[[str], Callable[[ProtocolError], Response]]) -> None:
        self.app = app
        self.limit = limit
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.limit:
                message = (f"the request's header fields take {size} bytes, more than the {self.limit} this "
                           "server takes (maxHeaderBytes)")
                response = self.render(scope["path"])(ProtocolError(431, message, "headers_too_large"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "application/json").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def authorized(request: Request) -> bool:
    """Whether the request carries ``Authorization: Bearer <key>`` with one of the configured API keys (always
    true when none is configured). Compared in constant time with every key, so timing tells nothing."""
    keys = request.app.state.ctx.settings.api_keys
    if not keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, key.get_secret_value().encode()) for key in keys]
    return scheme.lower() == "bearer" and any(matches)


def unauthorized(render: Callable[[ProtocolError], Response]) -> Response:
    message = "a valid API key is required: send `Authorization: Bearer <key>`"
    response = render(ProtocolError(401, message, "invalid_api_key"))
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def error_route_class(
    render: Callable[[ProtocolError], Response], validation_status: int = 422, require_json: bool = True
) -> type[APIRoute]:
    """An APIRoute subclass whose handlers answer every error through ``render``: a POST without a valid API
    key (401), invalid bodies, bodies over maxRequestLength (413), a non-JSON content type when
    ``require_json`` (415), and every :class:`ProtocolError` the handler raises."""

    class ProtocolRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                request = LimitedRequest(request.scope, request.receive)
                if request.method == "POST" and not authorized(request):
                    return unauthorized(render)
                if require_json and request.method == "POST" and not _is_json(request.headers.get("content-type")):
                    message = f"Content-Type must be application/json, not {request.headers['content-type']}"
                    return render(ProtocolError(415, message, "validation"))
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    body_sent = bool((await request.body()).strip())
                    return render(validation_error(exc, validation_status, body_sent))
                except HTTPException as exc:  # FastAPI could not read the body (bad UTF-8, JSON too deep)
                    if exc.status_code == 413:
                        return render(ProtocolError(413, exc.detail, "validation"))
                    if exc.status_code != 400:
                        raise
                    message = f"{VALIDATION_PREFIX}the body could not be parsed as JSON: {exc.detail}"
                    return render(ProtocolError(validation_status, message, "validation"))
                except ProtocolError as exc:
                    return render(exc)
                except REDIS_ERRORS as exc:  # a route's own Redis command (the pipeline words its own)
                    return render(ProtocolError(503, f"Redis is unreachable: {exc}", "unavailable"))

            return guarded

    return ProtocolRoute
