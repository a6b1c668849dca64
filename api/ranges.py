"""Declarative range rules for optional numeric request fields, shared by every protocol's schemas.

Each protocol has its own ranges and wording (SPEC.md sections 1 and 2, OpenAI's documentation), so a rule
is the bounds plus the protocol's message; ``None`` (an unset parameter) always passes.
"""

from __future__ import annotations

from pydantic import AfterValidator


def in_range(
    message: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> AfterValidator:
    """A field validator rejecting values outside the bounds with ``message`` (``{v}`` is the value)."""

    def check(value: float | None) -> float | None:
        if value is None:
            return value
        inside = (
            (gt is None or value > gt)
            and (ge is None or value >= ge)
            and (lt is None or value < lt)
            and (le is None or value <= le)
        )
        if not inside:
            raise ValueError(message.format(v=value))
        return value

    return AfterValidator(check)
