"""Token sampling: greedy, temperature, top-k, top-p, with per-request reproducible seeds.

Sampling uses the exponential race: with q_v ~ Exp(1) i.i.d., ``argmax_v p_v / q_v`` is distributed as
``p``. In log space that is ``argmax_v (logits_v / T - log q_v)`` over the allowed tokens, so no softmax
is needed. For a seeded request the noise vector for output index i is drawn from a generator seeded by
a hash of (seed, i), so the token depends only on the logits, the seed and i — not on which other requests
share the batch, nor on preemption and recomputation. Unseeded requests draw from one global generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import cpu_norm
from scheduler.request import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_for(seed: int, index: int) -> int:
    """Generator seed for output token ``index`` of a request seeded with ``seed`` (63-bit)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) & ((1 << 63) - 1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``, in one C pass for float32 CPU rows where the library builds (kernels/csrc/argmax.c
    says why: torch's is a scalar reduction, about 90 us of a vocabulary-wide row); the same indices."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and x.stride(-1) == 1:
        lib = cpu_norm.load()
        if lib is not None:
            return cpu_norm.argmax_rows(x, lib)
    return x.argmax(dim=-1)


class Sampler:
    """Picks one token per logits row. ``sample(logits, params, output_indices)``; logits float32 ``[N, V]``."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Seeded noise is drawn on the CPU so a given (seed, index) gives the same token on every device.
        self._cpu_gen = torch.Generator(device="cpu")

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[int]:
        n = logits.shape[0]
        if n == 0:
            return []
        if all(p.greedy for p in params):
            return _argmax(logits).tolist()
        vocab = logits.shape[1]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        out = _argmax(logits)  # greedy rows keep this
        sel = torch.tensor(rows, device=logits.device, dtype=torch.long) if len(rows) < n else None
        x = logits if sel is None else logits.index_select(0, sel)
        x = x.float()
        ps = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in ps], device=x.device, dtype=torch.float32)
        x = x / temps[:, None]
        x = self._apply_top_k_top_p(x, ps)
        noise = self._noise(len(rows), vocab, ps, [output_indices[i] for i in rows], x.device)
        picked = _argmax(x - noise.log())
        if sel is None:
            out = picked
        else:
            out = out.index_copy(0, sel, picked)
        return out.tolist()

    @staticmethod
    def _apply_top_k_top_p(x: torch.Tensor, ps: Sequence[SamplingParams]) -> torch.Tensor:
        vocab = x.shape[1]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
        tops = [p.top_p for p in ps]
        need_k = any(ks)
        need_p = any(tp < 1.0 for tp in tops)
        if not need_k and not need_p:
            return x
        if need_k and not need_p:
            kmax = max(ks)
            vals = x.topk(kmax, dim=-1).values  # [N, kmax] sorted descending
            kk = torch.tensor([k if k else kmax for k in ks], device=x.device)
            thresh = vals.gather(1, (kk - 1)[:, None])
            no_k = torch.tensor([k == 0 for k in ks], device=x.device)
            thresh = torch.where(no_k[:, None], torch.full_like(thresh, float("-inf")), thresh)
            return x.masked_fill(x < thresh, float("-inf"))
        # top-p (and maybe top-k): one descending sort.
        sorted_x, order = x.sort(dim=-1, descending=True)
        pos = torch.arange(vocab, device=x.device)[None, :]
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if need_k:
            kk = torch.tensor([k if k else vocab for k in ks], device=x.device)
            remove |= pos >= kk[:, None]
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        probs = sorted_x.softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        tp = torch.tensor(tops, device=x.device, dtype=torch.float32)
        remove |= cum_before >= tp[:, None]  # keep the smallest prefix whose mass reaches top_p
        remove[:, 0] = False
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    def _noise(
        self, n: int, vocab: int, ps: Sequence[SamplingParams], indices: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise ``[n, vocab]``: seeded rows from hash(seed, index) generators, others from the global one."""
        noise = torch.empty((n, vocab), dtype=torch.float32, device=device)
        unseeded = [j for j, p in enumerate(ps) if p.seed is None]
        if len(unseeded) == n:
            return noise.exponential_(generator=self.generator)
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            draw = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
            noise[idx] = draw.exponential_(generator=self.generator)
        for j, p in enumerate(ps):
            if p.seed is None:
                continue
            self._cpu_gen.manual_seed(seed_for(int(p.seed), int(indices[j])))
            row = torch.empty(vocab, dtype=torch.float32).exponential_(generator=self._cpu_gen)
            noise[j] = row.to(device)
        # Exp(1) draws can be exactly 0 in float32 (probability ~2^-24 per draw): keep the log finite.
        return noise.clamp_min_(1e-30)
