"""The API pod's torch-free tokenizer (:mod:`api.tokenizer`) against transformers' ``AutoTokenizer``.

Every check loads one folder both ways and compares: the token ids of many texts, with and without special
tokens, and the chat template's text. The folders are the tiny model and tokenizers of other styles, trained here
with the ``tokenizers`` library and saved by transformers as a real model's are: byte-level BPE (GPT-2, Llama 3,
Qwen) and SentencePiece-style BPE with byte fallback (Llama 2, Mistral; saved by ``LlamaTokenizer``, which
AutoTokenizer then loads with its model-specific code), each with BOS and EOS added or not. Variants of the tiny
model cover the config-file rules: ``add_bos_token``/``add_eos_token`` beside a tokenizer.json, no
post-processor, special tokens only in tokenizer_config.json or special_tokens_map.json, ``split_special_tokens``,
which chat template wins.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

from api.context import ModelInfo
from api.tokenizer import ApiTokenizer
from common.model_files import ModelUnavailable
from common.settings import Settings
from worker.tiny_model import CHAT_TEMPLATE, CORPUS

REPO = Path(__file__).resolve().parent.parent
TEXTS = [
    "", " ", "  ", "\n", "\n\n\t  \n", "Hello world", " Hello  world ", "Hello\tworld\r\n", "trailing   ",
    "def main():\n    return 42\n", "    indented\n        more    \n\n\n", "x = [1,   2,\t3]  # comment",
    "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。", "naïve café — Ünïcödé",
    "e\u0301 combining, \ufb01 ligature, \u00a0no-break\u2003em space", "emoji 🦀🚀 👩‍👩‍👧 family",
    "Ελληνικά и кириллица",
    "null\x00byte \x7f and \x1b[0m", "<s>", "</s>", "<unk><pad>", "<s>Hello</s>", "text <s> inside </s> text",
    " <s> spaced </s> ", "<<s>>", "<s", "<|im_start|>user\nHi<|im_end|>\n", "<|begin_of_text|>x<|end_of_text|>",
    "[INST] hi [/INST]", "<image> look", "<|tool|>call", "▁already▁metaspace", "<0x41> byte token text",
    "a" * 1000, " " * 64 + "x", "\n" * 10,
]
MESSAGE_SETS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "  You answer in <b>HTML</b> & \"quotes\".  "},
        {"role": "user", "content": "敏捷的棕色狐狸 🦀 <s> inside"},
        {"role": "assistant", "content": "Sure:\n  indented\n"},
        {"role": "user", "content": "Again?", "name": "ann"},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! </s>"}],
]
# Qwen-like ChatML, in the style real templates are written: block tags on their own indented lines (trim_blocks
# and lstrip_blocks shape the text), a namespace, loop controls, tojson, the {% generation %} block.
CHATML_TEMPLATE = """\
{% set ns = namespace(system=none) %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content %}
        {% continue %}
    {% endif %}
    {% if ns.system is not none and loop.index0 == 1 %}
<|im_start|>system
{{ ns.system }}<|im_end|>
    {% endif %}
<|im_start|>{{ message.role }}{% if message.name is defined %} {{ message.name | tojson }}{% endif %}

    {% if message.role == 'assistant' %}
        {% generation %}{{ message.content }}{% endgeneration %}
    {% else %}
{{ message.content }}
    {% endif %}
<|im_end|>
    {% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{{ {"count": messages | length, "first": messages[0], "eos": eos_token} | tojson(indent=1, sort_keys=true) }}
"""
# Llama 2's template: raise_exception, bos_token and eos_token.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
BOS_EOS = [(True, False), (False, False), (True, True), (False, True)]


# --------------------------------------------------------------------------------------------- helpers


def corpus_texts() -> list[str]:
    """Some lines of the training text (code, English, Chinese) besides :data:`TEXTS`."""
    lines = CORPUS.read_text().splitlines(keepends=True)
    return ["".join(lines[i:i + 7]) for i in range(0, len(lines), max(1, len(lines) // 40))]


def assert_same_ids(folder: Path, texts: list[str]) -> ApiTokenizer:
    """Our ids are transformers' for every text, with and without special tokens; returns our tokenizer."""
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = ApiTokenizer.load(folder)
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs(text, add_special_tokens=special)[
                "input_ids"], (text, special)
    return ours


def assert_same_chat(folder: Path, message_sets: list[list[dict[str, Any]]], template: str | None = None) -> None:
    """Our rendering is transformers' for every message set, with and without the generation prompt."""
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = ApiTokenizer.load(folder)
    if template is not None:
        theirs.chat_template = ours.chat_template = template
    assert ours.chat_template == theirs.chat_template
    for messages in message_sets:
        for prompt in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.render_chat(messages, add_generation_prompt=prompt) == expected, (messages, prompt)


def copy_tokenizer(source: Path, out: Path, edit: Callable[[Path], object]) -> Path:
    """A copy of the tokenizer files of ``source`` (no weights), changed by ``edit``."""
    out.mkdir()
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    edit(out)
    return out


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def byte_level_bpe() -> Tokenizer:
    """A byte-level BPE like GPT-2's, Llama 3's and Qwen's, with their kind of special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


@pytest.fixture(scope="module")
def metaspace_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges of a SentencePiece-style BPE (``▁`` for spaces) with Llama's byte tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=700, show_progress=False))
    model = json.loads(tokenizer.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    return vocab, [tuple(merge) for merge in model["merges"]]


@pytest.fixture(scope="module")
def byte_level_folder(byte_level_bpe: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A byte-level tokenizer saved by transformers with its BOS/EOS settings and the ChatML template."""

    def make(add_bos: bool, add_eos: bool) -> Path:
        out = tmp_path_factory.mktemp("byte-level")
        PreTrainedTokenizerFast(
            tokenizer_object=byte_level_bpe, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
            extra_special_tokens=["<|im_start|>", "<|im_end|>"], add_bos_token=add_bos, add_eos_token=add_eos,
            chat_template=CHATML_TEMPLATE,
        ).save_pretrained(out)
        return out

    return make


@pytest.fixture(scope="module")
def metaspace_folder(metaspace_vocab: tuple[dict[str, int], list[tuple[str, str]]],
                     tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A Llama/Mistral-style tokenizer (Metaspace, byte fallback) saved by ``LlamaTokenizer``, as such models are."""

    def make(add_bos: bool, add_eos: bool) -> Path:
        out = tmp_path_factory.mktemp("metaspace")
        vocab, merges = metaspace_vocab
        LlamaTokenizer(
            vocab=dict(vocab), merges=list(merges), add_bos_token=add_bos, add_eos_token=add_eos,
            extra_special_tokens=["[INST]", "[/INST]"], chat_template=LLAMA2_TEMPLATE,
        ).save_pretrained(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(vocab)}))
        return out

    return make


# --------------------------------------------------------------------------------------------- token ids


def test_the_tiny_model_tokenizes_as_transformers(tiny_model_path: Path) -> None:
    ours = assert_same_ids(tiny_model_path, TEXTS + corpus_texts())
    bos = AutoTokenizer.from_pretrained(tiny_model_path).bos_token_id
    assert ours.encode("Hello")[0] == bos == 1 and ours.encode("Hello", add_special_tokens=False)[0] != 1
    assert ours.encode("") == [1] and ours.encode("", add_special_tokens=False) == []


@pytest.mark.parametrize(("add_bos", "add_eos"), BOS_EOS)
def test_byte_level_bpe_tokenizes_as_transformers(byte_level_folder: Callable[..., Path], add_bos: bool,
                                                  add_eos: bool) -> None:
    ours = assert_same_ids(byte_level_folder(add_bos, add_eos), TEXTS + corpus_texts())
    ids = ours.encode("Hello world")
    assert (ids[0] == ours.encode("<|begin_of_text|>", False)[0], ids[-1] == ours.encode("<|end_of_text|>", False)[0]) \
        == (add_bos, add_eos)


@pytest.mark.parametrize(("add_bos", "add_eos"), BOS_EOS)
def test_metaspace_byte_fallback_tokenizes_as_transformers(metaspace_folder: Callable[..., Path], add_bos: bool,
                                                           add_eos: bool) -> None:
    """Llama/Mistral style; AutoTokenizer loads these with ``LlamaTokenizer``'s own pipeline."""
    folder = metaspace_folder(add_bos, add_eos)
    assert type(AutoTokenizer.from_pretrained(folder)).__name__ == "LlamaTokenizer"
    ours = assert_same_ids(folder, TEXTS + corpus_texts())
    ids = ours.encode("Hello world")
    assert (ids[0] == 1, ids[-1] == 2) == (add_bos, add_eos)
    assert ours.encode("🦀", add_special_tokens=False)[-4:] == [3 + byte for byte in "🦀".encode()]  # byte fallback


@pytest.mark.parametrize("config", [
    {"add_bos_token": False, "add_eos_token": True},  # ignored beside a tokenizer.json, by transformers 5 too
    {"split_special_tokens": True},  # "<s>" in a text is plain text
    {"extra_special_tokens": ["<|im_start|>", "<|im_end|>"], "image_token": "<image>"},  # not in tokenizer.json
    {"additional_special_tokens": ["<|tool|>"]},  # the older name
    {"added_tokens_decoder": {
        "2": {"content": "</s>", "lstrip": True, "rstrip": True, "normalized": False, "single_word": False,
              "special": True},
        "4096": {"content": "<|tool|>", "lstrip": False, "rstrip": False, "normalized": True, "single_word": True,
                 "special": False},
    }},
], ids=["add-bos-eos-flags", "split-special-tokens", "extra-special-tokens", "additional-special-tokens",
        "added-tokens-decoder"])
def test_tokenizer_config_rules(tiny_model_path: Path, tmp_path: Path, config: dict[str, Any]) -> None:
    folder = copy_tokenizer(tiny_model_path, tmp_path / "model",
                            lambda out: edit_json(out / "tokenizer_config.json", **config))
    assert_same_ids(folder, TEXTS)


def test_a_tokenizer_json_without_post_processor_adds_nothing(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(tiny_model_path, tmp_path / "model",
                            lambda out: edit_json(out / "tokenizer.json", post_processor=None))
    ours = assert_same_ids(folder, TEXTS)
    assert ours.encode("Hello") == ours.encode("Hello", add_special_tokens=False)


def test_legacy_special_tokens_map(tiny_model_path: Path, tmp_path: Path) -> None:
    """Without ``added_tokens_decoder`` in tokenizer_config.json, special_tokens_map.json names special tokens."""

    def edit(out: Path) -> None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        del config["bos_token"]
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        edit_json(out / "special_tokens_map.json", bos_token={
            "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        }, additional_special_tokens=["<|im_start|>", "<|im_end|>"])

    folder = copy_tokenizer(tiny_model_path, tmp_path / "model", edit)
    assert_same_ids(folder, TEXTS)
    assert_same_chat(folder, MESSAGE_SETS)
    assert ApiTokenizer.load(folder).special_tokens["bos_token"] == "<s>"


# --------------------------------------------------------------------------------------------- chat templates


def test_the_tiny_model_renders_chats_as_transformers(chat_model_path: Path) -> None:
    assert_same_chat(chat_model_path, MESSAGE_SETS)
    assert ApiTokenizer.load(chat_model_path).chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML_TEMPLATE, LLAMA2_TEMPLATE, "{{ strftime_now('%Y') }}"],
                         ids=["tiny", "chatml", "llama2", "strftime_now"])
def test_templates_render_as_in_transformers(tiny_model_path: Path, template: str) -> None:
    assert_same_chat(tiny_model_path, MESSAGE_SETS, template)


def test_saved_templates_render_as_in_transformers(byte_level_folder: Callable[..., Path],
                                                   metaspace_folder: Callable[..., Path]) -> None:
    assert_same_chat(byte_level_folder(False, False), MESSAGE_SETS)
    assert_same_chat(metaspace_folder(True, False), MESSAGE_SETS)


def test_chat_template_jinja_wins_over_the_config(tiny_model_path: Path, tmp_path: Path) -> None:
    """As in transformers 5; a config's list of named templates gives its ``default`` one."""

    def edit(out: Path) -> None:
        edit_json(out / "tokenizer_config.json", chat_template=[
            {"name": "default", "template": "config: {{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools"},
        ])

    listed = copy_tokenizer(tiny_model_path, tmp_path / "listed", edit)
    (listed / "chat_template.jinja").unlink()
    assert ApiTokenizer.load(listed).render_chat(MESSAGE_SETS[0]) == "config: Hello"
    both = copy_tokenizer(listed, tmp_path / "both", lambda out: (out / "chat_template.jinja").write_text("file"))
    assert_same_chat(both, MESSAGE_SETS)
    assert ApiTokenizer.load(both).chat_template == "file"


def test_template_errors_are_jinja_errors(tiny_model_path: Path) -> None:
    """What the template rejects (its raise_exception) and its broken syntax raise jinja2.TemplateError, with
    transformers' message; a broken template is replaceable, since it compiles on first use."""
    theirs = AutoTokenizer.from_pretrained(tiny_model_path)
    ours = ApiTokenizer.load(tiny_model_path)
    theirs.chat_template = ours.chat_template = LLAMA2_TEMPLATE
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as caught:
        ours.render_chat(messages)
    assert str(caught.value) == str(expected.value)
    assert str(caught.value) == "Conversation roles must alternate user/assistant/user/assistant/..."
    ours.chat_template = "{% for m in messages %}"
    with pytest.raises(jinja2.TemplateError):
        ours.render_chat(messages)
    ours.chat_template = "ok"
    assert ours.render_chat(messages) == "ok"


def test_the_sandbox_refuses_unsafe_templates(tiny_model_path: Path) -> None:
    ours = ApiTokenizer.load(tiny_model_path)
    ours.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.TemplateError):  # jinja2.sandbox.SecurityError
        ours.render_chat([{"role": "user", "content": "x"}])
    ours.chat_template = "{{ messages.append(1) }}"
    with pytest.raises(jinja2.TemplateError):
        ours.render_chat([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------------------- the pod


def test_a_model_without_tokenizer_json_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    """A slow, SentencePiece-only tokenizer: the pod stops at start-up, naming the folder and the missing file."""
    folder = copy_tokenizer(tiny_model_path, tmp_path / "slow", lambda out: (out / "tokenizer.json").unlink())
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")
    message = (f"cannot load the model at {folder}: it has no tokenizer.json, which API pods need: they read a "
               "tokenizer with the `tokenizers` library, not a slow SentencePiece-only one (tokenizer.model); "
               "AutoTokenizer.from_pretrained(folder).save_pretrained(folder) writes it")
    with pytest.raises(ModelUnavailable) as caught:
        ModelInfo.load(Settings(model_path=folder))
    assert str(caught.value) == message


def test_a_broken_tokenizer_json_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(tiny_model_path, tmp_path / "broken",
                            lambda out: (out / "tokenizer.json").write_text("{not json"))
    with pytest.raises(ModelUnavailable, match=f"^cannot load the model at {folder}: its tokenizer.json cannot be "
                                               "read: "):
        ApiTokenizer.load(folder)


def test_model_info_uses_it(tiny_model_path: Path) -> None:
    assert isinstance(ModelInfo.load(Settings(model_path=tiny_model_path)).tokenizer, ApiTokenizer)


@pytest.mark.integration  # starts a Python process
def test_api_pods_import_neither_torch_nor_transformers() -> None:
    """Issue 13: they cost an API pod seconds of start-up and hundreds of MiB."""
    code = ("import sys, api.app, api.main; "
            "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
