"""Our own forward pass for Llama-family decoder models (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM; SmolLM2 is a Llama).

The batch is flattened: all tokens of all scheduled requests form one ``[T, hidden]`` tensor with per-token
positions (no padding); attention goes through an ``AttentionBackend`` over the paged KV cache; logits are
computed only for the rows in ``logits_indices`` (the last token of each request that samples).

Weights come from local safetensors; q/k/v and gate/up projections are concatenated at load time into one
matmul each (fewer, larger GEMMs are faster on CPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from inferq.log import get_logger
from kernels import cpu_gemm, hugepages, packed_gemm
from kernels.backend import AttentionBackend, AttentionMetadata
from kernels.cpu_gemm import Linear

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelError(Exception):
    """A model that cannot be found, read or run (message names the path or the unsupported feature)."""


@dataclass
class ModelConfig:
    """The parts of a HF ``config.json`` the forward pass needs."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence we run exactly: the model's context, capped by a sliding window if one is used
        (we do not implement windowed attention, so stay within the window where it changes nothing)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Validate and normalise a HF config dict (transformers 4.x and 5.x layouts)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = raw.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        if archs or model_type not in by_type:
            raise ModelError(
                f"{where}: unsupported architecture {archs or model_type!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        arch = by_type[model_type]
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        # transformers 5 stores rope_theta/rope_scaling inside "rope_parameters".
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = rope_params
        rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rtype = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
            rope_scaling["rope_type"] = rtype
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise ModelError(
                    f"{where}: unsupported rope scaling type {rtype!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            if rtype == "default":
                rope_scaling = None
        if float(raw.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ModelError(f"{where}: partial rotary embeddings are not supported")
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelError(f"{where}: unsupported activation {raw.get('hidden_act')!r} (only silu)")
        sliding = None
        if arch == "MistralForCausalLM":
            sliding = raw.get("sliding_window")
        elif arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
            layer_types = raw.get("layer_types") or []
            if not layer_types or "sliding_attention" in layer_types:
                sliding = raw.get("sliding_window")
        qkv_bias = True if arch == "Qwen2ForCausalLM" else bool(raw.get("attention_bias", False))
        o_bias = bool(raw.get("attention_bias", False)) if arch != "Qwen2ForCausalLM" else False
        return ModelConfig(
            architecture=arch,
            model_type=str(raw.get("model_type", "")),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_list(raw.get("eos_token_id")),
            raw=raw,
        )
    except KeyError as exc:
        raise ModelError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{where}: invalid value ({exc})") from exc


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelError(f"{path} does not exist (not a Hugging Face model directory)") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{path} is not a JSON object")
    return parse_config(raw, str(path))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, config: ModelConfig | None = None
) -> torch.dtype:
    """``"auto"`` is float32 on CPU and the checkpoint's half dtype (default bfloat16) on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return _DTYPES[str(dtype)]
        except KeyError:
            raise ModelError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)") from None
    if device.type == "cpu":
        return torch.float32
    if config is not None and config.torch_dtype in ("float16", "bfloat16"):
        if config.torch_dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return _DTYPES[config.torch_dtype]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def cpu_half_gemm_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX, through oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# --- rotary embedding --------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), including linear/llama3 scaling as HF computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = config.rope_scaling
    if not sc:
        return inv_freq
    rtype = sc["rope_type"]
    if rtype == "linear":
        return inv_freq / float(sc["factor"])
    if rtype == "llama3":
        factor = float(sc["factor"])
        low = float(sc["low_freq_factor"])
        high = float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    raise ModelError(f"unsupported rope scaling type {rtype!r}")


# --- the model ----------------------------------------------------------------------------------------


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v projections stacked (q and k rows permuted for the complex RoPE path)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up stacked
    down: Linear


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
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


class CausalLM:
    """Llama/Qwen2/Mistral decoder with fused projections, run on a flattened batch."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        where: str = "checkpoint",
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype  # activations and arithmetic
        # the projections' storage: bfloat16 under float32 arithmetic on a CPU without native bfloat16
        # matmul (see from_pretrained); otherwise the same as dtype
        self.weight_dtype = weight_dtype or dtype
        self.device = device
        c = config
        # Normalise names: drop a leading "model." (and tolerate checkpoints saved without it).
        w: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith("model."):
                name = name[len("model.") :]
            w[name] = t

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = w.pop(name, None)
            if t is None:
                if required:
                    raise ModelError(f"{where}: missing weight {name!r}")
                return None
            return t.to(device=device, dtype=dtype)

        def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ModelError(f"{where}: inconsistent biases")
            return torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]

        # RoPE as one complex multiply (float32): permute each q/k head's rows from HF's rotate-half layout
        # [x1 | x2] to interleaved pairs (x1_i, x2_i). q.k is invariant under the same permutation of both, so
        # attention is unchanged (the cache simply holds keys in the permuted layout).
        self._complex_rope = dtype == torch.float32
        half_perm = torch.stack((torch.arange(c.head_dim // 2), torch.arange(c.head_dim // 2) + c.head_dim // 2),
                                dim=1).reshape(-1)

        def rope_rows(t: torch.Tensor | None, heads: int) -> torch.Tensor | None:
            if t is None or not self._complex_rope or t.shape[0] != heads * c.head_dim:
                return t  # (a shape mismatch is reported below)
            return t.view(heads, c.head_dim, *t.shape[1:])[:, half_perm].reshape(t.shape)

        # CPU: each projection's layout and GEMM form are measured on this machine (kernels/cpu_gemm.py)
        narrow = self.weight_dtype != dtype

        def linear(w_oi: torch.Tensor | None, b: torch.Tensor | None, embedding: bool = False) -> Linear:
            assert w_oi is not None  # take() raised for missing required weights
            if narrow:  # only the packed kernel multiplies bfloat16 panels by float32 rows
                return cpu_gemm.plan(w_oi.to(self.weight_dtype), b, packed_only=True)
            return cpu_gemm.plan(w_oi, b, embedding=embedding)

        self.embed = take("embed_tokens.weight")
        if self.embed.shape[0] < c.vocab_size:
            raise ModelError(
                f"{where}: embedding has {self.embed.shape[0]} rows, config vocab_size {c.vocab_size}"
            )
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(
                        cat(
                            rope_rows(take(a + "q_proj.weight"), c.num_heads),
                            rope_rows(take(a + "k_proj.weight"), c.num_kv_heads),
                            take(a + "v_proj.weight"),
                        ),
                        cat(
                            rope_rows(take(a + "q_proj.bias", c.qkv_bias), c.num_heads),
                            rope_rows(take(a + "k_proj.bias", c.qkv_bias), c.num_kv_heads),
                            take(a + "v_proj.bias", c.qkv_bias),
                        ),
                    ),
                    o=linear(take(a + "o_proj.weight"), take(a + "o_proj.bias", False)),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(cat(take(m + "gate_proj.weight"), take(m + "up_proj.weight")),
                                   cat(take(m + "gate_proj.bias", False), take(m + "up_proj.bias", False))),
                    down=linear(take(m + "down_proj.weight"), take(m + "down_proj.bias", False)),
                )
            )
            q_out = c.num_heads * c.head_dim
            kv_out = c.num_kv_heads * c.head_dim
            if self.layers[-1].qkv.out_features != q_out + 2 * kv_out:
                raise ModelError(
                    f"{where}: layer {i} attention weights do not match the config's head counts"
                )
        self.norm = take("norm.weight")
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None:
            if not c.tie_word_embeddings:
                # Some exports drop lm_head even without the flag; the embedding is the only sensible choice.
                pass
            lm_head = self.embed
        elif c.tie_word_embeddings:
            lm_head = self.embed
        else:
            lm_head = lm_head.to(device=device, dtype=dtype)
        # a tied head is the embedding table too: the lookup then reads the head's rows (one copy, whatever
        # layout the head runs fastest in)
        tied = lm_head is self.embed
        self.lm_head = linear(lm_head, None, embedding=tied)
        if tied:
            rows = self.lm_head.rows
            self._embed_rows = (lambda ids: rows(ids).to(dtype)) if narrow else rows
            del self.embed
        else:
            self._embed_rows = lambda ids, table=self.embed: F.embedding(ids, table)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.inv_freq = rope_inv_freq(c).to(device)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build_rope_cache(min(c.max_model_len, 8192))
        self._fast_norm = dtype == torch.float32 and hasattr(F, "rms_norm")
        self._contiguous_qkv = device.type != "cpu"

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
    ) -> CausalLM:
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev, config)
        tensors = _read_safetensors(model_dir)
        if (dev.type == "cpu" and dt == torch.bfloat16 and not cpu_half_gemm_is_native()
                and packed_gemm.available()):
            # No native bfloat16 matmul (torch's fallback GEMM is ~25x slower than float32 here): keep the
            # projections in bfloat16 (half the bytes each step reads) and compute in float32, widening each
            # weight as the packed kernel loads it. The KV cache is bfloat16 too (ModelRunner's default).
            get_logger(__name__).info("bfloat16 weights with float32 arithmetic (no native bfloat16 matmul on "
                                      "this CPU)")
            return cls(config, tensors, dtype=torch.float32, device=dev, where=str(model_dir),
                       weight_dtype=torch.bfloat16)
        if dev.type == "cpu" and dt != torch.float32 and not cpu_half_gemm_is_native():
            # measured on an AVX2-only AMD EPYC: a bfloat16 decode step of SmolLM2-135M at batch 64 took 11 s,
            # the float32 one 0.4 s (torch falls back to a reference GEMM without AVX512-BF16/AMX)
            get_logger(__name__).warning(
                "this CPU has no native bfloat16/float16 matrix multiply; expect it to be ~25x slower than "
                "float32 (use --dtype float32)", dtype=str(dt).removeprefix("torch."))
        return cls(config, tensors, dtype=dt, device=dev, where=str(model_dir))

    # -- helpers ---------------------------------------------------------------------------------------

    def _build_rope_cache(self, length: int) -> None:
        pos = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [L, D/2] float32, as HF computes it
        cos, sin = freqs.cos(), freqs.sin()
        if self._complex_rope:  # one complex table: rotation = multiplication by cos + i sin
            self._rope_cache = (torch.complex(cos, sin), sin)
        else:
            self._rope_cache = (cos.to(self.dtype), sin.to(self.dtype))

    def _rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rope_cache  # type: ignore[misc]
        if max_pos >= cos.shape[0]:
            self._build_rope_cache(max(max_pos + 1, 2 * cos.shape[0]))
            cos, sin = self._rope_cache  # type: ignore[misc]
        if self._complex_rope:
            return cos.index_select(0, positions), sin
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                          prefault: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One K and one V pool per layer, ``[num_blocks, block_size, Hkv, D]`` of ``dtype`` (default: the
        model's; attention computes in the model's dtype whatever the cache holds). ``prefault``: map every
        page now (CPU) rather than on first use inside a step."""
        c = self.config
        dtype = dtype or self.dtype
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        if self.device.type == "cpu":  # 2 MiB pages: fewer TLB misses for scattered block reads
            return [(hugepages.zeros(shape, dtype, prefault), hugepages.zeros(shape, dtype, prefault))
                    for _ in range(c.num_layers)]
        return [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        c = self.config
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem

    # -- forward ---------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Logits (float32) ``[len(logits_indices), vocab]`` (or for every token if indices is None)."""
        c = self.config
        t = input_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qk_heads = hq + hkv
        if max_position is None:
            max_position = int(positions.max()) if t else 0
        cos, sin = self._rope(positions, max_position)
        cos = cos[:, None, :]  # complex rotation [T, 1, D/2] on the complex path
        sin = sin[:, None, :]
        half = d // 2
        complex_rope = self._complex_rope
        if meta.scale is None:
            meta.scale = self.scale
        x = self._embed_rows(input_ids)
        residual = x
        h = self._norm(x, self.layers[0].input_norm) if self.layers else x
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)  # [T, (Hq + 2Hkv) D]
            if complex_rope:  # interleaved pairs (see __init__): RoPE on q and k as one complex multiply
                qk = torch.view_as_complex(qkv[:, : self.q_size + self.kv_size].view(t, qk_heads, half, 2))
                qk = torch.view_as_real(qk * cos).view(t, qk_heads, d)
            else:
                qk = qkv[:, : self.q_size + self.kv_size].view(t, qk_heads, d)
                x1, x2 = qk[..., :half], qk[..., half:]
                qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # RoPE on q and k at once
            q = qk[:, :hq]
            k = qk[:, hq:]
            v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
            if self._contiguous_qkv:  # GPU kernels get dense tensors; on CPU the strided views are fine
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            k_cache, v_cache = kv_caches[i]
            backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.forward(q, k, v, k_cache, v_cache, meta)
            attn = attn.reshape(t, self.q_size)
            # residual += attn W_o^T in place (the residual is always this forward's own tensor)
            layer.o.add_to(residual, attn)
            h = self._norm(residual, layer.post_norm)
            gu = layer.gate_up(h, contiguous=False)  # SiLU-mul and the down GEMM take any strides
            inter = gu.shape[-1] // 2
            act = F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:])  # SwiGLU in place (a strided view)
            layer.down.add_to(residual, act)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            if nxt is not None:
                h = self._norm(residual, nxt)
        if logits_indices is not None:
            residual = residual.index_select(0, logits_indices)
        h = self._norm(residual, self.norm)
        return self.lm_head(h).float()  # contiguous: the sampler's row-wise argmax is 3x slower on a transposed view

    __call__ = forward
