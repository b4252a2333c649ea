"""The model's projections (y = x W^T + b), each in the weight layout and GEMM form this CPU runs fastest.

Why: on CPU the same product can be handed to the BLAS four ways — the weight kept ``[out, in]`` (the
checkpoint's layout) or ``[in, out]``, and the product computed as ``x @ W^T`` (row-major output) or as
``W @ x^T`` (then read back transposed) — and which one is fastest depends on the CPU and the batch size M,
by up to 2x (measured per CPU in docs/BENCHMARKS.md, "CPU kernels"), so a fixed choice is wrong somewhere.
:func:`plan` times the candidates once per weight shape at load (a few M values standing for decode-sized,
mid and prefill-sized batches, interleaved, best of several runs), keeps the weight in the winning layout
(one copy, never two) and records the best form per M bucket. The result is cached per shape for the process,
and on disk for the machine where the engine turns that on (:mod:`kernels.plan_cache`: a later load reads it).
Off the CPU the plan is plain ``F.linear``.

A third layout, "pk", is this project's own kernel (:mod:`kernels.packed_gemm`): the weight packed once into
16-column panels, so no call repacks it (MKL repacks on every call, which at decode sizes costs about as much
as the product). Where it is available it is a candidate like the others. A fourth layout, "pd", is for
bfloat16 weights on CPUs with AVX512-BF16: panels in k pairs ``[ceil(out/16), in/2, 16, 2]`` multiplied by
bfloat16 rows with the CPU's bfloat16 dot product (float32 sums, one rounding of the result).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import packed_gemm, plan_cache, stream_prefetch

# M upper bounds of the buckets (decode-sized, mid, large, above: prefill-sized) and the M timed for each;
# a probe over MAX_PROBE_FLOP (the tied LM head at prefill sizes, never run: logits are per sequence) takes
# the previous bucket's choice
BUCKET_LIMITS = (16, 128, 512)
PROBE_M = (8, 64, 256, 1024)
MAX_PROBE_FLOP = 2e10
SCRATCH_BYTES = 64 << 20  # more than the last-level cache of the CPUs seen here
# The packed kernel wins a near tie: the BLAS forms' speed at decode sizes swings with the machine's load at
# probe time (measured: the same shape planned to MKL in one load and to pk in the next on a busy 2-core
# VM), while pk never repacks and was at least as fast on every layer shape measured on a quiet one.
PACKED_BIAS = 0.85
# A float32 or bfloat16 weight whose best layout is another one (a BLAS layout, or "pd") keeps a second copy
# in the packed layout for the decode bucket when the packed kernel is within this (float32; bfloat16: below)
# of the best form there: the fused decode step (kernels/decode_step.py) runs only where every projection is in
# panels, and it is worth 1.23-1.40x a whole small step (docs/BENCHMARKS.md), more than a product's own
# difference. Measured on an AMX Xeon: MKL won SmolLM2's gate_up (3072x576) by 1.3-1.4x at prefill sizes and
# tied at M = 8, so the single layout was MKL's and single-stream float32 decode ran op by op (35 tok/s against
# llama.cpp's 39).
FUSED_STEP_MARGIN = 1.35
# bfloat16: the probe's M = 8 undersells the packed kernel (it widens the weight and computes in float32) against
# oneDNN's AMX GEMM and "pd", and the fused step is worth more. Measured on an AMX Xeon, SmolLM2's bfloat16
# shapes: pk at 1.4-1.7x the best form at M = 8, yet up to 1.5x faster than oneDNN at M = 1 (the tied head);
# single-stream decode 38 tok/s with the BLAS forms at decode sizes, 64 with pk op by op, 95 fused.
FUSED_STEP_MARGIN_BF16 = 2.0
RETIME_REPS = 24  # decode-size samples per candidate where the packed panels missed the margin (_measure)

_plans: dict[tuple, tuple[str, tuple[str, ...]]] = {}
_lock = threading.Lock()


def _bucket(m: int) -> int:
    for i, limit in enumerate(BUCKET_LIMITS):
        if m <= limit:
            return i
    return len(BUCKET_LIMITS)


@dataclass
class Linear:
    """One projection. ``weight`` is ``[out, in]`` contiguous (layout "oi"), ``[in, out]`` contiguous ("io"),
    packed ``[ceil(out/16), in, 16]`` ("pk", :mod:`kernels.packed_gemm`), or packed in k pairs
    ``[ceil(out/16), in/2, 16, 2]`` ("pd", bfloat16); ``forms[b]`` is "xw" (``x @ W^T``, one GEMM writing
    rows), "wx" (``W @ x^T``, a GEMM writing columns, then transposed back), or "pk" / "pd" (the packed
    kernels; the only form of their layouts) for M bucket b. ``decode_panels``: a second copy of a BLAS- or
    "pd"-layout weight packed as "pk", which the "pk" form of the decode bucket reads (:func:`plan` says when it
    keeps one)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    layout: str = "oi"
    forms: tuple[str, ...] = ("xw",) * (len(BUCKET_LIMITS) + 1)
    out_dim: int = 0  # set from the weight unless packed (the packed weight is zero-padded to whole panels)
    decode_panels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("pk", "pd"):
            self.out_dim = int(self.weight.shape[0 if self.layout == "oi" else 1])

    @property
    def panels(self) -> torch.Tensor | None:
        """The weight in the "pk" layout where there is one: the weight itself, or the decode bucket's copy."""
        return self.weight if self.layout == "pk" else self.decode_panels

    @property
    def w_oi(self) -> torch.Tensor:
        """The weight as an ``[out, in]`` tensor (a view unless packed, then a copy)."""
        if self.layout == "pk":
            return self.weight.transpose(1, 2).reshape(-1, self.weight.shape[1])[: self.out_dim]
        if self.layout == "pd":
            return packed_gemm.unpack_pairs(self.weight, self.out_dim)
        return self.weight if self.layout == "oi" else self.weight.t()

    @property
    def out_features(self) -> int:
        return self.out_dim

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the ``[out, in]`` weight: the embedding lookup of a table tied to this head."""
        if self.layout == "pk":
            return self.weight[ids // packed_gemm.PANEL, :, ids % packed_gemm.PANEL]
        if self.layout == "pd":
            return self.weight[ids // packed_gemm.PANEL, :, ids % packed_gemm.PANEL].reshape(ids.shape[0], -1)
        return F.embedding(ids, self.w_oi)

    def _wx(self, x: torch.Tensor) -> torch.Tensor:
        """``(W @ x^T)^T``: a transposed view of an ``[out, M]`` result."""
        if self.bias is None:
            return torch.mm(self.w_oi, x.t()).t()
        return torch.addmm(self.bias[:, None], self.w_oi, x.t()).t()

    def __call__(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        """``x W^T + b`` as an ``[M, out]`` tensor: contiguous, or with ``contiguous=False`` possibly a
        transposed view (for consumers that take any strides: elementwise ops, another :class:`Linear`)."""
        form = self.forms[_bucket(x.shape[0])]
        if form == "pd":
            y = packed_gemm.matmul_pairs(x, self.weight, self.out_dim, self.bias)
            return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
        if form == "pk":
            if x.dtype != torch.float32:  # the kernel's arithmetic is float32 whatever the panels hold
                return packed_gemm.matmul(x.float(), self.panels, self.out_dim, self.bias).to(x.dtype)
            return packed_gemm.matmul(x, self.panels, self.out_dim, self.bias)
        if form == "wx":
            y = self._wx(x)
            return y.contiguous() if contiguous else y
        return F.linear(x, self.w_oi, self.bias)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x W^T + b`` in place (``out`` must be this forward's own tensor); returns ``out``."""
        form = self.forms[_bucket(x.shape[0])]
        if form == "pd":
            if out.dtype != torch.bfloat16:
                return out.add_(self(x))
            return packed_gemm.matmul_pairs(x, self.weight, self.out_dim, self.bias, out=out)
        if form == "pk":
            if out.dtype != torch.float32 or x.dtype != torch.float32:
                return out.add_(self(x))
            return packed_gemm.matmul(x, self.panels, self.out_dim, self.bias, out=out)
        if form == "wx":
            return out.add_(self._wx(x))
        if self.bias is None:
            return out.addmm_(x, self.w_oi.t())
        return out.add_(F.linear(x, self.w_oi, self.bias))


# Kept weights in the packed layouts go to huge pages (kernels/hugepages.py); the probes' copies do not.
HUGE_PAGE_WEIGHTS = True


def _stored(weight_oi: torch.Tensor, layout: str, kept: bool = False) -> torch.Tensor:
    if layout == "oi":
        return weight_oi
    if layout == "io":
        return weight_oi.t().contiguous()
    huge = kept and HUGE_PAGE_WEIGHTS
    if layout == "pd":
        return packed_gemm.pack_pairs(weight_oi, huge)
    return packed_gemm.pack(weight_oi, huge)


def _time(fn, x: torch.Tensor, scratch: torch.Tensor) -> float:
    # In the model a weight is read once per step, after every other layer's: cold in the caches. Evict it
    # (write a buffer larger than the last-level cache) so the probe measures that, not a hot-cache GEMM.
    scratch.add_(1.0)
    t = time.perf_counter()
    fn(x, False)
    return time.perf_counter() - t


def _measure(weight_oi: torch.Tensor, layouts: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    n, k = weight_oi.shape
    dt = weight_oi.dtype
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, k, generator=gen).to(dt) for m in PROBE_M if 2 * m * n * k <= MAX_PROBE_FLOP]
    candidates = []
    for layout in layouts:
        w = _stored(weight_oi, layout)
        for form in (layout,) if layout in ("pk", "pd") else ("xw", "wx"):
            candidates.append((layout, form, Linear(w, None, layout, (form,) * len(PROBE_M), n)))
    best = {(layout, form, i): float("inf") for layout, form, _ in candidates for i in range(len(xs))}
    scratch = torch.zeros(SCRATCH_BYTES // 4)
    with torch.inference_mode():
        for i, x in enumerate(xs):
            for _, _, lin in candidates:  # warm-up
                lin(x)
            # decode sizes swing most with the machine's load (and decide the fused step's panels): more samples
            reps = 8 if i == 0 else 4 if n * k * x.shape[0] < 2e8 else 2
            for r in range(reps):  # interleaved, order flipped each round: noise hits every candidate alike
                for layout, form, lin in candidates if r % 2 == 0 else reversed(candidates):
                    best[layout, form, i] = min(best[layout, form, i], _time(lin, x, scratch))
    floor = [min(best[key] for key in best if key[2] == i) for i in range(len(xs))]
    chosen: tuple[float, str, tuple[str, ...]] | None = None
    for layout in layouts:
        own = (layout,) if layout in ("pk", "pd") else ("xw", "wx")
        forms = tuple(min(own, key=lambda f, i=i: best[layout, f, i]) for i in range(len(xs)))
        forms += forms[-1:] * (len(PROBE_M) - len(forms))
        score = sum(best[layout, forms[i], i] / floor[i] for i in range(len(xs)))
        if layout in ("pk", "pd"):
            score *= PACKED_BIAS
        if chosen is None or score < chosen[0]:
            chosen = (score, layout, forms)  # type: ignore[assignment]
    assert chosen is not None
    layout, forms = chosen[1], chosen[2]
    margin = FUSED_STEP_MARGIN if dt == torch.float32 else FUSED_STEP_MARGIN_BF16
    if "pk" in layouts and layout != "pk" and best["pk", "pk", 0] > margin * floor[0]:
        _retime_decode_size(candidates, best, xs[0], scratch)  # one noisy sample must not cost the fused step
        floor[0] = min(best[key] for key in best if key[2] == 0)
    if "pk" in layouts and layout != "pk" and best["pk", "pk", 0] <= margin * floor[0]:
        forms = ("pk", *forms[1:])  # plan() keeps the panels beside the chosen layout
    return layout, forms  # type: ignore[return-value]


def _retime_decode_size(candidates, best: dict, x: torch.Tensor, scratch: torch.Tensor) -> None:
    """More samples of every candidate at the decode bucket's M, where the packed panels came out slower than
    the margin: they decide whether the decode bucket keeps them, and with them the fused step, worth up to 2x
    a small step. Measured: a bfloat16 shape planned without them in one load of eight on a busy 2-core VM
    (its single-stream decode then ran op by op at half the speed), with them in the others."""
    with torch.inference_mode():
        for r in range(RETIME_REPS):
            for layout, form, lin in candidates if r % 2 == 0 else reversed(candidates):
                best[layout, form, 0] = min(best[layout, form, 0], _time(lin, x, scratch))


def plan(weight_oi: torch.Tensor, bias: torch.Tensor | None = None, *, embedding: bool = False,
         autotune: bool = True, packed_only: bool = False) -> Linear:
    """A :class:`Linear` for ``weight_oi`` (``[out, in]``). On CPU with ``autotune``, the layout and the form
    per M bucket are measured (once per shape and dtype in this process, or read from this machine's plan file:
    :mod:`kernels.plan_cache`). ``embedding``: the weight is also
    the embedding table (a tied LM head), read through :meth:`Linear.rows`, so only the layouts whose rows
    gather cheaply ("oi", "pk") are candidates. ``packed_only``: the packed kernel, unmeasured (a bfloat16
    weight under float32 activations, which only it multiplies). Elsewhere: ``[out, in]`` and ``F.linear``."""
    weight_oi = weight_oi.contiguous()
    if packed_only:
        assert packed_gemm.available() and weight_oi.device.type == "cpu"
        stream_prefetch.ensure(weight_oi.dtype)
        return Linear(_stored(weight_oi, "pk", kept=True), bias, "pk", ("pk",) * (len(BUCKET_LIMITS) + 1),
                      int(weight_oi.shape[0]))
    if weight_oi.device.type != "cpu" or not autotune:
        return Linear(weight_oi, bias)
    layouts = ("oi",) if embedding else ("oi", "io")
    if weight_oi.dtype in packed_gemm.DTYPES and packed_gemm.available():
        layouts += ("pk",)
        stream_prefetch.ensure(weight_oi.dtype)  # before the forms are timed: they run at its distances
    if weight_oi.dtype == torch.bfloat16 and weight_oi.shape[1] % 2 == 0 and packed_gemm.has_bf16_dot():
        layouts += ("pd",)  # bfloat16 rows x bfloat16 panels with the CPU's bfloat16 dot product
    key = (tuple(weight_oi.shape), weight_oi.dtype, layouts, torch.get_num_threads())
    with _lock:
        found = _plans.get(key)
        if found is None:
            kept = plan_cache.lookup("cpu_gemm", key)  # this machine's earlier measurement (kernels/plan_cache.py)
            kept = kept if _valid_plan(kept, layouts) else None
            found = (kept[0], tuple(kept[1])) if kept else _measure(weight_oi, layouts)
            if not kept:
                plan_cache.store("cpu_gemm", key, found)
            _plans[key] = found
    layout, forms = found
    panels = _stored(weight_oi, "pk", kept=True) if layout != "pk" and "pk" in forms else None
    return Linear(_stored(weight_oi, layout, kept=True), bias, layout, forms, int(weight_oi.shape[0]), panels)


def _valid_plan(kept, layouts: tuple[str, ...]) -> bool:
    """Whether a plan read from disk is one :func:`_measure` could have made for these layouts."""
    forms = ("pk", "pd", "xw", "wx")
    return (isinstance(kept, list) and len(kept) == 2 and kept[0] in layouts and isinstance(kept[1], list)
            and len(kept[1]) == len(PROBE_M) and all(f in forms for f in kept[1]))


def plans() -> dict[str, str]:
    """The plans chosen so far, for logs and benchmark records: ``"out x in dtype" -> "layout forms"``."""
    with _lock:
        return {f"{k[0][0]}x{k[0][1]} {str(k[1]).removeprefix('torch.')}": f"{v[0]} {'/'.join(v[1])}"
                for k, v in _plans.items()}
