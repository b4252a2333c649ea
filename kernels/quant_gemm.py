"""Projections with quantised weights (:mod:`kernels.quant`), each product in the form this CPU runs fastest.

The forms are torch's own CPU kernels (maintained, vectorised, AMX/VNNI where the CPU has them), not ours:

- ``w8a16`` (int8): ``aten._weight_int8pack_mm``: bfloat16 rows times int8 weights, per-channel scales;
  weight-only, so its error is the weight's alone. Fastest at decode sizes.
- ``w8a8`` (int8): int8 activations quantised on the fly. Where our kernel builds (:mod:`kernels.w8a8_panels`,
  ``csrc/w8a8_gemm.c``) and K is a multiple of 32: in blocks of 32 inputs, each block with its own scale
  (llama.cpp's Q8_0 activations: an outlier channel coarsens only its own block), integer dot products (AVX2
  sign trick, VNNI where built), the weight in its own panels packed at load. Otherwise torch's per-token form:
  one scale per row, then ``torch._int_mm`` (AVX512-VNNI / AMX) and one rescale, measured 2-4x float32 at
  prefill sizes on an AVX512-VNNI Xeon but several times the KL of the block form on SmolLM2.
- ``w8a8w`` (int8): the same block-32 product, bit for bit, from int16 copies of the codes (``vpmaddwd``, twice
  the weight's bytes): a candidate on AVX2 CPUs without VNNI, where the int8 sign trick's three instructions per
  32 multiply-adds share two pipes (:func:`kernels.w8a8_panels.default_wide`) and the int16 form is faster at
  prefill sizes; the int8 one stays faster at decode sizes (half the bytes).
- ``w4`` (int4): ``aten._weight_int4pack_mm_for_cpu``: bfloat16 rows, 4-bit weights unpacked in registers,
  group-wise scales and zero points.
- ``w4dq`` / ``w8dq``: the weight de-quantised to bfloat16 for the call, then one bfloat16 GEMM (oneDNN,
  AMX/AVX512-BF16 where the CPU has them): at large M the unpacking is amortised over many rows.

As :mod:`kernels.cpu_gemm` does for float weights, :func:`plan` times the candidate forms once per shape at
load (the same M buckets, interleaved, best of several runs) and keeps the fastest per bucket; the choice is in
:func:`plans` for logs and benchmark records. Arithmetic is float32 into and out of every form (bfloat16
inside where the kernel needs it), so a quantised projection drops into a float32 or a bfloat16 model.

A last form, ``panels``, is this project's own kernel (:mod:`kernels.quant_panels`, where it builds): the codes
packed once into 16-column panels and widened in registers, float32 activations (no bfloat16 rounding), one
pass over the weight at decode sizes. It is timed like the others; where it wins the decode bucket and is within
``KEEP_ONE_MARGIN`` of the best form in every other bucket, it serves every bucket and the panels are the only
copy of the weight (the codes dropped unless a tied head's rows need them); otherwise each bucket keeps its
fastest form and the panels are kept beside torch's copy. :attr:`QuantLinear.panels` exposes them (None when
not chosen) for the fused decode step, which runs them through ``qgemm_team``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import plan_cache, quant_panels, w8a8_panels
from kernels.cpu_gemm import (
    BUCKET_LIMITS,
    FUSED_STEP_MARGIN,
    MAX_PROBE_FLOP,
    PROBE_M,
    RETIME_REPS,
    SCRATCH_BYTES,
    _bucket,
    _time,  # one cold-weight probe (QuantLinear takes its contiguous flag and ignores it)
)
from kernels.quant import QuantizedWeight

FORMS = {"int8": ("w8a16", "w8dq", "w8a8", "w8a8w", "panels"), "int4": ("w4", "w4dq", "panels")}
# int8 activations cost accuracy: per-token ones lose the few outlier channels LLM hidden states carry (+4.4%
# perplexity on SmolLM2 in ``bench quality``, several times weight-only int8's KL), so torch's per-token form is a
# candidate only when asked for (``activations="any"``); our kernel's blocks of 32 keep int8's +1% (+0.59% with
# every product but the LM head in them), so plain int8 times them too (``"blocks"``) where the kernel builds and
# K allows; ``"float"`` keeps activations float (the LM head: the logits are the most sensitive product).
# ``"int8"`` (int4 weights: the ``w4a8`` quantisation) quantises every product's activations to int8 in blocks of
# 32, whichever form runs it: our panels multiply them in integers (``csrc/quant_gemm.c``'s block4a8), torch's
# forms get the de-quantised blocks, so the arithmetic's rounding is the same in every M bucket.
ACTIVATIONS = ("float", "blocks", "any", "int8")
WEIGHT_ONLY = {"int8": ("w8a16", "w8dq", "panels"), "int4": ("w4", "w4dq", "panels")}
# Panels that win the decode bucket serve every bucket (one copy of the weight) when no other form is faster by
# more than this in any bucket
KEEP_ONE_MARGIN = 1.10
# The panels win a near tie (their times are scaled by this when the forms are compared), as cpu_gemm's packed
# layout does: torch's forms swing with the machine's load at probe time (measured: SmolLM2's qkv planned to
# w8a16 at M = 8 in one load of a busy 2-core VM, where panels were 2x faster in the next), and the panels keep
# float32 activations where torch's forms round them to bfloat16.
PANELS_BIAS = 0.9

_plans: dict[tuple, tuple[str, ...]] = {}
_lock = threading.Lock()


def _int4_packed(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 CPU layout: the packed codes and ``scales_and_zeros`` ``[in / group, out, 2]`` (bfloat16),
    the output rows padded to a multiple of 16 (the kernel's tile; padded rows are zero weights)."""
    assert q.zero is not None
    n, k = q.codes.shape
    pad = -n % 16
    codes, scale, zero = q.codes, q.scale, q.zero
    if pad:
        codes = torch.cat((codes, torch.full((pad, k), 8, dtype=codes.dtype)))
        scale = torch.cat((scale, torch.ones(pad, scale.shape[1])))
        zero = torch.cat((zero, torch.zeros(pad, zero.shape[1])))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    sz = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def act8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each row's blocks of 32 inputs quantised to int8 and back (``w8a8_panels.reference_quantize``,
    the kernels' own rounding): what a torch form multiplies where int4 panels would take int8 activations."""
    q, d = w8a8_panels.reference_quantize(x.float())
    m, k = x.shape
    return (q.float().view(m, k // 32, 32) * d.view(m, k // 32, 1)).view(m, k).to(x.dtype)


@dataclass
class QuantLinear:
    """``y = x W^T + b`` with ``W`` quantised; the same calls as :class:`kernels.cpu_gemm.Linear`.
    ``forms[b]``: the product's form for M bucket ``b`` (one of ``FORMS[weight.fmt]``)."""

    weight: QuantizedWeight
    bias: torch.Tensor | None
    forms: tuple[str, ...]
    keep_rows: bool = False  # keep what :meth:`rows` reads (a tied head is also the embedding table)
    huge: bool = False  # panels in the huge-page arena (a weight kept for the model's life)
    act8: bool = False  # int4: activations quantised to int8 blocks of 32 in every product (ACTIVATIONS' "int8")
    _state: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        q = self.weight
        self.panels: quant_panels.Panels | None = None
        if "panels" in self.forms:
            self.panels = quant_panels.pack(q, huge=self.huge)
            if self.act8:
                self.panels = quant_panels.with_int8_activations(self.panels)
        # w8a8 / w8a8w in our block-32 kernel where it builds and K is a multiple of 32 (else both are torch's
        # per-token form)
        self.a8: w8a8_panels.Panels | None = None
        self.a8w: w8a8_panels.Panels | None = None
        ours = q.fmt == "int8" and w8a8_panels.supports(q.shape[1]) and w8a8_panels.available()
        if ours and "w8a8" in self.forms:
            self.a8 = w8a8_panels.pack(q, wide=False)
        if ours and "w8a8w" in self.forms:
            self.a8w = w8a8_panels.pack(q, wide=True)
        torch_forms = set(self.forms) - {"panels"} - ({"w8a8", "w8a8w"} if ours else set())
        if q.fmt == "int8":
            self._state["scale_bf16"] = q.scale.to(torch.bfloat16)
            self._state["codes_t"] = q.codes.t()  # ``_int_mm``'s [in, out] operand, a view of the same codes
        elif "w4" in torch_forms:
            self._state["packed"], self._state["sz"] = _int4_packed(q)
        # drop the unpacked codes where no product reads them: int8's are what w8a16/w8dq/w8a8 read, and the
        # panels' own rows serve an int8 table; int4's are read by w4dq and by a tied table's rows
        needed = (bool(torch_forms) or self.keep_rows and self.panels is None) if q.fmt == "int8" else bool(torch_forms & {"w4dq"}) or self.keep_rows
        if not needed:
            self.weight = QuantizedWeight(q.fmt, q.codes[:0], q.scale, q.zero, q.group_size)
        self._out = int(q.scale.shape[0])

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def nbytes(self) -> int:
        """Bytes of everything kept: codes and scales, torch's int4 copy, the panels."""
        n = self.weight.nbytes if self.weight.codes.numel() else 0
        for a8 in (self.a8, self.a8w):
            n += a8.nbytes if a8 is not None else 0
        if "packed" in self._state:
            n += self._state["packed"].numel() * self._state["packed"].element_size() + self._state["sz"].numel() * 2
        return n + (self.panels.nbytes if self.panels is not None else 0)

    def bucket_nbytes(self, bucket: int = 0) -> int:
        """Bytes one product of M bucket ``bucket`` reads (0: decode sizes): those of the form that bucket runs
        (the panels' codes and scales, a block-32 W8A8 copy, torch's int4 copy, or the codes and scales), not
        every copy kept (:attr:`nbytes`). What a bandwidth-bound decode step is judged by."""
        form = self.forms[bucket]
        if form == "panels" and self.panels is not None:
            return self.panels.nbytes
        a8 = self._a8(form)
        if a8 is not None:
            return a8.nbytes
        if form == "w4" and "packed" in self._state:
            return self._state["packed"].nbytes + self._state["sz"].nbytes
        return self.weight.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the de-quantised weight (float32): the embedding lookup of a tied head."""
        q = self.weight
        if not q.codes.numel() and self.panels is not None:  # int8 in panels only (bit for bit the same rows)
            return self.panels.rows(ids)
        codes = q.codes.index_select(0, ids).float()
        if q.fmt == "int8":
            return codes * q.scale.index_select(0, ids)[:, None]
        assert q.zero is not None
        n, k = codes.shape
        g = codes.view(n, k // q.group_size, q.group_size)
        return ((g - 8.0) * q.scale.index_select(0, ids)[..., None]
                + q.zero.index_select(0, ids)[..., None]).view(n, k)

    def _a8(self, form: str) -> w8a8_panels.Panels | None:
        """Our block-32 panels serving ``form`` (None: not a w8a8 form, or torch's per-token product serves it)."""
        return self.a8 if form == "w8a8" else self.a8w if form == "w8a8w" else None

    def _product(self, x: torch.Tensor, form: str) -> torch.Tensor:
        s = self._state
        if form == "panels":
            assert self.panels is not None
            return quant_panels.matmul(x, self.panels)
        if form == "w8a16":
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight.codes, s["scale_bf16"])
        a8 = self._a8(form)
        if a8 is not None:
            return w8a8_panels.matmul(x, a8)
        if form in ("w8a8", "w8a8w"):
            xf = x.float()
            amax = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
            xq = torch.round(xf * (127.0 / amax)).to(torch.int8)
            acc = torch._int_mm(xq, s["codes_t"])
            return acc.float().mul_(amax * (1.0 / 127.0)).mul_(self.weight.scale)
        if form == "w4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), s["packed"],
                                                           self.weight.group_size, s["sz"])
            return y if y.shape[1] == self._out else y[:, : self._out]
        if form in ("w4dq", "w8dq"):
            w = self.weight.dequantize(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), w)
        raise ValueError(f"unknown quantised form {form!r}")

    def __call__(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        form = self.forms[_bucket(x.shape[0])]
        if form == "panels":
            assert self.panels is not None
            y = quant_panels.matmul(x, self.panels, self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        a8 = self._a8(form)
        if a8 is not None:
            y = w8a8_panels.matmul(x, a8, self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        y = self._product(act8_blocks(x) if self.act8 else x, form).to(x.dtype)
        return y.add_(self.bias) if self.bias is not None else y

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x W^T + b`` in place."""
        if (self.forms[_bucket(x.shape[0])] == "panels" and out.dtype == torch.float32 and out.stride(-1) == 1
                and self.panels is not None):
            return quant_panels.matmul(x, self.panels, self.bias, out=out)
        a8 = self._a8(self.forms[_bucket(x.shape[0])])
        if a8 is not None and out.dtype == torch.float32 and out.stride(-1) == 1:
            return w8a8_panels.matmul(x, a8, self.bias, out=out)
        return out.add_(self(x))


def _measure(q: QuantizedWeight, forms: tuple[str, ...], act8: bool = False) -> tuple[str, ...]:
    """The form per M bucket for this shape: each bucket's fastest of ``forms``, timed interleaved with a cold
    weight (as a model step reads it), best of a few runs; panels at decode sizes where they come within the
    fused step's margin (:func:`_decode_form`); then panels everywhere if they win the decode bucket and are
    within ``KEEP_ONE_MARGIN`` of the fastest in every other one (one copy of the weight)."""
    n, k = q.shape
    if len(forms) == 1:
        return forms * (len(BUCKET_LIMITS) + 1)
    lins = {f: QuantLinear(q, None, (f,) * len(PROBE_M), keep_rows=True, act8=act8) for f in forms}
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, k, generator=gen) for m in PROBE_M if 2 * m * n * k <= MAX_PROBE_FLOP]
    scratch = torch.zeros(SCRATCH_BYTES // 4)
    best = {(f, i): float("inf") for f in forms for i in range(len(xs))}
    with torch.inference_mode():
        for i, x in enumerate(xs):
            for lin in lins.values():
                lin(x)
            # more samples where they are cheap: a decode-sized probe takes ~0.1 ms, and on a busy machine a
            # two-thread call is slowed whenever the other core is taken (four samples flipped buckets there)
            _sample(lins, best, i, x, scratch, 12 if n * k * x.shape[0] < 2e7 else 4 if n * k * x.shape[0] < 2e8 else 2)
        chosen = tuple(min(_bucket_forms(forms, i), key=lambda f, i=i: best[f, i] * (PANELS_BIAS if f == "panels" else 1.0))
                       for i in range(len(xs)))
        chosen = (_decode_form(lins, best, chosen[0], xs[0], scratch), *chosen[1:])
    if "panels" in forms and chosen[0] == "panels" and all(
            best["panels", i] <= KEEP_ONE_MARGIN * best[chosen[i], i] for i in range(len(xs))):
        chosen = ("panels",) * len(xs)
    return chosen + chosen[-1:] * (len(BUCKET_LIMITS) + 1 - len(chosen))


def _sample(lins: dict, best: dict, i: int, x: torch.Tensor, scratch: torch.Tensor, reps: int) -> None:
    """``reps`` rounds of every form at bucket ``i``'s probe, interleaved and the order flipped each round (noise
    hits every form alike); ``best`` keeps each form's fastest."""
    for r in range(reps):
        for f in lins if r % 2 == 0 else reversed(lins):
            best[f, i] = min(best[f, i], _time(lins[f], x, scratch))


def _decode_form(lins: dict, best: dict, fastest: str, x: torch.Tensor, scratch: torch.Tensor) -> str:
    """The decode bucket's form: the panels wherever they are within ``FUSED_STEP_MARGIN`` of the fastest, as
    cpu_gemm keeps its packed ones, because the fused decode step runs only where every projection is in panels
    and is worth more than a product's own difference. Where the first samples put them outside, every form is
    timed again before they are dropped. Measured on a Zen 5: int8's down projection planned to w8a16 in one
    load (single-stream int8 then ran op by op, 0.88x llama.cpp), panels 45-50 us against its 58-71 after."""
    if "panels" not in lins or fastest == "panels":
        return fastest
    if best["panels", 0] > FUSED_STEP_MARGIN * best[fastest, 0]:
        _sample(lins, best, 0, x, scratch, RETIME_REPS)
        fastest = min(_bucket_forms(tuple(lins), 0), key=lambda f: best[f, 0])
    return "panels" if best["panels", 0] <= FUSED_STEP_MARGIN * best[fastest, 0] else fastest


def _bucket_forms(forms: tuple[str, ...], bucket: int) -> tuple[str, ...]:
    """The forms bucket ``bucket`` may choose: at decode sizes (bucket 0) not the int8-activation ones where the
    panels are a candidate, because the fused decode step (kernels/decode_step.py) multiplies float-activation
    panels only, and running a step's layers in one call is worth more there (1.23x a whole step, float32,
    docs/BENCHMARKS.md) than a product's own difference at one to sixteen rows."""
    if bucket or "panels" not in forms:
        return forms
    return tuple(f for f in forms if f not in ("w8a8", "w8a8w"))


def candidates(fmt: str, activations: str = "float", k: int | None = None) -> tuple[str, ...]:
    """The forms :func:`plan` times for ``fmt``: the weight-only ones; with ``activations="blocks"`` our
    block-32 W8A8 too where it builds for a K of ``k`` (None: unknown); with ``"any"`` every int8 form (torch's
    per-token W8A8 where ours does not apply); the panels where their kernel builds."""
    assert activations in ACTIVATIONS, activations
    blocks = (activations in ("blocks", "int8") and fmt == "int8" and k is not None and w8a8_panels.supports(k)
              and w8a8_panels.available())
    forms = FORMS[fmt] if activations == "any" or blocks else WEIGHT_ONLY[fmt]
    # the int16 w8a8 copy only where it can beat the int8 one (AVX2 without VNNI) and our kernel builds
    wide = w8a8_panels.available() and w8a8_panels.default_wide()
    return tuple(f for f in forms if (f != "panels" or quant_panels.available()) and (f != "w8a8w" or wide))


def plan(q: QuantizedWeight, bias: torch.Tensor | None = None, *, embedding: bool = False,
         autotune: bool = True, activations: str = "blocks") -> QuantLinear:
    """A :class:`QuantLinear` for ``q``, its form per M bucket measured once per shape and format in this
    process, or read from this machine's plan file (:mod:`kernels.plan_cache`) (``autotune=False``: the first
    form everywhere, for tests). ``embedding``: the weight is also the
    embedding table (kept readable by :meth:`QuantLinear.rows`); ``activations``: which int8-activation forms
    are candidates (:func:`candidates`); ``"int8"`` with int4 weights: every product's activations in int8
    blocks of 32 (``QuantLinear.act8``) where k allows (a multiple of 32).
    """
    forms = candidates(q.fmt, activations, q.shape[1])
    act8 = activations == "int8" and q.fmt == "int4" and quant_panels.supports_act8(q.shape[1], q.group_size)
    key = (tuple(q.shape), q.fmt, q.group_size, forms, torch.get_num_threads()) + (("a8",) if act8 else ())
    with _lock:
        found = _plans.get(key)
        if found is None and autotune:
            kept = plan_cache.lookup("quant_gemm", key)  # this machine's earlier measurement (kernels/plan_cache.py)
            kept = kept if isinstance(kept, list) and len(kept) == len(BUCKET_LIMITS) + 1 and set(kept) <= set(forms) else None
            found = tuple(kept) if kept else _measure(q, forms, act8)
            if not kept:
                plan_cache.store("quant_gemm", key, found)
            _plans[key] = found
        elif found is None:
            found = (forms[0],) * (len(BUCKET_LIMITS) + 1)
    return QuantLinear(q, bias, found, keep_rows=embedding, huge=True, act8=act8)


def plans() -> dict[str, str]:
    """The forms chosen so far: ``"out x in fmt" -> "form per M bucket"``."""
    with _lock:
        return {f"{k[0][0]}x{k[0][1]} {k[1]}{'/g' + str(k[2]) if k[2] else ''}"
                f"{' a8' if 'w8a8' in k[3] or 'a8' in k[5:] else ''}": "/".join(v)
                for k, v in _plans.items()}
