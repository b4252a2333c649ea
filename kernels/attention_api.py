"""The attention-backend interface: the metadata one engine step shares across layers, and the protocol every
backend implements (``kernels.backend.CPUBackend``, ``kernels.triton_backend.TritonBackend``).

The model calls, per layer, ``backend.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)`` then
``backend.forward(query, key, value, k_cache, v_cache, meta)`` (key/value are this step's fresh ``[T, Hkv, D]``
tensors, already in the cache). This module imports no backend, so both backends import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flattened batch (shared by all layers).

    Device tensors follow docs/INTERFACES.md; the ``*_host`` fields are the same numbers as Python/numpy
    values so backends can plan without device syncs. ``num_decodes`` counts the leading sequences with
    q_len 1 (the runner puts decodes first); ``cache`` holds per-step state a backend derives lazily
    (e.g. the CPU decode gather index), built on the first layer and reused by the others.
    """

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S+1]
    max_query_len: int
    max_seq_len: int
    block_size: int
    scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    num_decodes: int = 0  # leading sequences with q_len == 1
    num_decode_tokens: int = 0
    seq_lens_host: np.ndarray | None = None
    query_lens_host: np.ndarray | None = None
    query_start_loc_host: np.ndarray | None = None
    block_tables_host: np.ndarray | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        block_size: int,
        device: torch.device | str,
        scale: float | None = None,
    ) -> AttentionMetadata:
        """Metadata from host arrays (one host→device copy per array)."""
        seq_lens = np.asarray(seq_lens, dtype=np.int32)
        qsl = np.asarray(query_start_loc, dtype=np.int32)
        if qsl.shape[0] > 1 and int(qsl[-1]) == qsl.shape[0] - 1:  # one token each (every length is >= 1)
            qlens, num_decodes = np.ones(qsl.shape[0] - 1, dtype=np.int32), qsl.shape[0] - 1
        else:
            qlens = np.diff(qsl)
            not_decode = np.flatnonzero(qlens != 1)
            num_decodes = int(not_decode[0]) if not_decode.size else int(qlens.shape[0])
        dev = torch.device(device)
        return cls(
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            max_query_len=(1 if num_decodes == qlens.size else int(qlens.max())) if qlens.size else 0,
            max_seq_len=int(seq_lens.max()) if seq_lens.size else 0,
            block_size=block_size,
            scale=scale,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            seq_lens_host=seq_lens,
            query_lens_host=qlens,
            query_start_loc_host=qsl,
            block_tables_host=np.asarray(block_tables),
        )


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...
