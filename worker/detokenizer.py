"""Streaming detokenisation: generated token ids in, text deltas out.

Two problems make "decode the new token" wrong. A byte-level BPE token can end inside a multi-byte UTF-8
character (it then decodes to U+FFFD), and some tokenizers decode a token differently at the start of a
text than after other tokens (SentencePiece drops the leading space). :class:`IncrementalDetokenizer` keeps
a short window of already-emitted tokens as context and only emits text once it no longer ends in an
incomplete character. :class:`StopSequenceFilter` then holds back any tail that could still grow into a
stop sequence, so no delta ever contains a piece of the (excluded) stop text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[list[int]], str]


def make_decoder(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, calling the Rust backend directly when that is
    equivalent (a fast tokenizer without space clean-up), as this runs for every token of every request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one text out (a list of them decodes to a list)
        return text

    return decode


class IncrementalDetokenizer:
    """Decodes a growing id sequence into deltas whose concatenation is the decode of the whole sequence.

    ``prefix`` marks the start of the context window, ``read`` the end of the text already emitted:
    the new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``.
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(emitted) and not text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        emitted = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(emitted) :]


class StopSequenceFilter:
    """Passes text through, holding back a tail that is a prefix of a stop sequence; reports a match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        # Every proper prefix of a stop sequence: the tails that must be held back.
        self._starts = {stop[:length] for stop in self._stops for length in range(1, len(stop))}
        self._longest_start = max((len(start) for start in self._starts), default=0)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop sequence matched). After a match the emitted text ends
        right before the stop sequence and the rest is discarded."""
        if not self._stops:
            return text, False
        pending = self._pending + text
        matches = [index for index in (pending.find(stop) for stop in self._stops) if index >= 0]
        if matches:
            self._pending = ""
            return pending[: min(matches)], True
        keep = self._partial_match_length(pending)
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """Release the held-back text (the request ended without completing a stop sequence)."""
        pending, self._pending = self._pending, ""
        return pending

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop sequence starts with."""
        for length in range(min(self._longest_start, len(text)), 0, -1):
            if text[-length:] in self._starts:
                return length
        return 0


class TextStream:
    """The text side of one request: token ids in, (delta, stopped) out; ``text`` is everything emitted."""

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stops = StopSequenceFilter(stops)
        self.text = ""

    @property
    def ids(self) -> list[int]:
        return self._detokenizer.ids

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; return its text delta and whether it completed a stop sequence."""
        return self._emit(*self._stops.push(self._detokenizer.push(token_id)))

    def finish(self) -> tuple[str, bool]:
        """The request is ending: return the remaining text (and whether it turned out to hold a stop
        sequence, e.g. one that ended inside a character held back until now)."""
        delta, stopped = self._stops.push(self._detokenizer.flush())
        if not stopped:
            delta += self._stops.flush()
        return self._emit(delta, stopped)

    def _emit(self, delta: str, stopped: bool) -> tuple[str, bool]:
        self.text += delta
        return delta, stopped
