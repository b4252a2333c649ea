"""Micro-benchmarks of the CPU kernels, each side by side in one process (alternating order, best or sum of
repeats), on the default model's shapes. Run under the heavy-job lock:

    python -m bench.cpu_kernels gemm      # packed GEMM (this CPU's path, and AVX2 where AVX-512 is built) vs F.linear
    python -m bench.cpu_kernels decode    # decode attention, AVX-512 item vs AVX2 item, float32 and bfloat16 caches
    python -m bench.cpu_kernels decode-long  # decode attention at long contexts, split over the threads or not
    python -m bench.cpu_kernels prefill   # causal prefill kernel vs per-sequence SDPA
    python -m bench.cpu_kernels w4a8      # int4 panels: float activations vs int8 ones, each a8 tile this CPU runs

The shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query / 3 kv heads of 64, vocab 49152, 30 layers);
every layer has its own weight / KV pool, so data is cold in the caches as in a model step.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from kernels import cpu_attention, hugepages, packed_gemm, quant, quant_panels, reference

LAYERS = 30
SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # gate_up, down, qkv, o: (out, in)
LM_HEAD = (49152, 576)


def gemm(ms: list[int], repeats: int = 4) -> None:
    """GFLOP/s over a 30-layer set of the model's projections (+ the LM head for M <= 64)."""
    impls = {"F.linear": None, "packed": packed_gemm._load()}
    if packed_gemm._load().gemm_has_avx512():  # the same source built without its AVX-512 code
        impls["packed AVX2"] = packed_gemm.build({"INFERQ_NO_AVX512": 1})
    weights = {(n, k): [torch.randn(n, k) for _ in range(1 if (n, k) == LM_HEAD else LAYERS)]
               for n, k in [*SHAPES, LM_HEAD]}
    packed = {s: [packed_gemm.pack(w) for w in ws] for s, ws in weights.items()}
    print("GFLOP/s, float32, 2 threads:", "  ".join(impls))
    for m in ms:
        shapes = [s for s in weights if s != LM_HEAD or m <= 64]
        secs = dict.fromkeys(impls, 0.0)
        for rep in range(repeats):
            for name in (list(impls) if rep % 2 == 0 else list(impls)[::-1]):
                lib = impls[name]
                for n, k in shapes:
                    x, y = torch.randn(m, k), torch.empty(m, n)
                    t0 = time.perf_counter()
                    if lib is None:
                        for w in weights[n, k]:
                            F.linear(x, w)
                    else:
                        for p in packed[n, k]:
                            lib.gemm(x.data_ptr(), k, p.data_ptr(), None, y.data_ptr(), n, m, n, k, 0)
                    secs[name] += time.perf_counter() - t0
        flop = repeats * sum(2 * m * n * k * len(weights[n, k]) for n, k in shapes)
        print(f"M={m:5d}  " + "  ".join(f"{name} {flop / s / 1e9:6.1f}" for name, s in secs.items()), flush=True)


def decode(seqs: int = 64, repeats: int = 8) -> None:
    """One decode attention call per layer, ``seqs`` sequences of 40-760 cached positions, shuffled blocks."""
    num_blocks, bs, hkv, hq, d = 2912, 16, 3, 9, 64
    rng = random.Random(0)
    lens = [rng.randint(40, 760) for _ in range(seqs)]
    need = [(n + bs - 1) // bs for n in lens]
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = torch.zeros(seqs, max(need), dtype=torch.int32)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[i:i + n])
        i += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(seqs, hq, d)
    paths = ["AVX-512", "AVX2"] if cpu_attention.has_avx512() else ["AVX2"]
    for dtype in (torch.float32, torch.bfloat16):
        pools = [(hugepages.zeros((num_blocks, bs, hkv, d), dtype, prefault=True),
                  hugepages.zeros((num_blocks, bs, hkv, d), dtype, prefault=True)) for _ in range(LAYERS)]
        for kc, vc in pools:
            kc.normal_()
            vc.normal_()
        secs = dict.fromkeys(paths, 0.0)
        for rep in range(repeats):
            for path in (paths if rep % 2 == 0 else paths[::-1]):
                cpu_attention.use_avx512(path == "AVX-512")
                t0 = time.perf_counter()
                for kc, vc in pools:
                    cpu_attention.decode_attention(q, kc, vc, tables, seq_lens, max(lens), d ** -0.5)
                if rep:  # the first round warms up
                    secs[path] += time.perf_counter() - t0
        cpu_attention.use_avx512(True)
        kv_bytes = sum(lens) * hkv * d * dtype.itemsize * 2 * LAYERS * (repeats - 1)
        print(f"decode, {seqs} seqs x 40-760 positions, {str(dtype).removeprefix('torch.')} cache: " + "  ".join(
            f"{p} {s / (repeats - 1) / LAYERS * 1e3:.2f} ms/layer ({kv_bytes / s / 1e9:.1f} GB/s)"
            for p, s in secs.items()), flush=True)
        del pools


def decode_long(contexts: tuple[int, ...] = (500, 1000, 4000), batches: tuple[int, ...] = (1, 2, 8),
                repeats: int = 5) -> None:
    """Decode attention's KV read rate (GB/s, best of ``repeats`` over 30 layers' float32 pools) for sequences of
    ``contexts`` cached positions, ``batches`` at a time: with a few sequences' contexts split over the threads
    (whole rows per item, the default) and without (one kv head per item, each thread reading a strided slice of
    every row), alternated."""
    hq, hkv, d, bs = 9, 3, 64, 16
    for ctx in contexts:
        for seqs in batches:
            nb = (ctx + bs - 1) // bs
            pools = [(hugepages.zeros((nb * seqs + 1, bs, hkv, d), torch.float32, prefault=True),
                      hugepages.zeros((nb * seqs + 1, bs, hkv, d), torch.float32, prefault=True))
                     for _ in range(LAYERS)]
            for kc, vc in pools:
                kc.normal_()
                vc.normal_()
            tables = torch.arange(nb * seqs, dtype=torch.int32).view(seqs, nb)
            lens = torch.full((seqs,), ctx, dtype=torch.int32)
            q = torch.randn(seqs, hq, d)
            best = {"split": float("inf"), "kv heads": float("inf")}
            for rep in range(repeats):
                for name in (list(best) if rep % 2 == 0 else list(best)[::-1]):
                    cpu_attention.use_split(name == "split")
                    t0 = time.perf_counter()
                    for kc, vc in pools:
                        cpu_attention.decode_attention(q, kc, vc, tables, lens, ctx, d ** -0.5)
                    best[name] = min(best[name], time.perf_counter() - t0)
            cpu_attention.use_split(True)
            kv_bytes = seqs * ctx * hkv * d * 4 * 2 * LAYERS
            print(f"decode, {seqs} x {ctx} positions, float32 cache, ms per sequence per step (GB/s): " + "  ".join(
                f"{name} {t * 1e3 / seqs:.2f} ({kv_bytes / t / 1e9:.1f})" for name, t in best.items())
                + f"  split {best['kv heads'] / best['split']:.2f}x", flush=True)
            del pools


def prefill(repeats: int = 6) -> None:
    """One layer's causal prefill attention of a step's chunks: the kernel vs per-sequence SDPA."""
    for lens in ([512] * 4, [300, 400, 450, 500], [64] * 8):
        _prefill_case(lens, repeats)


def _prefill_case(lens: list[int], repeats: int) -> None:
    hq, hkv, d, bs = 9, 3, 64, 16
    blocks = [(n + bs - 1) // bs for n in lens]
    kc = torch.randn(sum(blocks) + 8, bs, hkv, d)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(lens), hq, d)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.arange(first, first + n)
        first += n
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.zeros(len(lens), dtype=torch.int32)
    k_flat, v_flat = kc.view(-1, hkv, d), vc.view(-1, hkv, d)

    def kernel():
        return cpu_attention.prefill_attention(q, kc, vc, tables, starts, ctx, d ** -0.5)

    def sdpa():
        out = torch.empty_like(q)
        for s, n in enumerate(lens):
            slots = reference.block_slots(tables[s], n, bs)
            q0 = int(starts[s])
            out[q0:q0 + n] = reference.attend_one(q[q0:q0 + n], k_flat.index_select(0, slots),
                                                  v_flat.index_select(0, slots), d ** -0.5)
        return out

    torch.testing.assert_close(kernel(), sdpa(), atol=1e-4, rtol=1e-4)
    secs = {"kernel": 0.0, "SDPA": 0.0}
    for rep in range(repeats):
        for name, fn in (("kernel", kernel), ("SDPA", sdpa))[:: 1 if rep % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn()
            secs[name] += time.perf_counter() - t0
    print(f"prefill chunks {lens}: " + "  ".join(f"{k} {v / repeats * 1e3:.2f} ms" for k, v in secs.items()),
          flush=True)


def w4a8(ms: list[int], repeats: int = 6) -> None:
    """Weight GB/s (codes and scales read per call) of int4-g32 panels over a 30-layer set of the model's
    projections: float activations (block4), and int8 ones on each tile this CPU runs (AVX2 vpmaddubsw, and
    AVX512-VNNI where built), plus a read of the same bytes by torch.sum for the machine's streaming rate."""
    builds = {"int4": quant_panels._load(), "w4a8 AVX2": quant_panels.build({"INFERQ_NO_VNNI": 1})}
    if quant_panels.act8_isa() != "avx2":
        builds["w4a8 " + quant_panels.act8_isa()] = quant_panels._load()
    layers = {s: [quant_panels.pack(quant.quantize(torch.randn(*s) * 0.05, "int4", 32)) for _ in range(LAYERS)]
              for s in SHAPES}
    a8 = {s: [quant_panels.with_int8_activations(p) for p in ps] for s, ps in layers.items()}
    nbytes = sum(p.codes.numel() * p.codes.element_size() + p.scales.numel() * p.scales.element_size()
                 for ps in layers.values() for p in ps)
    flat = torch.randn(nbytes // 4)
    print(f"weight GB/s, int4 g32, {nbytes / 1e6:.1f} MB per pass, 2 threads:", "  ".join(builds), " torch.sum")
    for m in ms:
        secs = dict.fromkeys([*builds, "torch.sum"], 0.0)
        xs = {s: torch.randn(m, s[1]) for s in SHAPES}
        for rep in range(repeats):
            for name in (list(secs) if rep % 2 == 0 else list(secs)[::-1]):
                t0 = time.perf_counter()
                if name == "torch.sum":
                    flat.sum()
                else:
                    for s in SHAPES:
                        for p in (layers if name == "int4" else a8)[s]:
                            quant_panels.matmul(xs[s], p, lib=builds[name])
                secs[name] += time.perf_counter() - t0
        base = secs["int4"]
        print(f"M={m:4d}  " + "  ".join(f"{n} {repeats * nbytes / t / 1e9:5.1f} ({base / t:.2f}x)" for n, t in secs.items()),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["gemm", "decode", "decode-long", "prefill", "w4a8"])
    parser.add_argument("--m", type=int, nargs="+", default=None, help="gemm / w4a8: rows")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if packed_gemm._load() is None or cpu_attention.load() is None:
        raise SystemExit("the C kernels are not available here (no AVX2+FMA CPU or no C compiler)")
    {"gemm": lambda: gemm(args.m or [1, 8, 16, 64, 256, 1024, 2048]), "decode": decode, "decode-long": decode_long,
     "prefill": prefill, "w4a8": lambda: w4a8(args.m or [1, 2, 4, 8, 16, 64, 256])}[args.what]()


if __name__ == "__main__":
    main()
