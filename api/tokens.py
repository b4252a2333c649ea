"""Prompt token counts at admission, exactly as the worker will count them, without torch or transformers.

The worker encodes a prompt with its Hugging Face fast tokenizer (``tokenizer.encode(prompt)``) and chat
messages by rendering the model's chat template (``apply_chat_template(..., add_generation_prompt=True)``)
and encoding the text without special tokens (``worker/engine.py``, ``LLMEngine.encode``). It publishes that
tokenizer's ``tokenizer.json``, the template and the template's special-token variables in the model
registry (``inferq.models_registry``); here the same ``tokenizers`` backend encodes and jinja2 renders the
template in the sandbox configuration transformers uses, so the counts agree (tests/api/test_admission.py
checks them against the worker's own code).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections import OrderedDict
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from inferq.contract import JobCreate
from inferq.models_registry import ModelCatalog, ModelEntry

_CACHED_TOKENIZERS = 8  # models an API process keeps a tokenizer of
_BATCH_ENCODE_CHARS = 4096  # longer texts go through encode_batch, which releases the GIL while it works


class TemplateError(ValueError):
    """The model's chat template cannot render these messages (its reason), or the model has none."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' chat-template environment (``_compile_jinja_template``): sandboxed, trim_blocks and
    lstrip_blocks, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return env


class PromptCounter:
    """Counts a job's prompt tokens with its model's published tokenizer; one per API process (the
    tokenizers and compiled templates are cached, keyed by the tokenizer's hash and the template text)."""

    def __init__(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog
        self._env = _environment()
        self._tokenizers: OrderedDict[str, Tokenizer] = OrderedDict()
        self._templates: dict[str, jinja2.Template] = {}
        self._lock = threading.Lock()

    def count(self, entry: ModelEntry, body: JobCreate) -> int | None:
        """The prompt's token count, or None when it cannot be known yet (no tokenizer published). Raises
        ``TemplateError`` for messages the model's template refuses, or a model without one."""
        if body.prompt_ids is not None:
            return len(body.prompt_ids)
        tokenizer = self.tokenizer(entry)
        if tokenizer is None:
            return None
        if body.prompt is not None:
            return _encoded_length(tokenizer, body.prompt, add_special_tokens=True)
        text = self.render(entry, [m.model_dump() for m in body.messages or []])
        return _encoded_length(tokenizer, text, add_special_tokens=False)

    def render(self, entry: ModelEntry, messages: list[dict[str, Any]]) -> str:
        """The chat text the worker's ``apply_chat_template(messages, add_generation_prompt=True)`` renders."""
        if entry.chat_template is None:
            raise TemplateError(f"model {entry.name!r} has no chat template: send prompt instead of messages")
        template = self._templates.get(entry.chat_template)
        if template is None:
            try:
                template = self._env.from_string(entry.chat_template)
            except jinja2.TemplateError as exc:
                raise TemplateError(f"model {entry.name!r} has a chat template that does not compile: {exc}") from None
            if len(self._templates) > 64:
                self._templates.clear()
            self._templates[entry.chat_template] = template
        try:
            return template.render(**entry.template_vars, messages=messages, tools=None, documents=None,
                                   add_generation_prompt=True)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template of model {entry.name!r} refuses these messages: {exc}") from None

    def tokenizer(self, entry: ModelEntry) -> Tokenizer | None:
        sha = entry.tokenizer
        if sha is None:
            return None
        with self._lock:
            tok = self._tokenizers.get(sha)
            if tok is not None:
                self._tokenizers.move_to_end(sha)
                return tok
        raw = self.catalog.tokenizer_json(sha)
        if raw is None:
            return None
        tok = Tokenizer.from_str(raw)
        tok.no_truncation()  # what the worker's PreTrainedTokenizerFast does before each call
        tok.no_padding()
        with self._lock:
            self._tokenizers[sha] = tok
            while len(self._tokenizers) > _CACHED_TOKENIZERS:
                self._tokenizers.popitem(last=False)
        return tok


def _encoded_length(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> int:
    if len(text) < _BATCH_ENCODE_CHARS:
        return len(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    return len(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
