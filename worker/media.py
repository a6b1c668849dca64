"""A multimodal job's media made into the model's inputs, by the model's own processor.

The API pod queues a multimodal prompt with one placeholder token per media item (the token the model's config
names, e.g. LLaVA's ``<image>``) and the item's bytes in Redis. Here, on the queue loop's media threads
(:meth:`worker.engine.Engine.prepare`), each image is checked against ``maxImagePixels`` from its header
(:mod:`common.images`), decoded and handed, with its placeholder's text, to the model folder's
``AutoProcessor``: what it returns is the placeholder expanded into the item's feature tokens (so the expanded
prompt is what ``prompt_tokens``, the length limits and the KV budget count) and the tensors the model's
forward takes with them (``pixel_values``, and ``image_sizes`` or ``image_grid_thw`` where the model has them).
The tensors of several images, and of several requests in one prefill, concatenate along their first
dimension in placeholder order, the order the model consumes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoProcessor, PretrainedConfig, ProcessorMixin

from common.images import ImageRefused, open_image
from common.model_files import declared_media
from common.protocol import Job, MediaKind
from worker.engine import RequestRefused

TOKEN_FIELDS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass
class MediaInputs:
    """A job's prompt with every placeholder expanded, and the tensors its prefill passes to the model."""

    input_ids: list[int]
    tensors: dict[str, torch.Tensor]


def concatenate(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of several items (images, or prefill rows) as one input each, in order."""
    names = dict.fromkeys(name for part in parts for name in part)
    return {name: torch.cat([part[name] for part in parts if name in part]) for name in names}


class MediaProcessor:
    """Expands a model's image placeholders with its processor (the only kind the workers decode here)."""

    def __init__(
        self, processor: ProcessorMixin, placeholders: Mapping[MediaKind, tuple[int, str]], max_pixels: int
    ) -> None:
        self.processor = processor
        self.placeholders = dict(placeholders)  # kind -> (token id, token text)
        self.max_pixels = max_pixels  # maxImagePixels: larger images are refused before they are decoded

    @classmethod
    def load(cls, path: Path, config: PretrainedConfig, trust_remote_code: bool,
             max_pixels: int) -> MediaProcessor | None:
        """The processor of a model whose config declares an image placeholder; None for a text-only model."""
        declared = declared_media(config.to_dict())
        if "image" not in declared:
            return None
        processor = AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        token_id = declared["image"]
        return cls(processor, {"image": (token_id, processor.tokenizer.convert_ids_to_tokens(token_id))}, max_pixels)

    def expand(self, job: Job, media: Sequence[bytes]) -> MediaInputs:
        """The job's prompt and tensors with its media (``media[i]`` is ``job.media[i]``'s bytes). Thread-safe:
        the queue loop runs it beside its steps (:meth:`worker.engine.Engine.prepare`)."""
        ids: list[int] = []
        tensors: list[dict[str, torch.Tensor]] = []
        items = iter(zip(job.media, media, strict=True))
        placeholder_ids = {token_id: kind for kind, (token_id, _) in self.placeholders.items()}
        for token in job.input_ids:
            if token not in placeholder_ids:
                ids.append(token)
                continue
            index, (ref, data) = len(tensors), next(items, (None, b""))
            if ref is None or ref.kind != placeholder_ids[token]:
                raise RequestRefused(f"the prompt's placeholders do not match its media (at media item {index})")
            expansion, features = self._image(index, data)
            ids += expansion
            tensors.append(features)
        if next(items, None) is not None:
            raise RequestRefused("the prompt holds fewer placeholders than its media items")
        return MediaInputs(ids, concatenate(tensors))

    def _image(self, index: int, data: bytes) -> tuple[list[int], dict[str, torch.Tensor]]:
        try:
            with open_image(data, self.max_pixels) as image:
                rgb = image.convert("RGB")
        except ImageRefused as exc:
            raise RequestRefused(f"media item {index} {exc}") from None
        except (OSError, ValueError) as exc:  # the header is read, the pixels are not (truncated, corrupt)
            raise RequestRefused(f"media item {index} cannot be decoded as an image: {exc}") from None
        out = self.processor(text=self.placeholders["image"][1], images=[rgb], add_special_tokens=False,
                             return_tensors="pt")
        features = {name: value for name, value in out.items() if name not in TOKEN_FIELDS}
        return out["input_ids"][0].tolist(), features
