"""Declarative range rules for optional numeric request fields, shared by every protocol's schemas.

Each protocol has its own ranges and wording (SPEC.md sections 1 and 2, OpenAI's documentation), so a rule
is the bounds plus the protocol's message; ``None`` (an unset parameter) always passes. The same bounds go
into the field's JSON schema (``minimum``, ``exclusiveMaximum``...), so ``/openapi.json`` declares the ranges
the server enforces and a schema-driven client or fuzzer generates only values it accepts.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

NUMERIC_TYPES = ("integer", "number")


@dataclass(frozen=True)
class in_range:  # noqa: N801 - used as a field annotation, like pydantic's own Field()
    """A field rule rejecting values outside the bounds with ``message`` (``{v}`` is the value)."""

    message: str
    _: KW_ONLY
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def check(self, value: Any) -> Any:
        if value is None:
            return value
        inside = (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )
        if not inside:
            raise ValueError(self.message.format(v=value))
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The field's schema with the bounds on its numeric branch (``int | None`` is an ``anyOf``)."""
        json_schema = handler(schema)
        bounds = {"exclusiveMinimum": self.gt, "minimum": self.ge, "exclusiveMaximum": self.lt, "maximum": self.le}
        bounds = {key: value for key, value in bounds.items() if value is not None}
        for branch in json_schema.get("anyOf", [json_schema]):
            if branch.get("type") in NUMERIC_TYPES:
                branch.update(bounds)
        return json_schema


def text_json_schema(max_chars: int) -> JsonSchemaValue:
    """The JSON schema of a prompt text whose validator enforces 1 to ``max_chars`` characters."""
    return {"type": "string", "minLength": 1, "maxLength": max_chars}


def text_schema(max_chars: int, description: str) -> WithJsonSchema:
    """A prompt text field's JSON schema (:func:`text_json_schema`), with its description."""
    return WithJsonSchema({**text_json_schema(max_chars), "description": description})


def stop_schema(max_items: int, max_chars: int) -> WithJsonSchema:
    """The JSON schema of a ``stop`` field (one string, a list of them, or null) whose validator enforces
    1 to ``max_chars`` characters per string and at most ``max_items`` strings."""
    item = {"type": "string", "minLength": 1, "maxLength": max_chars}
    return WithJsonSchema({"anyOf": [item, {"type": "array", "items": item, "maxItems": max_items}, {"type": "null"}]})
