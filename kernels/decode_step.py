"""A small step of the decoder's layers in one C call (``csrc/decode_step.c``): the thread team is forked once
per step and meets at barriers between a layer's phases, instead of ~10 ops per layer each paying a torch
dispatch or a ctypes call, a fork and join of the team, and the Python between them.

Why: at batch 1 a step's floor is reading every weight once (SmolLM2-135M float32: 538 MB); the op-by-op
forward adds its per-op costs on top (docs/BENCHMARKS.md, "Single-stream decode"). The C step chains the same
kernels the separate calls run, in the same order, so its output is bit-identical to theirs (a float32 model's;
a bfloat16 model's below).

When :meth:`DecodeStep.for_model` returns one and :meth:`DecodeStep.applies` holds (worker/model.py asks each
step): a CPU model in float32 or bfloat16 arithmetic whose every projection is in panels (the packed float32 or
bfloat16 layout, or the quantised int8/int4 panels where the planner serves decode sizes from them), no tensor
parallelism, a float32, bfloat16, int8 or fp8 KV cache (quantised rows packed here as the cache write packs
them), and a step of at most ``MAX_ROWS`` tokens (the GEMM planner's
decode-sized bucket: above it a step's per-op costs are a small share, and the small ops here are computed by
every thread): decodes, and chunks of several tokens (speculative proposals, short prefills) where the prefill
kernel reads the cache. Anything else runs op by op. Where the LM
head is in panels too, the final norm and the head run in the same call (one fork of the team less per step).

A bfloat16 model (a CPU with native bfloat16 matmul, worker/model.py) has its step computed in float32: the
caller widens the embedded rows, the bfloat16 panels are widened as they load (as under float32 arithmetic with
bfloat16 weights), the norms' weights are widened once here, RoPE takes the rotate-half form of the checkpoint's
q/k order with float32 cos and sin, and the keys and values are rounded to the bfloat16 cache as op by op. So
its logits are more precise than, and not bit-identical to, its op-by-op forward, which rounds to bfloat16
after every op. Why accept that: at decode sizes the step is bound by reading the weights, not by arithmetic
(SmolLM2-135M on an AMX Xeon: 36 tok/s op by op, no faster than float32's 35; 95 fused), and a bfloat16
model's results already depend on the batch size (each bucket's GEMM form rounds differently).
"""


from __future__ import annotations

import ctypes
import functools
import select
import time

import numpy as np
import torch

from kernels import cpu_attention, cpu_gemm, head_screen, kv_quant, native, packed_gemm, stream_prefetch

SOURCES = ("decode_step.c", "packed_gemm.c", "quant_gemm.c", "decode_attention.c", "prefill_attention.c",
           "rms_norm.c", "rope.c", "activation.c", "argmax.c")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
W_F32, W_BF16, W_I8, W_I4, W_I4A8 = range(5)  # decode_step.c's panel kinds
EMB_F32_ROWS, EMB_BF16_ROWS, EMB_F32_PANELS, EMB_BF16_PANELS, EMB_I8_PANELS = range(5)  # and its step_embed kinds
DTYPES = (torch.float32, torch.bfloat16)  # the models' arithmetic it takes (bfloat16: computed in float32)
MAX_ROWS = cpu_gemm.BUCKET_LIMITS[0]
# simd.h's ELEM_F32, ELEM_BF16, ELEM_I8 and ELEM_F8 (the quantised caches' rows of codes + scale)
ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, kv_quant.FP8_ROWS: 3}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# decode_step.c's phases, in its order, as the build with INFERQ_STEP_PHASES times them (phase_times)
PHASES = ("norms", "qkv", "wait after qkv", "rope + cache write", "attention", "o", "wait after o", "gate_up",
          "wait after gate_up", "silu_mul", "down", "wait after down", "lm_head")


class _Proj(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("scales", _P), ("kind", _I), ("group", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _Proj) for name in PROJECTIONS),
                *((name, _P) for name in ("input_norm", "post_norm", "k_cache", "v_cache"))]


class _Args(ctypes.Structure):
    _fields_ = [("layers", _P), ("L", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("inter", _I),
                ("kv_kind", _I), ("bs", _I), ("c_bs", _I64), ("c_ts", _I64), ("c_hs", _I64),
                ("eps", _F), ("scale", _F), ("qkv", _P), ("attn", _P), ("gu", _P), ("x", _P), ("M", _I),
                ("rot", _P), ("rope_half", _I), ("slots", _P), ("nd", _I), ("bt", _P), ("bt_ss", _I64), ("lens", _P), ("max_len", _I),
                ("np", _I), ("p_bt", _P), ("p_bt_ss", _I64), ("p_qs", _P), ("p_ctx", _P), ("p_first", _P),
                ("final_norm", _P), ("head", _Proj), ("V", _I), ("R", _I), ("rows", _P), ("logits", _P),
                ("screen", _Proj), ("screen_c", _P), ("screen_panels", _P), ("screen_add", _P),
                ("screen_k", _P)]


class _Embed(ctypes.Structure):  # decode_step.c's step_embed
    _fields_ = [("w", _P), ("scales", _P), ("kind", _I)]


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and bind the library; ``defines`` picks a variant (:mod:`kernels.native`, e.g.
    ``{"INFERQ_NO_AVX512": 1}`` for the AVX2 build). None where it cannot be built (it needs AVX2 + FMA, as the
    packed GEMM does)."""
    if not packed_gemm.available():
        return None
    lib = native.build("decode_step", SOURCES, defines)
    if lib is None:
        return None
    stream_prefetch.register(lib)  # its products' prefetch distances, as the packed GEMM's
    lib.decode_step.argtypes = [ctypes.POINTER(_Args)]
    lib.decode_step.restype = _I
    lib.decode_window.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Embed), _I64, _I, _I, _P, _I64, _P, _P,
                                  _P, _I, _P, _I64, _P, _I]
    lib.decode_window.restype = _I
    lib.set_generic.argtypes = [_I]
    lib.set_avx512.argtypes = [_I]
    lib.f8_from_f32.argtypes = [_F]  # the cache write's float8 conversion (tests compare it with torch's)
    lib.f8_from_f32.restype = ctypes.c_uint8
    if hasattr(lib, "step_phases"):
        lib.step_phases.argtypes = [_P, _I]
        lib.step_phases.restype = _I
    return lib


def phase_times(lib: ctypes.CDLL, threads: int) -> list[dict[str, float]]:
    """Per thread, the seconds each phase (:data:`PHASES`) took since the last call, from a library built with
    ``{"INFERQ_STEP_PHASES": None}`` (bench/latency.py's breakdown of the fused step); the counters restart."""
    out = (ctypes.c_double * (threads * len(PHASES)))()
    n = lib.step_phases(ctypes.cast(out, _P), threads)
    assert n == len(PHASES), "decode_step.c's phases and PHASES differ"
    return [{name: out[t * n + i] / 1e9 for i, name in enumerate(PHASES)} for t in range(threads)]


@functools.cache
def load() -> ctypes.CDLL | None:
    return build()


def _panels(lin) -> tuple | None:
    """(kind, weight, scales or None, group size) of a projection held in panels the fused step multiplies: the
    packed float layout (its only copy, or one kept beside a BLAS layout for the decode bucket), or quantised
    panels the planner serves decode sizes from; None otherwise."""
    if isinstance(lin, cpu_gemm.Linear):
        pk = lin.panels
        if pk is not None and lin.forms[0] == "pk" and pk.dtype in packed_gemm.DTYPES:
            return (W_BF16 if pk.dtype == torch.bfloat16 else W_F32), pk, None, 0
        return None
    panels = getattr(lin, "panels", None)
    if panels is not None and lin.forms[0] == "panels":
        return W_I8 + panels.code, panels.codes, panels.scales, panels.group_size
    return None


def _embedding(model) -> _Embed | None:
    """Where :meth:`DecodeStep.run_window` embeds its tokens from, as ``model``'s own lookup does: an
    untied float32 or bfloat16 table, or the tied head's panels (float32, bfloat16, or int8 codes and scales
    where the model computes in float32: a bfloat16 model rounds those rows to bfloat16 first, as it would
    float32 panels, which the C lookup does not). None: the window then runs its Python loop."""
    table = getattr(model, "embed", None)
    if table is not None:
        kind = {torch.float32: EMB_F32_ROWS, torch.bfloat16: EMB_BF16_ROWS}.get(table.dtype)
        ok = kind is not None and table.is_contiguous()
        return _Embed(table.data_ptr(), None, kind) if ok else None
    kind, w, scales, _ = _panels(model.lm_head)  # type: ignore[misc]
    if kind == W_I8 and model.dtype == torch.float32:
        return _Embed(w.data_ptr(), scales.data_ptr(), EMB_I8_PANELS)
    if kind == W_BF16 or (kind == W_F32 and model.dtype == torch.float32):  # rows widened exactly, or as stored
        return _Embed(w.data_ptr(), None, EMB_F32_PANELS if kind == W_F32 else EMB_BF16_PANELS)
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def woken(fd: int) -> bool:
    """Whether ``fd`` (>= 0) is readable now: a decode-ahead window's cue to end early (``run_window``'s
    ``wake_fd``, checked the same way between the tokens of a window run in Python)."""
    if fd < 0:
        return False
    poller = select.poll()  # not select.select: that refuses descriptors from 1024 on
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class DecodeStep:
    """The argument block of one model's layers and KV caches, filled once; :meth:`run` sets the step's inputs."""

    woken = staticmethod(woken)

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lib: ctypes.CDLL) -> None:
        c = model.config
        self.lib = lib
        self.kv_caches = kv_caches
        self.steps = 0  # fused steps run (tests check the path was taken)
        self.window_steps = 0  # of which from run_decode or run_window (decode-ahead windows)
        self.c_windows = 0  # windows run whole in C (run_window)
        self._keep: list[torch.Tensor] = []  # float32 biases and norm weights, alive as long as the pointers are
        layers = (_Layer * len(model.layers))()
        # an early-exit draft (worker/draft.py) has fewer layers than the caches
        for slot, layer, (k, v) in zip(layers, model.layers, kv_caches[:len(model.layers)], strict=True):
            for name in PROJECTIONS:
                lin = getattr(layer, name)
                kind, w, scales, group = _panels(lin)  # type: ignore[misc]
                setattr(slot, name, _Proj(w.data_ptr(), self._float_ptr(lin.bias), _ptr(scales), kind, group))
            slot.input_norm, slot.post_norm = self._float_ptr(layer.input_norm), self._float_ptr(layer.post_norm)
            slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
        self._layers = layers
        k0 = kv_caches[0][0]
        inter = model.layers[0].gate_up.out_features // 2
        nq, nqkv = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self._scratch = [torch.empty((MAX_ROWS, n), dtype=torch.float32) for n in (nqkv, nq, 2 * inter)]
        qkv, attn, gu = (t.data_ptr() for t in self._scratch)
        self._first = torch.empty(MAX_ROWS + 1, dtype=torch.int64)  # the prefill kernel's item offsets
        self.chunks = cpu_attention.supports_prefill(torch.empty((1, c.num_heads, c.head_dim)), k0)
        self.args = _Args(ctypes.cast(layers, _P), len(model.layers), c.hidden_size, c.num_heads, c.num_kv_heads,
                          c.head_dim, inter, ELEM[k0.dtype], k0.shape[1], *k0.stride()[:3], c.rms_norm_eps, model.scale,
                          qkv, attn, gu)
        self.args.rope_half = not model._complex_rope  # the bfloat16 forward keeps the checkpoint's q/k order
        self.has_head = self._set_head(model)
        self.embed = _embedding(model) if self.has_head else None
        self.screen = self._head_screen(model) if self.has_head else None
        self.screened_calls = 0  # C calls (steps or greedy windows) with the screened head (tests check the path)
        self._screen_panels = torch.zeros(1, dtype=torch.int64)  # the C side adds the panels it recomputes
        self.args.screen_panels = self._screen_panels.data_ptr()
        kinds = {getattr(slot, name).kind for slot in layers for name in PROJECTIONS}
        # float panels' prefetch distance, re-checked while serving (kernels/stream_prefetch.py)
        self.tuner = (stream_prefetch.OnlineTuner(lib, kinds == {W_BF16}, MAX_ROWS)
                      if kinds in ({W_F32}, {W_BF16}) else None)

    def _float_ptr(self, t: torch.Tensor | None) -> int | None:
        """The address of ``t`` as float32 rows (a bias, or a bfloat16 model's norm weight: a copy, kept)."""
        if t is None:
            return None
        t = t.float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _set_head(self, model) -> bool:
        """Point the step at the final norm and the LM head where the head is in panels (its logits then come
        out of :meth:`run`); else the caller runs them."""
        head = _panels(model.lm_head)
        if head is None or model.norm.dtype != model.dtype:
            return False
        kind, w, scales, group = head
        self.args.final_norm = self._float_ptr(model.norm)
        self.args.head = _Proj(w.data_ptr(), self._float_ptr(model.lm_head.bias), _ptr(scales), kind, group)
        self.args.V = model.lm_head.out_features
        return True

    def _head_screen(self, model) -> tuple[_Proj, head_screen.HeadScreen] | None:
        """The screened head for rows that only need their argmax (kernels/head_screen.py); None where the
        model's head is not screened (those steps run the head itself)."""
        screen = head_screen.prepare(model.lm_head)
        if screen is None:
            return None
        return _Proj(screen.weight.data_ptr(), None, screen.scales.data_ptr(), W_I8, 0), screen

    @property
    def screened_panels(self) -> int:
        """Head panels recomputed from the head itself by screened steps so far (read beyond the screen)."""
        return int(self._screen_panels[0])

    def _set_screened(self, on: bool | head_screen.ScreenRows) -> bool:
        """Point the step's head at the screen (``on``, where this model has one) or at the head itself; ``on``
        a :class:`~kernels.head_screen.ScreenRows`: what is read of each row instead of its argmax."""
        rows = on if isinstance(on, head_screen.ScreenRows) else None
        on = (rows is not None or on is True) and self.screen is not None
        proj, c = (self.screen[0], self.screen[1].bounds) if on else (_Proj(), None)  # type: ignore[index]
        if on and rows is not None:
            _check_rows(rows, self.args.R, self.args.V)
        self.args.screen, self.args.screen_c = proj, _ptr(c)
        self.args.screen_add = _ptr(rows.offsets) if on and rows is not None else None
        self.args.screen_k = _ptr(rows.top_k) if on and rows is not None else None
        self.screened_calls += on
        return on

    @staticmethod
    def for_model(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeStep | None:
        """The fused step for ``model`` over ``kv_caches``, or None where it does not apply (module docstring)."""
        # A bfloat16 model too: its step is then computed in float32, more precise than its op-by-op forward
        # and not bit-identical to it (module docstring). RoPE in the form its q/k rows take (interleaved for
        # float32, rotate-half for bfloat16).
        if (model.device.type != "cpu" or model.dtype not in DTYPES or model._c_ops is None
                or model.all_reduce is not None or not model.layers):
            return None
        k0 = kv_caches[0][0] if kv_caches else None
        if k0 is None or k0.dtype not in ELEM or k0.stride(-1) != 1:
            return None
        c = model.config
        if not cpu_attention.supports(torch.empty((1, c.num_heads, c.head_dim)), k0):
            return None
        for layer in model.layers:
            if any(_panels(getattr(layer, name)) is None for name in PROJECTIONS):
                return None
            if layer.input_norm.dtype != model.dtype or layer.post_norm.dtype != model.dtype:
                return None
        lib = load()  # its prefetch distances: those the weights' plans chose (kernels/stream_prefetch.py)
        return None if lib is None else DecodeStep(model, kv_caches, lib)

    def applies(self, kv_caches, meta, num_tokens: int) -> bool:
        """Whether this step is one the fused call runs: its caches, few rows, and chunks of several tokens only
        where the prefill kernel reads this cache."""
        return (kv_caches is self.kv_caches and 0 < num_tokens <= MAX_ROWS and meta.seq_lens_host is not None
                and (meta.num_decodes == meta.num_seqs or self.chunks))

    def run(self, x: torch.Tensor, rot: torch.Tensor, meta, rows: torch.Tensor | None = None,
            argmax_only: bool | head_screen.ScreenRows = False) -> torch.Tensor | None:
        """Every layer over ``x`` (float32 ``[M, H]``, dense, whatever the model's dtype; updated in place to the
        last residual stream): rot ``[M, D/2, 2]`` float32 (cos, sin per token and frequency), the step's slots,
        block tables and lengths from ``meta`` (the leading decodes, then the chunks of several tokens). Where :attr:`has_head`, the logits
        (float32 ``[len(rows), vocab]``, or every row's where ``rows`` is None) too; else None. ``argmax_only``:
        the caller reads each row's argmax alone (True: greedy), or what a ``ScreenRows`` says (the sampler's
        race or top-k cut, worker/sampler.py): the head may then be screened (kernels/head_screen.py), what is
        read exact and the other values approximate."""
        plan = meta.cache.get("decode_step")
        if plan is None:
            plan = meta.cache["decode_step"] = _step_plan(meta)
        logits = None
        if self.has_head:
            if rows is not None:
                rows = rows.to(torch.int64).contiguous()
            logits = torch.empty((x.shape[0] if rows is None else rows.shape[0], self.args.V), dtype=torch.float32)
        self.call(x, rot, plan, rows, logits, screened=argmax_only)
        return logits

    def run_decode(self, x: torch.Tensor, rot: torch.Tensor, slot: torch.Tensor, table: torch.Tensor,
                   length: torch.Tensor, logits: torch.Tensor,
                   argmax_only: bool | head_screen.ScreenRows = False) -> None:
        """One sequence's decode step from its own tensors, no metadata (a decode-ahead window, worker/model.py
        ``decode_window``): x float32 ``[1, H]``, rot ``[1, D/2, 2]``, slot int64 ``[1]``, table int32
        ``[1, blocks]``, length int32 ``[1]`` (the sequence's tokens, this one included, as read by the C side
        now); the logits go to ``logits`` float32 ``[1, vocab]`` (needs :attr:`has_head`); ``argmax_only`` as
        :meth:`run`'s."""
        assert self.has_head
        self.window_steps += 1
        self.call(x, rot, (slot, (1, table, length, int(length[0])), _NO_CHUNKS), None, logits, argmax_only)

    def run_window(self, token: int, pos0: int, rot: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                   stops: list[int], offsets: torch.Tensor | None = None, wake_fd: int = -1) -> list[int]:
        """A decode-ahead window in one C call (``decode_window``): from ``token`` at position ``pos0``, up to
        ``len(slots)`` tokens, each the argmax of its logits (greedy) or, with ``offsets`` (float32 ``[n, V]``,
        the sampler's race offsets of a row with no cut, drawn for the whole window), of its logits plus its row;
        ending after one in ``stops``, or after any token once ``wake_fd`` (>= 0) is readable. The embedding
        lookup and the argmax are the model's and the sampler's own, so the tokens are those of
        :meth:`run_decode` in a Python loop. ``rot`` ``[n, D/2, 2]`` float32, ``slots`` int64 ``[n]``, ``table``
        int32 ``[1, blocks]``. Needs :attr:`embed` (set where the head runs inside the step)."""
        assert self.embed is not None
        n, a = len(slots), self.args
        assert rot.is_contiguous() and slots.is_contiguous() and rot.shape[0] >= n
        x, length = torch.empty((1, a.H), dtype=torch.float32), torch.empty(1, dtype=torch.int32)
        logits, out = torch.empty((1, a.V), dtype=torch.float32), torch.empty(n, dtype=torch.int64)
        stop_ids = torch.tensor(sorted(stops), dtype=torch.int32)
        a.x, a.M, a.nd, a.np, a.R, a.rows, a.logits = x.data_ptr(), 1, 1, 0, 1, None, logits.data_ptr()
        a.bt, a.bt_ss, a.lens = table.data_ptr(), table.stride(0), length.data_ptr()
        if offsets is None:
            self._set_screened(True)
        else:
            assert offsets.shape == (n, a.V) and offsets.dtype == torch.float32 and offsets.is_contiguous()
            self._set_screened(head_screen.ScreenRows(offsets[:1], None))  # C moves it row by row
        ahead, t0 = self._tune(1), time.perf_counter()
        made = self.lib.decode_window(ctypes.byref(a), ctypes.byref(self.embed), token, n, pos0, rot.data_ptr(),
                                      rot.stride(0), slots.data_ptr(), length.data_ptr(), stop_ids.data_ptr(),
                                      len(stop_ids), _ptr(offsets), a.V, out.data_ptr(), wake_fd)
        if ahead is not None:  # (a failed call too: a trial's distance is taken back)
            self.tuner.record(1, (time.perf_counter() - t0) / max(made, 1))
        if made < 0:
            raise RuntimeError(f"fused decode step failed (code {-made}: 1 a shape the attention kernel does not "
                               "take, 2 out of memory)")
        self.steps += made
        self.window_steps += made
        self.c_windows += 1
        return out[:made].tolist()

    def _tune(self, rows: int) -> int | None:
        """The prefetch distance a step of ``rows`` decode rows runs with where the tuner times it (0 rows: a
        step with chunks, not timed)."""
        return self.tuner.choose(rows) if self.tuner is not None and rows else None

    def call(self, x: torch.Tensor, rot: torch.Tensor, plan, rows: torch.Tensor | None,
             logits: torch.Tensor | None, screened: bool | head_screen.ScreenRows = False) -> None:
        """The C step over ``x`` with the tables of ``plan`` (:func:`_step_plan`'s form); logits (where
        :attr:`has_head`) into ``logits``, rows ``rows`` (int64) or every row; ``screened`` (:meth:`run`'s
        ``argmax_only``): from the screened head where there is one (only their argmax exact)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and rot.is_contiguous()  # the C side's row strides
        slots, (nd, tables, lens, max_len), (np_, p_tables, starts, ctx) = plan
        a = self.args
        a.x, a.M, a.rot, a.slots = x.data_ptr(), x.shape[0], rot.data_ptr(), slots.data_ptr()
        a.nd, a.bt, a.bt_ss, a.lens, a.max_len = nd, tables.data_ptr(), tables.stride(0), lens.data_ptr(), max_len
        a.np, a.p_bt, a.p_bt_ss = np_, p_tables.data_ptr(), p_tables.stride(0)
        a.p_qs, a.p_ctx, a.p_first = starts.data_ptr(), ctx.data_ptr(), self._first.data_ptr()
        if logits is not None:
            a.R, a.rows, a.logits = logits.shape[0], _ptr(rows), logits.data_ptr()
        self._set_screened(screened if logits is not None else False)
        ahead, t0 = self._tune(x.shape[0] if nd == x.shape[0] else 0), time.perf_counter()
        err = self.lib.decode_step(ctypes.byref(a))
        if ahead is not None:
            self.tuner.record(x.shape[0], time.perf_counter() - t0)
        self.steps += 1
        if err:
            raise RuntimeError(f"fused decode step failed (code {err}: 1 a shape the attention kernel does not take, 2 out of memory)")


def _check_rows(rows: head_screen.ScreenRows, r: int, v: int) -> None:
    """The C side reads ``rows`` as dense float32 ``[r, v]`` offsets and int32 ``[r]`` k."""
    add, k = rows.offsets, rows.top_k
    if add.dtype != torch.float32 or add.shape != (r, v) or not add.is_contiguous():
        raise ValueError(f"race offsets {tuple(add.shape)} {add.dtype}: float32 [{r}, {v}] expected, dense")
    if k is not None and (k.dtype != torch.int32 or k.shape != (r,) or not k.is_contiguous()):
        raise ValueError(f"top-k {tuple(k.shape)} {k.dtype}: int32 [{r}] expected, dense")


_NO_CHUNKS = (0, torch.zeros((0, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
              torch.zeros(0, dtype=torch.int32))


def _step_plan(meta):
    """The step's int32 tables as the attention kernels read them: slots; the leading decodes' (count, block
    tables, lengths, longest); the chunks after them (count, block tables, first rows counted from the first
    chunk's, earlier context), as kernels/backend.py hands them to the kernels op by op."""
    nd, ns = meta.num_decodes, meta.num_seqs
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    tables = meta.block_tables[:nd].to(torch.int32).contiguous()
    lens = meta.seq_lens[:nd].to(torch.int32).contiguous()
    decodes = (nd, tables, lens, int(meta.seq_lens_host[:nd].max()) if nd else 0)
    if nd == ns:  # no chunks (the usual small step): nothing of theirs is read
        return slots, decodes, _NO_CHUNKS
    qsl = meta.query_start_loc_host
    starts = torch.from_numpy((qsl[nd:] - qsl[nd]).astype(np.int32))
    ctx = torch.from_numpy((meta.seq_lens_host[nd:ns] - np.diff(qsl[nd:])).astype(np.int32))
    chunks = (ns - nd, meta.block_tables[nd:ns].to(torch.int32).contiguous(), starts, ctx)
    return slots, decodes, chunks
