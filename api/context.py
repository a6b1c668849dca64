"""The explicit per-app state of an API pod (no module-level globals)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from api.media import MediaLoader
from api.metrics import ApiMetrics
from api.relay import EventRelay
from api.tokenizer import ApiTokenizer
from common.connection import AsyncRedis
from common.model_files import ModelUnavailable, declared_media, model_file, optional_model_file
from common.protocol import MediaKind
from common.settings import ModelEntry, Settings

MAX_INPUT_TOKENS_HARD_CAP = 1024 * 1024  # SPEC.md: the token limit never exceeds 1 Mi
SERVED_MEDIA: frozenset[MediaKind] = frozenset({"image"})  # the kinds the engines' workers turn into features


@dataclass(frozen=True)
class MediaToken:
    """The token a model's prompt holds in place of one media item."""

    id: int
    text: str


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know about the served model: its tokenizer and size limits."""

    model_id: str
    path: Path
    tokenizer: ApiTokenizer
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    default_top_k: int = 0
    media_tokens: Mapping[MediaKind, MediaToken] = field(default_factory=dict)  # the kinds served, by placeholder
    declared_media: frozenset[MediaKind] = frozenset()  # every kind its config names, served or not


    @classmethod
    def load(cls, settings: Settings, entry: ModelEntry | None = None) -> ModelInfo:
        """The model of ``entry``, by default the one the settings name (MODEL_NAME / MODEL_PATH)."""
        entry = entry or ModelEntry(name=settings.served_model_name, path=settings.resolved_model_path)
        config_file = model_file(entry.path, "config.json")
        path = config_file.parent  # the model's folder (for a hub id, its snapshot in the Hugging Face cache)
        config = json.loads(config_file.read_text())
        # A multimodal model's language model has its own config inside (LLaVA's text_config).
        text_config = {**config.get("text_config", {}), **config}
        generation_file = optional_model_file(entry.path, "generation_config.json")
        generation = json.loads(generation_file.read_text()) if generation_file else {}
        vocab_size = int(text_config.get("padded_vocab_size") or text_config["vocab_size"])
        tokenizer = ApiTokenizer.load(entry.path)
        declared = declared_media(config)
        media_tokens: dict[MediaKind, MediaToken] = {}
        for kind, token_id in declared.items():
            if (text := tokenizer.token_text(token_id)) is None:
                raise ModelUnavailable(entry.path, f"its config's {kind} token id {token_id} is not in its tokenizer")
            if kind in SERVED_MEDIA:
                media_tokens[kind] = MediaToken(token_id, text)
        return cls(
            model_id=entry.name,
            path=path,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            media_tokens=media_tokens,
            declared_media=frozenset(declared),
            max_position_embeddings=int(text_config.get("max_position_embeddings") or MAX_INPUT_TOKENS_HARD_CAP),
            dtype=str(text_config.get("torch_dtype") or text_config.get("dtype") or settings.dtype),
            # SPEC.md: an unset top_k means the model's default, from generation_config.json, then config.json
            default_top_k=int(next((src["top_k"] for src in (generation, config) if src.get("top_k") is not None), 0)),
        )


@dataclass
class Drain:
    """The pod's stopService state, shared by every per-model copy of the context: once ``stopping``, the
    pipeline refuses new requests (``stopping``, 503); ``force_at`` (event-loop time) ends the wait for the
    requests in flight."""

    stopping: bool = False
    force_at: float | None = None


@dataclass(frozen=True)
class ProbeResult:
    """How a ``/health/timed`` probe ended: ``error`` None when its token came; ``seconds`` it took; ``at``: when
    it ended (event-loop time)."""

    error: str | None
    seconds: float
    at: float


@dataclass
class TimedHealthProbe:
    """The pod's ``/health/timed`` probe (:mod:`api.mindie.routes`), shared by every per-model copy of the context: the
    generation ``running``, which every caller waits for (``waiters`` of them), and the ``last`` result, which
    answers the calls of the next timedHealthCacheSeconds. So probes cost one generation at a time, however many
    callers (kubelets send no API key: the route stays open)."""

    running: asyncio.Task[ProbeResult] | None = None
    waiters: int = 0
    last: ProbeResult | None = None


@dataclass
class ServerContext:
    """Everything a request handler needs; one per app, held on ``app.state.ctx``.

    ``model`` is the model a request is for: the default one (TGI routes), or the one a route names
    (:meth:`for_model`); ``models`` holds every model the pod serves, the default included.
    """

    settings: Settings
    redis: AsyncRedis
    relay: EventRelay
    model: ModelInfo
    api_id: str
    models: dict[str, ModelInfo] = field(default_factory=dict)
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    media: MediaLoader | None = None  # None: one under ``settings``' rules
    drain: Drain = field(default_factory=Drain)  # one object: for_model's copies share it
    health_probe: TimedHealthProbe = field(default_factory=TimedHealthProbe)  # shared likewise

    def __post_init__(self) -> None:
        self.models.setdefault(self.model.model_id, self.model)
        if self.media is None:
            self.media = MediaLoader(self.settings)

    def for_model(self, model_id: str) -> ServerContext | None:
        """This context for another served model (sharing Redis, relay and metrics), None if not served."""
        model = self.models.get(model_id)
        return None if model is None else dataclasses.replace(self, model=model)

    @property
    def max_input_tokens(self) -> int:
        """SPEC.md: min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1 Mi)."""
        return min(
            self.settings.max_input_token_len,
            self.settings.max_seq_len - 1,
            self.model.max_position_embeddings,
            MAX_INPUT_TOKENS_HARD_CAP,
        )

    @property
    def max_total_tokens(self) -> int:
        return min(self.settings.max_seq_len, self.model.max_position_embeddings)


async def get_ctx(request: Request) -> ServerContext:
    """FastAPI dependency: the app's context, for the model the route's ``{model}`` names when the pod serves
    it (routes check an unknown name themselves: it gets the default model's context). Async, as every
    dependency here: FastAPI runs a sync one in its thread pool, a thread hop per request."""
    ctx: ServerContext = request.app.state.ctx
    name = request.path_params.get("model")
    return (ctx.for_model(name) if name is not None else None) or ctx
