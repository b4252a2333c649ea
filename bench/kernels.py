"""Triton paged-attention kernel benchmark (CUDA): ``python -m bench.kernels [--quick]``.

For every configuration it first checks the kernel against ``kernels.reference`` (on a slice of the
batch), then times it with ``triton.testing.do_bench`` (median) and reports achieved memory bandwidth
against a measured device-to-device copy bandwidth (the practical ceiling of a memory-bound kernel):

* ``write_kv_cache`` (scatter of one step's K/V);
* decode (one token per sequence, split-K) at batch 1/32/256 x context 512/4k/32k for a SmolLM2-like
  shape (9 q heads, 3 kv heads, head dim 64) and a 32/8 x 128 shape, with the split-K heuristic and with
  ``num_splits=1`` (what split-K buys a small batch), plus the torch backend's decode path as a baseline;
* prefill: whole prompts, and chunks with a long cached prefix, as TFLOP/s (causal FLOPs), with torch
  SDPA on contiguous K/V as a baseline for the no-prefix case;
* optionally an end-to-end engine run on the GPU (Triton vs torch attention backend), if
  ``worker.engine`` imports and the default model resolves.

Results go to ``bench/results/kernels.json`` (rewritten after each section). Without CUDA it prints a
message and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"

SHAPES = {
    "smollm2": dict(hq=9, hkv=3, d=64),  # SmolLM2-135M/360M-like
    "llama8b": dict(hq=32, hkv=8, d=128),  # 32 q heads / 8 kv heads x 128
}


def _parse_list(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        out.append(int(part) * mult)
    return out


def prefill_cases(quick: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    """(label, [(cached context before the chunk, chunk length), ...]) per prefill benchmark."""
    if quick:
        return [("prompt 1x2k", [(0, 2048)]), ("chunk 256 after 2k prefix", [(2048, 256)])]
    return [
        ("prompt 1x4k", [(0, 4096)]),
        ("prompts 8x512", [(0, 512)] * 8),
        ("chunk 512 after 8k prefix", [(8192, 512)]),
        ("mixed 4x(2k prefix+256) + 32 decodes", [(2048, 256)] * 4 + [(1023, 1)] * 32),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sweep (a minute or so)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,32,256)")
    ap.add_argument("--contexts", default=None, help="decode context lengths (default 512,4k,32k)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-kv-gib", type=float, default=40.0, help="skip configs whose K+V exceed this")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode/prefill tile sizes")
    ap.add_argument("--no-baselines", action="store_true", help="skip torch baselines")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end engine run")
    ap.add_argument("--e2e-requests", type=int, default=64)
    ap.add_argument("--e2e-prompt", type=int, default=512)
    ap.add_argument("--e2e-output", type=int, default=128)
    ap.add_argument("--e2e-model", default=None,
                    help="model for the engine run (a name or a local HF directory; default: the settings' model)")
    ap.add_argument("--out", default=str(RESULTS), help="results JSON path")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches = args.batches or "1,32"
        args.contexts = args.contexts or "512,4k"
        args.rep = min(args.rep, 50)
        args.warmup = min(args.warmup, 10)
        args.e2e_requests = min(args.e2e_requests, 16)
        args.e2e_output = min(args.e2e_output, 32)
    args.batches = _parse_list(args.batches or "1,32,256")
    args.contexts = _parse_list(args.contexts or "512,4k,32k")
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {sorted(SHAPES)}")
    return args


class Bench:
    def __init__(self, args):
        import torch
        import triton
        from triton.testing import do_bench

        from kernels import reference
        from kernels import triton_attention as ta

        self.args = args
        self.torch = torch
        self.ta = ta
        self.ref = reference
        self.dtype = getattr(torch, args.dtype)
        self.elt = torch.tensor([], dtype=self.dtype).element_size()
        self.dev = torch.device("cuda")
        self._do_bench = do_bench
        props = torch.cuda.get_device_properties(self.dev)
        self.results: dict = {
            "machine": {
                "gpu": props.name,
                "sms": props.multi_processor_count,
                "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "args": {k: v for k, v in vars(args).items()},
            "dtype": args.dtype,
            "block_size": args.block_size,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self.tol = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}[self.dtype]

    # --- helpers ----------------------------------------------------------------------------------
    def bench_ms(self, fn) -> float:
        return float(self._do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median"))

    def save(self) -> None:
        path = Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.results, indent=2, default=str) + "\n")

    def rel_err(self, out, ref) -> float:
        out, ref = out.double(), ref.double()
        if not bool(self.torch.isfinite(out).all()):
            return float("inf")
        return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))

    def paged(self, seq_lens: list[int], hkv: int, d: int):
        """Caches holding exactly the sequences' blocks, shuffled; block tables [S, max_blocks]."""
        torch = self.torch
        bs = self.args.block_size
        nblk = [math.ceil(s / bs) for s in seq_lens]
        total = sum(nblk) + 1
        k_cache = torch.randn(total, bs, hkv, d, device=self.dev, dtype=self.dtype)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(total, device=self.dev).to(torch.int32)
        bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=self.dev)
        i = 0
        for s, n in enumerate(nblk):
            bt[s, :n] = perm[i : i + n]
            i += n
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=self.dev)
        return k_cache, v_cache, bt, sl

    # --- sections ---------------------------------------------------------------------------------
    def copy_bandwidth(self) -> float:
        gbs = self._copy_once(1 << 30)  # 1 GiB
        self.torch.cuda.empty_cache()
        self.copy_gbs = gbs
        self.results["copy_bandwidth_gbs"] = gbs
        print(f"device-to-device copy bandwidth: {gbs:,.0f} GB/s (read+write of 1 GiB, median)")
        return gbs

    def _copy_once(self, n: int) -> float:
        x = self.torch.empty(n, dtype=self.torch.uint8, device=self.dev)
        y = self.torch.empty_like(x)
        ms = self.bench_ms(functools.partial(y.copy_, x))
        return 2 * n / (ms * 1e-3) / 1e9

    def write_kv(self) -> None:
        rows = []
        for name in self.args.shapes:
            for T in (256, 4096) if not self.args.quick else (256,):
                row = self._write_kv_one(name, T)
                rows.append(row)
                print(f"write_kv_cache {name:8s} T={T:5d}: {'ok ' if row['ok'] else 'BAD'} {row['ms'] * 1e3:8.1f} us "
                      f"{row['gbs']:8.0f} GB/s ({row['pct_copy']:.0f}% of copy)  "
                      f"torch index_copy {row['torch_ms'] * 1e3:.1f} us")
        self.results["write_kv_cache"] = rows

    def _write_kv_one(self, name: str, T: int) -> dict:
        torch, ta = self.torch, self.ta
        hkv, d = SHAPES[name]["hkv"], SHAPES[name]["d"]
        bs = self.args.block_size
        num_blocks = 4 * math.ceil(T / bs) + 1
        kc = torch.zeros(num_blocks, bs, hkv, d, device=self.dev, dtype=self.dtype)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(num_blocks * bs, device=self.dev)[:T]
        key = torch.randn(T, hkv, d, device=self.dev, dtype=self.dtype)
        val = torch.randn_like(key)
        ta.write_kv_cache(key, val, kc, vc, slots)
        rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
        self.ref.write_kv_cache(key, val, rk, rv, slots)
        ok = bool(torch.equal(rk, kc) and torch.equal(rv, vc))
        ms = self.bench_ms(functools.partial(ta.write_kv_cache, key, val, kc, vc, slots))
        ref_ms = self.bench_ms(functools.partial(self.ref.write_kv_cache, key, val, rk, rv, slots))
        nbytes = 2 * 2 * T * hkv * d * self.elt  # K and V, read + write
        gbs = nbytes / (ms * 1e-3) / 1e9
        return dict(shape=name, tokens=T, ok=ok, ms=ms, gbs=gbs, pct_copy=100 * gbs / self.copy_gbs, torch_ms=ref_ms)

    def decode(self) -> None:
        rows = []
        self.results["decode"] = rows
        for name in self.args.shapes:
            shp = SHAPES[name]
            for S in self.args.batches:
                for L in self.args.contexts:
                    kv_bytes = 2 * S * L * shp["hkv"] * shp["d"] * self.elt
                    if kv_bytes > self.args.max_kv_gib * 2**30:
                        print(f"decode {name} B={S} L={L}: skipped ({kv_bytes / 2**30:.1f} GiB of K/V > "
                              f"--max-kv-gib {self.args.max_kv_gib})")
                        continue
                    row = self._decode_one(name, S, L, kv_bytes)
                    self.torch.cuda.empty_cache()
                    rows.append(row)
                    extra = ""
                    if "ms_no_split" in row:
                        extra += f"  no-split {row['ms_no_split'] * 1e3:8.1f} us (x{row['split_speedup']:.2f})"
                    if row.get("torch_backend_ms"):
                        extra += f"  torch {row['torch_backend_ms'] * 1e3:8.1f} us"
                    print(f"decode {name:8s} B={S:4d} L={L:6d} splits={row['num_splits']:3d}: "
                          f"{'ok ' if row['ok'] else 'BAD'} err {row['rel_err']:.1e} {row['ms'] * 1e3:9.1f} us "
                          f"{row['gbs']:7.0f} GB/s ({row['pct_copy']:3.0f}% of copy){extra}")
                    self.save()

    def _decode_one(self, name: str, S: int, L: int, kv_bytes: int) -> dict:
        torch, ta = self.torch, self.ta
        hq, hkv, d = SHAPES[name]["hq"], SHAPES[name]["hkv"], SHAPES[name]["d"]
        scale = d**-0.5
        kc, vc, bt, sl = self.paged([L] * S, hkv, d)
        q = torch.randn(S, hq, d, device=self.dev, dtype=self.dtype)
        out = torch.empty_like(q)
        splits = ta.default_num_splits(S, hkv, L, self.dev)

        def run(ns=None, bn=None):
            return ta.paged_decode_attention(q, kc, vc, bt, sl, scale, ns, max_seq_len=L, out=out, block_n=bn)

        run()
        n = min(S, 4)  # correctness on (up to) the first 4 sequences
        ref = self.ref.paged_attention(q[:n], kc, vc, bt[:n], sl[:n],
                                       torch.arange(n + 1, dtype=torch.int32, device=self.dev), scale)
        err = self.rel_err(out[:n], ref)
        ms = self.bench_ms(run)
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        row = dict(shape=name, batch=S, context=L, num_splits=splits, rel_err=err, ok=err < self.tol, ms=ms,
                   gbs=gbs, pct_copy=100 * gbs / self.copy_gbs)
        if splits > 1:
            ms1 = self.bench_ms(functools.partial(run, 1))
            row.update(ms_no_split=ms1, split_speedup=ms1 / ms)
        if self.args.sweep:
            sweep = {}
            for bn in (16, 32, 64, 128):
                for ns in sorted({1, splits, max(1, splits // 2), splits * 2}):
                    try:
                        sweep[f"block_n={bn},splits={ns}"] = self.bench_ms(functools.partial(run, ns, bn))
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                        sweep[f"block_n={bn},splits={ns}"] = f"error: {exc}"[:200]
            row["sweep_ms"] = sweep
        if not self.args.no_baselines and kv_bytes <= 4 * 2**30:
            row["torch_backend_ms"] = self._torch_decode_ms(q, kc, vc, bt, [L] * S, scale)
        return row

    def _torch_decode_ms(self, q, kc, vc, bt, seq_lens, scale):
        try:
            import numpy as np

            from kernels.attention_api import AttentionMetadata
            from kernels.backend import CPUBackend

            S = q.shape[0]
            meta = AttentionMetadata.build(
                slot_mapping=np.zeros(S, np.int64), block_tables=bt.cpu().numpy(), seq_lens=np.array(seq_lens),
                query_start_loc=np.arange(S + 1), block_size=self.args.block_size, device=self.dev,
            )
            be = CPUBackend(native=False)  # the portable torch path (what runs on CUDA without Triton)
            return self.bench_ms(functools.partial(be.forward, q, None, None, kc, vc, meta, scale))
        except Exception as exc:  # noqa: BLE001 - baseline only
            print(f"  (torch baseline failed: {exc})")
            return None

    def prefill(self) -> None:
        rows = []
        self.results["prefill"] = rows
        for name in self.args.shapes:
            for label, seqs in prefill_cases(self.args.quick):
                row = self._prefill_one(name, label, seqs)
                self.torch.cuda.empty_cache()
                rows.append(row)
                extra = f"  torch sdpa {row['torch_sdpa_ms'] * 1e3:8.1f} us" if row.get("torch_sdpa_ms") else ""
                print(f"prefill {name:8s} {label:38s}: {'ok ' if row['ok'] else 'BAD'} err {row['rel_err']:.1e} "
                      f"{row['ms'] * 1e3:9.1f} us {row['tflops']:6.1f} TFLOP/s{extra}")
                self.save()

    def _prefill_one(self, name: str, label: str, seqs: list[tuple[int, int]]) -> dict:
        torch, ta = self.torch, self.ta
        F = torch.nn.functional
        hq, hkv, d = SHAPES[name]["hq"], SHAPES[name]["hkv"], SHAPES[name]["d"]
        scale = d**-0.5
        seq_lens = [c + ql for c, ql in seqs]
        q_lens = [ql for _, ql in seqs]
        kc, vc, bt, sl = self.paged(seq_lens, hkv, d)
        qsl_l = [0]
        for ql in q_lens:
            qsl_l.append(qsl_l[-1] + ql)
        qsl = torch.tensor(qsl_l, dtype=torch.int32, device=self.dev)
        T = qsl_l[-1]
        q = torch.randn(T, hq, d, device=self.dev, dtype=self.dtype)
        out = torch.empty_like(q)
        mql = max(q_lens)

        def run(bm=None, bn=None):
            return ta.paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale, mql, out=out, block_m=bm, block_n=bn)

        run()
        ref = self.ref.paged_attention(q, kc, vc, bt, sl, qsl, scale)
        err = self.rel_err(out, ref)
        ms = self.bench_ms(run)
        # causal FLOPs: 2 matmuls x 2 flops x D per (query, visible key) pair per q head
        pairs = sum(ql * c + ql * (ql + 1) // 2 for c, ql in seqs)
        flops = 4 * d * hq * pairs
        kv_read = sum(seq_lens) * hkv * d * 2 * self.elt
        row = dict(shape=name, case=label, tokens=T, rel_err=err, ok=err < self.tol, ms=ms,
                   tflops=flops / (ms * 1e-3) / 1e12, kv_gbs=kv_read / (ms * 1e-3) / 1e9)
        if self.args.sweep:
            sweep = {}
            for bm in (32, 64, 128):
                for bn in (32, 64, 128):
                    try:
                        sweep[f"block_m={bm},block_n={bn}"] = self.bench_ms(functools.partial(run, bm, bn))
                    except Exception as exc:  # noqa: BLE001
                        sweep[f"block_m={bm},block_n={bn}"] = f"error: {exc}"[:200]
            row["sweep_ms"] = sweep
        if not self.args.no_baselines and len(seqs) == 1 and seqs[0][0] == 0:
            # torch SDPA (flash) on contiguous K/V of the same length
            L = seq_lens[0]
            qq = q.transpose(0, 1)[None]
            kk = torch.randn(1, hkv, L, d, device=self.dev, dtype=self.dtype)
            vv = torch.randn_like(kk)
            try:
                row["torch_sdpa_ms"] = self.bench_ms(functools.partial(
                    F.scaled_dot_product_attention, qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True))
            except Exception as exc:  # noqa: BLE001
                print(f"  (sdpa baseline failed: {exc})")
        return row

    def e2e(self) -> None:
        """The engine on the GPU with the Triton and with the torch attention backend: a warm-up request first
        (Triton compiles, cuBLAS picks its kernels), then the batch timed as a whole, and the median decode step
        at one sequence and at the full batch (a step's wall time, synchronised: launch overhead shows here)."""
        args = self.args
        try:
            from inferq.settings import load_settings
            from worker.engine import LLMEngine
        except Exception as exc:  # noqa: BLE001
            self.results["e2e"] = {"skipped": f"worker.engine not importable: {exc}"}
            print(f"e2e: skipped (worker.engine not importable: {exc})")
            return
        res: dict = {"requests": args.e2e_requests, "prompt_tokens": args.e2e_prompt,
                     "output_tokens": args.e2e_output, "model": args.e2e_model or "default"}
        outputs: dict[str, dict[str, list[int]]] = {}
        for backend in ("triton", "torch"):
            try:
                opts = dict(model=args.e2e_model) if args.e2e_model else {}
                settings = load_settings(device=self.dev.type, dtype=args.dtype, attention_backend=backend,
                                         max_num_seqs=max(64, args.e2e_requests), max_batched_tokens=4096,
                                         kv_cache_memory="8GiB", **opts)
                engine = LLMEngine(settings)
                self._e2e_run(engine, self._e2e_requests(engine, 2, 8, "warm"))
                row, outputs[backend] = self._e2e_run(engine, self._e2e_requests(engine, args.e2e_requests,
                                                                                  args.e2e_output, "r"))
                graphs = engine.runner.graphs
                # one sequence alone: eager steps, CUDA-graph replays (where the backend has them), then
                # replays in decode-ahead windows
                for label, replay, ahead in (("eager", False, 0.0), ("graphs", True, 0.0), ("graphs", True, 20.0)):
                    if replay and graphs is None:
                        continue
                    engine.runner.graphs = graphs if replay else None
                    alone = LLMEngine(settings.model_copy(update={"decode_ahead_ms": ahead}), runner=engine.runner,
                                      tokenizer=engine.tokenizer)
                    one, _ = self._e2e_run(alone, self._e2e_requests(alone, 1, args.e2e_output, "one"))
                    row[f"batch1_{label}_ahead{ahead:g}ms"] = {k: one[k] for k in ("decode_step_ms",
                                                                                   "decode_ms_per_token", "steps")}
                    print(f"e2e {backend:6s}: one sequence, {label}, decode_ahead_ms={ahead:g}: "
                          f"{one['decode_ms_per_token']:.2f} ms per token ({1e3 / one['decode_ms_per_token']:,.0f} "
                          f"tok/s), {one['steps']} steps")
                engine.runner.graphs = None
                eager, _ = self._e2e_run(engine, self._e2e_requests(engine, args.e2e_requests, args.e2e_output, "e"))
                row["eager_decode_step_ms"] = eager["decode_step_ms"]
                print(f"e2e {backend:6s}: {args.e2e_requests} requests, eager steps: decode step "
                      f"{eager['decode_step_ms']:.2f} ms (the run above: {row['decode_step_ms']:.2f} ms)")
                engine.runner.graphs = graphs
                row["decode_step_ms_batch1"] = row["batch1_eager_ahead0ms"]["decode_step_ms"]
                res[backend] = row
                print(f"e2e {backend:6s}: {args.e2e_requests} requests x ({args.e2e_prompt} prompt + "
                      f"{args.e2e_output} output): {row['wall_s']:.2f} s, {row['output_tok_s']:,.0f} output tok/s; "
                      f"decode step {row['decode_step_ms']:.2f} ms at {args.e2e_requests} sequences, "
                      f"{row['decode_step_ms_batch1']:.2f} ms at one")
                del engine
                self.torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - optional section
                res[backend] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"e2e {backend}: failed: {type(exc).__name__}: {exc}")
        if "triton" in outputs and "torch" in outputs:
            a, b = outputs["triton"], outputs["torch"]
            same = sum(a[k] == b.get(k) for k in a)
            res["greedy_identical_requests"] = f"{same}/{len(a)}"
            print(f"e2e greedy outputs identical (triton vs torch attention): {same}/{len(a)} requests "
                  f"(bf16 rounding differences may legitimately flip a few)")
        self.results["e2e"] = res

    def _e2e_requests(self, engine, n: int, max_tokens: int, tag: str) -> list:
        import random

        from scheduler.request import Request, SamplingParams

        rng = random.Random(tag)
        vocab = int(engine.runner.info.vocab_size)
        low = min(100, vocab // 2)
        return [Request(request_id=f"{tag}{i}",
                        prompt_token_ids=[rng.randrange(low, vocab) for _ in range(self.args.e2e_prompt)],
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for i in range(n)]

    def _e2e_run(self, engine, reqs: list) -> tuple[dict, dict[str, list[int]]]:
        """Run ``reqs`` to the end step by step: wall time, output tok/s and the median step once every
        request decodes (the steps after the last prefill)."""
        sync = self.torch.cuda.synchronize
        for r in reqs:
            engine.add_request(r)
        steps: list[tuple[float, bool]] = []  # (seconds, whether a prompt was still being prefilled)
        decode_tokens = 0
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs)
            before = sum(len(r.output_token_ids) for r in reqs)
            s0 = time.perf_counter()
            engine.step()
            sync()
            steps.append((time.perf_counter() - s0, prefilling))
            if not prefilling:
                decode_tokens += sum(len(r.output_token_ids) for r in reqs) - before
        wall = time.perf_counter() - t0
        decode = sorted(t for t, prefilling in steps if not prefilling)
        gen = sum(len(r.output_token_ids) for r in reqs)
        row = {"wall_s": wall, "generated_tokens": gen, "output_tok_s": gen / wall,
               "total_tok_s": (gen + self.args.e2e_prompt * len(reqs)) / wall, "steps": len(steps),
               "decode_step_ms": 1e3 * decode[len(decode) // 2] if decode else float("nan"),
               "decode_ms_per_token": 1e3 * sum(decode) / decode_tokens if decode_tokens else float("nan")}
        return row, {r.request_id: list(r.output_token_ids) for r in reqs}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench.kernels: torch is not installed; nothing to do.")
        return 0
    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA device available - the Triton kernel benchmark needs a GPU; skipping "
              "(the kernels are tested on CPU by tests/unit/test_triton_kernels.py under TRITON_INTERPRET=1).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench.kernels: triton is not installed (pip install triton); skipping.")
        return 0

    b = Bench(args)
    print(f"GPU {b.results['machine']['gpu']} ({b.results['machine']['sms']} SMs), torch {torch.__version__}, "
          f"triton {b.results['machine']['triton']}, dtype {args.dtype}, block size {args.block_size}")
    failures = []
    sections = [("copy", b.copy_bandwidth), ("write_kv_cache", b.write_kv), ("decode", b.decode),
                ("prefill", b.prefill)]
    if not args.no_e2e:
        sections.append(("e2e", b.e2e))
    for name, fn in sections:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep the other sections' results
            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            b.results.setdefault("errors", []).append(failures[-1])
            if name == "copy":
                b.copy_gbs = float("nan")
        b.save()
    bad = [r for sec in ("write_kv_cache", "decode", "prefill") for r in b.results.get(sec, []) if not r.get("ok")]
    b.results["all_correct"] = not bad and not failures
    b.save()
    print(f"results: {args.out}")
    if bad:
        print(f"CORRECTNESS FAILURES: {len(bad)} configuration(s): {bad}")
        return 1
    if failures:
        print("section errors: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
