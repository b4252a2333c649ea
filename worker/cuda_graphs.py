"""Decode steps replayed as CUDA graphs (the GPU path's single-stream latency).

Why: a decode step of a small model on a GPU is bound by the host. Each layer launches some thirty kernels of a
few microseconds of GPU work, and Python issues them one by one: on an H100, SmolLM2-135M's step took ~28 ms of
host time for ~2 ms of GPU work (docs/BENCHMARKS.md). A CUDA graph records one step's launches once per
batch-size bucket and replays them in one call; per step only the inputs change, copied into the graph's own
buffers first.

What a captured step fixes, and how the real step fits it:

* the batch size: a step of ``s`` sequences runs the smallest bucket ``b >= s``; the ``b - s`` pad rows write no
  KV (slot -1, which the cache write skips) and attend one token of block 0, and their logits are not read;
* the attention launch: partitions are planned for the model's whole context (``max_model_len``), not this
  step's longest sequence; the kernel skips each sequence's partitions past its length;
* the tensors: the graph's own. One pinned host row carries a step's ids, positions, slots, lengths and block
  tables; one copy moves it and the graph's first kernels unpack it. The tables are as wide as the whole
  context's blocks: 4 KB per sequence at 8k tokens and blocks of 16, 64 KB at 128k (cap ``max_model_len``
  where the copy would matter).

Only plain decode steps replay (one new token per sequence, each sampling, Triton attention, the model in this
process); any other step runs eagerly as before.
"""

from __future__ import annotations

import numpy as np
import torch

from inferq.log import get_logger
from kernels.attention_api import AttentionMetadata

log = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """One captured decode step per batch-size bucket up to ``max_batch``, sharing one memory pool."""

    def __init__(self, model, kv_caches, backend, *, block_size: int, max_model_len: int, max_batch: int) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        width = self.buckets[-1] * (4 + self.max_blocks)
        self._host = torch.empty(width, dtype=torch.int64, pin_memory=model.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._staged = torch.zeros(width, dtype=torch.int64, device=model.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, so the smaller ones reuse its pool."""
        pool = torch.cuda.graph_pool_handle() if self.model.device.type == "cuda" else None
        for b in reversed(self.buckets):
            self._stage_padding(b, 0)  # every row a pad row: the warm-up steps write no KV
            self._staged.copy_(self._host)
            self._graphs[b] = self._record(b, pool)
        log.info("decode steps captured as CUDA graphs", buckets=self.buckets)

    def _record(self, b: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Bucket ``b``'s graph and its logits buffer. The step runs eagerly twice first (Triton compiles,
        cuBLAS picks its kernels) on a side stream, as torch's graph capture asks."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._step(b)
        torch.cuda.synchronize()
        return graph, logits

    def _step(self, b: int) -> torch.Tensor:
        """The step the graph records for bucket ``b``: unpack the staged row, then the model's forward."""
        row, mb = self._staged, self.max_blocks
        ids, positions, slots = row[:b], row[b : 2 * b], row[2 * b : 3 * b]
        seq_lens = row[3 * b : 4 * b].to(torch.int32)
        tables = row[4 * b : 4 * b + b * mb].view(b, mb).to(torch.int32)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                 query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=row.device),
                                 max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size,
                                 scale=self.model.scale, num_decodes=b, num_decode_tokens=b)
        rows = torch.arange(b, dtype=torch.long, device=row.device)
        return self.model.forward(ids, positions, self.kv_caches, meta, self.backend, logits_indices=rows,
                                  max_position=self.max_model_len - 1)

    def bucket(self, num_seqs: int) -> int | None:
        """The bucket that serves a decode step of ``num_seqs`` sequences, or None (too many: run eagerly)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _stage_padding(self, b: int, s: int) -> None:
        """Rows ``s..b`` of bucket ``b``'s layout as pad rows: token 0 at position 0, no KV write, length 1."""
        h = self._host_np
        h[s:b] = 0
        h[b + s : 2 * b] = 0
        h[2 * b + s : 3 * b] = -1
        h[3 * b + s : 4 * b] = 1
        h[4 * b + s * self.max_blocks : 4 * b + b * self.max_blocks] = 0

    def run(self, input_ids: list[int], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray) -> torch.Tensor | None:
        """The float32 logits ``[s, vocab]`` of a decode step of ``s`` sequences (one token each, every one
        sampling), from a graph replay; None where no bucket holds ``s`` (the caller runs the step eagerly).
        The logits are the graph's own buffer: read them before the next replay."""
        s, width = len(input_ids), block_tables.shape[1]
        b = self.bucket(s)
        if b is None or width > self.max_blocks:
            return None
        h, mb = self._host_np, self.max_blocks
        h[:s] = input_ids
        h[b : b + s] = positions
        h[2 * b : 2 * b + s] = slots
        h[3 * b : 3 * b + s] = positions + 1
        tables = h[4 * b : 4 * b + s * mb].reshape(s, mb)
        tables[:, :width] = block_tables
        tables[:, width:] = 0
        self._stage_padding(b, s)
        n = 4 * b + b * mb
        self._staged[:n].copy_(self._host[:n])  # pinned: one synchronous copy, after which the row may be rewritten
        graph, logits = self._graphs[b]
        graph.replay()
        self.replays += 1
        return logits[:s]
