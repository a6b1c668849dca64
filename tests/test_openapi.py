"""``/openapi.json`` is the real contract: schemathesis generates requests from it for every route and holds
each answer to it.

Valid requests (by the document) must be accepted, invalid ones refused, and every answer must have a status,
content type and body the document declares for that route; never a 5xx. The app runs in-process over
fakeredis with a stand-in worker answering one token (tests/fakes.py), so what is fuzzed is the API pod:
validation, the adapters and their responses. A heartbeat in fakeredis makes the stand-in worker live, so
the health routes answer 200 and requests are taken.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from common import keys
from common.settings import Settings
from tests.fakes import one_token_submit, patch_submit
from tests.helpers import examples

# Refusals a schema-valid request may still get, for rules the document states in words only: limits of the
# served model (its vocabulary, its context length), which one document for every model cannot give as
# numbers; rules JSON Schema cannot express (two fields that must be equal);
# and /generate_stream's one rule on the body it shares with /generate. Any other refusal of a schema-valid
# request fails the test.
UNSTATED_RULES = (
    "the vocabulary size",
    "tokens. Given:",
    "`max_tokens` and `max_completion_tokens` disagree",
    "`decoder_input_details` == true is not supported when streaming tokens",
    "` takes no ",  # a media kind the served model does not take (the document lists every kind)
    "cannot be loaded: ",  # a LoRA adapter folder must exist and hold an adapter: the server's files decide
    "has already been loaded.",  # an adapter name already in use: the registry's state decides
    # what the samplers' float32 can compute with (common.protocol.SamplingParams, docs/reliability.md): the
    # document keeps SPEC.md's ranges, and temperature's floor depends on do_sample
    "the engines compute in float32",
    "the engines divide logits by it",
    # structured outputs: a schema, regex or grammar must compile, a JSON text hold a schema, and one constraint
    # at most be given (common.constraints)
    "does not compile: ",
    "must be a JSON schema",
    "takes one constraint",
)


def schema_valid_accepted(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """schemathesis' positive_data_acceptance, except for the refusals of :data:`UNSTATED_RULES`."""
    if response.status_code < 500 and any(rule in response.text for rule in UNSTATED_RULES):
        return None
    return positive_data_acceptance(ctx, response, case)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    schema_valid_accepted,
    negative_data_rejection,
]


# The document does not depend on the model, so it is read at collection (schemathesis parametrizes the test
# with one case per operation); the app that answers is made with the tests' tiny model.
SCHEMA = schemathesis.openapi.from_dict(create_app(Settings()).openapi())


@pytest.fixture(scope="module")
def session(tiny_model_path: Path) -> Iterator[asgi.ASGIClient]:
    """An in-process client of the app over fakeredis, with a stand-in worker whose heartbeat says it is
    alive (so the health routes answer 200 and requests are taken)."""
    settings = Settings(model_path=tiny_model_path, max_iter_times=512)
    server = fakeredis.FakeServer()
    model = settings.served_models[0].name
    fakeredis.FakeRedis(server=server).zadd(keys.heartbeats(model), {"cpu:openapi:1": time.time() + 3600})
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))
    with pytest.MonkeyPatch.context() as patcher:
        patch_submit(patcher, one_token_submit)
        with asgi.get_client(app) as client:
            yield client


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _bounds(node: Any) -> Iterator[tuple[str, Any]]:
    """Each numeric bound of a JSON schema document, as (keyword, value)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [(key, value)] if key in BOUNDS and not isinstance(value, dict) else _bounds(value)
    elif isinstance(node, list):
        for item in node:
            yield from _bounds(item)


def test_whole_bounds_are_written_as_integers() -> None:
    """The served document's bounds read as the server's: a float's JSON text (1.8446744073709552e+19) is a
    decimal past the largest seed taken (2^64 - 1), which a generator or client then sends."""
    served = TestClient(create_app(Settings())).get("/openapi.json")  # no lifespan: the document needs no model
    document = json.loads(served.text, parse_float=Decimal)
    bounds = list(_bounds(document))
    assert bounds and not [(key, value) for key, value in bounds if isinstance(value, Decimal) and value % 1 == 0]
    seed = document["components"]["schemas"]["TGIParameters"]["properties"]["seed"]["anyOf"][0]
    assert seed["exclusiveMaximum"] == 2**64 and seed["exclusiveMinimum"] == 0


# The URLs a docs page loads: its tags' src, href and spec-url attributes, and Swagger UI's `url: '...'`.
PAGE_URLS = re.compile(r"""(?:src|href|spec-url)="([^"]*)"|\burl: '([^']*)'""")


@pytest.mark.parametrize(("page", "script", "global_name"), [
    ("/docs", "swagger-ui-bundle.js", "SwaggerUIBundle"),
    ("/redoc", "redoc.standalone.js", "Redoc"),
])
def test_docs_pages_load_only_the_pods_own_assets(page: str, script: str, global_name: str) -> None:
    """An air-gapped host has no CDN: each docs page names only paths of the pod, and each answers with its
    asset (the script that defines what the page calls, the stylesheet, the icon, the document)."""
    client = TestClient(create_app(Settings()))  # no lifespan: the pages and assets need no model
    html = client.get(page)
    assert html.status_code == 200 and "://" not in html.text
    urls = {next(filter(None, match)) for match in PAGE_URLS.findall(html.text)}
    assert "/openapi.json" in urls and any(url.endswith("/" + script) for url in urls)
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = client.get(url)
        assert asset.status_code == 200 and asset.content, url
        kind = asset.headers["content-type"]
        expected = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}
        assert expected[url[url.rindex("."):]] in kind, (url, kind)
        if url.endswith(script):
            assert global_name in asset.text


@SCHEMA.parametrize()
@settings(max_examples=examples(50), deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_keeps_its_openapi_contract(case: schemathesis.Case, session: asgi.ASGIClient) -> None:
    case.call_and_validate(base_url=f"http://{asgi.HOST}", session=session, checks=CHECKS)
