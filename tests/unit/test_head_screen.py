"""The screened LM head (kernels/decode_step.py ``head_screen``, csrc/decode_step.c ``screen_head``): a greedy
step reads a float32 head's bfloat16 copy and recomputes from float32 only the panels that could hold a row's
maximum, so the argmax is the full head's, bit for bit. Checked against the full head on adversarial heads (a
column whose rounded copy ties or loses to another's), and end to end: the same tokens with and without it."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_step, packed_gemm
from scheduler.request import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.unit.test_decode_step import _engine_tokens, packed_runner, prompts

pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="the fused step's library does not build here")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-screen"), "llama", num_hidden_layers=2,
                           tie_word_embeddings=True)


def test_the_bound_holds_for_every_column():
    """|x . bf16(W_i) - x . W_i| <= |x|_2 c_i in exact (float64) arithmetic, with room left for the float32
    products' own rounding, for rows of every scale; and c is per column, length n (not the padded panels)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(70, 96, generator=gen) * torch.logspace(-3, 1, 70)[:, None]
    panels = packed_gemm.pack(w)
    rounded, c = decode_step.head_screen(panels, 70)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == panels.shape and c.shape == (70,)
    wb = rounded.float().transpose(1, 2).reshape(-1, 96)[:70].double()
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(8, 96, generator=gen, dtype=torch.float64) * scale
        err = (x @ wb.T - x @ w.double().T).abs()
        assert (err <= x.norm(dim=1, keepdim=True) * c.double() * 0.99).all()
    assert decode_step.head_screen(panels, 70)[0] is rounded  # cached per panels tensor


def _head_only_step(path, weight: torch.Tensor):
    """The fused step of a tiny model with no layers run (L = 0: the rows go straight to the final norm) and
    ``weight`` [n, H] as its float32 head, screened."""
    runner = packed_runner(path)
    model = runner.model
    model.norm.data.fill_(1.0)  # the head's rows are x / rms(x)
    step = decode_step.DecodeStep.for_model(model, runner.kv_caches)
    assert step is not None and step.screen is not None
    pk = packed_gemm.pack(weight)
    rounded, c = decode_step.head_screen(pk, weight.shape[0])
    step.args.L, step.args.V = 0, weight.shape[0]
    step.args.head = decode_step._Proj(pk.data_ptr(), None, None, decode_step.W_F32, 0)
    step.screen = (decode_step._Proj(rounded.data_ptr(), None, None, decode_step.W_BF16, 0), rounded, c)
    return step, (pk, rounded)


def _logits(step, x: torch.Tensor, screened: bool) -> torch.Tensor:
    plan = (torch.zeros(1, dtype=torch.int64), (0, torch.zeros((1, 1), dtype=torch.int32),
                                                 torch.zeros(1, dtype=torch.int32), 0), decode_step._NO_CHUNKS)
    logits = torch.empty((x.shape[0], step.args.V), dtype=torch.float32)
    step.call(x.clone(), torch.zeros((x.shape[0], 1, 2)), plan, None, logits, screened=screened)
    return logits


def _adversarial_head(hidden: int, x: torch.Tensor) -> torch.Tensor:
    """A head [64, hidden] whose best column for the row x (normed) is 40, though its bfloat16 copy ranks 5
    above it: 5 is exact in bfloat16 (g, a grid point, moved up a step on a third of the inputs), 40 is g moved
    up 0.49 of a step on every input (rounding back to g). 41 equals 40 exactly (a tie the first index wins);
    the other columns are far below."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, hidden, generator=gen) * 0.01
    h = x[0] / x[0].pow(2).mean().sqrt()
    g = (h / h.norm() * 4).bfloat16().float()
    step = torch.where(g != 0, torch.exp2(torch.floor(torch.log2(g.abs())) - 7), torch.zeros_like(g))
    up = step * h.sign()
    w[5] = g + up * (torch.arange(hidden) % 3 == 0)
    w[40] = g + 0.49 * up
    w[41] = w[40]
    assert torch.equal(w[5].bfloat16().float(), w[5]) and torch.equal(w[40].bfloat16().float(), g)
    return w


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_the_screened_argmax_is_the_full_heads_where_rounding_reorders_the_columns(tiny_dirs_llama, isa):
    """The rounded copy alone would pick column 5, above the true best 40 by more than 5's own bound; the
    screened head keeps 40 a candidate by its bound, recomputes the candidates' panels from float32 and picks
    40, as the full head does, with 41's exact tie left behind 40; only candidate panels are recomputed."""
    hidden = 64
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(9))
    step, (pk, rounded) = _head_only_step(tiny_dirs_llama, _adversarial_head(hidden, x))
    if isa == "avx2":  # the AVX2 build's tiles (on an AVX-512 machine a different kernel), both products
        step.lib = decode_step.build({"INFERQ_NO_AVX512": 1})
    full = _logits(step, x, screened=False)
    before = step.screened_panels
    screened = _logits(step, x, screened=True)
    h = x / x.pow(2).mean(dim=1, keepdim=True).add(1e-6).sqrt()
    rounded_only = h @ rounded.float().transpose(1, 2).reshape(-1, hidden).T
    assert int(rounded_only.argmax()) == 5  # the copy alone is wrong here
    assert int(full.argmax()) == 40 and int(screened.argmax()) == 40
    assert full[0, 40] == full[0, 41] and screened[0, 40] == full[0, 40]  # exact, and the tie kept
    assert 0 < step.screened_panels - before < 4


def test_rows_that_are_not_finite_recompute_every_panel(tiny_dirs_llama):
    hidden = 64
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    x[1, 3] = float("inf")
    step, _ = _head_only_step(tiny_dirs_llama, torch.randn(64, hidden, generator=torch.Generator().manual_seed(1)))
    full = _logits(step, x, screened=False)
    before = step.screened_panels
    screened = _logits(step, x, screened=True)
    assert step.screened_panels - before == 4
    torch.testing.assert_close(screened, full, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def tiny_dirs_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-screen-llama"), "llama", num_hidden_layers=2,
                           hidden_size=64)


@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_tokens_are_the_same_with_and_without_the_screen(tied_dir, ahead, monkeypatch):
    """Greedy decoding through the engine (one-token steps, or decode-ahead windows in one C call) with the
    screened head, and with it turned off: the same tokens; the screened steps ran and read fewer panels than
    the head has."""
    runner = packed_runner(tied_dir)
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    on, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=6))
    step = runner.model._decode_step
    calls, panels = step.screened_calls, step.screened_panels
    n_panels = -(-step.args.V // 16)
    assert calls >= 3 and panels < calls * n_panels
    monkeypatch.setattr(decode_step.DecodeStep, "_set_screened", lambda self, on: _unscreened(self))
    off, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=6))
    assert on == off and step.screened_calls == calls


def _unscreened(step) -> bool:
    step.args.screen, step.args.screen_c = decode_step._Proj(), None
    return False


def test_sampled_steps_read_the_head_itself(tied_dir):
    runner = packed_runner(tied_dir)
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=1, ignore_eos=True)
    _engine_tokens(runner, False, params, prompts(2, seed=1))
    assert runner.model._decode_step.screened_calls == 0

