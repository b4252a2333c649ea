"""``LLM.generate`` validation (fast, fake runner) and ``inferq generate`` end to end (tiny real model)."""

from __future__ import annotations

import json

import pytest

from tests.engine_fixtures import FakeRunner, reference
from worker.llm import LLM

BAD_LINES = [
    ({"id": "u", "prompt_ids": [1, 2], "colour": "red"}, "colour"),
    ({"id": "t", "prompt_ids": [1, 2], "max_tokens": "5"}, "max_tokens"),
    ({"id": "e", "prompt": ""}, "prompt is empty"),
    ({"id": "two", "prompt_ids": [1], "prompt": "x"}, "exactly one"),
    ({"id": "none"}, "exactly one"),
    ({"id": "neg", "prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
    ({"id": "tier", "prompt_ids": [1], "tier": "gold"}, "tier"),
    ({"id": "big", "prompt_ids": [1] * 10, "max_tokens": 500}, "KV blocks"),
    ({"id": "vocab", "prompt_ids": [1, 10_000]}, "prompt token ids"),
    ({"id": "emptyids", "prompt_ids": []}, "prompt_ids is empty"),
    ({"id": "nochat", "messages": [{"role": "user", "content": "hi"}]}, "tokenizer"),
]


def test_llm_generate_orders_outputs_and_isolates_bad_lines():
    llm = LLM(runner=FakeRunner(num_blocks=32, block_size=4), tokenizer=None, block_size=4, max_num_seqs=3)
    good = [{"id": f"g{i}", "prompt_ids": list(range(1, 2 + i)), "max_tokens": 2 + i % 3, "temperature": 0}
            for i in range(6)]
    lines = []
    for i, (bad, _) in enumerate(BAD_LINES):
        lines += [good[i % len(good)], bad]
    lines.append({"prompt_ids": [5, 6], "max_tokens": 1})  # no id: still answered, in place
    results = llm.generate(lines)
    assert len(results) == len(lines)
    for line, res in zip(lines, results, strict=True):
        assert res["id"] == line.get("id")
        if line in good:
            assert res["token_ids"] == reference(line["prompt_ids"], line["max_tokens"])
            assert res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == line["max_tokens"]
    for (_, expect), res in zip(BAD_LINES, results[1::2], strict=True):
        assert expect in res["error"], res
    assert "token_ids" in results[-1]


# --- the CLI on a real tiny model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cli"), arch="qwen2")


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_generate_cli_end_to_end(tiny, tmp_path, policy):
    import os
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "INFERQ_DEVICE": "cpu", "INFERQ_TORCH_THREADS": "1", "INFERQ_MAX_MODEL_LEN": "200"}
    ids = [5, 17, 42, 99, 7, 250, 31]
    lines = [
        json.dumps({"id": "ids", "prompt_ids": ids, "max_tokens": 8, "temperature": 0}),
        json.dumps({"id": "txt", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "tier": "interactive"}),
        "{not json",
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 6,
                    "seed": 3, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "priority": 2}),
        json.dumps({"id": "long", "prompt_ids": [5] * 201}),
        json.dumps({"id": "kv", "prompt_ids": [5] * 10, "max_tokens": 150}),
        json.dumps({"id": 7, "prompt": "1 2 3", "max_tokens": 4, "stop": ["zzz"], "ignore_eos": True}),
        "",
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    # A real process: the installed entry point path, logging to stderr, nothing but results in files.
    res = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--input", str(inp), "--output", str(out),
         "--model", str(tiny), "--policy", policy, "--max-num-seqs", "3", "--max-batched-tokens", "16",
         "--block-size", "4", "--kv-cache-memory", str(32 * 1024), "--dtype", "float32", "--stats", str(stats),
         "--allow-failures"],  # lines 3, 5 and 6 fail on purpose
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == ""  # no progress bar or logs on stdout (stderr is not a TTY here)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["ids", "txt", None, "chat", "long", "kv", 7]
    by = {r["id"]: r for r in rows}
    assert "invalid JSON" in rows[2]["error"]
    assert "context" in by["long"]["error"] and "KV blocks" in by["kv"]["error"]
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert by["ids"]["token_ids"] == want.tolist()
    # every answered greedy or seeded line is what the offline LLM gives for it here (same settings and seed)
    good = [json.loads(lines[i]) for i in (0, 1, 3, 6)]  # the lines that are answered, not refused
    assert [g["id"] for g in good] == ["ids", "txt", "chat", 7]
    offline = _offline_generate(tiny, policy, good)
    tok = AutoTokenizer.from_pretrained(tiny)
    for line, want_row in zip(good, offline, strict=True):
        r = by[line["id"]]
        if line.get("temperature") == 0 or "seed" in line:  # line 7 samples unseeded: no fixed answer
            assert (r["token_ids"], r["text"], r["finish_reason"]) == (
                want_row["token_ids"], want_row["text"], want_row["finish_reason"]), line["id"]
        usage = r["usage"]
        assert set(usage) >= {"prompt_tokens", "cached_prompt_tokens", "completion_tokens", "queue_seconds",
                              "time_to_first_token", "prefill_seconds", "decode_seconds", "compute_seconds"}
        assert usage["prompt_tokens"] == len(_prompt_ids(tok, line)) and usage["completion_tokens"] == len(r["token_ids"])
        ended_by_length = len(r["token_ids"]) == line["max_tokens"]
        assert r["finish_reason"] == ("length" if ended_by_length else "stop"), line["id"]
    assert by[7]["usage"]["completion_tokens"] == 4 and by[7]["finish_reason"] == "length"  # ignore_eos
    st = json.loads(stats.read_text())
    assert st["policy"] == policy and st["requests"] == 4 and st["errors"] == 3 and st["busy_seconds"] > 0
    assert st["lines"] == 7
    assert st["prompt_tokens"] == sum(by[g["id"]]["usage"]["prompt_tokens"] for g in good)
    assert st["completion_tokens"] == sum(by[g["id"]]["usage"]["completion_tokens"] for g in good)


def _prompt_ids(tok, line: dict) -> list[int]:
    """The prompt token ids of a JSONL line, tokenized the documented way (chat template for messages)."""
    if "prompt_ids" in line:
        return line["prompt_ids"]
    if "messages" in line:
        text = tok.apply_chat_template(line["messages"], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(line["prompt"])


def _offline_generate(model, policy: str, lines: list[dict]) -> list[dict]:
    """``LLM.generate`` in this process with the CLI's settings (one torch thread, as the CLI run had: the
    same arithmetic, so seeded sampling draws the same tokens); torch's thread count is restored after."""
    import torch

    from inferq.settings import Settings

    threads = torch.get_num_threads()
    try:
        llm = LLM(settings=Settings(model=str(model), device="cpu", dtype="float32", torch_threads=1,
                                    max_model_len=200, policy=policy, max_num_seqs=3, max_batched_tokens=16,
                                    block_size=4, kv_cache_memory=str(32 * 1024)))
        return llm.generate(lines)
    finally:
        torch.set_num_threads(threads)
