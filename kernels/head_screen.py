"""A screened LM head for greedy (and temperature-sampled) steps: the argmax of the full head's logits from a
copy of the head in fewer bytes, plus the few columns of the head itself that could hold the maximum.

Why: at one sequence a step reads every weight once, and the LM head is a fifth of a small model's weights
(SmolLM2-135M in float32: 113 of 543 MB), read only so that a greedy step can take its logits' argmax. The
screen is the head rounded to int8 codes with a scale per column (a quarter of a float32 head's bytes, half a
bfloat16 one's), and for every column i a bound c_i such that for any input row x

    |screened logit_i - exact logit_i| <= |x|_2 c_i.

The fused step (csrc/decode_step.c ``screen_head``) computes the screened logits s, takes T = max_i (s_i - b_i)
with b_i = |x|_2 c_i (the exact maximum is at least T), and recomputes from the head itself the panels of every
column with s_i + b_i >= T (the only ones that can reach it): on real text 1-126 of SmolLM2's 49,152 columns.
A float32 head had a bfloat16 screen until session 34 (1-17 columns recomputed): the int8 one reads 28 MB
less a step for 1-2 more panels of 16 columns, and made the float32 single-stream step 1.055-1.063x faster
(a Xeon with AMX, the two screens swapped every 2 steps in one engine; docs/BENCHMARKS.md). Every other column keeps a value below T, so the row's argmax
is the exact logits' argmax, the first of equal maxima included: the tokens are bit for bit those of the full
head (tests/unit/test_head_screen.py). A row sampled by temperature alone is screened the same way for the
argmax of its logits plus the sampler's race noise, drawn before the step (worker/sampler.py), and a top-k
row for its k largest logits (``ScreenRows``); a top-p cut reads every logit and runs the head itself.

The bound: by Cauchy-Schwarz the rounding costs at most |x|_2 |W_i - screen_i|_2; each product's float32
rounding is at most gamma_K sum_k |x_k w_k| <= gamma_K |x|_2 |w|_2 (K products summed in any order,
gamma_K = K u / (1 - K u), u = 2^-24), and the int8 screen's final multiply by its scale adds 2u |x|_2
|screen_i|_2. Computed in float64 from the exact values, raised by 2^-20 and rounded up to float32.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kernels import quant, quant_panels

CHUNK = 256  # panels per float64 pass of the bounds (bounded temporaries)
U = 2.0**-24  # float32's unit roundoff

_screens: dict[int, HeadScreen] = {}  # by id of the head's panels, dropped with them


@dataclass(frozen=True)
class ScreenRows:
    """What a step's caller reads of each logits row beyond greedy's argmax, so that the head may still be
    screened: the argmax of logits + ``offsets`` (float32 ``[rows, V]``: zero for a greedy row, ``-t log q``
    for the sampler's race), or, where ``top_k[r]`` > 0 (int32 ``[rows]``), row r's top_k[r] largest logits
    (the sampler's top-k cut, its race run after it on exact values)."""

    offsets: torch.Tensor
    top_k: torch.Tensor | None = None


@dataclass(frozen=True)
class HeadScreen:
    """A head's int8 screen: ``weight`` int8 panels and ``scales`` float32 ``[np * 16]`` (kernels/quant_panels.py's
    form); ``bounds`` float32 ``[n]``, the c_i above."""

    weight: torch.Tensor
    scales: torch.Tensor
    bounds: torch.Tensor

    @property
    def nbytes(self) -> int:
        """What a screened step reads besides the recomputed panels: the screen and its bounds."""
        return self.weight.nbytes + self.bounds.nbytes + self.scales.nbytes


def head_screen(panels: torch.Tensor, n: int) -> HeadScreen:
    """The int8 screen of a head held as float32 or bfloat16 panels ``[np, K, 16]`` with ``n`` output columns.
    Cached per panels tensor (computed once a model; ~0.1-0.3 s for SmolLM2)."""
    cached = _screens.get(id(panels))
    if cached is not None:
        return cached
    width = panels.shape[2]
    rows = panels.float().transpose(1, 2).reshape(-1, panels.shape[1])[:n]
    # read whole at every greedy step (28 MB for SmolLM2), so in huge pages as the weights are (the quantised
    # panels' arena; kernels/hugepages.py says why): from 4 KiB pages, greedy single-stream decode ran
    # 1.02-1.03x slower (two engines stepped alternately)
    packed = quant_panels.pack(quant.quantize(rows, "int8"), huge=True)
    scales = packed.scales.view(-1, 1, width).double()
    screen = HeadScreen(packed.codes, packed.scales,
                        _bounds(panels, lambda s: packed.codes[s].double() * scales[s], 2 * U, n))
    _screens[id(panels)] = screen
    weakref.finalize(panels, _screens.pop, id(panels), None)
    return screen


def _bounds(panels: torch.Tensor, screen_of, extra: float, n: int) -> torch.Tensor:
    """c_i per column (module docstring) of ``panels`` against ``screen_of(slice)``, the screen's exact values
    of those panels (float64 ``[p, K, 16]``); ``extra``: the screen product's error beyond gamma_K."""
    k, width = panels.shape[1], panels.shape[2]
    gamma = k * U / (1 - k * U)
    c = torch.empty(panels.shape[0] * width, dtype=torch.float64)
    for i in range(0, panels.shape[0], CHUNK):
        part = slice(i, i + CHUNK)
        w, s = panels[part].double(), screen_of(part)
        bound = (w - s).norm(dim=1) + gamma * w.norm(dim=1) + (gamma + extra) * s.norm(dim=1)
        c[i * width:i * width + bound.numel()] = bound.flatten()
    c = c[:n] * (1 + 2.0**-20)
    c32 = c.float()
    return torch.where(c32.double() < c, torch.nextafter(c32, torch.tensor(float("inf"))), c32)


def prepare(lm_head) -> HeadScreen | None:
    """The screen of ``lm_head`` (a planned Linear) where the fused step screens it: float32 or bfloat16
    panels serving the decode bucket, no bias; computed now if not yet. Else None."""
    panels = getattr(lm_head, "panels", None)
    if (panels is None or not isinstance(panels, torch.Tensor) or lm_head.forms[0] != "pk"
            or panels.dtype not in (torch.float32, torch.bfloat16) or lm_head.bias is not None):
        return None
    return head_screen(panels, lm_head.out_features)
