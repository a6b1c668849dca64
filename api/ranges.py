"""Declarative range rules for optional numeric request fields, shared by every protocol's schemas.

Each protocol has its own ranges and wording (SPEC.md sections 1 and 2, OpenAI's documentation), so a rule
is the bounds plus the protocol's message; ``None`` (an unset parameter) always passes. The same bounds go
into the field's JSON schema (``minimum``, ``exclusiveMaximum``...), so ``/openapi.json`` declares the ranges
the server enforces and a schema-driven client or fuzzer generates only values it accepts.

:data:`Integer` (and :data:`WholeNumbers` on a list of integers) makes a field take what the schema's
``"integer"`` admits: JSON Schema counts 590.0 as an integer, which a strict ``int`` refuses.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Any

from pydantic import (
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

NUMERIC_TYPES = ("integer", "number")
# A bound's keyword and its twin for integers: ``maximum`` n is ``exclusiveMaximum`` n + 1, and so on.
INTEGER_TWINS = {"maximum": ("exclusiveMaximum", 1), "exclusiveMaximum": ("maximum", -1),
                 "minimum": ("exclusiveMinimum", -1), "exclusiveMinimum": ("minimum", 1)}


def _integral(value: Any) -> Any:
    """``value`` with each float that has no fraction (590.0), in it or in its lists, as the int it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


def _whole_numbers(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate ``value``, and when that fails, once more with its whole floats as ints: the usual request
    pays nothing, and a value that still fails gets the field's own error."""
    try:
        return handler(value)
    except ValidationError:
        return handler(_integral(value))


# The annotation of a list of integers in a request (one call for the list), and the integer of a request field.
WholeNumbers = WrapValidator(_whole_numbers)
Integer = Annotated[int, WholeNumbers]


def _exact_bound(keyword: str, bound: float) -> tuple[str, float]:
    """A bound as the OpenAPI document can state it exactly. FastAPI's document holds bounds as floats, where
    2^64 - 1 reads 2^64; an integer bound that a float cannot hold is stated by its twin (``maximum`` 2^64 - 1
    as ``exclusiveMaximum`` 2^64), which means the same for integers and which :func:`integral_bounds` then
    writes back as an integer."""
    if float(bound) == bound:
        return keyword, bound
    twin, step = INTEGER_TWINS[keyword]
    if not isinstance(bound, int) or float(bound + step) != bound + step:
        raise ValueError(f"the bound {keyword} {bound} cannot be stated exactly in the OpenAPI document")
    return twin, bound + step


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
        given = {"exclusiveMinimum": self.gt, "minimum": self.ge, "exclusiveMaximum": self.lt, "maximum": self.le}
        bounds = dict(_exact_bound(key, value) for key, value in given.items() if value is not None)
        for branch in json_schema.get("anyOf", [json_schema]):
            if branch.get("type") in NUMERIC_TYPES:
                branch.update(bounds)
        return json_schema


def integral_bounds(node: Any) -> None:
    """Write each whole bound of an OpenAPI document (FastAPI's floats) as an integer: the JSON text of the float
    2^64, ``1.8446744073709552e+19``, is read by clients and validators as the decimal it spells, not 2^64."""
    if isinstance(node, list):
        for item in node:
            integral_bounds(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in INTEGER_TWINS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                integral_bounds(value)


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
