"""ModelRunner: turns one engine step's ``(request, num_new_tokens)`` pairs into a flattened model call.

Builds input ids, positions, the slot mapping (vectorised from the padded block table), block tables,
seq_lens and query_start_loc with numpy; runs the model under ``torch.inference_mode()``; samples the next
token for each request whose step reaches the end of its known tokens. Decodes are placed first in the
flattened batch (the CPU attention fast path batches them); results come back in the caller's order.
The runner never mutates a request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inferq.log import get_logger
from kernels import kv_quant
from kernels.attention_api import AttentionBackend, AttentionMetadata
from kernels.backend import get_backend
from kernels.decode_step import woken
from kernels.head_screen import ScreenRows
from scheduler.request import Request
from worker.gptq_weights import packed_config
from worker.loader import ModelInfo, model_info
from worker.model import CausalLM, gguf_source, load_config, resolve_device, resolve_dtype
from worker.sampler import RaceDraw, Sampler
from worker.weights import QUANTIZED_AT_LOAD

log = get_logger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
MAX_FAST_DECODES = 32  # _prepare_decodes' Python loop takes steps of up to this many decodes


@dataclass
class StepInputs:
    """One step's flattened model inputs, sequences reordered decodes first (host arrays)."""

    order: np.ndarray  # int64 [S]: order[i] is the caller's index of sequence i
    requests: list[Request]  # the requests in that order
    input_ids: list[int]  # [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, max_blocks]
    seq_lens: np.ndarray  # int64 [S]: context length including this step's tokens
    query_start_loc: np.ndarray  # int64 [S+1]
    sample_rows: np.ndarray  # sequences (in this order) that sample a token this step
    num_logits: np.ndarray  # int64, per sampling sequence: 1, or 1 + its proposals (each position verified)
    logits_indices: np.ndarray  # int64: the token rows whose logits are computed, num_logits per sequence


def _check_batch(batch: Sequence[tuple[Request, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(new tokens, computed tokens, known tokens) per request; raises for a step no request can take."""
    n_seq = len(batch)
    q_lens = np.fromiter((n for _, n in batch), dtype=np.int64, count=n_seq)
    starts = np.fromiter((r.num_computed_tokens for r, _ in batch), dtype=np.int64, count=n_seq)
    if (q_lens < 1).any():
        raise ValueError("every scheduled request must compute at least one token")
    totals = np.fromiter((r.num_tokens + len(r.spec_token_ids) for r, _ in batch), dtype=np.int64, count=n_seq)
    if (starts + q_lens > totals).any():
        bad = int(np.flatnonzero(starts + q_lens > totals)[0])
        r = batch[bad][0]
        raise ValueError(
            f"request {r.request_id}: {r.num_computed_tokens} computed + {batch[bad][1]} new exceeds its "
            f"{r.num_tokens} tokens"
        )
    return q_lens, starts, totals


def _input_ids(reqs: list[Request], starts: np.ndarray, q_lens: np.ndarray) -> list[int]:
    """The token ids to compute, flattened: ``all_token_ids[c:c+n]`` of each request (a decode reads its one
    token without building the whole list)."""
    ids: list[int] = []
    for r, c, n in zip(reqs, starts.tolist(), q_lens.tolist(), strict=True):
        if n == 1:
            ids.append(
                r.output_token_ids[c - r.num_prompt_tokens]
                if c >= r.num_prompt_tokens
                else r.prompt_token_ids[c]
            )
        else:
            ids.extend((r.all_token_ids + r.spec_token_ids)[c : c + n])
    return ids


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``concat(arange(c) for c in counts)``, without a Python loop."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum()), dtype=np.int64) - starts


def _load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, quantization: str = "none",
                  group_size: int = 32) -> CausalLM:
    """The model's weights, their loading logged as it goes (it is most of a worker's start)."""
    started = time.monotonic()
    log.info("loading weights", model_dir=str(model_dir), dtype=str(dtype), device=str(device),
             quantization=quantization)
    model = CausalLM.from_pretrained(model_dir, dtype=dtype, device=device, quantization=quantization,
                                     group_size=group_size)
    log.info("weights loaded", seconds=round(time.monotonic() - started, 2), weight_bytes=model.weight_bytes,
             quantization=model.quantization)
    return model


def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, quantization: str, group_size: int,
                tensor_parallel_size: int, attention_backend: str | AttentionBackend | None, threads: int | None,
                tp_timeout: float):
    """The model in this process, or (``tensor_parallel_size`` > 1) rank 0 of a tensor-parallel one: a
    ``TPDriver`` with the same surface, the model sharded over ranks it starts (worker/tp_driver.py)."""
    if tensor_parallel_size == 1:
        return _load_weights(model_dir, dtype, device, quantization, group_size)
    if quantization in QUANTIZED_AT_LOAD or quantization == "auto" and (
            gguf_source(model_dir) is not None or packed_config(model_dir) is not None):
        raise ValueError("tensor parallelism with quantised weights is not supported yet (use one of them)")
    from worker.tp_driver import TPDriver

    return TPDriver(model_dir, world=tensor_parallel_size, dtype=dtype, device=device,
                    attention_backend=getattr(attention_backend, "name", attention_backend), threads=threads,
                    timeout=tp_timeout)


def _kv_dtype(name: str | torch.dtype | None, model_dtype: torch.dtype, device: torch.device,
              quantized: bool = False) -> torch.dtype:
    """The KV cache's element type: auto, a float type, or int8 / fp8_e4m3 (rows with their scales,
    kernels/kv_quant.py; float8 rows are stored as uint8). auto is the model's dtype, except bfloat16 where a
    float32 model's weights are quantised (CPU): such weights already move the logits far more than a bfloat16
    cache does (``python -m bench quality``: w4a8's mean KL against float32 0.0044 with a float32 cache, 0.0045
    with bfloat16; the default GGUF model's 0.0020 either way), while the cache's bytes are most of what
    attention reads, a quarter of a quantised step's at chat lengths; so auto holds twice the tokens and reads
    half the bytes, as llama.cpp's default float16 cache does."""
    if name in ("auto", None):
        if quantized and model_dtype == torch.float32 and device.type == "cpu":
            return torch.bfloat16
        return model_dtype
    if name in ("int8", torch.int8):
        return torch.int8
    if name in ("fp8_e4m3", kv_quant.FP8_ROWS):
        if device.type != "cpu":
            raise ValueError("kv_cache_dtype fp8_e4m3 runs on CPU only")
        return kv_quant.FP8_ROWS
    return resolve_dtype(name, device)


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
        tensor_parallel_size: int = 1,
        tensor_parallel_timeout: float = 60.0,
        quantization: str = "none",
        quantization_group_size: int = 32,
        cuda_graph_max_batch: int = 0,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        config = load_config(self.model_dir)
        self.dtype = resolve_dtype(dtype, self.device, config)
        self.model = _load_model(self.model_dir, self.dtype, self.device, quantization, quantization_group_size,
                                 tensor_parallel_size, attention_backend, torch_threads, tensor_parallel_timeout)
        info = model_info(self.model_dir, dtype=_DTYPE_NAMES.get(self.dtype, str(self.dtype)), config=config)
        if max_model_len:
            from dataclasses import replace

            info = replace(info, max_model_len=min(info.max_model_len, int(max_model_len)))
        self.info: ModelInfo = info
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.max_batched_tokens = int(max_batched_tokens)
        quantized = getattr(self.model, "quantization", quantization) not in ("none", "auto")
        self.kv_dtype = _kv_dtype(kv_cache_dtype, self.dtype, self.device, quantized)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError("a KV-cache dtype other than the model's is supported on CPU only")
        self._allocate_kv(int(kv_cache_bytes), config.num_layers, kv_cache_prefault)
        if isinstance(attention_backend, str) or attention_backend is None:
            self.backend = get_backend(self.device, attention_backend)
        else:
            self.backend = attention_backend
        self.sampler = Sampler(self.device, seed=seed)
        # the logits' width (the head's rows, which may exceed config.vocab_size); None on a tensor-parallel
        # driver, whose steps draw their noise after the logits (no screened head there)
        self.vocab_size = getattr(getattr(self.model, "lm_head", None), "out_features", None)
        self.graphs = self._decode_graphs(int(cuda_graph_max_batch))
        if (prepare := getattr(self.model, "prepare_decode_step", None)) is not None:  # not on a TP driver
            prepare()
        log.info("model runner ready", model_dir=str(self.model_dir), device=str(self.device), dtype=self.info.dtype,
                 kv_blocks=self.num_blocks, block_size=self.block_size, threads=torch.get_num_threads(),
                 attention=getattr(self.backend, "name", type(self.backend).__name__))

    def _allocate_kv(self, kv_cache_bytes: int, num_layers: int, prefault: bool) -> None:
        """The KV pool: as many blocks as the budget holds; its size per token and the weights' bytes logged
        (and exported as metrics by the worker)."""
        per_block = self.model.kv_bytes_per_block(self.block_size, self.kv_dtype)
        self.num_blocks = kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv cache budget of {kv_cache_bytes} bytes is smaller than one block ({per_block} bytes: "
                f"block_size {self.block_size} x {num_layers} layers x K/V)"
            )
        self.kv_bytes_per_token = per_block / self.block_size
        self.weight_bytes = int(getattr(self.model, "weight_bytes", 0))
        log.info("sizing the KV pool", blocks=self.num_blocks, tokens=self.num_blocks * self.block_size,
                 kv_bytes_per_token=self.kv_bytes_per_token, weight_bytes=self.weight_bytes)
        self.kv_caches = self.model.allocate_kv_cache(self.num_blocks, self.block_size, self.kv_dtype,
                                                      prefault=prefault)

    def _decode_graphs(self, max_batch: int):
        """Decode steps of up to ``max_batch`` sequences replayed as CUDA graphs (worker/cuda_graphs.py), where
        they apply: a CUDA device, the Triton attention (the torch one plans on device values) and the model in
        this process. None elsewhere."""
        if (max_batch <= 0 or self.device.type != "cuda" or getattr(self.backend, "name", None) != "triton"
                or not isinstance(self.model, CausalLM)):
            return None
        from worker.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self.model, self.kv_caches, self.backend, block_size=self.block_size,
                            max_model_len=self.info.max_model_len, max_batch=min(max_batch, self.max_num_seqs))

    # -- batch preparation ---------------------------------------------------------------------------

    def _prepare(self, batch: Sequence[tuple[Request, int]]) -> StepInputs:
        """The flattened model inputs of one step, decodes first (stable), then prefill chunks."""
        decodes = self._prepare_decodes(batch)
        if decodes is not None:
            return decodes
        q_lens, starts, totals = _check_batch(batch)
        order = np.concatenate([np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens != 1)])
        reqs = [batch[i][0] for i in order]
        q_lens, starts = q_lens[order], starts[order]
        seq_lens = starts + q_lens
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        block_tables = self._block_tables(reqs, seq_lens)
        # Per-token sequence index and position, then slot = block_table[seq, pos // bs] * bs + pos % bs.
        bs = self.block_size
        seq_idx = np.repeat(np.arange(len(batch)), q_lens)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        slot_mapping = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        sample_rows = np.flatnonzero(seq_lens == totals[order])
        num_logits = np.fromiter((1 + len(reqs[i].spec_token_ids) for i in sample_rows), dtype=np.int64,
                                 count=len(sample_rows))
        ends = qsl[1:][sample_rows]
        logits_indices = np.repeat(ends - num_logits, num_logits) + _ranges(num_logits)
        return StepInputs(
            order=order,
            requests=reqs,
            input_ids=_input_ids(reqs, starts, q_lens),
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            sample_rows=sample_rows,
            num_logits=num_logits,
            logits_indices=logits_indices,
        )

    def _prepare_decodes(self, batch: Sequence[tuple[Request, int]]) -> StepInputs | None:
        """``_prepare``'s inputs for a step of plain decodes only (one new token each, the last of its request,
        no proposals), built from Python ints; None for any other step. Why: at a few sequences the general
        path's thirty-odd numpy calls are most of the step's Python, and they run with the caches cold (the
        step before streamed every weight through them): 0.28 ms of a 6.8 ms bfloat16 step measured."""
        if not batch or len(batch) > MAX_FAST_DECODES:
            return None
        bs, num_blocks = self.block_size, self.num_blocks
        ids, positions, slots, tables = [], [], [], []
        for r, n in batch:
            pos = r.num_computed_tokens
            if n != 1 or r.spec_token_ids or pos + 1 != r.num_tokens:
                return None
            table = r.block_table[: pos // bs + 1]
            if len(table) <= pos // bs or min(table) < 0 or max(table) >= num_blocks:
                return None  # the general path says what is wrong
            ids.append(r.output_token_ids[pos - r.num_prompt_tokens] if pos >= r.num_prompt_tokens
                       else r.prompt_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
        s = len(batch)
        block_tables = np.zeros((s, max(map(len, tables))), dtype=np.int32)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
        rows, pos = np.arange(s, dtype=np.int64), np.array(positions, dtype=np.int64)
        return StepInputs(order=rows, requests=[r for r, _ in batch], input_ids=ids,
                          positions=pos, slot_mapping=np.array(slots, dtype=np.int64),
                          block_tables=block_tables, seq_lens=pos + 1,
                          query_start_loc=np.arange(s + 1, dtype=np.int64), sample_rows=rows,
                          num_logits=np.ones(s, dtype=np.int64), logits_indices=rows)

    def _block_tables(self, reqs: list[Request], seq_lens: np.ndarray) -> np.ndarray:
        """int32 ``[S, max_blocks]``: each request's first blocks covering its ``seq_lens`` tokens, zero-padded."""
        bs = self.block_size
        need_blocks = (seq_lens + bs - 1) // bs
        block_tables = np.zeros((len(reqs), int(need_blocks.max())), dtype=np.int32)
        for i, r in enumerate(reqs):
            bt = r.block_table
            nb = int(need_blocks[i])
            if len(bt) < nb:
                raise ValueError(
                    f"request {r.request_id}: block table has {len(bt)} blocks, {nb} needed for "
                    f"{int(seq_lens[i])} tokens"
                )
            block_tables[i, :nb] = bt[:nb]
        if len(reqs) and (block_tables.max() >= self.num_blocks or block_tables.min() < 0):
            raise ValueError(f"block table entry out of range [0, {self.num_blocks})")
        return block_tables

    # -- execution -----------------------------------------------------------------------------------

    def _forward(self, step: StepInputs, argmax_only: bool | ScreenRows = False) -> torch.Tensor:
        """Run the model on one prepared step; returns the logits of its sampling rows (``argmax_only``: only
        their argmax is read, or what the ScreenRows say; CausalLM.forward says why)."""
        dev = self.device
        max_pos = int(step.seq_lens.max()) - 1
        if max_pos >= self.info.max_model_len:
            raise ValueError(f"position {max_pos} is beyond the model's context ({self.info.max_model_len})")
        if self.graphs is not None and len(step.input_ids) == len(step.requests) == step.sample_rows.size:
            logits = self.graphs.run(step.input_ids, step.positions, step.slot_mapping, step.block_tables)
            if logits is not None:  # a plain decode step, replayed
                return logits
        meta = AttentionMetadata.build(
            slot_mapping=step.slot_mapping,
            block_tables=step.block_tables,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            block_size=self.block_size,
            device=dev,
            scale=self.model.scale,
        )
        # All-prefill-chunk steps sample nothing: an empty index skips the LM head.
        return self.model.forward(
            torch.tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.from_numpy(step.positions).to(dev),
            self.kv_caches,
            meta,
            self.backend,
            logits_indices=torch.from_numpy(step.logits_indices).to(dev),
            max_position=max_pos,
            argmax_only=argmax_only,
        )

    @torch.inference_mode()
    def execute(self, batch: Sequence[tuple[Request, int]]) -> list[int | list[int] | None]:
        """Run one step; per request (caller's order): the next token if it reached its end, None if not; a
        request with proposals (``spec_token_ids``) gets the list of its accepted proposals plus one token.

        Verification samples every proposal's position exactly as plain decoding would (same sampler, same
        output index, so the same seeded noise) and keeps proposals while they equal the sampled token. The
        proposers are deterministic (a point-mass draft q), for which this is the standard rejection rule:
        a proposal x is kept with probability p(x) = min(1, p(x)/q(x)), and a rejected position's sampled
        token is distributed as p without x, i.e. normalised max(0, p - q). Greedy output is identical to
        non-speculative decoding, and so is a seeded request's; unseeded sampling has the same distribution.
        """
        if not batch:
            return []
        if len(batch) == 1 and batch[0][0].decode_ahead and batch[0][0].spec_token_ids:
            return [self._decode_ahead(*batch[0])]
        step = self._prepare(batch)
        sampled = [step.requests[i] for i in step.sample_rows]
        counts = step.num_logits.tolist()
        params = [r.sampling for r, c in zip(sampled, counts, strict=True) for _ in range(c)]
        indices = [r.num_output_tokens + j for r, c in zip(sampled, counts, strict=True) for j in range(c)]
        # every sampling row greedy: the sampler reads the logits' argmax alone; else, with no top-p cut, the
        # argmax of logits + the race's offsets (its noise drawn now) or a top-k row's k largest (worker/sampler.py)
        race = self.sampler.race(params, indices, self.vocab_size) if params and self.vocab_size else None
        logits = self._forward(step, race.screen if race else all(p.greedy for p in params))
        results: list[int | list[int] | None] = [None] * len(batch)
        if step.sample_rows.size == 0:
            return results
        tokens = self.sampler.sample(logits, params, indices, race)
        at = 0
        for row, req, c in zip(step.sample_rows.tolist(), sampled, counts, strict=True):
            if c == 1:
                results[int(step.order[row])] = int(tokens[at])
            else:
                results[int(step.order[row])] = _accept(req.spec_token_ids, tokens[at:at + c])
            at += c
        return results

    supports_decode_ahead = True  # worker/engine.py's _plan_ahead hands this runner decode-ahead windows
    wake_fd = -1  # set by the engine per window: where readable, the window ends after its current token

    def _decode_ahead(self, req: Request, n: int) -> list[int]:
        """A decode-ahead window (worker/engine.py, ``_plan_ahead``): up to ``n`` tokens of one decoding request,
        one forward each (the token just chosen is the next one's input), at the slots the scheduler granted
        its placeholders. Each token is sampled as plain decoding samples it (same sampler, same output index),
        so greedy and seeded output is unchanged. Stops after an end token, or any token once ``wake_fd`` is
        readable (kernels/decode_step.py ``woken``); the postprocess drops the rest."""
        bs, dev, sp = self.block_size, self.device, req.sampling
        pos0, last = req.num_computed_tokens, req.num_computed_tokens + n - 1
        if n != 1 + len(req.spec_token_ids) or pos0 + 1 != req.num_tokens:
            raise ValueError(f"request {req.request_id}: a decode-ahead window of {n} tokens at {pos0} computed "
                             f"of {req.num_tokens}")
        if last >= self.info.max_model_len:
            raise ValueError(f"position {last} is beyond the model's context ({self.info.max_model_len})")
        table = self._block_tables([req], np.array([last + 1]))
        positions = np.arange(pos0, last + 1)
        slots = table[0, positions // bs].astype(np.int64) * bs + positions % bs
        token = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_token_ids))
        qsl, first = np.array([0, 1]), req.num_output_tokens

        def meta_at(i: int) -> AttentionMetadata:
            return AttentionMetadata.build(slot_mapping=slots[i : i + 1], block_tables=table,
                                           seq_lens=positions[i : i + 1] + 1, query_start_loc=qsl, block_size=bs,
                                           device=dev, scale=self.model.scale)

        draws: dict[int, RaceDraw | None] = {}

        def race(i: int) -> ScreenRows | bool:  # token i's noise, before its step (execute says why)
            draws[i] = self.sampler.race([sp], [first + i], self.vocab_size) if self.vocab_size else None
            return draws[i].screen if draws[i] else sp.greedy  # type: ignore[union-attr]

        def pick(logits: torch.Tensor, i: int) -> int:
            return int(self.sampler.sample(logits, [sp], [first + i], draws.pop(i, None))[0])

        decode_window = getattr(self.model, "decode_window", None)  # not on a tensor-parallel driver
        if dev.type == "cpu" and decode_window is not None:  # the fused step's own loop, where it runs
            window = decode_window(self.kv_caches, self.backend, meta_at(0), token, torch.from_numpy(slots),
                                   torch.from_numpy(table), pick, stops, greedy=sp.greedy, race=race,
                                   window=lambda n: self.sampler.window_offsets(sp, first, n, self.vocab_size),
                                   wake_fd=self.wake_fd)
            if window is not None:
                return window
        rows, tokens = torch.zeros(1, dtype=torch.long, device=dev), []
        for i, pos in enumerate(positions.tolist()):
            logits = (self.graphs.run([token], positions[i : i + 1], slots[i : i + 1], table)
                      if self.graphs is not None else None)
            if logits is None:
                logits = self.model.forward(torch.tensor([token], device=dev), torch.tensor([pos], device=dev),
                                            self.kv_caches, meta_at(i), self.backend, logits_indices=rows,
                                            max_position=pos, argmax_only=race(i))
            token = pick(logits, i)
            tokens.append(token)
            if token in stops or woken(self.wake_fd):
                break
        return tokens

    @torch.inference_mode()
    def compute_logits(self, batch: Sequence[tuple[Request, int]]) -> list[torch.Tensor | None]:
        """Like ``execute`` but returns the float32 logits row of each sampling request (no sampling); for
        tests and tools."""
        if not batch:
            return []
        step = self._prepare(batch)
        logits = self._forward(step)
        out: list[torch.Tensor | None] = [None] * len(batch)
        last = np.cumsum(step.num_logits) - 1  # the row of each sequence's last position
        for j, row in enumerate(step.sample_rows.tolist()):
            out[int(step.order[row])] = logits[int(last[j])].cpu()
        return out


def _accept(proposals: list[int], sampled: list[int]) -> list[int]:
    """The sampled tokens up to and including the first that differs from its proposal (all of them when
    every proposal holds: the last is the token after the accepted ones)."""
    for i, tok in enumerate(proposals):
        if sampled[i] != tok:
            return [int(t) for t in sampled[: i + 1]]
    return [int(t) for t in sampled]
