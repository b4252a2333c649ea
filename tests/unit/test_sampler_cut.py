"""The sampler's top-k / top-p cut without a sort of the row (worker/sampler.py ``_kept``): the kept token set
against a float64 full-sort reference over peaked and flat rows (both of its ways, the 256 most likely tokens and
the buckets, checked to have run), and tokens sampled through it against the renormalised softmax (chi-square)."""

from __future__ import annotations

import pytest
import torch

from scheduler.request import SamplingParams
from worker import sampler as sampler_module
from worker.sampler import Sampler


def _reference(z: torch.Tensor, top_k: int, top_p: float) -> tuple[set[int], float]:
    """The cut by one float64 sort: the kept ids, and how close the prefix's boundary mass came to top_p
    (where a float32 running sum may round to the other side)."""
    order = z.double().argsort(descending=True, stable=True)
    if top_k:
        order = order[:top_k]
    probs = z.double()[order].softmax(0)
    before = probs.cumsum(0) - probs
    keep = before < top_p
    keep[0] = True
    return set(order[keep].tolist()), float((before - top_p).abs().min())


def _rows():
    g = torch.Generator().manual_seed(3)
    for vocab in (10, 1_000, 49_152):
        for scale in (0.3, 1.0, 3.0, 8.0):
            z = torch.randn(vocab, generator=g) * scale
            yield z
            peaked = z.clone()
            peaked[torch.randint(0, vocab, (4,), generator=g)] += 12.0  # a few tokens hold most of the mass
            yield peaked
        plateau = torch.randn(vocab, generator=g) * 0.1
        plateau[:300] += 10.0  # a prefix just longer than the 256 most likely tokens
        yield plateau


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (0, 0.9), (0, 0.95), (0, 0.999), (40, 0.9), (5, 1.0),
                                         (300, 0.8)])
def test_kept_set_is_the_full_sorts(monkeypatch, top_k, top_p):
    calls = {"buckets": 0}
    by_buckets = sampler_module._nucleus_by_buckets

    def counted(*args):
        calls["buckets"] += 1
        return by_buckets(*args)

    monkeypatch.setattr(sampler_module, "_nucleus_by_buckets", counted)
    checked = 0
    for z in _rows():
        k = top_k if top_k < z.shape[0] else 0
        want, margin = _reference(z, k, top_p)
        if margin < 1e-5:  # the float32 masses may fall either side: either set is the cut
            continue
        got = sampler_module._kept(z, k, top_p)
        got = (got.nonzero().squeeze(1) if got.dtype == torch.bool else got).tolist()
        assert len(got) == len(set(got)) and set(got) == want, (z.shape, k, top_p)
        checked += 1
    assert checked >= 10  # of 27 rows
    if not top_k and top_p < 1.0:  # flat rows take the buckets, peaked ones end among the 256 most likely
        assert calls["buckets"] > 0
        assert calls["buckets"] < checked or top_p > 0.99


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    n = float(counts.sum())
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64))) > 1e-3


@pytest.mark.parametrize("vocab,top_k,top_p", [(12, 0, 0.8), (2_000, 0, 0.9), (2_000, 6, 0.95)])
def test_cut_samples_the_renormalised_softmax(vocab, top_k, top_p):
    """Seeded rows with the output index varying: every token drawn is kept by the cut, and their frequencies
    follow softmax(z / T) over the kept tokens (chi-square, survival above 1e-3)."""
    g = torch.Generator().manual_seed(vocab + top_k)
    logits = torch.randn(1, vocab, generator=g)
    logits[0, :8] += torch.linspace(6.0, 3.0, 8)  # eight likely tokens, then a long flat tail
    t = 0.9
    kept, _ = _reference(logits[0] / t, top_k, top_p)
    ids = torch.tensor(sorted(kept))
    probs = (logits[0, ids] / t).double().softmax(0)
    assert len(ids) >= 3
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p, seed=5)]
    counts = torch.zeros(len(ids), dtype=torch.float64)
    position = {int(v): i for i, v in enumerate(ids)}
    for i in range(6_000):
        token = sampler.sample(logits, params, [i])[0]
        assert token in position
        counts[position[token]] += 1
    big = probs * 6_000 >= 5  # chi-square's expected counts; the rest pooled
    if not big.all():
        counts = torch.cat([counts[big], counts[~big].sum()[None]])
        probs = torch.cat([probs[big], probs[~big].sum()[None]])
    assert _chi_square_ok(counts, probs)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30])
@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (5, 1.0), (5, 0.5)])
def test_a_temperature_whose_logits_overflow_takes_the_greedy_token(temperature, top_k, top_p):
    """A positive temperature so small that logits / T overflow float32 (or round to 0: the API accepts any
    T > 0) samples its limit, the argmax, with a cut as without one; masked (-inf) logits go with the rest."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=g)
    logits[1, 10:200] = float("-inf")
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 3
    assert sampler.sample(logits, params, [0, 1, 2]) == logits.argmax(dim=1).tolist()
    masked = sampler.sample(logits[1:2], [SamplingParams(temperature=1.0, top_p=0.9)], [0])[0]
    assert not 10 <= masked < 200
