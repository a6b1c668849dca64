"""Structured outputs' grammars, one dialect for the whole system: llguidance's.

The API checks a request's :class:`~common.protocol.Constraint` here before queueing it, and the built-in
engine compiles the same grammar text, so what the API accepts is exactly what a worker can enforce.
llguidance (the grammar engine of vLLM's ``guidance`` backend) needs no torch: an API pod can import it.
"""

from __future__ import annotations

from llguidance import LLMatcher, grammar_from

from common.protocol import Constraint


class ConstraintError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled; the message says where."""


def grammar(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text; raises :class:`ConstraintError` when it does not compile."""
    try:
        text = grammar_from(constraint.format, constraint.value)
    except ValueError as exc:
        raise ConstraintError(str(exc)) from None
    if error := LLMatcher.validate_grammar(text):
        raise ConstraintError(error.strip())
    return text
