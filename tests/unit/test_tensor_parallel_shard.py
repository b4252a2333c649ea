"""Sharding a checkpoint for tensor parallelism (worker/tensor_parallel.py), in one process: the rank slices put
back together are the checkpoint, biases of row-parallel projections are held once, the vocabulary is padded,
and a size that does not split the model is refused with the sizes that do."""

from __future__ import annotations

import pytest
import torch

from worker.model_config import ModelError, parse_config
from worker.tensor_parallel import (
    GatheredHead,
    VocabParallelEmbedding,
    check_divisible,
    shard_checkpoint,
    valid_sizes,
)

H, HEADS, KV, D, INTER, VOCAB = 16, 4, 2, 4, 12, 10


def _config(**over):
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=H, num_attention_heads=HEADS,
               num_key_value_heads=KV, intermediate_size=INTER, num_hidden_layers=1, vocab_size=VOCAB,
               attention_bias=True, mlp_bias=True)
    return parse_config({**raw, **over})


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB + 1, H), "lm_head.weight": (VOCAB + 1, H),
              "model.norm.weight": (H,), "model.layers.0.input_layernorm.weight": (H,),
              "model.layers.0.self_attn.q_proj.weight": (HEADS * D, H), "model.layers.0.self_attn.q_proj.bias": (HEADS * D,),
              "model.layers.0.self_attn.k_proj.weight": (KV * D, H), "model.layers.0.self_attn.v_proj.weight": (KV * D, H),
              "model.layers.0.self_attn.o_proj.weight": (H, HEADS * D), "model.layers.0.self_attn.o_proj.bias": (H,),
              "model.layers.0.mlp.gate_proj.weight": (INTER, H), "model.layers.0.mlp.up_proj.weight": (INTER, H),
              "model.layers.0.mlp.down_proj.weight": (H, INTER), "model.layers.0.mlp.down_proj.bias": (H,)}
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def test_rank_slices_reassemble_the_checkpoint():
    full = _checkpoint()
    shards = [shard_checkpoint(_config(), full, r, 2) for r in range(2)]
    cfg, _, lay = shards[0]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (HEADS // 2, KV // 2, INTER // 2)
    assert (lay.vocab_rows, lay.vocab_per_rank, cfg.vocab_size) == (VOCAB + 1, 6, 6)  # 11 rows padded to 12
    p = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"):  # column-parallel
        assert torch.equal(torch.cat([s[1][p + name] for s in shards]), full[p + name]), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel
        assert torch.equal(torch.cat([s[1][p + name] for s in shards], dim=1), full[p + name]), name
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):  # added once, by rank 0
        assert torch.equal(shards[0][1][p + name], full[p + name]) and p + name not in shards[1][1]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        joined = torch.cat([s[1][name] for s in shards])
        assert torch.equal(joined[: VOCAB + 1], full[name]) and not joined[VOCAB + 1:].any()
    assert torch.equal(shards[1][1]["model.norm.weight"], full["model.norm.weight"])  # replicated


def test_sizes_that_do_not_split_the_model_are_refused():
    smol = _config(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, hidden_size=576)
    assert valid_sizes(smol) == [1, 3]
    with pytest.raises(ModelError, match=r"tensor_parallel_size 2 does not divide the model's attention heads 9, "
                                         r"KV heads 3 \(sizes that do, up to 16: 1, 3\)"):
        check_divisible(smol, 2)
    check_divisible(smol, 3)


def test_vocab_parallel_lookup_and_head_equal_the_full_ones():
    table = torch.randn(VOCAB + 1, H)
    padded = torch.cat([table, torch.zeros(1, H)])
    ids = torch.tensor([0, 5, 6, 10, 3])
    parts = [VocabParallelEmbedding(lambda i, r=r: padded[6 * r: 6 * r + 6][i], 6 * r, 6 * r + 6, lambda t: t)(ids)
             for r in range(2)]
    assert torch.equal(parts[0] + parts[1], table[ids])  # exactly one rank holds each id
    h = torch.randn(3, H)
    head = GatheredHead(lambda x: x @ padded.t(), lambda t: t, VOCAB + 1)  # one rank's "gather": the whole row
    assert head(h).shape == (3, VOCAB + 1) and torch.allclose(head(h), h @ table.t())
    assert head(h[:0]).shape == (0, VOCAB + 1)
