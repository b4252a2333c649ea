"""The model's ``config.json``: reading it, validating it, and normalising the fields the forward pass needs
(Llama, Qwen2 and Mistral layouts of transformers 4.x and 5.x)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "mistral": "MistralForCausalLM"}


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


def _architecture(raw: dict[str, Any], where: str) -> str:
    """The supported architecture named in ``architectures``, else the one ``model_type`` implies."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = raw.get("model_type")
    if archs or model_type not in _ARCHITECTURE_BY_MODEL_TYPE:
        raise ModelError(
            f"{where}: unsupported architecture {archs or model_type!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return _ARCHITECTURE_BY_MODEL_TYPE[model_type]


def _rope(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling with a normalised ``rope_type``, or None for plain RoPE)."""
    # transformers 5 stores rope_theta/rope_scaling inside "rope_parameters".
    rope_params = dict(raw.get("rope_parameters") or {})
    rope_scaling = raw.get("rope_scaling") or None
    if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
        rope_scaling = rope_params
    rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    if rope_scaling is None:
        return rope_theta, None
    rope_scaling = dict(rope_scaling)
    rtype = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
    rope_scaling["rope_type"] = rtype
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{where}: unsupported rope scaling type {rtype!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return rope_theta, (None if rtype == "default" else rope_scaling)


def _check_supported(raw: dict[str, Any], where: str) -> None:
    if float(raw.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ModelError(f"{where}: partial rotary embeddings are not supported")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelError(f"{where}: unsupported activation {raw.get('hidden_act')!r} (only silu)")


def _sliding_window(raw: dict[str, Any], arch: str) -> Any:
    """The raw ``sliding_window`` where the architecture uses one (Qwen2: only if some layer slides)."""
    sliding = None
    if arch == "MistralForCausalLM":
        sliding = raw.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        layer_types = raw.get("layer_types") or []
        if not layer_types or "sliding_attention" in layer_types:
            sliding = raw.get("sliding_window")
    return sliding


def _attention_biases(raw: dict[str, Any], arch: str) -> tuple[bool, bool]:
    """(q/k/v projections have biases, the output projection has one): Qwen2 always biases q/k/v only."""
    if arch == "Qwen2ForCausalLM":
        return True, False
    bias = bool(raw.get("attention_bias", False))
    return bias, bias


def _build(raw: dict[str, Any], where: str, arch: str) -> ModelConfig:
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope_theta, rope_scaling = _rope(raw, where)
    _check_supported(raw, where)
    sliding = _sliding_window(raw, arch)
    qkv_bias, o_bias = _attention_biases(raw, arch)
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


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Validate and normalise a HF config dict (transformers 4.x and 5.x layouts)."""
    arch = _architecture(raw, where)
    try:
        return _build(raw, where, arch)
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
