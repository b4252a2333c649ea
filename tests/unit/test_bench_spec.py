"""``python -m bench spec --engines inferq,vllm-cpu`` without vLLM: the option's parsing, the vLLM runner's step
loop on a fake engine, and vLLM-CPU's rows (numbers, or its refusal) beside inferq's in the report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench import spec
from bench.peers import vllm_cpu_runner as runner


def test_parse_engines():
    assert spec.parse_engines(None) == ("inferq",)
    assert spec.parse_engines("vllm-cpu, inferq") == ("inferq", "vllm-cpu")
    assert spec.parse_engines(("vllm-cpu",)) == ("vllm-cpu",)
    with pytest.raises(ValueError, match="hf-cb"):
        spec.parse_engines("inferq,hf-cb")
    with pytest.raises(ValueError):
        spec.parse_engines(" , ")


class _FakeEngine:
    """vLLM's ``llm_engine`` as the runner uses it: each step, every request in flight gets ``per_step`` tokens
    (DELTA outputs) until it has ``max_tokens``; the spec counters grow by one draft of 2 tokens, 1 accepted."""

    def __init__(self, per_step: int = 2) -> None:
        self.live: dict[str, list] = {}
        self.per_step = per_step
        self.max_live = 0
        self.counters = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_draft_tokens": 0.0,
                         "vllm:spec_decode_num_accepted_tokens": 0.0}

    def add_request(self, rid, prompt, params, arrival_time=None):
        internal = f"{rid}-abcd1234"
        self.live[internal] = [rid, params.max_tokens, 0]
        self.max_live = max(self.max_live, len(self.live))
        return internal

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for internal, st in list(self.live.items()):
            rid, left, done = st
            n = min(self.per_step, left - done)
            st[2] += n
            finished = st[2] >= left
            outs.append(SimpleNamespace(request_id=rid, finished=finished, metrics=None,
                                        outputs=[SimpleNamespace(token_ids=list(range(done, done + n)))]))
            self.counters["vllm:spec_decode_num_drafts"] += 1
            self.counters["vllm:spec_decode_num_draft_tokens"] += 2
            self.counters["vllm:spec_decode_num_accepted_tokens"] += 1
            if finished:
                del self.live[internal]
        return outs


def test_runner_drives_at_the_concurrency_and_reads_the_spec_counters():
    engine = _FakeEngine()
    llm = SimpleNamespace(llm_engine=engine, get_metrics=lambda: [SimpleNamespace(name=k, value=v)
                                                                  for k, v in engine.counters.items()])
    params = [SimpleNamespace(max_tokens=n) for n in (6, 4, 6, 2, 5)]
    r = runner.drive(llm, [[1, 2, 3]] * 5, params, 2, render=lambda ids: ids)
    assert engine.max_live == 2
    assert [len(t) for t in r["outputs"]] == [6, 4, 6, 2, 5]
    assert r["output_tokens"] == 23 and r["prompt_tokens"] == 15
    assert len(r["tpot_s"]) == 5 and all(t >= 0 for t in r["tpot_s"])
    assert r["request_steps"] == 3 + 2 + 3 + 1 + 3
    assert r["spec"] == {"num_drafts": 12, "num_draft_tokens": 24, "num_accepted_tokens": 12}
    assert r["engine_tpot_s"] is None


def test_runner_without_spec_counters():
    engine = _FakeEngine()

    def no_stats():
        raise AssertionError("Stat logging disabled")

    r = runner.drive(SimpleNamespace(llm_engine=engine, get_metrics=no_stats), [[1]], [SimpleNamespace(max_tokens=3)],
                     4, render=lambda ids: ids)
    assert r["spec"] is None and r["outputs"] == [[0, 1, 2]]


def _reply(outputs, wall=1.0, spec_counts=None):
    return {"wall_s": wall, "output_tokens": sum(map(len, outputs)), "prompt_tokens": 10, "outputs": outputs,
            "tpot_s": [0.01, 0.02], "engine_tpot_s": None, "request_steps": 8, "steps": 5, "spec": spec_counts}


def _result(rows, vllm):
    return {"machine": {}, "rows": rows, "methods": ["ngram"], "targets": spec._targets(rows, ("ngram",), (1,)),
            "elapsed_s": 1.0, "vllm_cpu": vllm}


def test_vllm_rows_beside_inferq(monkeypatch):
    monkeypatch.setattr(spec.common, "machine_line", lambda info: "machine")
    inferq_results = {m: {"output_tok_s": 100.0, "tpot_p50_ms": 10.0, "tpot_p95_ms": 12.0, "proposed": 8,
                          "accepted": 6, "request_steps": 8, "output_tokens": 40, "steps": 5,
                          "outputs": {"q0": [5, 6, 2], "q1": [7, 8]}} for m in ("off", "ngram")}
    irow = {"engine": "inferq", **spec._row("copy-heavy", 1, 2, inferq_results)}
    outs = [[5, 6], [7, 9]]  # q0 equal to inferq's once its EOS (2) is set aside, q1 not
    vrow = spec._vllm_row("copy-heavy", 1, 2, {"off": _reply(outs, 2.0), "ngram": _reply(
        outs, 1.0, {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 8})}, ("ngram",),
        inferq_results["off"]["outputs"], irow, [2])
    assert vrow["engine"] == "vllm-cpu" and vrow["off_tok_s"] == 2.0 and vrow["ngram_speedup"] == 2.0
    assert vrow["ngram_acceptance"] == 0.5 and vrow["ngram_accepted_len"] == 1.0 and vrow["ngram_identical"]
    assert vrow["ngram_vllm_mean_acceptance_length"] == 3.0
    assert vrow["off_same_as_inferq"] == 0.5 and vrow["inferq_over_off"] == 50.0
    rows = spec._interleave([irow], [vrow])
    assert [r["engine"] for r in rows] == ["inferq", "vllm-cpu"]
    result = _result(rows, {"version": "0.32.0", "errors": {}, "speculative_config": {"ngram": {"method": "ngram"}}})
    assert all("vllm" not in t["target"] for t in result["targets"]) and len(result["targets"]) == 3
    text = spec.report(result)
    assert "| engine |" in text and "| vllm-cpu | copy-heavy | 1 |" in text and "inferq/this ngram" in text


def test_vllm_refusal_is_the_result(monkeypatch):
    monkeypatch.setattr(spec.common, "machine_line", lambda info: "machine")
    msg = "vLLM-CPU runner: start-up failed: ValueError: speculative decoding is not supported on CPU"
    vrow = spec._vllm_row("copy-heavy", 4, 8, {"off": _reply([[1, 2]]), "ngram": {"error": msg}}, ("ngram",),
                          None, None, [2])
    assert vrow["ngram_error"] == msg and vrow["off_tok_s"] == 2.0 and "ngram_tok_s" not in vrow
    result = _result([vrow], {"version": "0.32.0", "errors": {"ngram": msg}, "speculative_config": {}})
    assert result["targets"] == []  # inferq's targets only
    text = spec.report(result)
    assert f"vllm-cpu ngram: cannot run: {msg}" in text and text.count(msg) == 1
