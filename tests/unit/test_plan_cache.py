"""Kernel plans kept on disk (kernels/plan_cache.py): a later load on the same machine reads the plan instead of
measuring, processes share it, and anything the file cannot vouch for is measured again."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, plan_cache, quant, quant_gemm


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The plan cache on in ``tmp_path``, this process's in-memory plans empty; measurements counted."""
    monkeypatch.setattr(plan_cache, "_active", None)
    plan_cache.use(tmp_path)
    calls = {"cpu_gemm": 0, "quant_gemm": 0}
    for module, name in ((cpu_gemm, "cpu_gemm"), (quant_gemm, "quant_gemm")):
        monkeypatch.setattr(module, "_plans", {})
        measure = module._measure

        def counted(*a, _measure=measure, _name=name, **kw):
            calls[_name] += 1
            return _measure(*a, **kw)

        monkeypatch.setattr(module, "_measure", counted)
    yield calls
    plan_cache.use(None)


def _forget_in_memory(monkeypatch):
    """As a new process would start: no plans in memory, the file read afresh."""
    monkeypatch.setattr(cpu_gemm, "_plans", {})
    monkeypatch.setattr(quant_gemm, "_plans", {})
    directory = plan_cache._active.path.parent
    plan_cache.use(None)
    plan_cache.use(directory)


def test_a_second_load_reads_the_plan_the_first_measured(cache, monkeypatch):
    w = torch.randn(96, 64)
    q = quant.quantize(torch.randn(64, 128), "int8")
    first, first_q = cpu_gemm.plan(w), quant_gemm.plan(q)
    assert cache == {"cpu_gemm": 1, "quant_gemm": 1}
    _forget_in_memory(monkeypatch)
    again, again_q = cpu_gemm.plan(w), quant_gemm.plan(q)
    assert cache == {"cpu_gemm": 1, "quant_gemm": 1}  # nothing measured: both came from the file
    assert (again.layout, again.forms) == (first.layout, first.forms) and again_q.forms == first_q.forms
    x = torch.randn(5, 64)
    torch.testing.assert_close(again(x), F.linear(x, w))
    other = cpu_gemm.plan(torch.randn(48, 64))  # a shape not in the file is measured
    assert cache["cpu_gemm"] == 2 and len(other.forms) == len(cpu_gemm.PROBE_M)


def test_processes_writing_together_keep_each_others_plans(tmp_path):
    a, b = plan_cache.PlanCache(tmp_path), plan_cache.PlanCache(tmp_path)
    a.put("cpu_gemm", ((8, 8), "x"), ["oi", ["xw"] * 4])
    b.put("cpu_gemm", ((16, 8), "x"), ["pk", ["pk"] * 4])  # b read the file before a wrote: merged, not lost
    fresh = plan_cache.PlanCache(tmp_path)
    assert fresh.get("cpu_gemm", ((8, 8), "x")) == ["oi", ["xw"] * 4]
    assert fresh.get("cpu_gemm", ((16, 8), "x")) == ["pk", ["pk"] * 4]
    assert [p.name for p in tmp_path.iterdir()] == [fresh.path.name]  # no temporary file left behind


def test_a_plan_the_file_cannot_vouch_for_is_measured_again(cache, monkeypatch):
    w = torch.randn(96, 64)
    cpu_gemm.plan(w)
    path = plan_cache._active.path
    data = json.loads(path.read_text())
    key = next(iter(data["cpu_gemm"]))
    data["cpu_gemm"][key] = ["no-such-layout", ["xw"] * 4]
    path.write_text(json.dumps(data))
    _forget_in_memory(monkeypatch)
    lin = cpu_gemm.plan(w)
    assert cache["cpu_gemm"] == 2 and lin.layout != "no-such-layout"
    path.write_text("{ torn")
    _forget_in_memory(monkeypatch)
    cpu_gemm.plan(w)
    assert cache["cpu_gemm"] == 3


def test_another_cpu_gets_a_file_of_its_own(tmp_path, monkeypatch):
    here = plan_cache.PlanCache(tmp_path)
    monkeypatch.setattr(plan_cache, "cpu_model", lambda: "some other CPU")
    there = plan_cache.PlanCache(tmp_path)
    assert here.path != there.path
    here.put("cpu_gemm", ("k",), ["oi", ["xw"] * 4])
    assert plan_cache.PlanCache(tmp_path).get("cpu_gemm", ("k",)) is None


def test_off_each_load_measures(cache, monkeypatch):
    plan_cache.use(None)
    w = torch.randn(96, 64)
    cpu_gemm.plan(w)
    monkeypatch.setattr(cpu_gemm, "_plans", {})
    cpu_gemm.plan(w)
    assert cache["cpu_gemm"] == 2 and plan_cache.lookup("cpu_gemm", ("anything",)) is None


def test_the_engine_settings_choose_the_directory(tmp_path, monkeypatch):
    from inferq.settings import Settings

    monkeypatch.setattr(plan_cache, "_active", None)
    monkeypatch.delenv("INFERQ_KERNEL_PLAN_CACHE", raising=False)
    s = Settings(kernel_plan_dir=tmp_path)
    assert s.kernel_plan_cache  # on by default, outside the test suite
    plan_cache.use(s.kernel_plan_dir if s.kernel_plan_cache else None)
    assert plan_cache._active.path.parent == tmp_path
    plan_cache.use(None)


def test_a_second_engine_loads_without_measuring_and_generates_the_same(tmp_path, monkeypatch):
    from scheduler.request import SamplingParams
    from tests.tiny_models import make_tiny_model
    from worker.engine import LLMEngine

    model = make_tiny_model(tmp_path / "model", arch="llama")
    monkeypatch.setattr(plan_cache, "_active", None)
    calls = []
    measure = cpu_gemm._measure
    monkeypatch.setattr(cpu_gemm, "_measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    outs, measured = [], []
    for _ in range(2):
        monkeypatch.setattr(cpu_gemm, "_plans", {})  # as a new worker process starts
        plan_cache.use(None)
        engine = LLMEngine(model=str(model), device="cpu", kv_cache_memory="16MiB", kernel_plan_cache=True,
                           kernel_plan_dir=tmp_path / "plans")
        engine.add_request(_request([5, 9, 2, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        outs.append(engine.run_until_done()[0].token_ids)
        measured.append(len(calls))
    assert measured[0] > 0  # the first engine measured its shapes
    assert measured[1] == measured[0] and outs[0] == outs[1]  # the second measured nothing
    assert list((tmp_path / "plans").glob("*.json"))
    plan_cache.use(None)


def _request(prompt, sampling):
    from scheduler.request import Request

    return Request("r", prompt, sampling)
