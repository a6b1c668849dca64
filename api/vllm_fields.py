"""vLLM's sampling fields, as the OpenAI routes (:mod:`api.openai.schemas`) and MindIE's vLLM dialect of
``/generate`` (:mod:`api.mindie.schemas`) both take them: one declaration beside both protocols, so that neither
imports the other."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from api.ranges import WholeNumbers, in_range
from api.rules import MAX_STOP_ITEMS, validate_stop_token_ids

UNSUPPORTED_PENALTY = ("`{field}` is not supported, only 0: this server has no such penalty (its repetition_penalty "
                       "is a different, multiplicative penalty). Given: {{v}}")


# The penalty fields of OpenAI's and vLLM's this server has no such penalty for: only 0, else a message
PresencePenalty = Annotated[
    float | None, in_range(UNSUPPORTED_PENALTY.format(field="presence_penalty"), ge=0, le=0)
]
FrequencyPenalty = Annotated[
    float | None, in_range(UNSUPPORTED_PENALTY.format(field="frequency_penalty"), ge=0, le=0)
]

VllmTopP = Annotated[float | None, in_range("`top_p` must be > 0 and <= 1 (1 = off). Given: {v}", gt=0.0, le=1.0)]
VllmRepetitionPenalty = Annotated[
    float | None, in_range("`repetition_penalty` must be strictly positive (1 = off). Given: {v}", gt=0.0)
]
StopTokenIds = Annotated[
    list[int] | None,
    WholeNumbers,
    Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}, "maxItems": MAX_STOP_ITEMS}),
    AfterValidator(validate_stop_token_ids),
]
