"""Shapes only the TGI routes answer with: ``/generate_stream``'s events and ``GET /info``. The shapes MindIE
shares with TGI are in :mod:`api.tgi_format`."""

from __future__ import annotations

from pydantic import BaseModel, Field

from common.protocol import FinishReason


class TGIStreamToken(BaseModel):
    id: int | list[int] = Field(description="a list on `POST /` (seed format), an int on /generate_stream")
    text: str
    logprob: float | None
    special: bool


class TGIStreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    seed: int | None


class TGIStreamResponse(BaseModel):
    token: TGIStreamToken
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


class InfoModel(BaseModel):
    """One served model in ``/info``'s ``models`` (MindIE's field)."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None
    max_total_tokens: int


class TGIInfo(BaseModel):
    """``GET /info`` as TGI 0.9.4 reports it (the default model), plus MindIE's ``models``: every served model,
    the default first. TGI's ``max_batch_total_tokens``, ``max_concurrent_requests`` and ``max_best_of`` are
    MindIE's fields too. ``max_concurrent_requests`` is maxLinkNum, the requests this pod holds open before it
    refuses more, as TGI's is its router's bound (not the workers' maxBatchSize)."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_length: int
    max_total_tokens: int
    waiting_served_ratio: float
    max_batch_total_tokens: int
    max_waiting_tokens: int
    validation_workers: int
    version: str
    sha: str | None
    docker_label: str | None
    models: list[InfoModel]
