"""Test doubles for the engine: a fake model runner whose next token is a function of the context it
reads back *through the paged KV cache*, so wrong block tables or bad prefix-cache hits change outputs. Also
the workloads the real-model engine tests share (on CPU and on CUDA)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from scheduler.request import Request, SamplingParams, Tier


@dataclass
class FakeInfo:
    vocab_size: int = 97
    max_model_len: int = 256
    eos_token_ids: tuple[int, ...] = ()


def next_token(context: list[int], vocab: int) -> int:
    """The reference "model": deterministic in the whole context."""
    h = 0
    for t in context:
        h = (h * 1000003 + t + 1) % 2_147_483_647
    return h % vocab


@dataclass
class FakeRunner:
    num_blocks: int = 64
    block_size: int = 4
    info: FakeInfo = field(default_factory=FakeInfo)
    calls: list[list[tuple[str, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [[None] * self.block_size for _ in range(self.num_blocks)]

    def execute(self, batch: list[tuple[Request, int]]) -> list[int | None]:
        self.calls.append([(r.request_id, n) for r, n in batch])
        out: list[int | None] = []
        bs = self.block_size
        for r, n in batch:
            c = r.num_computed_tokens
            toks = r.all_token_ids
            assert 1 <= n and c + n <= len(toks) and len(r.block_table) * bs >= c + n
            for pos in range(c, c + n):  # "write K/V"
                self.kv[r.block_table[pos // bs]][pos % bs] = toks[pos]
            if c + n < len(toks):
                out.append(None)
                continue
            context = [self.kv[r.block_table[p // bs]][p % bs] for p in range(c + n)]  # "attend"
            out.append(next_token(context, self.info.vocab_size))
        return out


def reference(prompt: list[int], max_tokens: int, vocab: int = 97, eos: tuple[int, ...] = ()) -> list[int]:
    """What an engine over FakeRunner must produce for a request alone."""
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(ctx, vocab)
        out.append(t)
        ctx.append(t)
        if t in eos:
            break
    return out


def run_all(engine: Any, reqs: list[Request]) -> dict[str, Any]:
    """Add ``reqs`` and step the engine until they are done: their outputs by request id."""
    for r in reqs:
        engine.add_request(r)
    return {o.request_id: o for o in engine.run_until_done()}


def greedy_workload(seed: int = 1, n: int = 22) -> tuple[list[list[int]], list[int]]:
    """Prompts (a third share a 20-token system prompt, lengths 1-70) and their max_tokens, for greedy runs
    compared with Hugging Face ``generate``."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(20)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 300) for _ in range(rng.choice([1, 3, 8, 15, 33, 50]))]
        prompts.append(system + tail if i % 3 == 0 else tail)
    return prompts, [4 + (i * 5) % 13 for i in range(n)]


def seeded_requests(seed: int = 2, n: int = 10) -> list[Request]:
    """Sampled requests with seeds of their own (temperature, top-p, top-k): their tokens must not depend on
    how they are batched."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    return [Request(f"s{i}", p, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=40, seed=100 + i,
                                               ignore_eos=True))
            for i, p in enumerate(prompts)]


def greedy_requests(prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Greedy requests ``g0, g1, ...``, every fourth in the interactive tier."""
    return [Request(f"g{i}", p, SamplingParams(max_tokens=m, temperature=0.0),
                    tier=Tier.INTERACTIVE if i % 4 == 0 else Tier.BATCH)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]


def mismatches(outs: dict[str, Any], expected: list[list[int]]) -> list[int]:
    """The indices of the greedy requests whose tokens differ from ``expected``."""
    return [i for i in range(len(expected)) if outs[f"g{i}"].token_ids != expected[i]]
