"""The request rules every protocol's schemas share (SPEC.md's limits on text, token ids, stop sequences,
request ids and adapter names; structured outputs' constraints, compiled once to be checked): plain checks on
values, so that the schemas depend on them alone and not on the pipeline that queues the request."""

from __future__ import annotations

import json
import re
from typing import Any

from common.constraints import ConstraintError, grammar
from common.protocol import ADAPTER_NAME_PATTERN, ADAPTER_NAME_RULE, Constraint

GREEDY_TEMPERATURE = 1e-5  # vLLM's threshold, on its OpenAI and vLLM-dialect routes: a lower temperature is greedy
REQUEST_ID_REGEX = r"^[a-zA-Z0-9_-]{1,256}$"  # a client's request id (KServe `id`, TGI `x-request-id`)
REQUEST_ID_PATTERN = re.compile(REQUEST_ID_REGEX)
MAX_INPUT_CHARS = 4 * 1024 * 1024  # SPEC.md: a text prompt has at most 4 MiB of characters
# SPEC.md's limits on stop strings, the same on every route that takes them.
MAX_STOP_ITEMS = 1024
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 32768


def check_text(field: str, value: str) -> str:
    """Reject text that is not valid Unicode (a JSON escape like "\\ud800" yields a lone surrogate), which
    neither the tokenizer nor the job's JSON could carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"`{field}` must be valid Unicode text: it contains an unpaired surrogate") from None
    return value


def check_token_ids(field: str, value: list[int]) -> list[int]:
    """Reject a negative token id (the vocabulary bound is the pipeline's check, which knows the model)."""
    bad = next((i for i in value if i < 0), None)
    if bad is not None:
        raise ValueError(f"`{field}` must be token ids, >= 0. Given: {bad}")
    return value


NO_ADAPTER = "None"  # SPEC.md: adapter_id's default, the base model


def validate_adapter_id(value: str | None) -> str | None:
    """``adapter_id`` as TGI and KServe take it: None (unset, or the seed's "None") for the base model, else a
    name in the adapter name rule; whether it is loaded is the pipeline's check."""
    if value is None or value == NO_ADAPTER:
        return None
    if not re.match(ADAPTER_NAME_PATTERN, value):
        raise ValueError(f"`adapter_id` must be {ADAPTER_NAME_RULE}. Given: {value!r}")
    return value


def validate_stop_token_ids(value: list[int] | None) -> list[int] | None:
    """``stop_token_ids`` (vLLM's field, on the OpenAI and vLLM-dialect routes): at most as many as stop strings,
    each a token id (the vocabulary bound is the pipeline's check)."""
    if value is not None and len(value) > MAX_STOP_ITEMS:
        raise ValueError(f"`stop_token_ids` supports up to {MAX_STOP_ITEMS} ids. Given: {len(value)}")
    return None if value is None else check_token_ids("stop_token_ids", value)


def validate_stop(value: list[str] | str | None) -> list[str]:
    """The stop strings as a list (a string is one item, null or [] none), within SPEC.md's limits."""
    stops = [check_text("stop", value)] if isinstance(value, str) else [check_text("stop", s) for s in value or []]
    if len(stops) > MAX_STOP_ITEMS:
        raise ValueError(f"`stop` supports up to {MAX_STOP_ITEMS} stop sequences. Given: {len(stops)}")
    for item in stops:
        if not 1 <= len(item) <= MAX_STOP_CHARS:
            raise ValueError(f"each `stop` sequence must have 1 to {MAX_STOP_CHARS} characters. Given: {len(item)}")
    total = sum(len(item) for item in stops)
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(f"`stop` sequences must total at most {MAX_STOP_TOTAL_CHARS} characters. Given: {total}")
    return stops


ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object, vLLM's json_object: any JSON object
# JSON answers without free whitespace between their tokens, unless the schema sets llguidance's own `x-guidance`
# options: a model that may pad JSON with whitespace can fill its whole answer with it and never close the object
# (why vLLM has disable_any_whitespace); the engines read the options from the schema.
COMPACT_JSON = {"whitespace_flexible": False}


def checked_constraint(field: str, constraint: Constraint) -> Constraint:
    """A constraint the engines can enforce, checked before the request is queued: a schema, regex, choice
    list or grammar that does not compile is the client's error, named by ``field``."""
    try:
        grammar(constraint)
    except ConstraintError as exc:
        raise ValueError(f"`{field}` does not compile: {exc}") from None
    return constraint


def constraint_of(field: str, kind: str, value: Any) -> Constraint:
    """A constraint field's value as a :class:`Constraint`, by its kind: ``json`` (a JSON schema object or its
    JSON text, as vLLM takes it), ``regex``, ``choice`` (strings) or ``grammar`` (Lark or GBNF). Its shape is
    checked here; :func:`checked_constraint` compiles it."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"`{field}` must be a JSON schema: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"`{field}` must be a JSON schema (an object). Given: {value!r}")
        return Constraint(format="json_schema", value=json.dumps({"x-guidance": COMPACT_JSON, **value}))
    if kind == "choice":
        if not value:
            raise ValueError(f"`{field}` must hold at least one choice")
        choices = [check_text(f"{field}[{i}]", choice) for i, choice in enumerate(value)]
        return Constraint(format="choice", value=json.dumps(choices))
    return Constraint(format="regex" if kind == "regex" else "grammar", value=check_text(field, value))
