"""A model's files, whether the model is given as a local folder or as a Hugging Face hub id.

A model path (``MODEL_PATH``, ``modelWeightPath``, ``--model-path``) that names a folder is used as it is;
anything else is a hub id (``Qwen/Qwen2.5-0.5B-Instruct``) whose files come from the Hugging Face cache
(``HF_HOME``), downloaded on first use unless ``HF_HUB_OFFLINE`` is set. The engines load hub ids through
``from_pretrained``, which resolves them the same way; this module gives API pods the files they read
themselves, and every command the same one-line reason when a model cannot be had.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from huggingface_hub import constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

from common.protocol import MediaKind


class ModelUnavailable(RuntimeError):
    """The model's files cannot be had; the message names the model and why, in one line."""

    def __init__(self, model: Path, cause: str) -> None:
        super().__init__(f"cannot load the model at {model}: {cause}")


def model_file(model: Path, name: str) -> Path:
    """The local path of the model's file ``name``: in its folder, or for a hub id in the Hugging Face cache
    (downloaded there first when missing and not offline). Raises :class:`ModelUnavailable` saying why not."""
    if model.is_dir():
        if not (model / name).is_file():
            raise ModelUnavailable(model, f"the folder has no {name}")
        return model / name
    try:
        return Path(hf_hub_download(str(model), name))
    except HFValidationError:  # not of the form of a hub id either
        raise ModelUnavailable(model, "no such folder") from None
    except LocalEntryNotFoundError:  # a kind of EntryNotFoundError: caught first
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "the Hugging Face hub cannot be reached"
        cause = f"no such folder, and the Hugging Face cache ({constants.HF_HUB_CACHE}) does not hold that model id"
        raise ModelUnavailable(model, f"{cause} while {why}") from None
    except GatedRepoError:  # a kind of RepositoryNotFoundError: caught first
        raise ModelUnavailable(model, "the Hugging Face model is gated: accept its terms on huggingface.co and "
                               "set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(model, "no such folder, and no Hugging Face model has that id (a private one needs "
                               "HF_TOKEN)") from None
    except EntryNotFoundError:
        raise ModelUnavailable(model, f"the Hugging Face model has no {name}") from None
    except HfHubHTTPError as exc:
        raise ModelUnavailable(model, f"the Hugging Face hub answered: {' '.join(str(exc).split())}") from None


def optional_model_file(model: Path, name: str) -> Path | None:
    """:func:`model_file`, or None when the model does not have the file (call it after a file the model
    must have, which says why a model cannot be had at all)."""
    try:
        return model_file(model, name)
    except ModelUnavailable:
        return None


# Where a model's config.json names the placeholder token of each media kind (transformers 5 names, then older).
MEDIA_TOKEN_KEYS: Mapping[MediaKind, tuple[str, ...]] = MappingProxyType({
    "image": ("image_token_id", "image_token_index"),
    "video": ("video_token_id", "video_token_index"),
    "audio": ("audio_token_id", "audio_token_index", "audio_token_idx"),
})


def declared_media(config: dict[str, Any]) -> dict[MediaKind, int]:
    """The media kinds a model's config (config.json as a dict) declares a placeholder token for, with its id."""
    declared: dict[MediaKind, int] = {}
    for kind, names in MEDIA_TOKEN_KEYS.items():
        token_id = next((config[name] for name in names if isinstance(config.get(name), int)), None)
        if token_id is not None:
            declared[kind] = token_id
    return declared
