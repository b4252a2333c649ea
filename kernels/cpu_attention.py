"""A small C kernel for batched decode attention straight from the paged KV cache (CPU).

Why: on CPU, decode attention is memory bound. The torch path must first gather every decode sequence's
blocks into a padded ``[S, L, Hkv, D]`` copy (read + write of all the context, padded to the longest
sequence) and then run SDPA over the copy (a third pass). On the mixed benchmark workload that gather plus
SDPA was ~40% of the engine's time. This kernel reads each sequence's K and V once, block by block, where
they lie in the cache: per (sequence, kv head) it computes the scores of the ``Hq / Hkv`` query heads of
that kv head (one pass over K), a float32 softmax, and the weighted sum of V (one pass over V), in float32
whatever the cache dtype (float32 or bfloat16). Work items are spread over torch's own OpenMP thread pool
(the library links ``libgomp.so.1``, which resolves to the copy torch already loaded).

The C source is compiled once per machine with the system C compiler (``cc -O3 -march=native -fopenmp``,
about a second) into ``~/.cache/inferq/kernels/`` keyed by a hash of the source, flags and CPU flags, and
loaded with ctypes (no torch headers, no build step at install time). If no compiler is available or the
build fails, :func:`load` returns None and the torch backend keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

static inline float bf16_load(const uint16_t* p, int64_t i) {
    uint32_t u = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One (sequence, kv head) work item: G query heads against the sequence's first `len` cached positions.
   T is the cache element type; LOAD(ptr, i) reads element i of a cache row as float. */
#define DEFINE_DECODE(NAME, T, LOAD)                                                                       \
static void NAME##_item(const float* q, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,  \
                        int64_t c_hs, const int32_t* bt, int len, int G, int D, int bs, float scale,         \
                        float* out, int64_t o_hs, float* sc, float* acc) {                                  \
    const int nblk = (len + bs - 1) / bs;                                                                   \
    float m[MAX_GROUP];                                                                                     \
    for (int g = 0; g < G; g++) m[g] = -INFINITY;                                                           \
    for (int b = 0; b < nblk; b++) {                                                                        \
        const int64_t base = (int64_t)bt[b] * c_bs;                                                         \
        const int n = (b == nblk - 1) ? len - b * bs : bs;                                                  \
        for (int t = 0; t < n; t++) {                                                                       \
            const T* k = kc + base + (int64_t)t * c_ts;                                                     \
            const int p = b * bs + t;                                                                       \
            for (int g = 0; g < G; g++) {                                                                   \
                const float* qg = q + (int64_t)g * q_hs;                                                    \
                float s = 0.f;                                                                              \
                _Pragma("omp simd reduction(+:s)")                                                          \
                for (int d = 0; d < D; d++) s += qg[d] * LOAD(k, d);                                        \
                s *= scale;                                                                                 \
                sc[(int64_t)g * len + p] = s;                                                               \
                if (s > m[g]) m[g] = s;                                                                     \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    float sum[MAX_GROUP];                                                                                   \
    for (int g = 0; g < G; g++) {                                                                           \
        float* row = sc + (int64_t)g * len;                                                                 \
        float z = 0.f;                                                                                      \
        const float mg = m[g];                                                                              \
        for (int p = 0; p < len; p++) { const float e = expf(row[p] - mg); row[p] = e; z += e; }            \
        sum[g] = z;                                                                                         \
    }                                                                                                       \
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);                                                  \
    for (int b = 0; b < nblk; b++) {                                                                        \
        const int64_t base = (int64_t)bt[b] * c_bs;                                                         \
        const int n = (b == nblk - 1) ? len - b * bs : bs;                                                  \
        for (int t = 0; t < n; t++) {                                                                       \
            const T* v = vc + base + (int64_t)t * c_ts;                                                     \
            const int p = b * bs + t;                                                                       \
            for (int g = 0; g < G; g++) {                                                                   \
                const float w = sc[(int64_t)g * len + p];                                                   \
                float* a = acc + (int64_t)g * D;                                                            \
                _Pragma("omp simd")                                                                         \
                for (int d = 0; d < D; d++) a[d] += w * LOAD(v, d);                                         \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (int g = 0; g < G; g++) {                                                                           \
        const float inv = 1.f / sum[g];                                                                     \
        float* o = out + (int64_t)g * o_hs;                                                                 \
        const float* a = acc + (int64_t)g * D;                                                              \
        for (int d = 0; d < D; d++) o[d] = a[d] * inv;                                                      \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
int NAME(const float* q, int64_t q_ss, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,  \
         int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out, int64_t o_ss,      \
         int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len) {                    \
    const int G = Hq / Hkv;                                                                                 \
    if (G > MAX_GROUP || G * Hkv != Hq) return 1;                                                           \
    int err = 0;                                                                                            \
    _Pragma("omp parallel")                                                                                 \
    {                                                                                                       \
        float* sc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(max_len > 0 ? max_len : 1));        \
        float* acc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)D);                                 \
        if (!sc || !acc) {                                                                                  \
            _Pragma("omp atomic write")                                                                     \
            err = 2;                                                                                        \
        }                                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                             \
        for (int64_t i = 0; i < (int64_t)S * Hkv; i++) {                                                    \
            if (!sc || !acc) continue;                                                                      \
            const int s = (int)(i / Hkv), h = (int)(i % Hkv);                                               \
            const int len = lens[s];                                                                        \
            if (len <= 0) continue;                                                                         \
            NAME##_item(q + s * q_ss + (int64_t)h * G * q_hs, q_hs, kc + h * c_hs, vc + h * c_hs, c_bs,     \
                        c_ts, c_hs, bt + s * bt_ss, len, G, D, bs, scale,                                   \
                        out + s * o_ss + (int64_t)h * G * o_hs, o_hs, sc, acc);                             \
        }                                                                                                   \
        free(sc);                                                                                           \
        free(acc);                                                                                          \
    }                                                                                                       \
    return err;                                                                                             \
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_load((p), (i))
DEFINE_DECODE(decode_f32, float, LOAD_F32)
DEFINE_DECODE(decode_bf16, uint16_t, LOAD_BF16)
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # q, strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # caches, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables, row stride, lens
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # out, strides
    + [ctypes.c_int] * 5  # S, Hq, Hkv, D, block_size
    + [ctypes.c_float, ctypes.c_int]  # scale, max_len
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "inferq" / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler found: CPU decode attention uses the torch path")
        return None
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), cc, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib_path = out_dir / f"cpu_attention_{key}.so"
    if not lib_path.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "cpu_attention.c"
                src.write_text(_SOURCE)
                tmp_lib = Path(tmp) / "cpu_attention.so"
                proc = subprocess.run([cc, *_FLAGS, str(src), "-o", str(tmp_lib), "-lm"],
                                      capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    log.warning("building the CPU attention kernel failed (torch path used): %s",
                                proc.stderr.strip()[-2000:])
                    return None
                os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building the CPU attention kernel failed (torch path used): %s", exc)
            return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as exc:
        log.warning("loading the CPU attention kernel failed (torch path used): %s", exc)
        return None
    for name in ("decode_f32", "decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib = _build()
            _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` handles these tensors (CPU, float32/bfloat16 cache, dense rows)."""
    if query.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    if k_cache.dtype not in (torch.float32, torch.bfloat16):
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
    Hkv, D]`` (same strides); block_tables int32 ``[S, >= ceil(max_len / block_size)]``; seq_lens int32
    ``[S]`` (context length including the query token). Returns ``[S, Hq, D]`` in the query's dtype."""
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
    fn = lib.decode_f32 if k_cache.dtype == torch.float32 else lib.decode_bf16
    cs = k_cache.stride()
    err = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0], cs[1], cs[2],
             bt.data_ptr(), bt.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
             s, hq, hkv, d, bs, float(scale), int(max_len))
    if err:
        raise RuntimeError(f"CPU decode attention kernel failed (code {err})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
