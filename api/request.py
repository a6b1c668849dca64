"""The one protocol-neutral request every adapter builds, and the job it resolves to.

Adapters only translate: their body becomes an :class:`InferenceRequest` (the prompt as text, token ids, chat
messages or multimodal parts; each sampling field as the client sent it, None where unset; protocol flags),
which :mod:`api.resolve` makes a :class:`QueuedRequest` and :mod:`api.pipeline` queues. The request's field
rules live in :mod:`api.rules`, beside it.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from api.media import MediaData, MediaSource
from common.protocol import GenerationRequest, RequestOptions

DEFAULT_MAX_NEW_TOKENS = 20  # SPEC.md, TGI and KServe routes


class InferenceRequest(RequestOptions):
    """One request as every adapter translates it, before :func:`api.resolve.resolve`. Exactly one of ``text``,
    ``token_ids``, ``messages`` and ``parts`` is the prompt; ``prompt_field`` names it in errors. Sampling fields
    are as sent (None: unset), already in the pipeline's meaning (e.g. top_k 0 is off); the
    :class:`~common.protocol.RequestOptions` go to the engines as they are."""

    model_config = ConfigDict(frozen=True)

    request_id: str | None = Field(None, description="the client's id; None: a new one")
    prompt_field: str
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = Field(
        None, description="chat messages, rendered with the chat template; a content is a text, or (media) parts"
    )
    parts: list[str | MediaSource] | None = Field(
        None, description="a multimodal prompt: texts and media items, in the order the model sees them"
    )
    truncate: int | None = Field(None, description="keep only the prompt's last tokens")
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    default_max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, description="when unset; None: maxIterTimes")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @property
    def media_sources(self) -> list[MediaSource]:
        """The prompt's media items, in the order the model sees them."""
        parts = self.parts or [part for message in self.messages or () if isinstance(message["content"], list)
                               for part in message["content"]]
        return [part for part in parts if isinstance(part, MediaSource)]

    @model_validator(mode="after")
    def _one_prompt(self) -> InferenceRequest:
        if sum(p is not None for p in (self.text, self.token_ids, self.messages, self.parts)) != 1:
            raise ValueError("a request has exactly one prompt: text, token ids, messages or parts")
        return self


def new_request_id() -> str:
    """An id for a request the client named none for."""
    return uuid.uuid4().hex


class QueuedRequest(GenerationRequest):
    """A resolved request with its media items read: the job carries them as Redis keys
    (:class:`common.protocol.MediaRef`), written when it is queued."""

    media: list[MediaData] = Field(default_factory=list, description="read and checked, in placeholder order")
