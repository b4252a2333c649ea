"""The screened LM head (kernels/head_screen.py, csrc/decode_step.c ``screen_head``): a greedy step reads a
float32 head's bfloat16 copy (a bfloat16 head's int8 one) and recomputes from the head only the panels that
could hold a row's maximum, so the argmax is the full head's, bit for bit. Checked against the full head on
adversarial heads (a column whose rounded copy ranks above the true best), and end to end: the same tokens
with and without it."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_step, head_screen, packed_gemm, quant
from scheduler.request import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.unit.test_decode_step import _decode_panels, _engine_tokens, packed_runner, prompts
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="the fused step's library does not build here")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-screen"), "llama", num_hidden_layers=2,
                           tie_word_embeddings=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_holds_for_every_column(dtype):
    """|x . screen_i - x . W_i| <= |x|_2 c_i in exact (float64) arithmetic, with room left for the float32
    products' own rounding, for rows of every scale; c is per column, length n (not the padded panels)."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(70, 96, generator=gen) * torch.logspace(-3, 1, 70)[:, None]).to(dtype)
    panels = packed_gemm.pack(w)
    screen = head_screen.head_screen(panels, 70)
    assert screen.bounds.shape == (70,) and screen.weight.shape == panels.shape
    assert screen.weight.dtype == torch.int8 and screen.scales.dtype == torch.float32
    values = screen.weight.double() * screen.scales.double().view(-1, 1, 16)
    rows = values.transpose(1, 2).reshape(-1, 96)[:70]
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(8, 96, generator=gen, dtype=torch.float64) * scale
        err = (x @ rows.T - x @ w.double().T).abs()
        assert (err <= x.norm(dim=1, keepdim=True) * screen.bounds.double() * 0.99).all()
    assert head_screen.head_screen(panels, 70) is screen  # cached per panels tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_heads_screen_is_in_huge_pages(dtype, monkeypatch):
    """The screen is read whole at every greedy step, so a head's worth of it lives in huge pages as the weights
    do: its int8 codes carved from the quantised panels' arena, for a float32 head as for a bfloat16 one."""
    from kernels import hugepages, quant_panels

    arena = hugepages.Arena()
    monkeypatch.setattr(quant_panels, "_arena", arena)
    w = torch.randn(4000, 576, generator=torch.Generator().manual_seed(9)).to(dtype)  # 4.6-9.2 MB of panels
    screen = head_screen.head_screen(packed_gemm.pack(w), 4000)
    assert screen.weight.untyped_storage().data_ptr() == arena._chunk.untyped_storage().data_ptr()


def _head_only_step(path, weight: torch.Tensor):
    """The fused step of a tiny model with no layers run (L = 0: the rows go straight to the final norm) and
    ``weight`` [n, H] (float32 or bfloat16) as its head, screened."""
    runner = packed_runner(path)
    model = runner.model
    model.norm.data.fill_(1.0)  # the head's rows are x / rms(x)
    step = decode_step.DecodeStep.for_model(model, runner.kv_caches)
    assert step is not None and step.screen is not None
    pk = packed_gemm.pack(weight)
    screen = head_screen.head_screen(pk, weight.shape[0])
    half = weight.dtype == torch.bfloat16
    step.args.L, step.args.V = 0, weight.shape[0]
    step.args.head = decode_step._Proj(pk.data_ptr(), None, None, decode_step.W_BF16 if half else decode_step.W_F32, 0)
    step.screen = (decode_step._Proj(screen.weight.data_ptr(), None, screen.scales.data_ptr(), decode_step.W_I8, 0),
                   screen)
    step._keep.append(pk)  # the C side reads the head's panels: alive as long as the step
    return step, (pk, screen)


def _logits(step, x: torch.Tensor, screened: bool) -> torch.Tensor:
    plan = (torch.zeros(1, dtype=torch.int64), (0, torch.zeros((1, 1), dtype=torch.int32),
                                                 torch.zeros(1, dtype=torch.int32), 0), decode_step._NO_CHUNKS)
    logits = torch.empty((x.shape[0], step.args.V), dtype=torch.float32)
    step.call(x.clone(), torch.zeros((x.shape[0], 1, 2)), plan, None, logits, screened=screened)
    return logits


def _adversarial_head(hidden: int, x: torch.Tensor) -> torch.Tensor:
    """A head [64, hidden] whose best column for the row x (normed) is 40, though its bfloat16 rounding (and
    its int8 screen: the test checks) ranks 5 above it: 5 is exact in bfloat16 (g, a grid point, moved up a step on a third of the inputs), 40 is g moved
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
    """The int8 screen alone would pick column 5, above the true best 40; the screened head keeps 40 a
    candidate by its bound, recomputes the candidates' panels from float32 and picks
    40, as the full head does, with 41's exact tie left behind 40; only candidate panels are recomputed."""
    hidden = 64
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(9))
    step, (pk, screen) = _head_only_step(tiny_dirs_llama, _adversarial_head(hidden, x))
    if isa == "avx2":  # the AVX2 build's tiles (on an AVX-512 machine a different kernel), both products
        step.lib = decode_step.build({"INFERQ_NO_AVX512": 1})
    full = _logits(step, x, screened=False)
    before = step.screened_panels
    screened = _logits(step, x, screened=True)
    h = x / x.pow(2).mean(dim=1, keepdim=True).add(1e-6).sqrt()
    values = screen.weight.float() * screen.scales.view(-1, 1, 16)
    rounded_only = h @ values.transpose(1, 2).reshape(-1, hidden)[:64].T
    assert int(rounded_only.argmax()) == 5  # the screen alone is wrong here
    assert int(full.argmax()) == 40 and int(screened.argmax()) == 40
    assert full[0, 40] == full[0, 41] and screened[0, 40] == full[0, 40]  # exact, and the tie kept
    assert 0 < step.screened_panels - before < 4


def _int8_reordered_head(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 head of near-copies of one column (each off it by a fraction of an int8 step; the last 32
    columns small) and a row x
    whose best column by the head differs from its best by the int8 screen (seeds tried until one does)."""
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(hidden, generator=gen)
        step = base.abs().max() / 127
        w = base + 0.4 * step * torch.randn(64, hidden, generator=gen)
        w[32:] = 0.01 * torch.randn(32, hidden, generator=gen)  # two panels far below: never candidates
        w = w.bfloat16()
        x = torch.randn(1, hidden, generator=gen)
        h = (x / x.pow(2).mean().sqrt()).double()
        q = quant.quantize(w.float(), "int8")
        screened = h @ (q.codes.double() * q.scale.double()[:, None]).T
        if int(screened.argmax()) != int((h @ w.double().T).argmax()):
            return w, x
    raise AssertionError("no seed reorders the columns")


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_a_bfloat16_heads_int8_screen_gives_its_argmax(tiny_dirs_llama, isa):
    """A bfloat16 head is screened by int8 codes: where they rank another column first, the screened step
    still gives the head's own argmax (its float32-arithmetic logits'), recomputing some panels, not all."""
    w, x = _int8_reordered_head(64)
    step, _ = _head_only_step(tiny_dirs_llama, w)
    if isa == "avx2":
        step.lib = decode_step.build({"INFERQ_NO_AVX512": 1})
    full = _logits(step, x, screened=False)
    before = step.screened_panels
    screened = _logits(step, x, screened=True)
    assert int(screened.argmax()) == int(full.argmax())
    assert screened[0, int(full.argmax())] == full.max()
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


def _runner(path, dtype: str):
    """Every projection and the head in panels for the decode bucket: float32, or bfloat16 weights (computed
    in bfloat16 where the CPU multiplies it natively, else in float32; the fused step computes in float32)."""
    if dtype == "float32":
        return packed_runner(path)
    runner = ModelRunner(path, block_size=4, device="cpu", kv_cache_bytes=1 << 20, dtype="bfloat16")
    model = runner.model
    for lin in [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]:
        _decode_panels(lin)
    _decode_panels(model.lm_head)
    model.use_decode_step(True)
    return runner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_tokens_are_the_same_with_and_without_the_screen(tied_dir, dtype, ahead, monkeypatch):
    """Greedy decoding through the engine (one-token steps, or decode-ahead windows in one C call) with the
    screened head, and with it turned off: the same tokens; the screened steps ran and read fewer panels than
    the head has."""
    runner = _runner(tied_dir, dtype)
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    on, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=6))
    step = runner.model._decode_step
    assert step.screen[1].weight.dtype == torch.int8
    calls, panels = step.screened_calls, step.screened_panels
    n_panels = -(-step.args.V // 16)
    assert calls >= 3 and panels < calls * n_panels
    monkeypatch.setattr(decode_step.DecodeStep, "_set_screened", lambda self, on: _unscreened(self))
    off, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=6))
    assert on == off and step.screened_calls == calls


def _unscreened(step) -> bool:
    step.args.screen, step.args.screen_c = decode_step._Proj(), None
    return False


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
                                    SamplingParams(max_tokens=9, temperature=0.01, top_k=5, seed=1, ignore_eos=True)])
def test_steps_sampled_with_top_p_or_top_k_at_a_tiny_temperature_read_the_head_itself(tied_dir, params):
    runner = packed_runner(tied_dir)
    _engine_tokens(runner, False, params, prompts(2, seed=1))
    assert runner.model._decode_step.screened_calls == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize(("top_k", "temperature"), [(0, 1.0), (6, 1.0), (0, 0.01)])
def test_seeded_sampled_tokens_are_the_same_with_and_without_the_screen(tied_dir, dtype, ahead, top_k, temperature,
                                                                        monkeypatch):
    """Rows sampled by temperature alone draw their race noise before the step and screen the head for the
    argmax of logits + offsets, a top-k row for its k largest logits: with seeds, the very tokens of the
    unscreened head (one-token steps, and decode-ahead windows: in one C call for a row with no cut, stepping
    in Python for a top-k row); fewer panels read than the head has."""
    runner = _runner(tied_dir, dtype)
    params = SamplingParams(max_tokens=33, temperature=temperature, top_k=top_k, seed=4, ignore_eos=True)
    on, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=7))
    step = runner.model._decode_step
    calls, panels, steps = step.screened_calls, step.screened_panels, step.steps
    assert (step.c_windows >= 3) == (ahead and not top_k)
    assert calls >= (3 if ahead and not top_k else 3 * 32) and panels < steps * -(-step.args.V // 16)
    monkeypatch.setattr(decode_step.DecodeStep, "_set_screened", lambda self, on: _unscreened(self))
    off, _ = _engine_tokens(runner, ahead, params, prompts(3, seed=7))
    assert on == off and step.screened_calls == calls
    assert temperature < 0.1 or len({t for row in on for t in row}) > 10  # sampled, not a greedy walk


def _race_winners(step, x: torch.Tensor, temperature: float, draws: int, seed: int):
    """For ``draws`` Exp(1) noise rows q: the exponential race's winner (argmax fl(z + n), n = -t log q, the
    sampler's arithmetic for a row with no cut) from the full head's logits z and from the screened step given
    the offsets n; with the exact logits and the screened values at each screened winner."""
    gen = torch.Generator().manual_seed(seed)
    full = _logits(step, x, screened=False)
    out = []
    for _ in range(draws):
        log_q = torch.empty(full.shape).exponential_(generator=gen).clamp_min_(1e-30).log()
        offsets = (log_q * -temperature).contiguous()
        screened = _logits(step, x, screened=head_screen.ScreenRows(offsets))
        want = int((full + offsets).argmax())
        got = int((screened + offsets).argmax())
        out.append((want, got, float(full[0, got]), float(screened[0, got])))
    return out


def _near_equal_step(path, head: str, isa: str):
    """A head-only step (and its row x) whose best columns are near-equal, over several panels: float32, 48
    columns along the row, logits about 32 spread by 0.6 against bounds of about 0.06; bfloat16, the int8
    screen's reordered near-copies. ``isa`` "avx2": that build's tiles."""
    hidden = 64
    if head == "float32":
        gen = torch.Generator().manual_seed(9)
        x = torch.randn(1, hidden, generator=gen)
        w = torch.randn(64, hidden, generator=gen) * 0.01
        w[:48] += (x[0] / x[0].norm() * 4) * (1 + 0.02 * torch.rand(48, 1, generator=gen))
    else:
        w, x = _int8_reordered_head(hidden)
    step, _ = _head_only_step(path, w)
    if isa == "avx2":
        step.lib = decode_step.build({"INFERQ_NO_AVX512": 1})
    return step, x


@pytest.mark.parametrize("isa", ["default", "avx2"])
@pytest.mark.parametrize("head", ["float32", "bfloat16"])
def test_the_screened_race_winner_is_the_full_heads(tiny_dirs_llama, isa, head):
    """Heads whose screened copy reorders near-equal columns, spread over several panels, so the noise decides
    the winner: for every draw and two temperatures the screened step's race winner is the full head's, its
    logit exact (its panel recomputed); winners land in more than one panel; not every panel is read."""
    step, x = _near_equal_step(tiny_dirs_llama, head, isa)
    before, winners = step.screened_panels, set()
    for t in (0.3, 1.0):
        for want, got, exact, value in _race_winners(step, x, t, 60, seed=int(t * 10)):
            assert got == want and value == exact
            winners.add(want)
    assert len({c // 16 for c in winners}) > 1
    assert step.screened_panels - before < 120 * 4


def test_the_screened_race_samples_the_softmax(tiny_dirs_llama):
    """Sampling through the screened step follows softmax(z / t) of the full head's logits (a chi-square test
    over the near-equal columns, unseeded noise: 4,000 draws, p > 0.001)."""
    w, x = _int8_reordered_head(64)
    step, _ = _head_only_step(tiny_dirs_llama, w)
    t = 0.7
    full = _logits(step, x, screened=False)[0].double()
    p = torch.softmax(full / t, 0)
    counts = torch.zeros(64)
    for _, got, _, _ in _race_winners(step, x, t, 4000, seed=11):
        counts[got] += 1
    keep = p * 4000 >= 5  # chi-square's expected counts; the rest pooled
    expected = torch.cat([p[keep] * 4000, (p[~keep] * 4000).sum().view(1)])
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)]).double()
    if expected[-1] < 5:  # too rare to test: leave the pool out (it must then be nearly empty)
        assert observed[-1] <= 5
        expected, observed = expected[:-1] * observed[:-1].sum() / expected[:-1].sum(), observed[:-1]
    assert int(keep.sum()) >= 10
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    assert float(torch.special.gammaincc(dof, stat / 2)) > 1e-3  # the chi-square survival function



@pytest.mark.parametrize("isa", ["default", "avx2"])
@pytest.mark.parametrize("head", ["float32", "bfloat16"])
def test_a_top_k_row_gets_its_k_largest_logits_exact(tiny_dirs_llama, isa, head):
    """A top-k row's screened logits hold its k largest exact logits (every other column below the k-th), so
    the sampler's cut keeps the same k columns with the same values and its race the same token; panels
    beyond the candidates' are not read (the float32 head's)."""
    from worker.sampler import Sampler

    step, x = _near_equal_step(tiny_dirs_llama, head, isa)
    full = _logits(step, x, screened=False)
    sampler = Sampler("cpu", seed=0)
    for k in (1, 3, 7, 20):
        params = [SamplingParams(temperature=0.9, top_k=k, seed=k)]
        before = step.screened_panels
        for i in range(20):
            race = sampler.race(params, [i], 64)
            assert race is not None and race.screen.top_k.tolist() == [k]
            screened = _logits(step, x, screened=race.screen)
            top = full[0].topk(k)
            assert torch.equal(screened[0, top.indices], top.values)  # the k largest, exact
            others = torch.ones(64, dtype=torch.bool)
            others[top.indices] = False
            assert (screened[0, others] < top.values[-1]).all()
            assert sampler.sample(screened, params, [i], race) == sampler.sample(full, params, [i])
        if head == "float32" and k < 20:  # (the int8 screen's bounds here are as wide as the columns' spread)
            assert step.screened_panels - before < 20 * 4
