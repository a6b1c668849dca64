"""Streaming text: byte-level BPE deltas and stop-sequence hold-back."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.detokenizer import IncrementalDetokenizer, StopSequenceFilter, TextStream, make_decoder


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("text", ["hello world", "你好，世界！数据结构", "emoji 😀🚀 and ünïcödé", "a\n\tb  c"])
def test_deltas_never_split_a_character(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(make_decoder(tokenizer))
    deltas = [detokenizer.push(token) for token in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_an_incomplete_character_is_flushed_as_replacement(tokenizer) -> None:
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1  # not in the tiny vocabulary as one token
    detokenizer = IncrementalDetokenizer(make_decoder(tokenizer))
    assert detokenizer.push(ids[0]) == ""
    assert detokenizer.flush() == tokenizer.decode(ids[:1])


def test_special_tokens_decode_to_nothing(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(make_decoder(tokenizer))
    assert detokenizer.push(tokenizer.eos_token_id) == ""


def test_stop_filter_holds_back_possible_starts() -> None:
    stops = StopSequenceFilter(["###", "END"])
    assert stops.push("abc#") == ("abc", False)
    assert stops.push("#") == ("", False)
    assert stops.push("x E") == ("##x ", False)
    assert stops.push("N") == ("", False)
    assert stops.push("D tail") == ("", True)


def test_stop_filter_cuts_at_the_earliest_match() -> None:
    stops = StopSequenceFilter(["lo w", "o"])
    assert stops.push("hello world") == ("hel", True)


def test_stop_filter_flushes_an_unfinished_start() -> None:
    stops = StopSequenceFilter(["STOP"])
    assert stops.push("x ST") == ("x ", False)
    assert stops.flush() == "ST"


def test_text_stream_detects_a_stop_across_tokens(tokenizer) -> None:
    ids = tokenizer("one two three four", add_special_tokens=False).input_ids
    stream = TextStream(make_decoder(tokenizer), ["three"])
    deltas, stopped = [], False
    for token in ids:
        delta, stopped = stream.push(token)
        deltas.append(delta)
        if stopped:
            break
    assert stopped and "".join(deltas) == stream.text == "one two "
