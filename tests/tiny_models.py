"""Tiny random Hugging Face checkpoints for tests (shared by all test suites).

    from tests.tiny_models import make_tiny_model
    path = make_tiny_model(tmp_path, arch="qwen2", num_hidden_layers=3)

writes a real HF directory (config.json, model.safetensors, generation_config.json and a byte-level BPE
tokenizer with a ChatML chat template) that both transformers and inferq load. Weights are random but
deterministic for a given ``seed``; the default shapes use grouped-query attention (4 heads, 2 kv heads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "Paged attention keeps keys and values in fixed size blocks.",
    "Continuous batching schedules requests every step.",
    "Redis streams carry jobs; PostgreSQL keeps the ledger.",
    "Once upon a time there was a small language model.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]

ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (any text encodes) with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", **overrides: Any):
    """A transformers config for a tiny model of ``arch`` ("llama", "qwen2" or "mistral")."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r} (expected one of {sorted(ARCHS)})")
    base: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    if arch == "mistral":
        base.setdefault("sliding_window", None)
    cfg = cls(**base)
    cfg.architectures = [ARCHS[arch]]
    return cfg


def make_tiny_model(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    name: str | None = None,
    with_tokenizer: bool = True,
    init_std: float = 0.1,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint under ``tmp_path`` and return its directory.

    ``overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``, ``num_key_value_heads=1``,
    ``tie_word_embeddings=True``, ``rope_scaling={...}``, ``attention_bias=True``). ``init_std`` is larger
    than HF's default so that random logits are well separated (greedy argmax is stable across
    implementations). The tokenizer's ids are all below the default vocab_size 384."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = tiny_config(arch, **overrides)
    cfg.initializer_range = init_std
    out = Path(tmp_path) / (name or f"tiny-{arch}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Random (not zero/one) norms and biases so that every weight matters in equivalence tests.
        for name_, p in model.named_parameters():
            if name_.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name_.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(out)
    if with_tokenizer:
        tok = make_tokenizer()
        tok.save_pretrained(out)
        vocab = len(tok)
        if vocab > cfg.vocab_size:
            raise ValueError(f"tokenizer has {vocab} tokens but vocab_size is {cfg.vocab_size}")
        # Point the ids at the tokenizer's specials so chat-style tests stop on <|im_end|>.
        eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
        bos_id = tok.convert_tokens_to_ids(BOS_TOKEN)
        for fname in ("config.json", "generation_config.json"):
            p = out / fname
            data = json.loads(p.read_text())
            data["eos_token_id"] = eos_id
            data["bos_token_id"] = bos_id
            if fname == "config.json":
                data["pad_token_id"] = bos_id
            p.write_text(json.dumps(data, indent=2))
    return out
