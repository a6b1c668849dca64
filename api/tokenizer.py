"""The API pod's tokenizer: a model's token ids and chat template without transformers, hence without torch.

Importing transformers pulls in torch (seconds and hundreds of MiB more per pod: README "Architecture") for what
the ``tokenizers`` library and jinja2 do on their own. :class:`ApiTokenizer` reads the files transformers 5 reads
for a fast tokenizer, and gives the ids of
``AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=...)["input_ids"]`` and the text of
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``:

* ``tokenizer.json``: the whole pipeline. BOS and EOS come from its post-processor alone: when a folder has a
  tokenizer.json, transformers 5 drops ``add_bos_token``/``add_eos_token`` from tokenizer_config.json
  (``PreTrainedTokenizerBase._from_pretrained``). Truncation and padding saved in it are off, as transformers
  turns them off for a call without ``truncation``/``padding``.
* ``tokenizer_config.json``: the special tokens (one missing from tokenizer.json's added tokens is added, as
  ``TokenizersBackend.__init__`` does; their texts are the template's ``bos_token``, ``eos_token``...),
  ``added_tokens_decoder``, ``split_special_tokens`` and ``chat_template`` (of a list of named templates, the
  ``default`` one). ``special_tokens_map.json`` counts only when that config has no ``added_tokens_decoder``
  (transformers' legacy rule).
* ``chat_template.jinja``, which takes priority over the config's ``chat_template``. Templates render in
  transformers' Jinja environment (:func:`chat_environment`).

A model without tokenizer.json (a slow, SentencePiece-only ``tokenizer.model``, a tiktoken or tekken vocabulary)
is refused at start-up with :class:`ModelUnavailable`, naming the folder and the missing file: transformers
converts those at load with sentencepiece, protobuf or tiktoken code, which a pod should neither carry nor redo
differently from the workers. ``AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`` writes one.

Not reproduced: transformers 5's model-specific classes (``LlamaTokenizer``, ``Qwen2Tokenizer``...) build their
normalizer and pre-tokenizer from their own code rather than from tokenizer.json. A tokenizer.json that
transformers 5 saved holds that same pipeline; one written before may differ (e.g. a legacy ``Prepend("▁")``
normalizer where ``LlamaTokenizer`` prepends only at the start of the text, which shows after a special token).
Nor ``fix_mistral_regex``, ``added_tokens.json`` or the named templates of ``additional_chat_templates/``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from common.chat_template import CHAT_TEMPLATE_EXTENSIONS
from common.model_files import ModelUnavailable, optional_model_file

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
NO_TOKENIZER_JSON = (
    "it has no tokenizer.json, which API pods need: they read a tokenizer with the `tokenizers` library, not a "
    "slow SentencePiece-only one (tokenizer.model); AutoTokenizer.from_pretrained(folder).save_pretrained(folder) "
    "writes it"
)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML characters), with its options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """transformers' chat-template environment (``_cached_compile_jinja_template``), so that a template renders
    the same text here: sandboxed, ``trim_blocks`` and ``lstrip_blocks``, its extensions, filter and globals."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=CHAT_TEMPLATE_EXTENSIONS
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return environment


def _read_json(file: Path | None) -> dict[str, Any]:
    return json.loads(file.read_text(encoding="utf-8")) if file is not None else {}


def _added_token(value: str | dict[str, Any]) -> AddedToken:
    """A token as the config files give it: its text (a special token), or an AddedToken's fields."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    return AddedToken(**{key: item for key, item in value.items() if key != "__type"})


def _special_tokens(
    config: dict[str, Any], legacy_map: dict[str, Any]
) -> tuple[dict[str, AddedToken], list[AddedToken]]:
    """The named special tokens (``bos_token``... then model-specific ones such as ``image_token``) and the extra
    ones, from tokenizer_config.json and, without its ``added_tokens_decoder``, special_tokens_map.json."""
    settings = dict(config)
    extras = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    if isinstance(extras, dict):  # a dict of extra tokens names them
        settings.update(extras)
        extras = []
    extras = list(extras)
    if "added_tokens_decoder" not in config:
        for key, value in legacy_map.items():
            if key in ("additional_special_tokens", "extra_special_tokens"):
                extras += [token for token in value if token not in extras]
            else:
                settings[key] = {**value, "special": True} if isinstance(value, dict) else value
    model_specific = (key for key in settings if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS)
    keys = [*NAMED_SPECIAL_TOKENS, *model_specific]
    named = {key: _added_token(settings[key]) for key in keys if isinstance(settings.get(key), (str, dict))}
    return named, [_added_token(token) for token in extras]


def _add_missing_tokens(backend: Tokenizer, config: dict[str, Any], named: dict[str, AddedToken],
                        extras: list[AddedToken]) -> None:
    """Add, as ``TokenizersBackend.__init__`` does, the config's added tokens that tokenizer.json lacks or holds
    with other options, then the special tokens it does not hold at all (a special token is never split)."""
    present = backend.get_added_tokens_decoder().values()
    known = {repr(token) for token in present}
    decoder = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
    missing = [token for token in (_added_token(fields) for _, fields in decoder) if repr(token) not in known]
    texts = {token.content for token in present} | {token.content for token in missing}
    missing += [token for token in [*named.values(), *extras] if token.content not in texts]
    named_texts = {token.content for token in named.values()}
    for token in missing:
        if not token.special and token.content in named_texts:
            token.special = True
    backend.add_tokens(missing)


def _chat_template(config: dict[str, Any], template_file: Path | None) -> str | None:
    if template_file is not None:
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the API renders with the default one
        return next((item["template"] for item in template if item["name"] == "default"), None)
    return template


class ApiTokenizer:
    """A model's tokenizer as the API pod needs it: token ids of a text, and its chat template rendered.

    Thread-safe: requests encode and render in worker threads. ``chat_template`` may be replaced (the pod's
    ``--chat-template``); a template is compiled on its first use, so a model's broken one fails its chat
    requests only (transformers' behaviour) and can still be replaced.
    """

    def __init__(self, backend: Tokenizer, special_tokens: Mapping[str, str], chat_template: str | None) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. bos_token -> "<s>": the templates' variables
        self._environment = chat_environment()
        self.chat_template = chat_template

    @classmethod
    def load(cls, model: Path) -> ApiTokenizer:
        """The tokenizer of ``model`` (a folder or a hub id whose config.json was found); raises
        :class:`ModelUnavailable` when it has no tokenizer.json or that file cannot be read."""
        tokenizer_file = optional_model_file(model, "tokenizer.json")
        if tokenizer_file is None:
            raise ModelUnavailable(model, NO_TOKENIZER_JSON)
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
            raise ModelUnavailable(model, f"its tokenizer.json cannot be read: {exc}") from None
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(optional_model_file(model, "tokenizer_config.json"))
        named, extras = _special_tokens(config, _read_json(optional_model_file(model, "special_tokens_map.json")))
        _add_missing_tokens(backend, config, named, extras)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        template = _chat_template(config, optional_model_file(model, "chat_template.jinja"))
        return cls(backend, {key: token.content for key, token in named.items()}, template)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._compiled: jinja2.Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; ``add_special_tokens`` adds what the post-processor adds (BOS, EOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> str | None:
        """The text of one token of the vocabulary (a placeholder such as ``<image>``); None: no such id."""
        return self._backend.id_to_token(token_id)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The messages rendered with the chat template, by default ending with the assistant's turn; raises
        :class:`jinja2.TemplateError` when the template fails or rejects them (its ``raise_exception``)."""
        if self._chat_template is None:
            raise ValueError("the model has no chat template")
        if self._compiled is None:
            self._compiled = self._environment.from_string(self._chat_template)
        return self._compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
