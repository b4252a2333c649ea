"""Rotary position embedding's inverse frequencies, as Hugging Face computes them (linear and llama3 scaling
included): the tables ``worker/model.py`` builds its cos/sin rows from."""

from __future__ import annotations

import math

import torch

from worker.model_config import ModelConfig, ModelError


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
