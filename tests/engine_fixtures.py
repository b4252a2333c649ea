"""Test doubles for the engine: a fake model runner whose next token is a function of the context it
reads back *through the paged KV cache*, so wrong block tables or bad prefix-cache hits change outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


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
