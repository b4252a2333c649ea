"""Token sampling: greedy, temperature, top-k, top-p, with per-request reproducible seeds.

Sampling uses the exponential race: with q_v ~ Exp(1) i.i.d., ``argmax_v p_v / q_v`` is distributed as
``p``. In log space that is ``argmax_v (logits_v / T - log q_v)`` over the allowed tokens, so no softmax
is needed; a row with no top-k or top-p cut takes it as ``argmax_v (logits_v - T log q_v)`` (the same race
times T > 0: one add over the row, and what a screened head bounds). For a seeded request the noise vector
for output index i is a function of a hash of (seed, i) (kernels/csrc/race_noise.c), so the token depends only
on the logits, the seed and i — not on which other requests share the batch, nor on preemption and
recomputation, nor on the CPU. Unseeded requests draw their keys from the sampler's own generator.

Where no sampling row has a top-p cut, the noise can be drawn before the step (:meth:`Sampler.race`): the step
then reads only each row's argmax of ``logits + offsets`` (offsets ``-T log q``; zero for a greedy row), or
a top-k row's k largest logits, which lets it screen its LM head (kernels/head_screen.py), and
:meth:`Sampler.sample` takes the same draw, so the token is the one the unscreened logits give.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_norm
from kernels.head_screen import ScreenRows
from scheduler.request import SamplingParams

_MASK64 = (1 << 64) - 1
# Below this temperature a top-k row is not screened: its cut compares logits / T, which could overflow to
# equal infinities the screen (bounding the logits, not their quotients) cannot order. (A row with no cut never
# divides: its race keys are logits - T log q.)
MIN_CUT_TEMPERATURE = 0.05
# A top-k cut above this is not screened: the step keeps a heap of k bounds per row (and a large k reads most
# of the head anyway).
MAX_SCREENED_TOP_K = 1024


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


# A top-p cut looks for its prefix among the most likely NUCLEUS_TOP tokens first, then by buckets of z (logits /
# T) NUCLEUS_BUCKETS wide over NUCLEUS_SPAN below the row's max (the last bucket holds the rest).
NUCLEUS_TOP, NUCLEUS_BUCKETS, NUCLEUS_SPAN = 256, 512, 24.0


def _kept(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """What a cut keeps of one row ``z`` (logits / T), as token ids or as a mask: its ``top_k`` largest where
    top_k > 0, then, where top_p < 1, the smallest most likely prefix of those (or of the whole row) whose softmax
    mass reaches top_p (a token stays while the mass of those before it is below top_p; the first always). Why not
    one sort of the row: sorting 49,152 logits took 3 ms on the CPU (more than a quantised model's whole step); a
    top-k of 256 finds a peaked row's prefix in 0.07 ms, and :func:`_nucleus_by_buckets` any other's in 0.2-0.4
    ms."""
    if top_k:
        values, ids = z.topk(top_k)
        if top_p >= 1.0:
            return ids
        probs = values.softmax(0)
        return ids[_prefix(probs, probs.cumsum(0), top_p)]
    probs = z.softmax(0)
    if NUCLEUS_TOP * 4 <= z.shape[0]:
        values, ids = probs.topk(NUCLEUS_TOP)
        mass = values.cumsum(0)
        if mass[-1] >= top_p:  # the prefix ends among these
            return ids[_prefix(values, mass, top_p)]
    return _nucleus_by_buckets(z, probs, top_p)


def _nucleus_by_buckets(z: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p prefix as a mask over the row, without sorting it: each token's bucket by how far z falls below
    its max (a bucket above another holds only larger probabilities), the buckets' masses summed from the top to
    the one where the prefix ends, and only that bucket's probabilities sorted, for the smallest one kept (tokens
    equal to it all stay)."""
    below = (z.max() - z).clamp_max_(NUCLEUS_SPAN)  # -inf logits (masked tokens) too: into the last bucket
    bucket = (below * (NUCLEUS_BUCKETS / NUCLEUS_SPAN)).long().clamp_max_(NUCLEUS_BUCKETS - 1)
    mass = torch.zeros(NUCLEUS_BUCKETS, dtype=probs.dtype, device=z.device).index_add_(0, bucket, probs)
    running = mass.cumsum(0)
    reached = (running >= top_p).nonzero()
    last = int(reached[0]) if len(reached) else int((mass > 0).nonzero()[-1])  # rounding: the whole row
    inside = bucket == last
    values = probs.masked_select(inside).sort(descending=True).values
    keep = (float(running[last] - mass[last]) + values.cumsum(0) - values) < top_p
    kept = max(1, int(keep.sum())) if last == 0 else int(keep.sum())  # a prefix: the running mass only grows
    return (bucket < last) | (inside & (probs >= values[kept - 1]))


def _prefix(probs: torch.Tensor, mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """The mask of the nucleus over probabilities sorted in descending order (``mass`` their running sum)."""
    keep = (mass - probs) < top_p
    keep[0] = True
    return keep


@dataclass(frozen=True)
class RaceDraw:
    """The exponential race's noise for one step's sampling rows, drawn before their logits exist:
    ``log_q`` ``[non-greedy rows, V]`` (the log of the Exp(1) draws), and ``screen``, what the step's caller
    reads of each row: the argmax of ``logits + offsets`` (``-T log q``, zero for a greedy row), or a top-k
    row's k largest logits (its race runs after the cut)."""

    log_q: torch.Tensor
    screen: ScreenRows


class Sampler:
    """Picks one token per logits row. ``sample(logits, params, output_indices)``; logits float32 ``[N, V]``."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Noise on the CPU (every seeded row's, so a given (seed, index) gives the same token on every device) is
        # computed in C from one key a row (kernels/csrc/race_noise.c: 27 us for 49,152 columns where numpy's
        # ziggurat and torch's log took 160 and torch's exponential_ 900); unseeded rows draw their key here.
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        race: RaceDraw | None = None,
    ) -> list[int]:
        """``race``: the noise :meth:`race` drew for these rows before the step (else drawn now)."""
        n = logits.shape[0]
        if n == 0:
            return []
        if all(p.greedy for p in params):
            return _argmax(logits).tolist()
        if race is not None and race.screen.top_k is None:  # no row has a cut: the race is one add
            return _argmax(logits.float() + race.screen.offsets).tolist()
        vocab = logits.shape[1]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        out = _argmax(logits)  # greedy rows keep this
        sel = torch.tensor(rows, device=logits.device, dtype=torch.long) if len(rows) < n else None
        x = logits if sel is None else logits.index_select(0, sel)
        ps = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in ps], device=x.device, dtype=torch.float32)
        if race is None:
            log_q = self._log_noise(len(rows), vocab, ps, [output_indices[i] for i in rows], x.device)
        else:
            log_q = race.log_q
        picked = self._race_tokens(x.float(), log_q, temps, ps)
        if sel is None:
            out = picked
        else:
            out = out.index_copy(0, sel, picked)
        return out.tolist()

    def race(self, params: Sequence[SamplingParams], output_indices: Sequence[int], vocab: int) -> RaceDraw | None:
        """The noise of these sampling rows, drawn now (before the step) where some row samples and no such
        row has a top-p cut (which needs every logit), nor a top-k cut above :data:`MAX_SCREENED_TOP_K` or
        below :data:`MIN_CUT_TEMPERATURE`; else None. The same draws as :meth:`sample` would make, in the same
        order."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if not rows or any(params[i].top_p < 1.0 or ks[i] > MAX_SCREENED_TOP_K
                           or ks[i] and params[i].temperature < MIN_CUT_TEMPERATURE for i in rows):
            return None
        ps = [params[i] for i in rows]
        log_q = self._log_noise(len(rows), vocab, ps, [output_indices[i] for i in rows], self.device)
        temps = torch.tensor([p.temperature for p in ps], device=self.device, dtype=torch.float32)
        offsets = log_q * -temps[:, None]  # the race keys' own products (_race_tokens)
        if len(rows) < len(params):  # greedy rows: zero (their argmax)
            offsets = torch.zeros((len(params), vocab), dtype=torch.float32, device=self.device).index_copy_(
                0, torch.tensor(rows, device=self.device), offsets)
        top_k = torch.tensor(ks, dtype=torch.int32) if any(ks[i] for i in rows) else None
        return RaceDraw(log_q, ScreenRows(offsets, top_k))

    def window_offsets(self, sp: SamplingParams, first: int, n: int, vocab: int | None) -> torch.Tensor | None:
        """A decode-ahead window's race offsets ``[n, vocab]`` (output indices ``first`` ..), drawn now, for a
        sampled row with no top-k or top-p cut: each token is then the argmax of its logits plus its row, which
        the fused step's C loop takes itself (kernels/decode_step.py ``run_window``). The draws :meth:`race`
        makes token by token. None, drawing nothing, for any other row."""
        if not vocab or sp.greedy or sp.top_p < 1.0 or 0 < sp.top_k < vocab:
            return None
        draw = self.race([sp] * n, range(first, first + n), vocab)
        return None if draw is None else draw.screen.offsets

    def _race_tokens(self, x: torch.Tensor, log_q: torch.Tensor, temps: torch.Tensor,
                     ps: Sequence[SamplingParams]) -> torch.Tensor:
        """Each sampled row's token, the argmax of its race keys: ``x - T log q`` for a row with no cut (the
        offsets :meth:`race` hands a screened head, the same float32 products), ``x / T - log q`` over the tokens
        a top-k or top-p cut keeps (:func:`_kept`) for a row with one (the first of equal keys by index; the greedy
        token where logits / T overflow, the limit as T -> 0)."""
        vocab = x.shape[1]
        cut = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if not cut:
            return _argmax(x + log_q * -temps[:, None])
        out = torch.empty(len(ps), dtype=torch.long, device=x.device)
        if len(cut) < len(ps):
            plain = torch.tensor([j for j in range(len(ps)) if j not in cut], device=x.device)
            out[plain] = _argmax(x[plain] + log_q[plain] * -temps[plain, None])
        for j in cut:
            p, z = ps[j], x[j] / temps[j]
            if not bool(torch.isfinite(z.max())):  # a temperature so small that logits / T overflow: its limit
                out[j] = _argmax(x[j][None])[0]
                continue
            kept = _kept(z, p.top_k if 0 < p.top_k < vocab else 0, p.top_p)
            if kept.dtype == torch.bool:
                out[j] = _argmax(torch.where(kept, z - log_q[j], float("-inf"))[None])[0]
            else:
                keys = z[kept] - log_q[j, kept]
                out[j] = kept[keys == keys.max()].min()
        return out

    def _log_noise(
        self, n: int, vocab: int, ps: Sequence[SamplingParams], indices: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """log E for Exp(1) noise E, ``[n, vocab]``. Each CPU row is a function of one 64-bit key
        (kernels/csrc/race_noise.c): a seeded row's hash of (seed, index), another row's drawn from the
        sampler's own generator; on a GPU the unseeded rows come from its device generator instead."""
        on_cpu = device.type == "cpu"
        out = torch.empty((n, vocab), dtype=torch.float32, device=device)
        unseeded = [j for j, p in enumerate(ps) if p.seed is None]
        if unseeded and not on_cpu:
            idx = torch.tensor(unseeded, device=device)
            draw = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
            # Exp(1) draws can be exactly 0 in float32: keep the log finite.
            out[idx] = draw.exponential_(generator=self.generator).clamp_min_(1e-30).log_()
        rows = [j for j, p in enumerate(ps) if on_cpu or p.seed is not None]
        keys = [int(self._rng.integers(1 << 63)) if ps[j].seed is None else seed_for(int(ps[j].seed), int(indices[j]))
                for j in rows]
        noise = cpu_norm.race_log_noise(keys, vocab) if cpu_norm.load() else cpu_norm.race_log_noise_reference(
            keys, vocab)
        if on_cpu and len(rows) == n:
            return noise
        if rows:
            out[torch.tensor(rows, device=device)] = noise.to(device)
        return out
