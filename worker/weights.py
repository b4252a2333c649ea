"""A checkpoint's weights in the layout ``worker.model.CausalLM`` runs: read from local safetensors, names
normalised, q/k/v and gate/up projections fused into one matmul each (fewer, larger GEMMs are faster on CPU),
q/k rows permuted for the complex RoPE path, the head tied to the embedding, and every projection planned
for the CPU GEMM (``kernels.cpu_gemm``: layout and kernel measured on this machine)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, quant, quant_gemm
from kernels.cpu_gemm import Linear
from kernels.quant import QuantizedWeight
from worker.model_config import ModelConfig, ModelError

# The quantisation settings that quantise float weights as they load, and the int8-activation forms a setting
# lets the planner time where it differs from our block-32 ones (kernels/quant_gemm.py): w8a16 none, w8a8
# torch's per-token one too
QUANTIZED_AT_LOAD = ("int8", "w8a16", "w8a8", "int4", "w4a8")
ACTIVATIONS = {"w8a16": "float", "w8a8": "any", "w4a8": "int8"}
WEIGHT_FORMAT = {"w4a8": "int4"}  # the weight format of a setting not named after one


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear | quant_gemm.QuantLinear  # q, k, v stacked (q and k rows permuted for the complex RoPE path)
    o: Linear | quant_gemm.QuantLinear
    post_norm: torch.Tensor
    gate_up: Linear | quant_gemm.QuantLinear  # gate and up stacked
    down: Linear | quant_gemm.QuantLinear


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear | quant_gemm.QuantLinear
    embed_rows: Callable[[torch.Tensor], torch.Tensor]  # token ids -> embeddings in the model's dtype
    embed: torch.Tensor | None  # the embedding table, None when the lookup reads the tied head's rows


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (OSError, SafetensorError, ValueError) as exc:
            raise ModelError(f"cannot read weights {f}: {exc}") from exc
    return tensors


class _Reader:
    """Takes named tensors out of a checkpoint (each once), converted to the model's device and dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, weight_dtype: torch.dtype, interleave_rope: bool, where: str,
                 quantization: str = "none", group_size: int = 32) -> None:
        # Normalise names: drop a leading "model." (and tolerate checkpoints saved without it).
        self.w = {name.removeprefix("model."): t for name, t in tensors.items()}
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weight_dtype = weight_dtype
        self.interleave_rope = interleave_rope
        self.where = where
        # "none", or one of QUANTIZED_AT_LOAD: float weights quantised as loaded (kernels/quant_gemm.py's
        # activations: int8 times float or block-32 int8 ones; w8a16 float only; w8a8 per-token ones too; w4a8
        # int4 times block-32 int8 ones in every product but the head's)
        self.quantization = quantization
        self.group_size = group_size
        half = config.head_dim // 2
        self._half_perm = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)

    def take(self, name: str, required: bool = True) -> torch.Tensor | QuantizedWeight | None:
        """A float tensor in the model's dtype, or a pre-quantised weight as the checkpoint holds it."""
        t = self.w.pop(name, None)
        if t is None:
            if required:
                raise ModelError(f"{self.where}: missing weight {name!r}")
            return None
        if isinstance(t, QuantizedWeight):
            return t
        return t.to(device=self.device, dtype=self.dtype)

    def cat(self, *parts):
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ModelError(f"{self.where}: inconsistent biases")
        if any(isinstance(p, QuantizedWeight) for p in parts):
            if not all(isinstance(p, QuantizedWeight) for p in parts):  # e.g. a GGUF with q in Q4_1, k in F16
                parts = tuple(p if isinstance(p, QuantizedWeight) else quant.quantize(p, self._fmt(parts))
                              for p in parts)
            return quant.cat(list(parts))
        return torch.cat(parts, dim=0).contiguous()

    @staticmethod
    def _fmt(parts) -> str:
        return next(p.fmt for p in parts if isinstance(p, QuantizedWeight))

    def rope_rows(self, t: torch.Tensor | None, heads: int) -> torch.Tensor | None:
        """RoPE as one complex multiply (float32): permute each q/k head's rows from HF's rotate-half layout
        [x1 | x2] to interleaved pairs (x1_i, x2_i). q.k is invariant under the same permutation of both, so
        attention is unchanged (the cache simply holds keys in the permuted layout)."""
        d = self.config.head_dim
        if t is None or not self.interleave_rope or t.shape[0] != heads * d:
            return t  # (a shape mismatch is reported by the caller)
        if isinstance(t, QuantizedWeight):
            return t.rows((torch.arange(heads)[:, None] * d + self._half_perm[None, :]).reshape(-1))
        return t.view(heads, d, *t.shape[1:])[:, self._half_perm].reshape(t.shape)

    def linear(self, w_oi, b: torch.Tensor | None, embedding: bool = False, head: bool = False):
        """A projection planned for this CPU (kernels/cpu_gemm.py measures each one's layout and GEMM form;
        kernels/quant_gemm.py the form of a quantised one). With ``quantization`` set, a float weight is
        quantised first; the LM head to int8 whatever the format (the logits are the most sensitive product,
        and int8 keeps its error well under int4's, as llama.cpp's 4-bit files do with a Q6/Q8 head)."""
        assert w_oi is not None  # take() raised for missing required weights
        if not isinstance(w_oi, QuantizedWeight) and self.quantization != "none":
            fmt = WEIGHT_FORMAT.get(self.quantization, self.quantization)
            fmt = fmt if fmt in ("int8", "int4") and not head else "int8"
            try:
                w_oi = quant.quantize(w_oi, fmt, self.group_size)
            except ValueError as exc:  # e.g. a width that is no whole number of int4 groups
                raise ModelError(f"{self.where}: cannot quantise to {fmt}: {exc}") from exc
        if isinstance(w_oi, QuantizedWeight):
            return quant_gemm.plan(w_oi, None if b is None else b.float(), embedding=embedding,
                                   activations="float" if head else ACTIVATIONS.get(self.quantization, "blocks"))
        if self.weight_dtype != self.dtype:  # only the packed kernel multiplies bfloat16 panels by float32 rows
            return cpu_gemm.plan(w_oi.to(self.weight_dtype), b, packed_only=True)
        return cpu_gemm.plan(w_oi, b, embedding=embedding)


def _load_layer(r: _Reader, i: int) -> LayerWeights:
    c = r.config
    p = f"layers.{i}."
    a = p + "self_attn."
    m = p + "mlp."
    layer = LayerWeights(
        input_norm=r.take(p + "input_layernorm.weight"),
        qkv=r.linear(
            r.cat(
                r.rope_rows(r.take(a + "q_proj.weight"), c.num_heads),
                r.rope_rows(r.take(a + "k_proj.weight"), c.num_kv_heads),
                r.take(a + "v_proj.weight"),
            ),
            r.cat(
                r.rope_rows(r.take(a + "q_proj.bias", c.qkv_bias), c.num_heads),
                r.rope_rows(r.take(a + "k_proj.bias", c.qkv_bias), c.num_kv_heads),
                r.take(a + "v_proj.bias", c.qkv_bias),
            ),
        ),
        o=r.linear(r.take(a + "o_proj.weight"), r.take(a + "o_proj.bias", False)),
        post_norm=r.take(p + "post_attention_layernorm.weight"),
        gate_up=r.linear(r.cat(r.take(m + "gate_proj.weight"), r.take(m + "up_proj.weight")),
                         r.cat(r.take(m + "gate_proj.bias", False), r.take(m + "up_proj.bias", False))),
        down=r.linear(r.take(m + "down_proj.weight"), r.take(m + "down_proj.bias", False)),
    )
    if layer.qkv.out_features != (c.num_heads + 2 * c.num_kv_heads) * c.head_dim:
        raise ModelError(f"{r.where}: layer {i} attention weights do not match the config's head counts")
    return layer


def _load_head(r: _Reader, embed: torch.Tensor):
    """(lm_head, embedding lookup, embedding table or None): a tied head is the embedding table too, so the
    lookup then reads the head's rows (one copy, whatever layout the head runs fastest in)."""
    lm_head = r.w.pop("lm_head.weight", None)
    # Some exports drop lm_head even without tie_word_embeddings; the embedding is the only sensible choice.
    if lm_head is None or r.config.tie_word_embeddings:
        lm_head = embed
    elif not isinstance(lm_head, QuantizedWeight):
        lm_head = lm_head.to(device=r.device, dtype=r.dtype)
    tied = lm_head is embed
    head = r.linear(lm_head, None, embedding=tied, head=True)
    if not tied:
        if isinstance(embed, QuantizedWeight):  # an untied pre-quantised table: looked up in float
            embed = embed.dequantize(r.dtype)
        return head, (lambda ids, table=embed: F.embedding(ids, table)), embed
    rows, dtype = head.rows, r.dtype
    widen = r.weight_dtype != r.dtype or isinstance(head, quant_gemm.QuantLinear)  # rows come back float32
    return head, ((lambda ids: rows(ids).to(dtype)) if widen else rows), None


def load_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device, weight_dtype: torch.dtype | None = None, interleave_rope: bool = False,
                 where: str = "checkpoint", quantization: str = "none", group_size: int = 32) -> ModelWeights:
    """The fused, planned weights of ``config``'s model from a checkpoint's tensors (float, or quantised as
    read from a GGUF). ``weight_dtype``: the projections' storage when it differs from the arithmetic
    ``dtype``; ``interleave_rope``: permute q/k rows for the complex RoPE path; ``quantization``: "int8" or
    "int4" quantises float projections as they load (``group_size``: int4's)."""
    r = _Reader(tensors, config=config, dtype=dtype, device=device, weight_dtype=weight_dtype or dtype,
                interleave_rope=interleave_rope, where=where, quantization=quantization, group_size=group_size)
    embed = r.take("embed_tokens.weight")
    if embed.shape[0] < config.vocab_size:
        raise ModelError(f"{where}: embedding has {embed.shape[0]} rows, config vocab_size {config.vocab_size}")
    layers = [_load_layer(r, i) for i in range(config.num_layers)]
    norm = r.take("norm.weight")
    lm_head, embed_rows, table = _load_head(r, embed)
    return ModelWeights(layers=layers, norm=norm, lm_head=lm_head, embed_rows=embed_rows, embed=table)
