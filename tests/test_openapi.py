"""``/openapi.json`` is the real contract: schemathesis generates requests from it for every route and holds
each answer to it.

Valid requests (by the document) must be accepted, invalid ones refused, and every answer must have a status,
content type and body the document declares for that route; never a 5xx. The app runs in-process over
fakeredis with a stand-in worker answering one token (tests/fakes.py), so what is fuzzed is the API pod:
validation, the adapters and their responses. A heartbeat in fakeredis makes the stand-in worker live, so
the health routes answer 200 and requests are taken.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import schemathesis
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

# Refusals a schema-valid request may still get, for rules the document states in words only: limits of the
# served model (its vocabulary, its context length), which one document for every model cannot give as
# numbers; rules JSON Schema cannot express (two fields that must be equal; and see schema_valid_accepted);
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
)


FLOAT_EXACT = 2**53
NUMBERS = re.compile(r"-?\d{16,}")


def _rounded_past_bound(message: str) -> bool:
    """A refusal of a value past a bound beyond 2^53 that only float rounding puts inside it: the generator
    compares integers with such bounds as floats (seed's 2^64-1 lets 18446744073709551999 through)."""
    *bounds, given = [int(n) for n in NUMBERS.findall(message)] or [0]
    return any(abs(b) > FLOAT_EXACT and float(b) == float(given) and b != given for b in bounds)


def _integral_float(value: Any) -> bool:
    """Whether the JSON value holds a float with no fraction (1.0), somewhere."""
    if isinstance(value, dict):
        return any(_integral_float(item) for item in value.values())
    if isinstance(value, list):
        return any(_integral_float(item) for item in value)
    return isinstance(value, float) and value.is_integer()


def schema_valid_accepted(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """schemathesis' positive_data_acceptance, except for the refusals of :data:`UNSTATED_RULES`, of values
    the generator rounded past a bound, and of bodies holding an integer written as 1.0 (JSON Schema's
    "integer" admits it; the routes take integers in integer notation, as TGI's serde does)."""
    if response.status_code < 500 and (
        any(rule in response.text for rule in UNSTATED_RULES)
        or _rounded_past_bound(response.text)
        or _integral_float(case.body)
    ):
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


@SCHEMA.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_keeps_its_openapi_contract(case: schemathesis.Case, session: asgi.ASGIClient) -> None:
    case.call_and_validate(base_url=f"http://{asgi.HOST}", session=session, checks=CHECKS)
