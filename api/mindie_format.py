"""MindIE's route class: each response of MindIE's routes (:mod:`api.mindie.routes`, and the administration
routes of :mod:`api.admin`), errors included, carries a ``RequestUUID`` header, and errors are TGI's
(:func:`api.tgi_format.render_tgi_error`). Beside the protocols, as :mod:`api.tgi_format` is, so that the
administration routes need not import MindIE's inference routes."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from api.errors import error_route_class
from api.request import new_request_id
from api.tgi_format import render_tgi_error

REQUEST_UUID = "RequestUUID"


def _uuid_route_class(base: type[APIRoute]) -> type[APIRoute]:
    """``base`` whose routes give each request an id (``request.state.request_uuid``, which a handler may
    replace by the pipeline's) and answer it in the ``RequestUUID`` header, errors included: the error
    answers are made inside ``base``'s handler, so they pass here too. Only MindIE's routes carry it."""

    class MindIERoute(base):  # type: ignore[misc, valid-type]  # mypy takes no base class from a variable
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def tagged(request: Request) -> Response:
                request.state.request_uuid = new_request_id()
                response = await handler(request)
                response.headers[REQUEST_UUID] = request.state.request_uuid
                return response

            return tagged

    return MindIERoute


MindIERoute = _uuid_route_class(error_route_class(render_tgi_error))
