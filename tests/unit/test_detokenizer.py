"""Incremental detokenizer: clean deltas, no broken UTF-8, stop strings never leaked."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tokenizer
from worker.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def stream(tok, text, stop=(), prompt="Hello", chunk=1):
    """Feed ``text``'s tokens ``chunk`` at a time; returns (deltas, detokenizer)."""
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(d.step(ids[i : i + chunk]))
        if d.stopped:
            break
    if not d.stopped:
        deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", ["The quick brown fox.", " leading space", "naïve café – 😀 ok 日本語", "a\nb\n\n c"])
def test_deltas_concatenate_to_decode_and_never_break_utf8(tok, text):
    deltas, d = stream(tok, text)
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids) == text == d.text
    assert all("\ufffd" not in x for x in deltas)


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: the emoji spans several tokens
    d = IncrementalDetokenizer(tok, [], ())
    out = [d.step([i]) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_special_tokens_are_skipped(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    d = IncrementalDetokenizer(tok, [], ())
    text = d.step(tok.encode("Hi", add_special_tokens=False)) + d.step([eos]) + d.flush()
    assert text == "Hi"


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_truncates_and_is_never_leaked(tok, chunk):
    deltas, d = stream(tok, "The quick brown fox jumps", stop=["brown"], chunk=chunk)
    assert "".join(deltas) == "The quick " and d.text == "The quick " and d.stopped == "brown"
    assert not any("b" in x for x in deltas)
    assert d.step(tok.encode(" more", add_special_tokens=False)) == ""  # finished: nothing more


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, d = stream(tok, "abcdef", stop=["cd", "bc"])
    assert "".join(deltas) == "a" and d.stopped == "bc"


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tok):
    deltas, d = stream(tok, "The bro and the brow", stop=["brown"])
    joined = "".join(deltas)
    assert joined == "The bro and the brow" and d.stopped is None
    assert "".join(deltas[:-1]) == "The bro and the "  # "brow" held back until the end (flush)


def test_stop_string_spanning_tokens(tok):
    text = "Hello world! This is"
    deltas, d = stream(tok, text, stop=["o w"])
    assert "".join(deltas) == "Hell" and d.stopped == "o w"


def test_nul_becomes_replacement_character_in_deltas_and_text(tok):
    """PostgreSQL stores no NUL: the stored text has U+FFFD in its place, so the streamed deltas must too."""
    deltas, d = stream(tok, "a\x00b")
    assert tok.decode(tok.encode("a\x00b", add_special_tokens=False)) == "a\x00b"  # the model can emit it
    assert "".join(deltas) == d.text == "a\ufffdb"


class _OwnDecode:
    """A tokenizer of another kind: only its ``decode`` (the detokenizer must call it, not a backend)."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, 0

    def decode(self, ids, **kw):
        self.calls += 1
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("skip", [True, False])
def test_the_backend_decode_is_the_wrappers(tok, skip):
    """A fast tokenizer is decoded by the tokenizers library directly (worker/detokenizer.py's backend_decode),
    exactly as its Hugging Face decode does; any other tokenizer keeps its own decode."""
    from worker.detokenizer import backend_decode

    fast = backend_decode(tok, skip)
    assert fast is not None
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for text in ["naïve café – 😀 ok 日本語", " leading space", "a\nb\n\n c"]:
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        for cut in range(len(ids) + 1):  # every prefix: partial characters, the special token or not
            assert fast(ids[:cut]) == tok.decode(ids[:cut], skip_special_tokens=skip,
                                                 clean_up_tokenization_spaces=False)
    other = _OwnDecode(tok)
    assert backend_decode(other, skip) is None
    d = IncrementalDetokenizer(other, [], ())
    assert d.step(tok.encode("Hi", add_special_tokens=False)) + d.flush() == "Hi" and other.calls > 0
