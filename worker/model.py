"""Our own forward pass for Llama-family decoder models (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM; SmolLM2 is a Llama).

The batch is flattened: all tokens of all scheduled requests form one ``[T, hidden]`` tensor with per-token
positions (no padding); attention goes through an ``AttentionBackend`` over the paged KV cache; logits are
computed only for the rows in ``logits_indices`` (the last token of each request that samples).

Weights come from local safetensors through ``worker.weights`` (q/k/v and gate/up projections fused into one
matmul each); the config through ``worker.model_config``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from inferq.log import get_logger
from kernels import cpu_norm, hugepages, kv_quant, packed_gemm
from kernels.attention_api import AttentionBackend, AttentionMetadata
from worker.model_config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    ModelError,
    load_config,
    parse_config,
)
from worker.rope import rope_inv_freq
from worker.weights import QUANTIZED_AT_LOAD, LayerWeights, load_weights, read_safetensors

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "CausalLM",
    "LayerWeights",
    "ModelConfig",
    "ModelError",
    "cpu_half_gemm_is_native",
    "load_config",
    "parse_config",
    "resolve_device",
    "resolve_dtype",
    "rope_inv_freq",
]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


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


# --- the model ----------------------------------------------------------------------------------------


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a model directory was converted from (``worker.loader``'s marker), if it is still there."""
    import json

    from worker.loader import MARKER

    try:
        source = Path(json.loads((model_dir / MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


def _quantized_format(tensors: dict) -> str:
    """"none", or the format of a checkpoint's pre-quantised weights ("int4" wins over "int8")."""
    from kernels.quant import QuantizedWeight

    fmts = {t.fmt for t in tensors.values() if isinstance(t, QuantizedWeight)}
    return "int4" if "int4" in fmts else ("int8" if fmts else "none")


def _read_packed(model_dir: Path, tensors: dict, quantization: str) -> dict | None:
    """A GPTQ/AWQ checkpoint's tensors with its packed projections unpacked (``worker/gptq_weights.py``):
    kept 4-bit under "auto", "int4" and "w4a8", de-quantised to float otherwise (logged); None for any other
    checkpoint."""
    from worker import gptq_weights

    cfg = gptq_weights.packed_config(model_dir)
    if cfg is None:
        return None
    return gptq_weights.unpack(tensors, cfg, keep=quantization in ("auto", "int4", "w4a8"), where=str(model_dir))


def _linear_bytes(p) -> int:
    """A projection's stored bytes (a quantised one reports its own; a float one its weight and bias)."""
    if hasattr(p, "nbytes"):
        return int(p.nbytes)
    return p.weight.nbytes + (p.bias.nbytes if p.bias is not None else 0)


def _triton_ops():
    """kernels.triton_ops where Triton imports (a GPU's half-precision norms and RoPE), else None (torch ops)."""
    try:
        from kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


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
        quantization: str = "none",
        group_size: int = 32,
    ) -> None:
        self.config = config
        self.dtype = dtype  # activations and arithmetic
        # the projections' storage: bfloat16 under float32 arithmetic on a CPU without native bfloat16
        # matmul (see from_pretrained); otherwise the same as dtype
        self.weight_dtype = weight_dtype or dtype
        self.device = device
        c = config
        # RoPE as one complex multiply on float32: the weights' q/k rows are interleaved (worker/weights.py)
        self._complex_rope = dtype == torch.float32
        weights = load_weights(c, tensors, dtype=dtype, device=device, weight_dtype=self.weight_dtype,
                               interleave_rope=self._complex_rope, where=where, quantization=quantization,
                               group_size=group_size)
        self.quantization = quantization if quantization != "none" else _quantized_format(tensors)
        self.layers: list[LayerWeights] = weights.layers
        self.norm = weights.norm
        self.lm_head = weights.lm_head
        self._embed_rows = weights.embed_rows
        if weights.embed is not None:  # (a tied head's lookup reads the head's rows: no separate table)
            self.embed = weights.embed
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.inv_freq = rope_inv_freq(c).to(device)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build_rope_cache(min(c.max_model_len, 8192))
        self._fast_norm = dtype == torch.float32 and hasattr(F, "rms_norm")
        self._triton_ops = _triton_ops() if device.type == "cuda" and dtype != torch.float32 else None
        # float32 or bfloat16 on CPU: one C call per norm, RoPE and SwiGLU (kernels/cpu_norm.py), a few us
        # instead of torch's chains of small ops
        self.use_c_ops(True)
        self.use_decode_step(True)
        self._contiguous_qkv = device.type != "cpu"
        # tensor parallelism (worker/tp_driver.py): sums the row-parallel o and down partial products over ranks
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
        transform: Callable[[ModelConfig, dict], tuple[ModelConfig, dict]] | None = None,
        quantization: str = "none", group_size: int = 32,
    ) -> CausalLM:
        """``transform``: (config, tensors) -> (config, tensors) before loading (a tensor-parallel shard).
        ``quantization``: "none"; "int8"/"w8a16"/"w8a8"/"int4"/"w4a8" (float weights quantised as they load); "auto" (a model
        converted from a GGUF is read from that GGUF with its 4/8-bit blocks kept, a GPTQ/AWQ checkpoint keeps its
        4-bit weights; any other stays float). A GPTQ/AWQ checkpoint under "none" is de-quantised to float."""
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev, config)
        if quantization != "none" and dev.type != "cpu":
            raise ModelError("quantised weights run on CPU only so far (use --quantization none on CUDA)")
        gguf = gguf_source(model_dir) if quantization == "auto" else None
        if gguf is not None:
            from worker.gguf_weights import read_gguf

            get_logger(__name__).info("reading the GGUF's quantised blocks as they are", gguf=str(gguf))
            tensors = read_gguf(gguf, config)
        else:
            tensors = read_safetensors(model_dir)
        packed = _read_packed(model_dir, tensors, quantization) if gguf is None else None
        if packed is not None:
            tensors = packed
        if transform is not None:
            config, tensors = transform(config, tensors)
        as_read = gguf is not None or packed is not None and quantization == "auto"  # the file's own formats
        if as_read or quantization in QUANTIZED_AT_LOAD:
            return cls(config, tensors, dtype=dt, device=dev, where=str(gguf or model_dir),
                       quantization="none" if as_read else quantization, group_size=group_size)
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

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a forward reads (quantised ones as stored), for logs and metrics."""
        total = self.norm.nbytes + _linear_bytes(self.lm_head)
        for layer in self.layers:
            total += layer.input_norm.nbytes + layer.post_norm.nbytes
            total += sum(_linear_bytes(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total + (self.embed.nbytes if getattr(self, "embed", None) is not None else 0)

    def use_c_ops(self, on: bool) -> None:
        """Run RMSNorm, RoPE and SwiGLU as C calls (float32 or bfloat16 on CPU where the library builds; the
        default) or as torch ops (what a machine without a C compiler runs; tests compare both)."""
        self._c_ops = (cpu_norm.load() if on and self.device.type == "cpu"
                       and self.dtype in (torch.float32, torch.bfloat16) else None)
        self._decode_step_caches = None  # the fused step needs the C ops: decided again at the next step

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

    def _rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Float32 ``[T, D/2, (cos, sin)]`` rows of ``positions`` for the fused step of a bfloat16 model (its
        own tables are rounded to bfloat16); a few rows, computed as the tables are."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.stack((freqs.cos(), freqs.sin()), dim=-1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if (self._c_ops is not None and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
                and weight.dtype == x.dtype):
            return cpu_norm.rms_norm(x, weight, self.config.rms_norm_eps, self._c_ops)
        if self._fast_norm:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        if self._triton_ops is not None and x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype:
            return self._triton_ops.rms_norm(x, weight, self.config.rms_norm_eps)  # one kernel, not eight
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
        row = kv_quant.row_width(c.head_dim) if kv_quant.is_quantized(dtype) else c.head_dim  # codes + scale
        shape = (num_blocks, block_size, c.num_kv_heads, row)
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
        dtype = dtype or self.dtype
        elem = torch.empty((), dtype=dtype).element_size()
        row = kv_quant.row_width(c.head_dim) if kv_quant.is_quantized(dtype) else c.head_dim
        return 2 * c.num_layers * block_size * c.num_kv_heads * row * elem

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
        argmax_only=False,
    ) -> torch.Tensor:
        """Logits (float32) ``[len(logits_indices), vocab]`` (or for every token if indices is None); the head may be
        screened (kernels/head_screen.py) where only each row's argmax is read (``argmax_only`` True: greedy) or
        what a ``head_screen.ScreenRows`` says (the sampler's race or top-k cut, worker/sampler.py)."""
        t = input_ids.shape[0]
        if max_position is None:
            max_position = int(positions.max()) if t else 0
        cos, sin = self._rope(positions, max_position)
        c_ops = self._c_ops  # on CPU: RoPE and SwiGLU in C too
        rot = torch.view_as_real(cos) if c_ops is not None and self._complex_rope else None  # [T, D/2, (cos, sin)]
        cos, sin = cos[:, None, :], sin[:, None, :]  # complex rotation [T, 1, D/2] on the complex path
        if meta.scale is None:
            meta.scale = self.scale
        x = self._embed_rows(input_ids)
        residual = x
        fused = self._fused_step(kv_caches, meta, t, backend)
        if fused is not None:  # every layer (and the head, where in panels) in one C call (kernels/decode_step.py)
            logits, x = self._run_fused(fused, x, rot, positions, meta, logits_indices, argmax_only)
            if logits is not None:
                return logits
            residual = x
        h = self._norm(x, self.layers[0].input_norm) if self.layers and fused is None else x
        for i, layer in enumerate(self.layers if fused is None else ()):
            q, k, v = self._qkv_heads(layer.qkv(h), cos, sin, rot, c_ops)
            k_cache, v_cache = kv_caches[i]
            backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.forward(q, k, v, k_cache, v_cache, meta)
            attn = attn.reshape(t, self.q_size)
            # residual += attn W_o^T in place (the residual is always this forward's own tensor)
            self._add_row_parallel(residual, layer.o, attn)
            h = self._norm(residual, layer.post_norm)
            gu = layer.gate_up(h, contiguous=False)  # SiLU-mul and the down GEMM take any strides
            inter = gu.shape[-1] // 2
            if c_ops is not None and gu.stride(-1) == 1:
                act = cpu_norm.silu_mul_(gu, c_ops)
            else:
                act = F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:])  # SwiGLU in place (a strided view)
            self._add_row_parallel(residual, layer.down, act)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            if nxt is not None:
                h = self._norm(residual, nxt)
        if logits_indices is not None:
            residual = residual.index_select(0, logits_indices)
        h = self._norm(residual, self.norm)
        return self.lm_head(h).float()  # contiguous: the sampler's row-wise argmax is 3x slower on a transposed view

    __call__ = forward

    def _run_fused(self, fused, x: torch.Tensor, rot: torch.Tensor | None, positions: torch.Tensor,
                   meta: AttentionMetadata, logits_indices: torch.Tensor | None, argmax_only=False):
        """The fused step over ``x``: (logits, x) where the head ran inside it, else (None, the last residual
        stream in the model's dtype). A bfloat16 model's step computes in float32 (rotate-half RoPE, float32
        rows: its own tables are rounded)."""
        if self.dtype != torch.float32:
            x, rot = x.float(), self._rope_rows(positions)
        logits = fused.run(x, rot, meta, logits_indices, argmax_only)  # rot: the C RoPE's (cos, sin) rows
        return logits, x.to(self.dtype)

    def decode_window(self, kv_caches, backend: AttentionBackend, meta: AttentionMetadata, token: int,
                      slots: torch.Tensor, table: torch.Tensor, pick: Callable[[torch.Tensor, int], int],
                      stops: set[int], greedy: bool = False, race=None, window=None,
                      wake_fd: int = -1) -> list[int] | None:
        """A decode-ahead window of one sequence (worker/model_runner.py ``_decode_ahead``) through the fused
        step, with no per-token metadata: ``token`` first, then each token ``pick(logits, i)`` chooses, until
        ``len(slots)`` tokens, one in ``stops``, or ``wake_fd`` readable (``DecodeStep.woken``). ``meta``: the
        first token's (it decides whether the fused step applies); ``slots`` int64 ``[n]`` and ``table`` int32
        ``[1, blocks]`` cover the window. Per token: the embedding row, the C step (logits into one buffer),
        ``pick``. ``greedy``, or ``window(n)`` (every token's race offsets: a sampled row with no cut), runs it all
        in one C call where the step can look the tokens up; else ``race(i)``, drawn before token i's step, is its
        ``argmax_only``. Returns the tokens, or None where the fused step with the head inside does not run."""
        step = self._fused_step(kv_caches, meta, 1, backend)
        if step is None or not step.has_head:
            return None
        n, pos0 = len(slots), int(meta.seq_lens_host[0]) - 1
        positions = torch.arange(pos0, pos0 + n)
        rot = (self._rope_rows(positions) if self.dtype != torch.float32  # as _run_fused: float32, rotate-half
               else torch.view_as_real(self._rope(positions, pos0 + n - 1)[0]).contiguous())
        offsets = window(n) if window is not None and not greedy and step.embed is not None else None
        if (greedy or offsets is not None) and step.embed is not None:
            return step.run_window(token, pos0, rot, slots, table, sorted(stops), offsets, wake_fd)
        length, ids, out = torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.long), []
        logits = torch.empty((1, step.args.V), dtype=torch.float32)
        for i in range(n):
            ids[0], length[0] = token, pos0 + i + 1
            x = self._embed_rows(ids)
            step.run_decode(x if x.dtype == torch.float32 else x.float(), rot[i : i + 1], slots[i : i + 1], table,
                            length, logits, race(i) if race else greedy)
            token = pick(logits, i)
            out.append(token)
            if token in stops or step.woken(wake_fd):
                break
        return out

    def use_decode_step(self, on: bool) -> None:
        """Run qualifying decode steps as one C call (kernels/decode_step.py; the default) or op by op (tests
        and benchmarks compare both)."""
        self._decode_step_on = on
        self._decode_step = None
        self._decode_step_caches = None

    def prepare_decode_step(self) -> None:
        """The fused step's screened head now (kernels/head_screen.py: 0.1-0.3 s for SmolLM2), not in a step."""
        if self.device.type == "cpu":
            from kernels import head_screen

            head_screen.prepare(self.lm_head)

    def _fused_step(self, kv_caches, meta: AttentionMetadata, t: int, backend: AttentionBackend):
        """The fused decode step where this step qualifies (kernels/decode_step.py says when), else None. Built
        once per set of KV caches; only for the CPU backend's own kernels (not a reference backend under test)."""
        if not self._decode_step_on or not getattr(backend, "native", False):
            return None
        # keyed by the layer list too: an early-exit draft (worker/draft.py) is a shallow copy with fewer layers
        if self._decode_step_caches != (id(kv_caches), id(self.layers)):
            from kernels.decode_step import DecodeStep

            self._decode_step = DecodeStep.for_model(self, kv_caches)
            self._decode_step_caches = (id(kv_caches), id(self.layers))
        step = self._decode_step
        return step if step is not None and step.applies(kv_caches, meta, t) else None

    def _qkv_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor | None,
                   c_ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` of one layer's ``qkv`` ``[T, (Hq + 2Hkv) D]``, RoPE applied:
        views on CPU, dense tensors for a GPU's kernels (a bfloat16 one rotates into them in one kernel)."""
        c = self.config
        t, hq, hkv, d = qkv.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self._triton_ops is not None and qkv.dtype == torch.bfloat16 and qkv.stride(-1) == 1:
            q, k = self._triton_ops.rope_half(qkv, cos[:, 0], sin[:, 0], hq, hkv, d)
            return q, k, v.contiguous()
        qk = self._rotate_qk(qkv, cos, sin, rot, c_ops)
        q, k = qk[:, :hq], qk[:, hq:]
        if self._contiguous_qkv:  # GPU kernels get dense tensors; on CPU the strided views are fine
            return q.contiguous(), k.contiguous(), v.contiguous()
        return q, k, v

    def _add_row_parallel(self, residual: torch.Tensor, proj, x: torch.Tensor) -> None:
        """``residual += x W^T``; under tensor parallelism each rank holds a slice of W's input columns, so
        the partial products are summed over the ranks first (one all-reduce)."""
        if self.all_reduce is None:
            proj.add_to(residual, x)
        else:
            residual.add_(self.all_reduce(proj(x)))

    def _rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor | None,
                   c_ops) -> torch.Tensor:
        """RoPE on the q and k heads of ``qkv`` ``[T, (Hq + 2Hkv) D]``, as ``[T, Hq + Hkv, D]``: one C call in
        place, one complex multiply (interleaved pairs, worker/weights.py), or the rotate-half form."""
        c = self.config
        t, qk_heads, d = qkv.shape[0], c.num_heads + c.num_kv_heads, c.head_dim
        qk_flat = qkv[:, : self.q_size + self.kv_size]
        if c_ops is not None and qkv.stride(-1) == 1:
            if self._complex_rope:
                cpu_norm.rope_interleaved_(qkv, qk_heads, rot, c_ops)
            else:  # bfloat16: cos and sin are [T, 1, D/2] views of dense [T, D/2] rows
                cpu_norm.rope_half_(qkv, qk_heads, cos[:, 0], sin[:, 0], c_ops)
            return qk_flat.view(t, qk_heads, d)
        if self._complex_rope:
            qk = torch.view_as_complex(qk_flat.view(t, qk_heads, d // 2, 2))
            return torch.view_as_real(qk * cos).view(t, qk_heads, d)
        qk = qk_flat.view(t, qk_heads, d)
        x1, x2 = qk[..., : d // 2], qk[..., d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # RoPE on q and k at once
