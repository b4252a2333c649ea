"""Triton paged-attention kernels against torch references (runs on CPU via the Triton interpreter).

Every problem is fresh random data on a paged cache whose blocks are shuffled across sequences; all cache
positions that no sequence owns (unused blocks, the tail of each sequence's last block, and a dedicated
block every block-table padding entry points at) hold NaN, and the outputs are NaN-poisoned before each
run, so a kernel that reads past a sequence or leaves an element unwritten fails.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # No GPU: run the kernels in the Triton interpreter. This must happen before triton is first imported
    # (triton decorates its own standard library at import). On a CUDA machine the kernels run compiled on
    # the GPU instead and the process-wide setting is left alone, so other tests' compiled kernels work.
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402,F401 - a dev dependency (pyproject's dev extras): missing it is an error, not a skip

from kernels import reference as kref  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402
from kernels import triton_common  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not _INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is disabled and there is no CUDA device", allow_module_level=True)


def _interpreted_kernels():
    """Re-import the kernel modules (in dependency order) if they were first imported before
    TRITON_INTERPRET was set, so their kernels are re-decorated for the interpreter (in place: a reloaded
    module keeps its identity, so ``ta`` and ``triton_backend.ta`` see the new kernels)."""
    if _INTERPRET and not triton_common._interpreting():
        from kernels import triton_backend, triton_decode, triton_prefill

        for mod in (triton_common, triton_decode, triton_prefill, ta, triton_backend):
            importlib.reload(mod)


_interpreted_kernels()

DEVICE = "cpu" if _INTERPRET else "cuda"

TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _cdiv(a, b):
    return -(-a // b)


class Problem:
    """A random paged batch: caches, block tables, per-sequence lengths and a flattened query."""

    def __init__(self, seq_lens, q_lens, hq, hkv, d, bs, dtype, seed, extra_blocks=3):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens_l = list(seq_lens)
        self.q_lens_l = list(q_lens)
        assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
        S = len(seq_lens)
        nblks = [_cdiv(s, bs) for s in seq_lens]
        max_blocks = max(nblks) + 1  # at least one padding column
        num_blocks = sum(nblks) + extra_blocks + 1
        poison_blk = num_blocks - 1
        perm = torch.randperm(num_blocks - 1, generator=g).tolist()
        self.block_tables = torch.full((S, max_blocks), poison_blk, dtype=torch.int32)
        self.k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        i = 0
        for s, n in enumerate(nblks):
            self.block_tables[s, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
            i += n
        # Valid positions get random values; slot_mapping of every (seq, position).
        self.slots = []
        for s, L in enumerate(seq_lens):
            pos = torch.arange(L)
            blk = self.block_tables[s, pos // bs].long()
            self.slots.append(blk * bs + pos % bs)
            flat_k = self.k_cache.view(-1, hkv, d)
            flat_v = self.v_cache.view(-1, hkv, d)
            flat_k[self.slots[-1]] = torch.randn(L, hkv, d, generator=g).to(dtype)
            flat_v[self.slots[-1]] = torch.randn(L, hkv, d, generator=g).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        self.query = torch.randn(qsl[-1], hq, d, generator=g).to(dtype)
        self.scale = d**-0.5
        self.max_query_len = max(q_lens)
        self.bs, self.hq, self.hkv, self.d, self.dtype = bs, hq, hkv, d, dtype

    def to(self, device):
        for name in ("block_tables", "k_cache", "v_cache", "seq_lens", "query_start_loc", "query"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def poisoned_out(self):
        return torch.full_like(self.query, float("nan"))

    def naive(self):
        """float64 attention straight from the definition (per sequence, per head)."""
        hq, hkv, bs = self.hq, self.hkv, self.bs
        group = hq // hkv
        kc = self.k_cache.double().cpu()
        vc = self.v_cache.double().cpu()
        q_all = self.query.double().cpu()
        bt = self.block_tables.cpu()
        out = torch.empty_like(q_all)
        q0 = 0
        for s, (L, ql) in enumerate(zip(self.seq_lens_l, self.q_lens_l, strict=True)):
            pos = torch.arange(L)
            blk = bt[s, pos // bs].long()
            k = kc[blk, pos % bs]  # [L, Hkv, D]
            v = vc[blk, pos % bs]
            q = q_all[q0 : q0 + ql]  # [ql, Hq, D]
            qpos = L - ql + torch.arange(ql)
            allowed = pos[None, :] <= qpos[:, None]  # [ql, L]
            for h in range(hq):
                sc = q[:, h] @ k[:, h // group].T * self.scale
                sc = sc.masked_fill(~allowed, float("-inf"))
                out[q0 : q0 + ql, h] = torch.softmax(sc, -1) @ v[:, h // group]
            q0 += ql
        return out


def _rel_err(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or a read past a sequence)"
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _check_against_refs(p, out):
    naive = p.naive()
    err = _rel_err(out, naive)
    assert err < TOL[p.dtype], f"kernel vs naive relative error {err:.2e}"
    if p.dtype == torch.float32:
        ref = kref.paged_attention(
            p.query.cpu(), p.k_cache.cpu(), p.v_cache.cpu(), p.block_tables.cpu(), p.seq_lens.cpu(),
            p.query_start_loc.cpu(), p.scale,
        )
        assert _rel_err(ref, naive) < 1e-4, "kernels.reference disagrees with the naive reference"
        err = _rel_err(out, ref)
        assert err < TOL[p.dtype], f"kernel vs kernels.reference relative error {err:.2e}"


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs,dtype,d", [(8, torch.float32, 64), (16, torch.bfloat16, 128), (32, torch.float16, 80)])
def test_write_kv_cache(bs, dtype, d):
    g = torch.Generator().manual_seed(bs)
    hkv, num_blocks = 3, 7
    T = 11
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[[2, 7]] = -1  # padding tokens: skipped
    key = torch.randn(T, hkv, d, generator=g).to(dtype)
    value = torch.randn(T, hkv, d, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    for t, sl in enumerate(slots.tolist()):  # naive scatter
        if sl >= 0:
            exp_k[sl // bs, sl % bs] = key[t]
            exp_v[sl // bs, sl % bs] = value[t]
    rk, rv = k_cache.clone(), v_cache.clone()
    kref.write_kv_cache(key, value, rk, rv, slots)
    assert torch.equal(rk, exp_k) and torch.equal(rv, exp_v)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    ta.write_kv_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), exp_k)
    assert torch.equal(v_cache.cpu(), exp_v)


# Decode: one query token per sequence. Lengths: 1, block boundaries, ragged, several partitions.
DECODE_CASES = [
    # (hq, hkv, d, bs, dtype, num_splits, block_n, seq_lens)
    (4, 4, 64, 16, torch.float32, 3, 16, [1, 16, 100, 33]),  # MHA, 3 partitions x 3 tiles
    (9, 3, 64, 8, torch.float32, 4, 16, [8, 1, 71, 24, 40]),  # SmolLM2 GQA 3, empty partitions too
    (8, 2, 128, 16, torch.float32, 1, 32, [1, 48, 95]),  # GQA 4, head dim 128, no split
    (9, 3, 64, 16, torch.bfloat16, None, 16, [1, 32, 90]),  # default split heuristic
    (8, 2, 64, 8, torch.float16, 2, 16, [7, 64, 65]),
    (4, 2, 80, 16, torch.float32, 2, 16, [1, 45]),  # head dim not a power of two (masked tiles)
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,num_splits,block_n,seq_lens", DECODE_CASES)
def test_paged_decode_attention(hq, hkv, d, bs, dtype, num_splits, block_n, seq_lens):
    p = Problem(seq_lens, [1] * len(seq_lens), hq, hkv, d, bs, dtype, seed=hq * 100 + bs + d).to(DEVICE)
    out = p.poisoned_out()
    res = ta.paged_decode_attention(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.scale, num_splits,
        out=out, block_n=block_n,
    )
    assert res is out
    _check_against_refs(p, out)


# Prefill: decode tokens, whole prompts, chunks with earlier context (prefix hits / earlier chunks).
PREFILL_CASES = [
    # (hq, hkv, d, bs, dtype, block_m, block_n, seq_lens, q_lens)
    (4, 4, 64, 16, torch.float32, 16, 16, [1, 40, 50, 33, 30], [1, 40, 18, 1, 16]),  # MHA
    (9, 3, 64, 8, torch.float32, 32, 16, [24, 37, 16, 9, 23], [24, 21, 8, 1, 8]),  # GQA 3, block edges
    (8, 2, 64, 16, torch.float32, 32, 32, [64, 70, 5], [16, 35, 5]),  # GQA 4
    (8, 2, 128, 8, torch.float32, 32, 16, [30, 17], [13, 17]),  # head dim 128
    (9, 3, 64, 16, torch.bfloat16, 64, 32, [1, 48, 40], [1, 17, 40]),
    (4, 1, 64, 8, torch.float16, 32, 16, [20, 33], [20, 9]),
    (4, 2, 80, 8, torch.float32, 16, 16, [19, 6], [11, 6]),  # head dim not a power of two
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,block_m,block_n,seq_lens,q_lens", PREFILL_CASES)
def test_paged_prefill_attention(hq, hkv, d, bs, dtype, block_m, block_n, seq_lens, q_lens):
    p = Problem(seq_lens, q_lens, hq, hkv, d, bs, dtype, seed=hq * 10 + bs + d + block_m).to(DEVICE)
    out = p.poisoned_out()
    res = ta.paged_prefill_attention(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc, p.scale,
        p.max_query_len, out=out, block_m=block_m, block_n=block_n,
    )
    assert res is out
    _check_against_refs(p, out)


def test_paged_attention_dispatch_default_tiles():
    """The convenience entry point with default tile sizes, decode and mixed batches."""
    p = Problem([3, 70, 17], [1, 1, 1], 9, 3, 64, 16, torch.float32, seed=7).to(DEVICE)
    _check_against_refs(p, ta.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              p.query_start_loc, p.scale, max_seq_len=70))
    p = Problem([3, 70], [1, 22], 9, 3, 64, 16, torch.float32, seed=8).to(DEVICE)
    _check_against_refs(p, ta.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              p.query_start_loc, p.scale))


def test_default_num_splits():
    dev = torch.device("cpu")
    assert ta.default_num_splits(256, 8, 32768, dev) == 1  # big batch: no split
    assert ta.default_num_splits(1, 3, 100, dev) == 1  # short context: no split
    assert ta.default_num_splits(1, 3, 32768, dev) > 1  # one long request: split


# --------------------------------------------------------------------------------------------------
# The backend: write the step's K/V into the cache, then attend (decode-only and mixed batches).


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 1, 19, 7]])
def test_triton_backend(q_lens):
    import numpy as np

    from kernels import attention_api as backend_mod
    from kernels import triton_backend

    _interpreted_kernels()
    seq_lens = [5, 40, 30, 7][: len(q_lens)]
    hq, hkv, d, bs, dtype = 9, 3, 64, 8, torch.float32
    p = Problem(seq_lens, q_lens, hq, hkv, d, bs, dtype, seed=len(q_lens))
    # This step's K/V: take the cached values of the new positions, clobber those slots, rewrite them.
    slot_mapping = torch.cat([sl[L - q:] for sl, L, q in zip(p.slots, seq_lens, q_lens, strict=True)])
    key = p.k_cache.view(-1, hkv, d)[slot_mapping].clone()
    value = p.v_cache.view(-1, hkv, d)[slot_mapping].clone()
    p.k_cache.view(-1, hkv, d)[slot_mapping] = 0.0
    p.v_cache.view(-1, hkv, d)[slot_mapping] = 0.0
    slot_mapping = torch.cat([slot_mapping, torch.tensor([-1, -1])])  # padding tokens
    key = torch.cat([key, torch.randn(2, hkv, d)])
    value = torch.cat([value, torch.randn(2, hkv, d)])
    meta = backend_mod.AttentionMetadata.build(
        slot_mapping=slot_mapping.numpy(), block_tables=p.block_tables.numpy(),
        seq_lens=np.array(seq_lens), query_start_loc=p.query_start_loc.numpy(), block_size=bs, device=DEVICE,
    )
    p.to(DEVICE)
    be = triton_backend.TritonBackend()
    assert isinstance(be, backend_mod.AttentionBackend)
    be.write_kv_cache(key.to(DEVICE), value.to(DEVICE), p.k_cache, p.v_cache, meta.slot_mapping)
    T = p.query.shape[0]
    # The model passes strided views of one fused qkv projection: do the same.
    qkv = torch.cat([p.query, key[:T].to(DEVICE), value[:T].to(DEVICE)], dim=1)
    q_view, k_view, v_view = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    assert not q_view.is_contiguous()
    out = be.forward(q_view, k_view, v_view, p.k_cache, p.v_cache, meta)
    _check_against_refs(p, out)
    assert math.isclose(p.scale, d**-0.5)


@pytest.mark.slow  # ~10 s, mostly importing transformers
def test_engine_greedy_matches_cpu_backend(tmp_path):
    """The Triton backend inside the real engine (tiny random model): chunked prefill, mixed
    decode/prefill steps and a prefix-cache hit give the same greedy tokens as the CPU backend."""
    from transformers import AutoTokenizer

    from inferq.settings import load_settings
    from kernels import triton_backend
    from scheduler.request import Request, SamplingParams
    from tests.tiny_models import make_tiny_model
    from worker.engine import LLMEngine
    from worker.model_runner import ModelRunner

    _interpreted_kernels()
    model_dir = make_tiny_model(tmp_path, arch="llama", num_hidden_layers=1, num_attention_heads=6,
                                num_key_value_heads=2, hidden_size=384)
    outputs, cached = {}, {}
    for backend in ("cpu", triton_backend.TritonBackend()):
        settings = load_settings(device=DEVICE, dtype="float32", max_num_seqs=8, max_batched_tokens=16,
                                 kv_cache_memory="4MiB", block_size=8)
        runner = ModelRunner(model_dir, dtype="float32", device=DEVICE, kv_cache_bytes=settings.kv_cache_bytes,
                             block_size=8, max_num_seqs=8, max_batched_tokens=16, attention_backend=backend)
        engine = LLMEngine(settings, runner=runner, tokenizer=AutoTokenizer.from_pretrained(model_dir))
        g = torch.Generator().manual_seed(0)
        vocab = runner.info.vocab_size
        prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (21, 3, 9)]
        prompts.append(prompts[0][:17] + [7, 8, 9])  # shares two full blocks with the first prompt

        def request(i, ids):
            return Request(request_id=f"r{i}", prompt_token_ids=ids,
                           sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))

        reqs = [request(i, p) for i, p in enumerate(prompts)]
        for r in reqs[:3]:
            engine.add_request(r)
        engine.run_until_done()
        engine.add_request(reqs[3])  # after the first finished: its prefix blocks are cached
        engine.run_until_done()
        name = getattr(backend, "name", backend)
        outputs[name] = [list(r.output_token_ids) for r in reqs]
        cached[name] = engine.stats.cached_prompt_tokens
    assert all(len(o) == 3 for o in outputs["triton"])
    assert cached["triton"] >= 16
    assert outputs["triton"] == outputs["cpu"]
    assert cached["triton"] == cached["cpu"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 576), (5, 4096), (3, 100)])
def test_rms_norm_matches_the_torch_chain(dtype, rows, width):
    """kernels/triton_ops.py against worker/model.py's torch chain (HF's two roundings): elements equal but for
    the odd neighbouring half-precision value (the mean of squares is summed in another order); strided rows."""
    from kernels import triton_ops

    _interpreted_kernels()
    g = torch.Generator().manual_seed(rows * width)
    wide = (3 * torch.randn(rows, width + 8, generator=g)).to(dtype).to(DEVICE)
    x = wide[:, 4 : 4 + width]  # rows strided, last dim contiguous
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    xf = x.float()
    ref = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = triton_ops.rms_norm(x, weight, 1e-5)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert out.dtype == dtype and out.shape == (rows, width)
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=0.0)
    assert (out == ref).float().mean() >= 0.98
    with pytest.raises(ValueError, match="half rows"):
        triton_ops.rms_norm(x.float(), weight, 1e-5)


@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 9, 3, 64), (7, 4, 2, 128), (3, 2, 1, 48)])
def test_rope_half_matches_the_torch_chain_bit_for_bit(tokens, hq, hkv, d):
    """kernels/triton_ops.py's RoPE against worker/model.py's rotate-half chain (every product and sum rounded
    to the half type): the same bits, in dense q and k; qkv rows strided as a fused projection's output."""
    from kernels import triton_ops

    _interpreted_kernels()
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(tokens * d)
    width = (hq + 2 * hkv) * d
    qkv = (2 * torch.randn(tokens, width + 16, generator=g)).to(dtype).to(DEVICE)[:, :width]
    freqs = torch.arange(100, 100 + tokens, dtype=torch.float32)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)
    q, k = triton_ops.rope_half(qkv, cos, sin, hq, hkv, d)
    qk = qkv[:, : (hq + hkv) * d].reshape(tokens, hq + hkv, d)
    x1, x2, c, s_ = qk[..., : d // 2], qk[..., d // 2 :], cos[:, None], sin[:, None]
    ref = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
    assert q.is_contiguous() and k.is_contiguous() and q.shape == (tokens, hq, d) and k.shape == (tokens, hkv, d)
    assert torch.equal(q, ref[:, :hq]) and torch.equal(k, ref[:, hq:])
    with pytest.raises(ValueError, match="rope_half needs"):
        triton_ops.rope_half(qkv, cos.float(), sin, hq, hkv, d)
    with pytest.raises(ValueError, match="rope_half needs"):
        triton_ops.rope_half(qkv.half(), cos.half(), sin.half(), hq, hkv, d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_model_forward_with_the_triton_ops(tmp_path, monkeypatch, dtype):
    """worker/model.py with kernels/triton_ops.py in its forward (as on a GPU at half precision; bfloat16 with the
    RoPE kernel too): the same logits as its torch chains but for the norm's last-bit roundings."""
    from kernels import triton_ops
    from scheduler.request import Request, SamplingParams
    from tests.tiny_models import make_tiny_model
    from worker.model_runner import ModelRunner

    _interpreted_kernels()
    monkeypatch.setattr("worker.model.cpu_half_gemm_is_native", lambda: True)  # a CPU keeps bfloat16 arithmetic
    model_dir = make_tiny_model(tmp_path, arch="qwen2", num_hidden_layers=2)
    runner = ModelRunner(model_dir, dtype=dtype, device=DEVICE, kv_cache_bytes=1 << 20, block_size=8,
                         attention_backend="torch")
    runner.model.use_c_ops(False)
    assert runner.model.dtype == getattr(torch, dtype)
    req = Request("r", list(range(20, 33)), SamplingParams(max_tokens=2, temperature=0.0))
    req.block_table = [0, 1]
    logits = {}
    for name, ops in (("torch", None), ("triton", triton_ops)):
        runner.model._triton_ops = ops
        req.num_computed_tokens = 0
        logits[name] = runner.compute_logits([(req, 13)])[0].float()
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=2e-2, atol=2e-2)
    assert logits["triton"].argmax() == logits["torch"].argmax()


class _EagerReplay:
    """A captured decode step stood in by the same step run eagerly (no GPU: no CUDA graphs), its logits
    copied into one buffer as a replay's are."""

    def __init__(self, graphs, b: int) -> None:
        self.graphs, self.b = graphs, b
        self.logits = graphs._step(b).clone()

    def replay(self) -> None:
        self.logits.copy_(self.graphs._step(self.b))


@pytest.mark.slow  # ~20 s interpreted
def test_decode_graphs_replay_like_eager_steps(tmp_path):
    """worker/cuda_graphs.py: the staged row, the pad rows of a bucket (3 sequences in bucket 4), steps too big
    for any bucket (5 sequences) and decode-ahead windows give the tokens of eager steps, greedy and seeded.
    On a GPU the graphs are captured for real; interpreted, each replay runs the recorded step eagerly."""
    from transformers import AutoTokenizer

    from inferq.settings import load_settings
    from kernels import triton_backend
    from scheduler.request import Request, SamplingParams
    from tests.tiny_models import make_tiny_model
    from worker.cuda_graphs import DecodeGraphs
    from worker.engine import LLMEngine
    from worker.model_runner import ModelRunner

    class Graphs(DecodeGraphs):
        def _record(self, b, pool):
            if DEVICE == "cuda":
                return super()._record(b, pool)
            replay = _EagerReplay(self, b)
            return replay, replay.logits

    _interpreted_kernels()
    model_dir = make_tiny_model(tmp_path, arch="llama", num_hidden_layers=1, num_attention_heads=6,
                                num_key_value_heads=2, hidden_size=384)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def requests():
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (21, 3, 9, 5, 12)]
        return [Request(request_id=f"r{i}", prompt_token_ids=p,
                        sampling=SamplingParams(max_tokens=16 - 3 * i, temperature=0.0 if i % 2 else 0.8,
                                                seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]

    def run(graphs: bool, alone: bool):
        settings = load_settings(device=DEVICE, dtype="float32", max_num_seqs=8, max_batched_tokens=32,
                                 kv_cache_memory="4MiB", block_size=8, decode_ahead_ms=1000.0 if alone else 0.0,
                                 cuda_graph_max_batch=0)
        runner = ModelRunner(model_dir, dtype="float32", device=DEVICE, kv_cache_bytes=settings.kv_cache_bytes,
                             block_size=8, max_num_seqs=8, max_batched_tokens=32,
                             attention_backend=triton_backend.TritonBackend())
        if graphs:
            runner.graphs = Graphs(runner.model, runner.kv_caches, runner.backend, block_size=8,
                                   max_model_len=runner.info.max_model_len, max_batch=4)
        engine = LLMEngine(settings, runner=runner, tokenizer=tokenizer)
        reqs = requests()
        for r in reqs:
            engine.add_request(r)
            if alone:
                engine.run_until_done()
        engine.run_until_done()
        return [list(r.output_token_ids) for r in reqs], runner.graphs, engine.stats.steps

    for alone in (False, True):
        eager, _, _ = run(False, alone)
        replayed, graphs, steps = run(True, alone)
        assert replayed == eager, alone
        assert [len(t) for t in replayed] == [16, 13, 10, 7, 4]
        assert graphs.buckets == [1, 2, 4] and graphs.replays > 0
        if alone:  # windows ran, one replay per token after each request's first
            assert steps < sum(len(t) for t in replayed) and graphs.replays == sum(len(t) - 1 for t in replayed)


_AOT_SCRIPT = r"""
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from kernels import triton_common, triton_decode, triton_prefill

ptr = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "slot_ptr": "*i64",
       "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
common = dict(DOT_PRECISION="tf32", DOT_F32=False, EVEN_D=True)
cases = [
    (triton_common._write_kv_cache_kernel, dict(BLOCK_H=4, BLOCK_D=64)),
    (triton_decode._decode_kernel, dict(GROUP=3, BLOCK_G=16, BLOCK_D=64, BLOCK_N=64, USE_SPLITS=True, **common)),
    (triton_decode._decode_reduce_kernel, dict(BLOCK_P=64, BLOCK_D=64)),
    (triton_prefill._prefill_kernel, dict(GROUP=3, BLOCK_G=4, BLOCK_Q=16, BLOCK_D=64, BLOCK_N=64, **common)),
]
for fn, consts in cases:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = ptr.get(name, "*bf16") if name.endswith("_ptr") else ("fp32" if name == "qk_scale" else "i32")
        if name.endswith("_ptr") or name in ("head_dim", "block_size", "partition_size") or (
            name.startswith("stride_") and name not in ("stride_bt", "stride_pms", "stride_pmh")
        ):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher specializes for 16-multiples
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    assert kernel.asm.get("cubin"), fn.__name__
    print("compiled", fn.__name__)
"""


@pytest.mark.slow  # ~10 s: a subprocess importing torch + triton, then four compiles
def test_kernels_compile_for_cuda_without_a_gpu(tmp_path):
    """Ahead-of-time compile (down to a cubin, with the wheel's ptxas) for sm_90 in a subprocess without
    the interpreter: catches code the interpreter accepts but the compiler rejects. Needs no GPU."""
    import subprocess
    import sys
    from pathlib import Path

    if sys.platform != "linux":
        pytest.skip("the CUDA toolchain in the triton wheel is Linux-only")
    root = Path(ta.__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 4
