"""Model resolution: local directories, clear errors, and the default SmolLM2 converted once from GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from inferq.settings import Settings
from tests.tiny_models import make_tiny_model
from worker.loader import DEFAULT_MODEL, ModelError, list_models, model_info, resolve_model
from worker.model import CausalLM


def _settings(cache: Path) -> Settings:
    return Settings(model_cache_dir=cache)


# --- local directories and errors (fast) -------------------------------------------------------------


def test_local_directory_used_as_is(tmp_path):
    d = make_tiny_model(tmp_path, "qwen2")
    assert resolve_model(str(d), _settings(tmp_path / "cache")) == d.resolve()
    info = model_info(d)
    assert info.architecture == "Qwen2ForCausalLM" and info.num_kv_heads == 2 and info.max_model_len == 512
    assert info.eos_token_ids == (2,)


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match=str(missing)):
        resolve_model(str(missing), _settings(tmp_path))
    with pytest.raises(ModelError, match="unknown model 'not-a-model'"):
        resolve_model("not-a-model", _settings(tmp_path))


@pytest.mark.parametrize(
    "breakage,message",
    [
        ("no-config", "config.json does not exist"),
        ("bad-json", "cannot read .*config.json"),
        ("unsupported-arch", "unsupported architecture"),
        ("unsupported-rope", "unsupported rope scaling type 'yarn'"),
        ("no-weights", "no \\*.safetensors"),
        ("no-tokenizer", "no tokenizer"),
        ("file-not-dir", "is not a directory"),
    ],
)
def test_broken_directories_raise_model_error_naming_the_path(tmp_path, breakage, message):
    d = make_tiny_model(tmp_path, "llama")
    cfg = d / "config.json"
    if breakage == "no-config":
        cfg.unlink()
    elif breakage == "bad-json":
        cfg.write_text("{not json")
    elif breakage == "unsupported-arch":
        data = json.loads(cfg.read_text())
        data["architectures"] = ["GPT2LMHeadModel"]
        data["model_type"] = "gpt2"
        cfg.write_text(json.dumps(data))
    elif breakage == "unsupported-rope":
        data = json.loads(cfg.read_text())
        data["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
        cfg.write_text(json.dumps(data))
    elif breakage == "no-weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    elif breakage == "no-tokenizer":
        (d / "tokenizer.json").unlink()
    elif breakage == "file-not-dir":
        d = cfg
    with pytest.raises(ModelError, match=message) as exc:
        resolve_model(str(d), _settings(tmp_path / "cache"))
    assert str(d.parent if breakage == "file-not-dir" else d) in str(exc.value)


def test_corrupt_weights_raise_model_error(tmp_path):
    d = make_tiny_model(tmp_path, "llama")
    weights = next(d.glob("*.safetensors"))
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match=str(weights)):
        CausalLM.from_pretrained(d, device="cpu")


def test_missing_gguf_package_is_reported(tmp_path, monkeypatch):
    import worker.loader as loader

    monkeypatch.setitem(loader.KNOWN_MODELS, "fake-model", loader.KnownModel("fake-model", "no_such_pkg_xyz"))
    with pytest.raises(ModelError, match="no-such-pkg-xyz"):
        resolve_model("fake-model", _settings(tmp_path))
    names = {m["name"]: m for m in list_models(_settings(tmp_path))}
    assert names["fake-model"]["converted"] is False and "error" in names["fake-model"]


# --- the default model (real conversion) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory):
    """A model cache for this module. Set INFERQ_TEST_MODEL_CACHE to reuse a converted copy across runs
    (the conversion is then checked for the marker only)."""
    reuse = os.environ.get("INFERQ_TEST_MODEL_CACHE")
    return Path(reuse) if reuse else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def smollm_dir(smollm_cache):
    return resolve_model(DEFAULT_MODEL, _settings(smollm_cache))


@pytest.mark.integration
def test_default_model_converts_once_and_is_reused(smollm_cache, smollm_dir):
    assert smollm_dir == smollm_cache / DEFAULT_MODEL
    assert (smollm_dir / ".inferq-converted").is_file()
    assert list(smollm_dir.glob("*.safetensors")) and (smollm_dir / "tokenizer.json").is_file()
    assert not [p for p in smollm_cache.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    # resolving again reuses the directory: a conversion would write a new one and rename it into place
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [smollm_dir, *smollm_dir.iterdir()]}
    again = resolve_model("smollm2-135m-instruct", _settings(smollm_cache))
    assert again == smollm_dir
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [smollm_dir, *smollm_dir.iterdir()]} == before
    listed = {m["name"]: m for m in list_models(_settings(smollm_cache))}
    entry = listed[DEFAULT_MODEL]
    assert entry["converted"] is True and entry["size"] > 100_000_000 and entry["path"] == str(smollm_dir)

    info = model_info(smollm_dir)
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.vocab_size == 49152 and info.max_model_len == 8192


@pytest.mark.integration
def test_default_model_tokenizer_chat_template_and_eos(smollm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    info = model_info(smollm_dir)
    assert tok.eos_token_id in info.eos_token_ids
    gen = json.loads((smollm_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id


@pytest.mark.integration
def test_converted_weights_equal_dequantised_gguf(smollm_dir):
    """Independent of transformers' GGUF loader: tensors that need no re-layout must equal the GGUF
    tensors dequantised by the gguf package."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    from worker.loader import KNOWN_MODELS, _gguf_source

    reader = GGUFReader(str(_gguf_source(KNOWN_MODELS[DEFAULT_MODEL])))
    gg = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    with safe_open(str(next(smollm_dir.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        for gname, hname in pairs.items():
            t = gg[gname]
            ref = dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist())))
            ours = f.get_tensor(hname).numpy()
            assert ours.shape == ref.shape, hname
            np.testing.assert_allclose(ours, ref.astype(np.float32), rtol=0, atol=1e-6, err_msg=hname)
        # the GGUF has no output tensor (the head is the embedding): the conversion keeps the two tied
        assert "output.weight" not in gg
        assert json.loads((smollm_dir / "config.json").read_text())["tie_word_embeddings"] is True
        if "lm_head.weight" in names:  # a tied copy, if one is written, is the embedding table itself
            np.testing.assert_array_equal(f.get_tensor("lm_head.weight").numpy(),
                                          f.get_tensor("model.embed_tokens.weight").numpy())


@pytest.mark.integration
def test_converted_logits_equal_hf_gguf_loader(smollm_dir):
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        pytest.skip("transformers needs accelerate to load GGUF files directly")
    from worker.loader import KNOWN_MODELS, _gguf_source

    gguf = _gguf_source(KNOWN_MODELS[DEFAULT_MODEL])
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)(
            ids
        ).logits
        b = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.integration
def test_runner_on_default_model_matches_hf_generate(smollm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scheduler.request import Request, SamplingParams
    from worker.model_runner import ModelRunner

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    runner = ModelRunner(smollm_dir, device="cpu", dtype="float32", kv_cache_bytes=64 << 20, block_size=16)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    new_tokens = 12
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
        expected.append(out[0, len(p) :].tolist())  # stops after EOS (we keep going: compare the prefix)
    assert any(len(e) == new_tokens for e in expected)

    reqs = [
        Request(f"r{i}", list(p), SamplingParams(temperature=0, max_tokens=new_tokens))
        for i, p in enumerate(prompts)
    ]
    next_block = 0
    for r in reqs:
        need = -(-(r.num_prompt_tokens + new_tokens) // 16)
        r.block_table = list(range(next_block, next_block + need))[::-1]  # reversed: non-contiguous order
        next_block += need
    for _ in range(new_tokens):
        batch = [(r, r.num_tokens - r.num_computed_tokens) for r in reqs]
        for (r, n), t in zip(batch, runner.execute(batch), strict=True):
            r.num_computed_tokens += n
            r.output_token_ids.append(t)
    for r, exp in zip(reqs, expected, strict=True):
        assert r.output_token_ids[: len(exp)] == exp, (tok.decode(r.output_token_ids), tok.decode(exp))
