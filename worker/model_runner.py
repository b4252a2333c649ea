"""ModelRunner: turns one engine step's ``(request, num_new_tokens)`` pairs into a flattened model call.

Builds input ids, positions, the slot mapping (vectorised from the padded block table), block tables,
seq_lens and query_start_loc with numpy; runs the model under ``torch.inference_mode()``; samples the next
token for each request whose step reaches the end of its known tokens. Decodes are placed first in the
flattened batch (the CPU attention fast path batches them); results come back in the caller's order.
The runner never mutates a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kernels.backend import AttentionBackend, AttentionMetadata, get_backend
from scheduler.request import Request
from worker.loader import ModelInfo, model_info
from worker.model import CausalLM, load_config, resolve_device, resolve_dtype
from worker.sampler import Sampler

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        kv_cache_bytes: int,
        kv_cache_dtype: str | torch.dtype = "auto",
        kv_cache_prefault: bool = False,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_batched_tokens: int = 2048,
        attention_backend: str | AttentionBackend | None = None,
        torch_threads: int | None = None,
        max_model_len: int | None = None,
        seed: int | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        config = load_config(self.model_dir)
        self.dtype = resolve_dtype(dtype, self.device, config)
        self.model = CausalLM.from_pretrained(self.model_dir, dtype=self.dtype, device=self.device)
        info = model_info(self.model_dir, dtype=_DTYPE_NAMES.get(self.dtype, str(self.dtype)), config=config)
        if max_model_len:
            from dataclasses import replace

            info = replace(info, max_model_len=min(info.max_model_len, int(max_model_len)))
        self.info: ModelInfo = info
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.max_batched_tokens = int(max_batched_tokens)
        self.kv_dtype = self.dtype if kv_cache_dtype in ("auto", None) else resolve_dtype(kv_cache_dtype, self.device)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError("a KV-cache dtype other than the model's is supported on CPU only")
        per_block = self.model.kv_bytes_per_block(self.block_size, self.kv_dtype)
        self.num_blocks = int(kv_cache_bytes) // per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv cache budget of {kv_cache_bytes} bytes is smaller than one block ({per_block} bytes: "
                f"block_size {self.block_size} x {config.num_layers} layers x K/V)"
            )
        self.kv_caches = self.model.allocate_kv_cache(self.num_blocks, self.block_size, self.kv_dtype,
                                                      prefault=kv_cache_prefault)
        if isinstance(attention_backend, str) or attention_backend is None:
            self.backend = get_backend(self.device, attention_backend)
        else:
            self.backend = attention_backend
        self.sampler = Sampler(self.device, seed=seed)
        log.info(
            "model runner ready: %s on %s (%s), %d KV blocks of %d tokens, attention %s, threads %d",
            self.model_dir,
            self.device,
            self.info.dtype,
            self.num_blocks,
            self.block_size,
            getattr(self.backend, "name", type(self.backend).__name__),
            torch.get_num_threads(),
        )

    # -- batch preparation ---------------------------------------------------------------------------

    def _prepare(self, batch: Sequence[tuple[Request, int]]):
        n_seq = len(batch)
        q_lens = np.fromiter((n for _, n in batch), dtype=np.int64, count=n_seq)
        starts = np.fromiter((r.num_computed_tokens for r, _ in batch), dtype=np.int64, count=n_seq)
        if (q_lens < 1).any():
            raise ValueError("every scheduled request must compute at least one token")
        totals = np.fromiter((r.num_tokens for r, _ in batch), dtype=np.int64, count=n_seq)
        if (starts + q_lens > totals).any():
            bad = int(np.flatnonzero(starts + q_lens > totals)[0])
            r = batch[bad][0]
            raise ValueError(
                f"request {r.request_id}: {r.num_computed_tokens} computed + {batch[bad][1]} new exceeds its "
                f"{r.num_tokens} tokens"
            )
        # Decodes first (stable), then prefill chunks.
        order = np.concatenate([np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens != 1)])
        reqs = [batch[i][0] for i in order]
        q_lens = q_lens[order]
        starts = starts[order]
        seq_lens = starts + q_lens
        qsl = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])

        ids: list[int] = []
        for r, c, n in zip(reqs, starts.tolist(), q_lens.tolist(), strict=True):
            if n == 1:
                ids.append(
                    r.output_token_ids[c - r.num_prompt_tokens]
                    if c >= r.num_prompt_tokens
                    else r.prompt_token_ids[c]
                )
            else:
                ids.extend(r.all_token_ids[c : c + n])

        bs = self.block_size
        need_blocks = (seq_lens + bs - 1) // bs
        max_blocks = int(need_blocks.max())
        block_tables = np.zeros((n_seq, max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            bt = r.block_table
            nb = int(need_blocks[i])
            if len(bt) < nb:
                raise ValueError(
                    f"request {r.request_id}: block table has {len(bt)} blocks, {nb} needed for "
                    f"{int(seq_lens[i])} tokens"
                )
            block_tables[i, :nb] = bt[:nb]
        if n_seq and (block_tables.max() >= self.num_blocks or block_tables.min() < 0):
            raise ValueError(f"block table entry out of range [0, {self.num_blocks})")

        # Per-token sequence index and position, then slot = block_table[seq, pos // bs] * bs + pos % bs.
        seq_idx = np.repeat(np.arange(n_seq), q_lens)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        slot_mapping = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs

        sample_mask = seq_lens == totals[order]
        sample_rows = np.flatnonzero(sample_mask)
        logits_indices = qsl[1:][sample_rows] - 1
        return (
            order,
            reqs,
            ids,
            positions,
            slot_mapping,
            block_tables,
            seq_lens,
            qsl,
            sample_rows,
            logits_indices,
        )

    # -- execution -----------------------------------------------------------------------------------

    def _forward(
        self, batch: Sequence[tuple[Request, int]]
    ) -> tuple[np.ndarray, list[Request], np.ndarray, torch.Tensor]:
        """Run the model on one step; returns (order, reordered requests, sampling rows, their logits)."""
        (
            order,
            reqs,
            ids,
            positions,
            slot_mapping,
            block_tables,
            seq_lens,
            qsl,
            sample_rows,
            logits_indices,
        ) = self._prepare(batch)
        dev = self.device
        max_pos = int(seq_lens.max()) - 1
        if max_pos >= self.info.max_model_len:
            raise ValueError(f"position {max_pos} is beyond the model's context ({self.info.max_model_len})")
        meta = AttentionMetadata.build(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            block_size=self.block_size,
            device=dev,
            scale=self.model.scale,
        )
        # All-prefill-chunk steps sample nothing: an empty index skips the LM head.
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.from_numpy(positions).to(dev),
            self.kv_caches,
            meta,
            self.backend,
            logits_indices=torch.from_numpy(logits_indices).to(dev),
            max_position=max_pos,
        )
        return order, reqs, sample_rows, logits

    @torch.inference_mode()
    def execute(self, batch: Sequence[tuple[Request, int]]) -> list[int | None]:
        """Run one step; the next token for each request that reached its end, else None (caller's order)."""
        if not batch:
            return []
        order, reqs, sample_rows, logits = self._forward(batch)
        results: list[int | None] = [None] * len(batch)
        if sample_rows.size == 0:
            return results
        sampled = [reqs[i] for i in sample_rows]
        tokens = self.sampler.sample(
            logits, [r.sampling for r in sampled], [r.num_output_tokens for r in sampled]
        )
        for row, tok in zip(sample_rows.tolist(), tokens, strict=True):
            results[int(order[row])] = int(tok)
        return results

    @torch.inference_mode()
    def compute_logits(self, batch: Sequence[tuple[Request, int]]) -> list[torch.Tensor | None]:
        """Like ``execute`` but returns the float32 logits row of each sampling request (no sampling); for
        tests and tools."""
        if not batch:
            return []
        order, _, sample_rows, logits = self._forward(batch)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for j, row in enumerate(sample_rows.tolist()):
            out[int(order[row])] = logits[j].cpu()
        return out
