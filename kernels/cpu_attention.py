"""Attention read straight from the paged KV cache on CPU: batched decode, and causal prefill of a step's chunks.

Why: the torch path must first gather every sequence's blocks into a padded copy and run SDPA over it (a
write and two more reads of all the context); these C kernels read each sequence's K and V once, block by
block, where they lie, and compute in float32 whatever the cache dtype (float32, bfloat16, or the int8 / float8 e4m3 rows of
:mod:`kernels.kv_quant`: codes widened in registers, each row's scale applied once per row). Sources:
``csrc/decode_attention.c``, ``csrc/prefill_attention.c`` (one library), built by :mod:`kernels.native`; where
that fails :func:`load` returns None and the torch backend keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kernels import kv_quant, native

log = logging.getLogger(__name__)

SOURCES = ("decode_attention.c", "prefill_attention.c")

_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # q, strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # caches, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables, row stride, lens
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # out, strides
    + [ctypes.c_int] * 5  # S, Hq, Hkv, D, block_size
    + [ctypes.c_float, ctypes.c_int]  # scale, max_len
)

_PREFILL_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # q, row and head strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # caches, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # block tables, row stride, qs, ctx
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # out, strides
    + [ctypes.c_int] * 5  # S, Hq, Hkv, D, block_size
    + [ctypes.c_float]  # scale
)


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and bind the library; ``defines`` picks a variant (see :mod:`kernels.native`,
    e.g. ``{"INFERQ_NO_AVX512": 1}``). None where it cannot be built."""
    lib = native.build("cpu_attention", SOURCES, defines)
    if lib is None:
        return None
    for name in ("has_avx512", "has_simd", "has_prefill"):
        getattr(lib, name).restype = ctypes.c_int
    for name in ("set_avx512", "set_generic", "set_split", "set_head_groups"):
        getattr(lib, name).argtypes = [ctypes.c_int]
        getattr(lib, name).restype = None
    for name, argtypes in (("decode_f32", _ARGTYPES), ("decode_bf16", _ARGTYPES), ("decode_i8", _ARGTYPES),
                           ("decode_f8", _ARGTYPES), ("prefill_f32", _PREFILL_ARGTYPES),
                           ("prefill_bf16", _PREFILL_ARGTYPES), ("prefill_i8", _PREFILL_ARGTYPES),
                           ("prefill_f8", _PREFILL_ARGTYPES)):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    log.debug("CPU attention kernels loaded (vector path: %s, AVX-512: %s)", bool(lib.has_simd()),
              bool(lib.has_avx512()))
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be built. Two first calls
    racing may both build: harmless, ``native.build`` installs the library atomically."""
    return build()


def available() -> bool:
    return load() is not None


def has_simd() -> bool:
    """Whether the AVX2+FMA path was compiled in (head dims that are multiples of 8, power-of-two blocks)."""
    lib = load()
    return lib is not None and bool(lib.has_simd())


def has_avx512() -> bool:
    """Whether the AVX-512 decode path was compiled in (head dims that are multiples of 16)."""
    lib = load()
    return lib is not None and bool(lib.has_avx512())


def use_avx512(on: bool) -> None:
    """Let the decode kernel take its AVX-512 path where compiled in (default), or keep it on AVX2: for tests
    and side-by-side timings."""
    lib = load()
    if lib is not None:
        lib.set_avx512(1 if on else 0)


def use_split(on: bool) -> None:
    """Let the decode kernel split a few sequences' contexts over the threads (default: whole rows per item, the
    parts' softmax merged), or keep one kv head per item: for tests and side-by-side timings. This library's
    switch only: the fused step's library (kernels/decode_step.py) compiles the kernel in with a ``set_split``
    of its own."""
    lib = load()
    if lib is not None:
        lib.set_split(1 if on else 0)


def use_head_groups(on: bool) -> None:
    """Let the AVX2 decode passes take a kv head's query heads together (default: each K and V chunk loaded once
    for up to 3 of them), or one at a time: for tests (equal results) and side-by-side timings. This library's
    switch only, as :func:`use_split`'s."""
    lib = load()
    if lib is not None:
        lib.set_head_groups(1 if on else 0)


def use_generic(on: bool) -> None:
    """Route every call to the portable scalar loops (``True``) or back to the vector path: for tests."""
    lib = load()
    if lib is not None:
        lib.set_generic(1 if on else 0)


_KERNELS = {torch.float32: ("decode_f32", "prefill_f32"), torch.bfloat16: ("decode_bf16", "prefill_bf16"),
            torch.int8: ("decode_i8", "prefill_i8"), kv_quant.FP8_ROWS: ("decode_f8", "prefill_f8")}


def _row_fits(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the cache's rows hold the query's head dim D: D values, or in an int8 / float8 cache D codes and
    the row's scale (:mod:`kernels.kv_quant`)."""
    d = query.shape[-1]
    return k_cache.shape[-1] == (kv_quant.row_width(d) if kv_quant.is_quantized(k_cache.dtype) else d)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` handles these tensors (CPU, a float32/bfloat16 cache or one of int8 or
    float8 rows ``D + 4`` wide, dense rows)."""
    if query.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    if k_cache.dtype not in _KERNELS or not _row_fits(query, k_cache):
        return False
    hq, hkv = query.shape[1], k_cache.shape[2]
    return hq % hkv == 0 and hq // hkv <= 16 and k_cache.stride(-1) == 1 and load() is not None


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence. query ``[S, Hq, D]``; k/v cache ``[num_blocks, block_size,
    Hkv, D]`` (same strides; an int8 cache's rows are ``D + 4``: codes and scale); block_tables int32
    ``[S, >= ceil(max_len / block_size)]``; seq_lens int32 ``[S]`` (context length including the query token).
    Returns ``[S, Hq, D]`` in the query's dtype."""
    lib = load()
    assert lib is not None, "CPU attention kernel not available"
    s, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    q = query.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((s, hq, d), dtype=torch.float32)
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lens = lens.contiguous()
    fn = getattr(lib, _KERNELS[k_cache.dtype][0])
    cs = k_cache.stride()
    err = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0], cs[1], cs[2],
             bt.data_ptr(), bt.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
             s, hq, hkv, d, bs, float(scale), int(max_len))
    if err:
        raise RuntimeError(f"CPU decode attention kernel failed (code {err})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def supports_prefill(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention` handles these tensors (the AVX2 path: head dim a multiple of 8 up to
    128, power-of-two blocks, float32/bfloat16/int8 cache; float32 queries, or bfloat16 ones widened first)."""
    if not supports(query, k_cache) or query.dtype not in (torch.float32, torch.bfloat16):
        return False
    lib = load()
    d, bs = query.shape[-1], k_cache.shape[1]
    return bool(lib.has_prefill()) and d % 8 == 0 and d <= 128 and bs & (bs - 1) == 0


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of S prefill chunks read from the paged cache (their own keys/values already written).
    query ``[T, Hq, D]`` float32, chunk s being rows ``query_start[s] .. query_start[s+1]`` at positions
    ``context_lens[s]`` onwards; block_tables int32 ``[S, >= blocks]``. Returns ``[T, Hq, D]`` float32 (the
    caller's output tensor rounds it to the model's dtype)."""
    lib = load()
    assert lib is not None, "CPU attention kernel not available"
    t, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    q = query.float() if query.dtype != torch.float32 else query  # the kernel's arithmetic is float32
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((t, hq, d), dtype=torch.float32)
    bt = block_tables.to(torch.int32).contiguous()
    qs = query_start.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    fn = getattr(lib, _KERNELS[k_cache.dtype][1])
    cs = k_cache.stride()
    err = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0], cs[1], cs[2],
             bt.data_ptr(), bt.stride(0), qs.data_ptr(), ctx.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
             int(ctx.shape[0]), hq, hkv, d, bs, float(scale))
    if err:
        raise RuntimeError(f"CPU prefill attention kernel failed (code {err})")
    return out
