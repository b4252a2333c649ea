"""The sampler's race noise in C (kernels/csrc/race_noise.c, ``cpu_norm.race_log_noise``): log E, E ~ Exp(1),
one row per 64-bit key. Equal bit for bit in every build this CPU can run (its own, the AVX2 one, the portable
loops), close to numpy's float64 of the same bits, and distributed as it must be: E against Exp(1)
(Kolmogorov-Smirnov, both tails), rows and columns uncorrelated, and the race it feeds against the softmax
(chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_norm, native
from scheduler.request import SamplingParams
from worker.sampler import Sampler, seed_for

pytestmark = pytest.mark.skipif(cpu_norm.load() is None, reason="no C compiler: the numpy reference draws")

FLAGS = native.cpu_flags().split()
BUILDS = [pytest.param(({"INFERQ_NO_AVX512": 1}, "avx2" if "avx2" in FLAGS else "scalar"), id="avx2"),
          pytest.param(({"INFERQ_NO_AVX2": 1}, "scalar"), id="scalar")]
KEYS = [0, 1, 2, (1 << 64) - 1, 0xDEADBEEF12345678, seed_for(7, 3)]


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49_157])
@pytest.mark.parametrize("build", BUILDS)
def test_every_build_gives_the_same_bits(build, vocab):
    """Vector bodies, scalar tails (odd widths) and the threads' spans (several rows) give one set of values."""
    defines, expected = build
    other = cpu_norm.build(defines)
    assert other is not None and cpu_norm.path(other) == expected
    own = cpu_norm.race_log_noise(KEYS, vocab)
    assert torch.equal(cpu_norm.race_log_noise(KEYS, vocab, other), own)
    assert torch.equal(cpu_norm.race_log_noise(KEYS[2:3], vocab), own[2:3])  # a row alone: the same


def test_values_are_the_float64_logs_of_the_same_bits():
    got = cpu_norm.race_log_noise(KEYS, 49_152)
    want = cpu_norm.race_log_noise_reference(KEYS, 49_152)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def _ks_exponential(e: torch.Tensor) -> float:
    """The Kolmogorov-Smirnov distance between the sample and Exp(1)."""
    x = e.double().sort().values
    n = x.numel()
    cdf = -torch.expm1(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())


def test_noise_is_exponential_in_the_bulk_and_both_tails():
    """2^21 draws: KS distance under its 0.1% critical value (1.95 / sqrt(n)); the counts below 1e-4 and 1e-6
    (the draws that decide a race for unlikely tokens) and above 10 within 5 sigma of their Poisson means."""
    keys = [seed_for(11, i) for i in range(32)]
    e = cpu_norm.race_log_noise(keys, 1 << 16).double().exp().flatten()
    n = e.numel()
    assert _ks_exponential(e) < 1.95 / math.sqrt(n)
    for below in (1e-4, 1e-6):
        mean = n * -math.expm1(-below)
        assert abs(int((e < below).sum()) - mean) < 5 * math.sqrt(mean) + 1
    mean = n * math.exp(-10.0)
    assert abs(int((e > 10.0).sum()) - mean) < 5 * math.sqrt(mean) + 1


def test_rows_and_columns_are_uncorrelated():
    """Neighbouring keys (consecutive seeds' rows, or one key and the next) and neighbouring columns: Pearson
    correlations of the noise within 5 / sqrt(n) of zero, and no row a shifted copy of another."""
    vocab = 1 << 16
    rows = cpu_norm.race_log_noise([0, 1, seed_for(3, 0), seed_for(3, 1), seed_for(4, 0)], vocab).double()
    bound = 5 / math.sqrt(vocab)
    for a in range(rows.shape[0]):
        x = rows[a]
        assert abs(float(torch.corrcoef(torch.stack([x[1:], x[:-1]]))[0, 1])) < bound
        for b in range(a + 1, rows.shape[0]):
            assert abs(float(torch.corrcoef(rows[[a, b]])[0, 1])) < bound
            for shift in (1, 2, 16):
                assert not torch.equal(rows[a, shift:], rows[b, :-shift])


def test_race_over_this_noise_samples_the_softmax():
    """The sampler's race (seeded rows, index varying) picks token v with probability softmax(z / T)_v:
    chi-square over 20,000 draws, survival probability above 1e-3; and a seeded row's token is the same on
    a second sampler."""
    z = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0]])
    t, n = 0.8, 20_000
    sampler, again = Sampler("cpu", seed=0), Sampler("cpu", seed=1)
    params = [SamplingParams(temperature=t, seed=21)]
    counts = torch.zeros(z.shape[1])
    for i in range(n):
        token = sampler.sample(z, params, [i])[0]
        counts[token] += 1
        if i < 50:
            assert again.sample(z, params, [i])[0] == token
    expected = torch.softmax(z[0] / t, 0) * n
    keep = expected >= 5  # chi-square's expected counts; the rest (if any) pooled
    if not keep.all():
        counts = torch.cat([counts[keep], counts[~keep].sum()[None]])
        expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    observed = counts
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    assert float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64))) > 1e-3
