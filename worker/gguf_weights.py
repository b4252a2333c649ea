"""A Llama-family GGUF checkpoint's tensors as they are: 4-bit and 8-bit blocks kept quantised, not widened.

The default model ships as a Q4_1 GGUF. Converting it to float (what ``worker.loader`` does once, for the
float path and for Hugging Face's tools) multiplies the bytes each decode step reads by eight; with
``--quantization auto`` the loader reads the blocks straight from the GGUF instead and maps them onto
:mod:`kernels.quant`'s formats:

- Q4_1 (per 32 weights: f16 ``d``, f16 ``m``, 4-bit ``q``; ``w = d q + m``) -> int4, group 32, exactly in
  form (``scale = d``, ``zero = m + 8 d``; torch's int4 kernel rounds scales to bfloat16);
- Q4_0 (``w = d (q - 8)``) -> int4, group 32 (``zero = 0``);
- Q8_0 (``w = d q``, 32 per block) -> int8 with one scale per output channel: re-quantised from the exact
  float values, since the int8 product takes per-channel scales (logged, and measured by ``bench quality``);
- F32/F16/BF16 as float; any other type de-quantised to float with a logged notice.

Names become Hugging Face's (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``) and q/k
rows are put back in Hugging Face's rotate-half order (GGUF stores them interleaved), exactly as
transformers' GGUF loader does, so the rest of the loader cannot tell the sources apart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from inferq.log import get_logger
from kernels.quant import QuantizedWeight, quantize_int8
from worker.model_config import ModelConfig, ModelError

log = get_logger(__name__)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = 32


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face's name for a GGUF tensor name, or None for one the model does not use."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    return None


def _f16(raw: np.ndarray, at: int) -> torch.Tensor:
    """The f16 field at byte ``at`` of every block, as float32 ``[rows, blocks]``."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """A block's 16 bytes -> its 32 4-bit codes in order: low nibbles are weights 0-15, high ones 16-31."""
    return torch.from_numpy(np.concatenate((qs & 0x0F, qs >> 4), axis=-1))


def _q4(raw: np.ndarray, rows: int, cols: int, with_min: bool) -> QuantizedWeight:
    """Q4_1 (``with_min``) or Q4_0 blocks ``[rows, cols / 32, 20 or 18]`` -> int4, group 32."""
    blocks = raw.reshape(rows, cols // _BLOCK, -1)
    d = _f16(blocks, 0)
    head = 4 if with_min else 2
    codes = _nibbles(blocks[..., head:head + 16]).reshape(rows, cols)
    zero = _f16(blocks, 2) + 8.0 * d if with_min else torch.zeros_like(d)
    return QuantizedWeight("int4", codes.contiguous(), d.contiguous(), zero.contiguous(), _BLOCK)


def _q8_0_float(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    blocks = raw.reshape(rows, cols // _BLOCK, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32))
    return (q * _f16(blocks, 0)[..., None]).reshape(rows, cols)


def _tensor(t, name: str) -> torch.Tensor | QuantizedWeight:
    """One GGUF tensor, kept quantised where its blocks map onto a format of ours."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    cols = int(t.shape[0])  # GGUF lists the fastest-varying dimension (the input width) first
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    kind = t.tensor_type
    if kind in (T.Q4_0, T.Q4_1) and cols % _BLOCK == 0:
        return _q4(np.asarray(t.data), rows, cols, with_min=kind == T.Q4_1)
    if kind == T.Q8_0 and cols % _BLOCK == 0:
        w = _q8_0_float(np.asarray(t.data), rows, cols)
        q = quantize_int8(w)
        err = float((q.dequantize() - w).abs().max())
        log.info("Q8_0 weight re-quantised to int8 per output channel", tensor=name, max_abs_error=round(err, 6))
        return q
    if kind in (T.F32, T.F16, T.BF16):
        arr = np.asarray(t.data)
        out = torch.from_numpy(arr.astype(np.float32) if kind == T.F16 else arr.copy())
        if kind == T.BF16:
            out = out.view(torch.bfloat16).float()
        return out.reshape(rows, cols) if len(t.shape) > 1 else out.reshape(-1)
    log.info("GGUF tensor type has no quantised format here: de-quantised to float", tensor=name,
             type=kind.name)
    return torch.from_numpy(dequantize(np.asarray(t.data), kind).astype(np.float32)).reshape(rows, cols)


def _reverse_permute(w: torch.Tensor | QuantizedWeight, heads: int) -> torch.Tensor | QuantizedWeight:
    """GGUF's interleaved q/k rows back to Hugging Face's rotate-half order, per head."""
    n = w.shape[0]
    half = n // heads // 2
    index = torch.arange(n).view(heads, half, 2).transpose(1, 2).reshape(-1)
    if isinstance(w, QuantizedWeight):
        return w.rows(index)
    return w.index_select(0, index)


def read_gguf(path: Path, config: ModelConfig) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The checkpoint's tensors by Hugging Face name, quantised blocks kept (see the module docstring)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read GGUF {path}: {exc}") from exc
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = _tensor(t, t.name)
        if ".self_attn.q_proj." in name:
            w = _reverse_permute(w, config.num_heads)
        elif ".self_attn.k_proj." in name:
            w = _reverse_permute(w, config.num_kv_heads)
        tensors[name] = w
    return tensors
