"""Hugging Face transformers baselines, in process.

- :func:`hf_static_generate`: what a user writes by hand: ``model.generate`` on static batches of 16 requests
  in arrival order, left padding, greedy, ``max_new_tokens`` = the largest request of the batch, end-of-sequence
  ignored (as every engine in the comparison). Only each request's own ``max_tokens`` count as useful output.
- :func:`hf_continuous`: transformers' own continuous batching (paged attention; ``init_continuous_batching``)
  with a per-request ``max_new_tokens``, if the installed version has it.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.workloads import Workload

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_hf_model(model_dir: str | Path, dtype: str, attn_implementation: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": getattr(torch, _DTYPES[dtype])}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw)
    model.eval()
    return model


def _pad_id(model) -> int:
    cfg = model.config
    for v in (getattr(model.generation_config, "pad_token_id", None), getattr(cfg, "pad_token_id", None),
              getattr(cfg, "eos_token_id", None), 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def hf_static_generate(model, workload: Workload, batch_size: int = 16) -> dict:
    """Run ``workload`` with static batches; returns wall time and token counts (useful vs computed)."""
    import torch
    from transformers import GenerationConfig

    pad = _pad_id(model)
    items = workload.items
    outputs: list[list[int]] = []
    computed = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(items), batch_size):
            batch = items[start:start + batch_size]
            width = max(i.prompt_len for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, it in enumerate(batch):
                ids[r, width - it.prompt_len:] = torch.tensor(it.prompt_ids, dtype=torch.long)
                mask[r, width - it.prompt_len:] = 1
            new = max(i.max_tokens for i in batch)
            # eos_token_id=None: no end-of-sequence stop (ignore_eos), without suppressing the EOS logit.
            gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad, bos_token_id=None,
                                  temperature=None, top_p=None, top_k=None, max_new_tokens=new)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            gen = out[:, width:]
            computed += gen.numel()
            for r, it in enumerate(batch):
                outputs.append(gen[r, :it.max_tokens].tolist())
    wall = time.perf_counter() - t0
    useful = sum(min(len(o), i.max_tokens) for o, i in zip(outputs, items, strict=False))
    return {"wall_s": wall, "output_tokens": useful, "prompt_tokens": workload.prompt_tokens,
            "computed_output_tokens": computed, "outputs": outputs, "batch_size": batch_size}


def has_continuous_batching(model) -> bool:
    return hasattr(model, "init_continuous_batching")


def hf_continuous(model, workload: Workload, *, kv_tokens: int = 65536, page_size: int = 64,
                  max_batch_tokens: int = 2048, timeout_s: float = 600) -> dict:
    """transformers' continuous batching (paged attention) over the whole workload at once."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model),
                          max_new_tokens=max(i.max_tokens for i in workload.items),
                          temperature=None, top_p=None, top_k=None)
    cbc = ContinuousBatchingConfig(page_size=page_size, num_blocks=max(1, kv_tokens // page_size),
                                   max_batch_tokens=max_batch_tokens, max_requests_per_batch=len(workload.items),
                                   use_cuda_graph=False, use_async_batching=False)
    outputs: dict[str, list[int]] = {}
    with torch.no_grad():  # not inference_mode: the manager's thread updates tensors made here in place
        with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                       block=True, timeout=10, warmup=True) as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(it.prompt_ids, request_id=f"r{k}", max_new_tokens=it.max_tokens,
                                       eos_token_id=-1) for k, it in enumerate(workload.items)]
            deadline = time.monotonic() + timeout_s
            while len(outputs) < len(ids):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"transformers continuous batching: {len(outputs)}/{len(ids)} done in {timeout_s}s")
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching loop stopped")
                    continue
                if res.is_finished():
                    if res.error:
                        raise RuntimeError(f"transformers continuous batching: {res.error}")
                    outputs[res.request_id] = list(res.generated_tokens)
            wall = time.perf_counter() - t0
    ordered = [outputs.get(f"r{k}", []) for k in range(len(workload.items))]
    useful = sum(min(len(o), i.max_tokens) for o, i in zip(ordered, workload.items, strict=False))
    return {"wall_s": wall, "output_tokens": useful, "prompt_tokens": workload.prompt_tokens, "outputs": ordered}
