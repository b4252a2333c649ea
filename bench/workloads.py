"""Deterministic benchmark workloads: token ids (not text) drawn from a seed, so every engine gets exactly the
same prompts; and ShareGPT-format JSON files when the user has one.

A workload is a list of :class:`WorkItem` (prompt token ids, number of output tokens, optional arrival
offset in seconds and tier). Generation is meant to run with ``ignore_eos`` so each request produces
exactly ``max_tokens`` tokens on every engine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class WorkItem:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start of the run (online benchmarks)
    tier: str = "batch"
    shared_prefix_len: int = 0  # tokens at the head shared with other items (prefix workload)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Workload:
    name: str
    items: list[WorkItem]
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    @property
    def prompt_tokens(self) -> int:
        return sum(i.prompt_len for i in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(i.max_tokens for i in self.items)

    def summary(self) -> dict:
        p = [i.prompt_len for i in self.items]
        o = [i.max_tokens for i in self.items]
        return {"name": self.name, "requests": len(self.items), "prompt_tokens": sum(p), "output_tokens": sum(o),
                "prompt_len_min": min(p, default=0), "prompt_len_max": max(p, default=0),
                "output_len_min": min(o, default=0), "output_len_max": max(o, default=0), **self.params}

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "params": self.params, "items": [asdict(i) for i in self.items]})

    @classmethod
    def from_json(cls, text: str) -> Workload:
        d = json.loads(text)
        return cls(d["name"], [WorkItem(**i) for i in d["items"]], d.get("params", {}))


def _token_range(vocab_size: int, special_ids: Sequence[int] = ()) -> tuple[int, int]:
    """Ids to draw from: skip the low ids (special/control tokens in most vocabularies)."""
    low = min(100, max(1, vocab_size // 8))
    if special_ids:
        low = max(low, min(max(special_ids) + 1, vocab_size // 2))
    return low, vocab_size - 1


def random_tokens(rng: random.Random, n: int, vocab_size: int, special_ids: Sequence[int] = ()) -> list[int]:
    lo, hi = _token_range(vocab_size, special_ids)
    return [rng.randint(lo, hi) for _ in range(n)]


def mixed(n: int = 64, seed: int = 0, *, vocab_size: int, prompt_len: tuple[int, int] = (32, 512),
          output_len: tuple[int, int] = (16, 256), special_ids: Sequence[int] = ()) -> Workload:
    """The mixed offline workload: prompt and output lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        p = rng.randint(*prompt_len)
        o = rng.randint(*output_len)
        items.append(WorkItem(random_tokens(rng, p, vocab_size, special_ids), o))
    return Workload("mixed", items, {"seed": seed, "prompt_len": list(prompt_len), "output_len": list(output_len),
                                     "vocab_size": vocab_size})


def shared_prefix(n: int = 64, seed: int = 0, *, vocab_size: int, prefix_len: int = 512,
                  question_len: tuple[int, int] = (16, 48), output_len: int = 32,
                  special_ids: Sequence[int] = ()) -> Workload:
    """``n`` requests sharing one ``prefix_len``-token system prompt, each with a short distinct question."""
    rng = random.Random(seed)
    prefix = random_tokens(rng, prefix_len, vocab_size, special_ids)
    items = [WorkItem(prefix + random_tokens(rng, rng.randint(*question_len), vocab_size, special_ids), output_len,
                      shared_prefix_len=prefix_len) for _ in range(n)]
    return Workload("shared_prefix", items, {"seed": seed, "prefix_len": prefix_len,
                                             "question_len": list(question_len), "output_len": output_len,
                                             "vocab_size": vocab_size})


def poisson_arrivals(workload: Workload, rate: float, seed: int = 0, *, interactive_share: float = 0.0) -> Workload:
    """Copy of ``workload`` with Poisson arrival offsets at ``rate`` requests/s (``inf``: all at 0) and a
    ``interactive_share`` fraction of items (chosen by the seed) marked interactive."""
    rng = random.Random(seed * 7919 + 1)
    t = 0.0
    items = []
    for it in workload.items:
        if rate != float("inf"):
            t += rng.expovariate(rate)
        tier = "interactive" if rng.random() < interactive_share else "batch"
        items.append(WorkItem(list(it.prompt_ids), it.max_tokens, t if rate != float("inf") else 0.0, tier,
                              it.shared_prefix_len))
    return Workload(workload.name, items, {**workload.params, "rate": rate, "interactive_share": interactive_share,
                                           "arrival_seed": seed})


def load_sharegpt(path: str | Path, tokenize, *, n: int = 64, seed: int = 0, max_prompt_len: int = 1024,
                  max_output_len: int = 512, min_len: int = 4) -> Workload:
    """Load a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}]}``).

    As in vLLM's benchmarks: conversations with at least two turns; the first turn is the prompt, the length of
    the second (the reply) is the number of output tokens. Items are shuffled by ``seed`` and too short or too
    long pairs are skipped. ``tokenize`` maps text to token ids (e.g. ``engine.encode``-like callable).
    """
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("data") or data.get("conversations") or []
    convs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages") or []
        if len(turns) >= 2:
            first, second = turns[0], turns[1]
            a = first.get("value", first.get("content"))
            b = second.get("value", second.get("content"))
            if isinstance(a, str) and isinstance(b, str):
                convs.append((a, b))
    rng = random.Random(seed)
    rng.shuffle(convs)
    items: list[WorkItem] = []
    for prompt, reply in convs:
        if len(items) >= n:
            break
        p = list(tokenize(prompt))
        o = len(list(tokenize(reply)))
        if len(p) < min_len or o < min_len or len(p) > max_prompt_len or o > max_output_len:
            continue
        items.append(WorkItem(p, o))
    if not items:
        raise ValueError(f"{path}: no usable ShareGPT conversations (need >= 2 turns within the length limits)")
    return Workload("sharegpt", items, {"path": str(path), "seed": seed, "max_prompt_len": max_prompt_len,
                                        "max_output_len": max_output_len})
