"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level and SentencePiece tokenizers (a character may span
tokens; a leading space depends on the previous token), so each step decodes a small window of recent
tokens and emits only what the window adds beyond its already-read part. Text is held back while

* the decoded window ends in U+FFFD (an incomplete UTF-8 sequence that the next token may complete), or
* the text ends with a prefix of a stop string (it might become the stop string, which is never shown).

When a stop string appears, the text is truncated just before it.

A NUL character (a model may emit the byte 0) becomes U+FFFD here, once: PostgreSQL cannot store NUL, and the
streamed deltas must be a prefix of the stored result text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_CONTEXT = 5  # prompt tokens used as left context (leading-space handling of the first output token)


def backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The ``tokenizers`` library's own decode, where the Hugging Face tokenizer's ``decode`` (with the clean-up
    off) is exactly a call of it: a fast tokenizer whose class overrides neither ``decode`` nor ``_decode``. The
    wrapper's argument conversions cost more than the decode of a few tokens, and a step decodes twice per
    request. None for any other tokenizer (it keeps its own ``decode``)."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - an older transformers: the wrapper it is
        return None
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    if not (isinstance(tokenizer, TokenizersBackend) and isinstance(backend, Tokenizer)
            and cls.decode is TokenizersBackend.decode and cls._decode is TokenizersBackend._decode):
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # longest possibly-partial stop
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # tokens already turned into text
        self.text = ""  # all output text decoded so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped: str | None = None  # the stop string that ended the text
        self._fast_decode = backend_decode(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_ids: Sequence[int]) -> str:
        """Add new output tokens; the text that can be shown now (maybe ""). Check ``stopped`` after."""
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=self.stopped is not None)

    def flush(self) -> str:
        """The request ended (not by a stop string): release everything, incomplete tails included."""
        if self.stopped is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self._append(full[len(prefix) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=True)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)  # a stop string may straddle old and new text
        self.text += new.replace("\x00", "\ufffd")
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)  # the earliest stop string wins
            self.text, self.stopped = self.text[:i], s

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end -= self._partial_stop_len()
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text, best = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
