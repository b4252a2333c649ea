"""One sequence's decode speed under two KV-cache dtypes, side by side in one process.

``python -m bench.kv_cache_ab [--dtype w4a8] [--prompts 64,300,1000] [--kv float32,auto] [--tokens 200]``

Loads the model once per KV dtype (``kv_cache_dtype``; ``auto`` is bfloat16 under quantised float32 weights,
worker/model_runner.py says why), then for each prompt length runs one greedy request of ``--tokens`` tokens on
each engine in turn, the order alternating, five timed rounds after a warm-up, decode-ahead windows on (as
served). Prints each dtype's median decode tok/s (from the first token to the last) and their ratio against
the first: the machine's bandwidth drifts by a third within minutes, so only the ratio of runs alternated in
one process is evidence. Compare variants inside one run, never across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common, latency
from bench.engines import InferqOffline

ROUNDS = 6  # the first warms up


def decode_tok_s(engine, request_id: str, prompt: list[int], tokens: int) -> float:
    """Decode tokens per second of one greedy request alone on ``engine``, after its first token."""
    from scheduler.request import Request, SamplingParams

    engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                  ignore_eos=True)))
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (tokens - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="w4a8", choices=sorted(latency.VARIANTS))
    parser.add_argument("--prompts", default="64,300,1000", help="prompt lengths, comma-separated")
    parser.add_argument("--kv", default="float32,auto", help="KV-cache dtypes, the first the reference")
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    model_dir = common.resolve_model_dir(None)
    bases = {kv: InferqOffline(model_dir, kv_cache_memory="256MiB", max_num_seqs=8, max_batched_tokens=2048,
                               kv_cache_dtype=kv, **latency.VARIANTS[args.dtype][0]) for kv in args.kv.split(",")}
    engines = {kv: base.new_engine() for kv, base in bases.items()}
    names = list(engines)
    for length in (int(n) for n in args.prompts.split(",")):
        prompt = [(7 * i) % 40000 + 100 for i in range(length)]
        rates: dict[str, list[float]] = {kv: [] for kv in names}
        for r in range(ROUNDS):
            for kv in names if r % 2 == 0 else names[::-1]:
                rate = decode_tok_s(engines[kv], f"{kv}-{length}-{r}", prompt, args.tokens)
                if r:
                    rates[kv].append(rate)
        median = {kv: statistics.median(v) for kv, v in rates.items()}
        print(f"{args.dtype}, prompt {length}: " + ", ".join(
            f"KV {kv} ({bases[kv].runner.kv_dtype}) {median[kv]:.1f} tok/s ({median[kv] / median[names[0]]:.3f}x)"
            for kv in names), flush=True)


if __name__ == "__main__":
    main()
