"""Megatron-style sharding of a checkpoint for tensor parallelism: which slice of every weight a rank holds.

Why slice the checkpoint rather than the fused weights: ``worker.weights`` fuses q/k/v and gate/up and plans
every projection for this CPU; slicing the *source* tensors per rank and giving ``load_weights`` a config
with ``num_heads / N`` (etc.) reuses all of that unchanged. The float32 RoPE interleave permutes rows within
each head, so it works per shard as long as a shard holds whole heads (it does: heads split by rank).

Per rank ``r`` of ``N``:
- q/k/v and gate/up (column-parallel): the rows of this rank's attention heads, KV heads and MLP columns;
- o and down (row-parallel): the matching input columns; their partial products are summed across ranks
  (one all-reduce each, ``CausalLM.all_reduce``); a bias is added once (rank 0 keeps it);
- embedding and LM head (vocabulary-parallel): rows ``[r V/N, (r+1) V/N)`` of the vocabulary padded to a
  multiple of N; a lookup masks ids outside the slice and all-reduces, the head's logit slices are gathered
  to rank 0;
- norms: replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from worker.model_config import ModelConfig, ModelError

# checkpoint name suffixes (after the layer prefix) and how each is split
_HEAD_ROWS = ("self_attn.q_proj.",)
_KV_ROWS = ("self_attn.k_proj.", "self_attn.v_proj.")
_MLP_ROWS = ("mlp.gate_proj.", "mlp.up_proj.")
_ROW_PARALLEL = {"self_attn.o_proj.": "heads", "mlp.down_proj.": "mlp"}
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


class TensorParallelError(RuntimeError):
    """Tensor parallelism cannot start or cannot go on (a bad size for the model, a rank that died or hung)."""


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``world`` holds: its slices of the heads, KV heads, MLP columns and vocabulary."""

    rank: int
    world: int
    heads: int  # attention heads per rank
    kv_heads: int
    head_dim: int
    intermediate: int  # MLP columns per rank
    vocab_rows: int  # embedding/head rows in the checkpoint (may exceed config.vocab_size)
    vocab_per_rank: int  # padded rows / world

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.vocab_per_rank


def check_divisible(config: ModelConfig, world: int) -> None:
    """Raise a ModelError naming every dimension that does not split evenly over ``world`` ranks (the
    vocabulary is padded instead, so it never fails)."""
    if world < 1:
        raise ModelError(f"tensor_parallel_size must be at least 1, got {world}")
    bad = [f"{name} {value}" for name, value in (("attention heads", config.num_heads),
                                                  ("KV heads", config.num_kv_heads),
                                                  ("intermediate size", config.intermediate_size))
           if value % world]
    if bad:
        sizes = valid_sizes(config, limit=16)
        raise ModelError(f"tensor_parallel_size {world} does not divide the model's {', '.join(bad)} "
                         f"(sizes that do, up to 16: {', '.join(map(str, sizes))})")


def valid_sizes(config: ModelConfig, limit: int = 16) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` that split this model's heads, KV heads and MLP evenly."""
    return [n for n in range(1, limit + 1)
            if not (config.num_heads % n or config.num_kv_heads % n or config.intermediate_size % n)]


def layout(config: ModelConfig, vocab_rows: int, rank: int, world: int) -> ShardLayout:
    check_divisible(config, world)
    return ShardLayout(rank=rank, world=world, heads=config.num_heads // world,
                       kv_heads=config.num_kv_heads // world, head_dim=config.head_dim,
                       intermediate=config.intermediate_size // world, vocab_rows=vocab_rows,
                       vocab_per_rank=-(-vocab_rows // world))


def shard_config(config: ModelConfig, lay: ShardLayout) -> ModelConfig:
    """The config a rank's ``CausalLM`` is built with: its own head counts, MLP width and vocabulary slice."""
    return replace(config, num_heads=lay.heads, num_kv_heads=lay.kv_heads, intermediate_size=lay.intermediate,
                   vocab_size=lay.vocab_per_rank)


def _rows(t: torch.Tensor, per_rank: int, rank: int) -> torch.Tensor:
    return t.narrow(0, rank * per_rank, per_rank)


def _cols(t: torch.Tensor, per_rank: int, rank: int) -> torch.Tensor:
    return t.narrow(1, rank * per_rank, per_rank)


def _vocab_rows(t: torch.Tensor, lay: ShardLayout) -> torch.Tensor:
    """This rank's vocabulary rows; the last rank's slice is zero-padded (padded logits are dropped)."""
    padded = lay.vocab_per_rank * lay.world
    if padded > t.shape[0]:
        t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
    return _rows(t, lay.vocab_per_rank, lay.rank)


def _shard_one(name: str, t: torch.Tensor, lay: ShardLayout) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor ``name`` (None: not held on this rank, a row-parallel bias)."""
    short = name.removeprefix("model.")
    if short in _VOCAB:
        return _vocab_rows(t, lay)
    part = short.split(".", 2)[-1] if short.startswith("layers.") else short
    d, r = lay.head_dim, lay.rank
    if part.startswith(_HEAD_ROWS):
        return _rows(t, lay.heads * d, r)
    if part.startswith(_KV_ROWS):
        return _rows(t, lay.kv_heads * d, r)
    if part.startswith(_MLP_ROWS):
        return _rows(t, lay.intermediate, r)
    for prefix, kind in _ROW_PARALLEL.items():
        if part.startswith(prefix):
            if part.endswith(".bias"):
                return t if r == 0 else None
            return _cols(t, lay.heads * d if kind == "heads" else lay.intermediate, r)
    return t  # norms: replicated


def shard_checkpoint(config: ModelConfig, tensors: dict[str, torch.Tensor], rank: int,
                     world: int) -> tuple[ModelConfig, dict[str, torch.Tensor], ShardLayout]:
    """(the rank's config, its slices of the checkpoint's tensors, the layout). Slices are copied so the
    full tensors can be freed."""
    embed = next((t for n, t in tensors.items() if n.removeprefix("model.") == "embed_tokens.weight"), None)
    if embed is None:
        raise ModelError("checkpoint has no embed_tokens.weight")
    lay = layout(config, int(embed.shape[0]), rank, world)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        part = _shard_one(name, t, lay)
        if part is not None:
            out[name] = part.contiguous().clone() if world > 1 else part
    return shard_config(config, lay), out, lay


@dataclass
class ShardLoader:
    """``CausalLM.from_pretrained(transform=...)``: the checkpoint as rank ``rank`` of ``world`` loads it; the
    layout it used is kept for the vocabulary-parallel lookup and head."""

    rank: int
    world: int
    layout: ShardLayout | None = None

    def __call__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]):
        cfg, part, self.layout = shard_checkpoint(config, tensors, self.rank, self.world)
        return cfg, part


# --- the vocabulary-parallel lookup and head -------------------------------------------------------------


@dataclass
class VocabParallelEmbedding:
    """Embedding lookup over a vocabulary slice: ids outside ``[start, end)`` give zero rows, and the sum over
    ranks (exactly one rank holds each id, the others add zeros) is the full lookup, bit for bit."""

    lookup: Callable[[torch.Tensor], torch.Tensor]
    start: int
    end: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        rows = self.lookup((ids - self.start).masked_fill_(outside, 0))
        return self.all_reduce(rows.masked_fill_(outside[:, None], 0))


@dataclass
class GatheredHead:
    """LM head over a vocabulary slice: each rank computes its slice of the logits, rank 0 gathers the full
    row (the others get their own slice back, which nobody reads). ``width``: the unpadded vocabulary."""

    head: Callable[[torch.Tensor], torch.Tensor]
    gather_columns: Callable[[torch.Tensor], torch.Tensor]
    width: int

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:  # nothing samples this step (every rank knows it): no collective
            return h.new_zeros(0, self.width)
        full = self.gather_columns(self.head(h))
        if full.shape[1] <= self.width:  # unpadded, or a rank other than 0 (its own slice)
            return full
        return full[:, : self.width].contiguous()  # rank 0 only: the padded columns dropped
