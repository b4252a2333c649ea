"""Model-based proposers for speculative decoding: a smaller draft model, or the target's own first layers.

Both propose greedily (a point-mass draft, so ModelRunner's verification stays exact under sampling) and
run *after* the scheduler: before it, the policy only asks for ``k`` placeholder proposals per request; the
scheduler grants ``k' <= k`` of them from the leftover budget and allocates their KV slots in the request's
own block table; then ``fill`` runs ``k'`` batched draft forwards (one per proposal position, every
proposing request at once) that write their KV into those slots and replace the placeholders with the
draft's tokens. The slots past a request's computed tokens are never shared (only full computed blocks
are), and the verification forward of the same step writes every one of them again, so nothing the draft
wrote there outlives the step unless it is what the target would have written anyway.

- ``early-exit``: the draft is the target's first ``L`` layers + final norm + LM head. Its layers are the
  target's, so the target's KV cache already holds the draft's KV for every computed position: no pool,
  no catch-up, no state. The draft's writes at the proposal positions land in layers < L of slots the
  verification overwrites with the same (position ``c``) or its own (later positions) values.
- ``draft``: a separate small model with its own paged pool of the *same* block ids (same block manager
  accounting: ``split_kv_bytes`` divides the memory setting so both pools have the same number of
  blocks). Its pool mirrors the target's: every step the draft also runs over every token the target
  computes (prefill chunks included), so prefix-cache hits, chunked prefill, preemption and rollback are
  handled by the block manager for both pools at once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferq.log import get_logger
from kernels.attention_api import AttentionMetadata
from scheduler.request import Request
from worker.model import CausalLM, load_config

log = get_logger(__name__)


class DraftProposer:
    """``propose(req, k)`` (before scheduling): ``k`` placeholders; ``fill(scheduled)`` (after): the draft's
    greedy tokens for the granted proposals. ``mirror``: the draft has its own pool, kept in step with the
    target's by running the draft over the step's tokens too."""

    costs_compute = True  # the policy stops asking it for a request whose guesses are almost never right

    def __init__(self, model: CausalLM, kv_caches: list, runner: Any, *, mirror: bool) -> None:
        self.model, self.kv_caches, self.runner, self.mirror = model, kv_caches, runner, mirror

    def propose(self, req: Request, k: int) -> list[int]:
        """Placeholders: the scheduler only counts them; ``fill`` writes the real guesses once granted."""
        last = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
        return [last] * max(k, 0)

    def forget(self, request_id: str) -> None:
        """Nothing per request: the draft's KV lives in the request's own blocks."""

    @torch.inference_mode()
    def fill(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Replace the granted placeholders with the draft's greedy tokens (and, with ``mirror``, write the
        draft's KV for every token the target computes this step)."""
        spec = [r for r, _ in scheduled if r.spec_token_ids]
        if not spec and not self.mirror:
            return
        first = [(r, 1 if r.spec_token_ids else n) for r, n in scheduled] if self.mirror else [(r, 1) for r in spec]
        guesses = self._first(first, spec)
        wanted = [len(r.spec_token_ids) for r in spec]
        for j in range(1, max(wanted, default=0) + 1):
            # feed guess j at position c + j; its logits give guess j + 1 (mirror: the last guess's KV too)
            rows = [i for i, k in enumerate(wanted) if k > j or (self.mirror and k == j)]
            if not rows:
                break
            reqs = [spec[i] for i in rows]
            out_rows = [p for p, i in enumerate(rows) if wanted[i] > j]
            nxt = self._decode(reqs, [r.num_computed_tokens + j for r in reqs], [guesses[i][-1] for i in rows],
                               out_rows)
            for p, tok in zip(out_rows, nxt, strict=True):
                guesses[rows[p]].append(tok)
        for r, g in zip(spec, guesses, strict=True):
            r.spec_token_ids = g[: len(r.spec_token_ids)]

    def _first(self, batch: list[tuple[Request, int]], spec: list[Request]) -> list[list[int]]:
        """The first draft forward: each proposing request's last token (and the mirrored step); returns
        one-element guess lists, in ``spec`` order."""
        step = self.runner._prepare(batch)
        where = {id(r): i for i, r in enumerate(step.requests)}
        rows = [int(step.query_start_loc[where[id(r)] + 1]) - 1 for r in spec]
        meta = self._meta(step.slot_mapping, step.block_tables, step.seq_lens, step.query_start_loc)
        toks = self._run(step.input_ids, step.positions, meta, rows)
        return [[t] for t in toks]

    def _decode(self, reqs: list[Request], positions: list[int], ids: list[int], out_rows: list[int]) -> list[int]:
        """One token per request at ``positions`` (slots already allocated); greedy tokens of ``out_rows``."""
        bs = self.runner.block_size
        pos = np.asarray(positions, dtype=np.int64)
        nblocks = pos // bs + 1
        tables = np.zeros((len(reqs), int(nblocks.max())), dtype=np.int32)
        for i, r in enumerate(reqs):
            tables[i, : nblocks[i]] = r.block_table[: nblocks[i]]
        slots = tables[np.arange(len(reqs)), pos // bs].astype(np.int64) * bs + pos % bs
        meta = self._meta(slots, tables, pos + 1, np.arange(len(reqs) + 1, dtype=np.int64))
        return self._run(ids, pos, meta, out_rows)

    def _meta(self, slots, tables, seq_lens, qsl) -> AttentionMetadata:
        return AttentionMetadata.build(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                       query_start_loc=qsl, block_size=self.runner.block_size,
                                       device=self.runner.device, scale=self.model.scale)

    def _run(self, ids: list[int], positions: np.ndarray, meta: AttentionMetadata, rows: list[int]) -> list[int]:
        dev = self.runner.device
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.from_numpy(np.asarray(positions, dtype=np.int64)).to(dev), self.kv_caches,
                                    meta, self.runner.backend,
                                    logits_indices=torch.tensor(rows, dtype=torch.long, device=dev),
                                    max_position=int(np.max(positions)), argmax_only=True)  # greedy proposals
        return logits.argmax(-1).tolist() if rows else []


# --- the two drafts ------------------------------------------------------------------------------------


def early_exit_layers(num_layers: int, setting: int | None) -> int:
    """``L``: the setting, or a third of the layers (at least 1); raises unless ``1 <= L < num_layers``."""
    n = setting if setting is not None else max(1, num_layers // 3)
    if not 1 <= n < num_layers:
        raise ValueError(f"speculative_early_exit_layers must be in [1, {num_layers - 1}] for this "
                         f"{num_layers}-layer model, got {n}")
    return n


def early_exit(runner: Any, layers: int | None) -> DraftProposer:
    """The target's first ``L`` layers as the draft, reading and writing the target's own KV cache."""
    target = _local_model(runner)
    n = early_exit_layers(len(target.layers), layers)
    draft = copy.copy(target)  # shares every tensor; only its layer list is shorter
    draft.layers = target.layers[:n]
    log.info("early-exit draft", layers=n, of=len(target.layers))
    return DraftProposer(draft, runner.kv_caches, runner, mirror=False)


def draft_model(runner: Any, draft_dir: str | Path) -> DraftProposer:
    """A separate draft checkpoint with a pool of the target pool's block count (see ``split_kv_bytes``)."""
    draft_dir = Path(draft_dir)
    _local_model(runner)
    check_vocab(runner.model_dir, draft_dir)
    model = CausalLM.from_pretrained(draft_dir, dtype=runner.dtype, device=runner.device)
    kv = model.allocate_kv_cache(runner.num_blocks, runner.block_size, runner.kv_dtype)
    log.info("draft model", model_dir=str(draft_dir), layers=len(model.layers), kv_blocks=runner.num_blocks)
    return DraftProposer(model, kv, runner, mirror=True)


def _local_model(runner: Any) -> CausalLM:
    """The runner's model, which the draft runs in this process: not a tensor-parallel group's driver."""
    if not isinstance(runner.model, CausalLM):
        raise ValueError("draft and early-exit speculation need the model in this process "
                         "(tensor_parallel_size 1); use speculative_method=ngram with tensor parallelism")
    return runner.model


def split_kv_bytes(total: int, target_dir: str | Path, draft_dir: str | Path) -> int:
    """The target's share of the KV memory setting when a draft model shares it: both pools get the same
    number of blocks (they are indexed by the same block tables), so the split follows the per-block sizes
    (layers x KV heads x head dim; the element type is the same)."""
    t, d = (_kv_width(load_config(Path(p))) for p in (target_dir, draft_dir))
    return total * t // (t + d)


def _kv_width(c) -> int:
    return c.num_layers * c.num_kv_heads * c.head_dim


def check_vocab(target_dir: str | Path, draft_dir: str | Path) -> None:
    """Raise unless the draft's token ids mean what the target's do: the same vocabulary size and, where
    both ship a tokenizer.json, the same token -> id table."""
    t, d = load_config(Path(target_dir)), load_config(Path(draft_dir))
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"draft model {draft_dir} has a vocabulary of {d.vocab_size} tokens, the target "
                         f"{target_dir} {t.vocab_size}: speculative_draft_model needs the same tokenizer")
    tv, dv = _tokenizer_vocab(Path(target_dir)), _tokenizer_vocab(Path(draft_dir))
    if tv is not None and dv is not None and tv != dv:
        raise ValueError(f"draft model {draft_dir} has a different tokenizer from the target {target_dir}: "
                         "speculative_draft_model needs the same tokenizer")


def _tokenizer_vocab(model_dir: Path) -> dict | None:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    tok = json.loads(path.read_text())
    return {"vocab": tok.get("model", {}).get("vocab"), "added": [(a.get("id"), a.get("content"))
                                                                  for a in tok.get("added_tokens", [])]}
