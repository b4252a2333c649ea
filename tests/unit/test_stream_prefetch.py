"""The decode tiles' prefetch distance (kernels/stream_prefetch.py, packed_gemm.c's table): no distance changes a
product, every built library takes the chosen distances, and the choice is measured once per machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import packed_gemm, plan_cache, stream_prefetch

needs_packed = pytest.mark.skipif(not packed_gemm.available(), reason="the packed GEMM needs AVX2 + FMA")


def _builds():
    """The library as built here, and its AVX2 build where this CPU also has AVX-512 (what an AVX2-only CPU
    runs; its tiles are at most 6 rows, so more rows leave the one-tile path)."""
    libs = [packed_gemm._load()]
    if libs[0].gemm_has_avx512():
        libs.append(packed_gemm.build({"INFERQ_NO_AVX512": 1}))
    return libs


def _tables_of(lib) -> list[list[int]]:
    return [[lib.get_prefetch_ahead(bf16, r) for r in range(stream_prefetch.MAX_ROWS + 1)] for bf16 in (0, 1)]


def _set_tables(lib, tables: list[list[int]]) -> None:
    for bf16, table in enumerate(tables):
        for rows, ahead in enumerate(table):
            lib.set_prefetch_ahead(bf16, rows, ahead)


def _sets_of(lib) -> list[list[int]]:
    return [[lib.get_k_sets(bf16, r) for r in stream_prefetch.SETS_ROWS] for bf16 in (0, 1)]


def _set_sets(lib, sets: list[list[int]] | None) -> None:
    """Each panel element's accumulator sets by row count; None: the most the build takes (its default)."""
    for bf16 in (0, 1):
        for i, rows in enumerate(stream_prefetch.SETS_ROWS):
            lib.set_k_sets(bf16, rows, lib.max_k_sets(rows) if sets is None else sets[bf16][i])


@pytest.fixture
def fresh(monkeypatch):
    """No distances or sets chosen yet in this process and every library's tables at their defaults (a model
    loaded by an earlier test may have set them), no libraries registered but the ones the test registers;
    afterwards every library's tables as they were."""
    libs = [*_builds(), *stream_prefetch._libs] if packed_gemm.available() else []
    saved = [(_tables_of(lib), _sets_of(lib)) for lib in libs]
    defaults = [[stream_prefetch.DEFAULT] * (stream_prefetch.MAX_ROWS + 1)] * 2
    for lib in libs:
        _set_tables(lib, defaults)
        _set_sets(lib, None)
    monkeypatch.setattr(stream_prefetch, "_tables", {})
    monkeypatch.setattr(stream_prefetch, "_sets", {})
    monkeypatch.setattr(stream_prefetch, "_libs", [])
    yield
    for lib in stream_prefetch._libs:  # built by the test (or the tuner tests' stand-ins: no sets)
        _set_tables(lib, defaults)
        if hasattr(lib, "set_k_sets"):
            _set_sets(lib, None)
    for lib, (tables, sets) in zip(libs, saved, strict=True):
        _set_tables(lib, tables)
        _set_sets(lib, sets)


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_distance_changes_a_product(dtype, fresh):
    """A prefetch is a hint: with none, one line, the default or a megabyte ahead (past the weight's end: a
    prefetch does not fault) every decode-sized product is the same bits, on every path this CPU runs."""
    g = torch.Generator().manual_seed(3)
    for lib in _builds():
        fn = lib.gemm if dtype == torch.float32 else lib.gemm_bf16
        for m, n, k in [(1, 40, 37), (2, 48, 576), (4, 33, 64), (8, 100, 29), (12, 64, 130)]:
            w = torch.randn(n, k, generator=g).to(dtype)
            x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
            packed = packed_gemm.pack(w)
            outs = []
            for ahead in (0, 64, 4096, 1 << 20):
                lib.set_prefetch_ahead(int(dtype == torch.bfloat16), m, ahead)
                y = torch.empty(m, n)
                fn(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, n, k, 0)
                outs.append(y)
            torch.testing.assert_close(outs[0], F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)
            for y in outs[1:]:
                assert torch.equal(y, outs[0])


@needs_packed
def test_the_table_takes_what_it_is_given_and_no_more(fresh):
    lib = packed_gemm._load()
    lib.set_prefetch_ahead(1, 3, 8192)
    assert lib.get_prefetch_ahead(1, 3) == 8192 and lib.get_prefetch_ahead(0, 3) == stream_prefetch.DEFAULT
    lib.set_prefetch_ahead(1, 3, -5)  # ignored
    lib.set_prefetch_ahead(0, stream_prefetch.MAX_ROWS + 1, 1)  # no such row count: ignored
    assert lib.get_prefetch_ahead(1, 3) == 8192
    assert lib.get_prefetch_ahead(0, stream_prefetch.MAX_ROWS + 1) == -1


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_accumulator_set_count_is_the_product(dtype, fresh):
    """One, two or four sets for tiles of 1-3 rows (as many as the build takes): each is the product to float32
    rounding, on every path this CPU runs; a count the build does not take, or a row count without sets, is
    ignored."""
    g = torch.Generator().manual_seed(5)
    bf16 = int(dtype == torch.bfloat16)
    for lib in _builds():
        fn = lib.gemm if dtype == torch.float32 else lib.gemm_bf16
        assert [lib.max_k_sets(r) for r in (0, 1, 2, 3, 4)] == [1, 4 if lib.gemm_has_avx512() else 2, 2, 2, 1]
        for m, n, k in [(1, 40, 37), (2, 48, 576), (3, 33, 130), (1, 100, 1536)]:
            w = torch.randn(n, k, generator=g).to(dtype)
            x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
            packed = packed_gemm.pack(w)
            for sets in stream_prefetch.SETS:
                lib.set_k_sets(bf16, m, sets)
                assert lib.get_k_sets(bf16, m) == min(sets, lib.max_k_sets(m))
                y = torch.empty(m, n)
                fn(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, n, k, 0)
                torch.testing.assert_close(y, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)
            lib.set_k_sets(bf16, m, 1)
            lib.set_k_sets(bf16, m, 3)  # no such count
            lib.set_k_sets(bf16, 4, 1)  # four rows have one set: nothing to set
            assert lib.get_k_sets(bf16, m) == 1 and lib.get_k_sets(bf16, 4) == 1
    no_split = packed_gemm.build({"INFERQ_NO_SPLIT_K": 1})
    no_split.set_k_sets(0, 1, 4)
    assert no_split.get_k_sets(0, 1) == 1 and no_split.max_k_sets(1) == 1


def test_the_probe_ring_is_past_the_last_level_cache(monkeypatch):
    """A pass must not find its panels cached by an earlier one: the ring is half again the L3 (in whole passes),
    and two passes where sysfs reports no cache."""
    monkeypatch.setattr(stream_prefetch, "l3_bytes", lambda: 480 << 20)
    ring = stream_prefetch._ring_bytes()
    assert ring >= 720 << 20 and ring % stream_prefetch.PROBE_BYTES == 0
    monkeypatch.setattr(stream_prefetch, "l3_bytes", lambda: 0)
    assert stream_prefetch._ring_bytes() == 2 * stream_prefetch.PROBE_BYTES


@needs_packed
def test_sets_are_chosen_only_where_a_plan_file_shares_them(fresh, tmp_path, monkeypatch):
    """Without a plan file every process keeps the kernels' sets (two measuring apart could round differently);
    with one, float32's are measured once, set in every library registered before and after (a build that takes
    fewer keeps its own), stored, and read back by a new process; bfloat16's are never measured."""
    monkeypatch.setattr(plan_cache, "_active", None)
    monkeypatch.setattr(stream_prefetch, "PROBE_BYTES", 4 << 20)
    monkeypatch.setattr(stream_prefetch, "ROUNDS", 2)
    monkeypatch.setattr(stream_prefetch, "l3_bytes", lambda: 0)  # a small ring: the choice is what is tested
    lib = packed_gemm._load()
    stream_prefetch.register(lib)
    stream_prefetch.ensure(torch.float32)
    assert stream_prefetch.chosen_sets() == {} and _sets_of(lib)[0] == [lib.max_k_sets(r) for r in (1, 2, 3)]
    measured = []
    real = stream_prefetch.measure_sets

    def counted(lib, bf16, rounds=2, one_pass=None):
        best = real(lib, bf16, rounds=rounds, one_pass=one_pass)
        assert set(best) == set(stream_prefetch.SETS_ROWS)
        assert all(c in stream_prefetch.SETS and c <= lib.max_k_sets(r) for r, c in best.items())
        measured.append(bf16)
        return {1: 1, 2: 1, 3: 2}  # one the defaults do not make, to see it arrive everywhere

    rings = []
    real_probe = stream_prefetch._probe

    def probe(lib, bf16):
        rings.append(bf16)
        return real_probe(lib, bf16)

    monkeypatch.setattr(stream_prefetch, "measure_sets", counted)
    monkeypatch.setattr(stream_prefetch, "_probe", probe)
    monkeypatch.setattr(stream_prefetch, "_tables", {})
    plan_cache.use(tmp_path)
    try:
        early = packed_gemm.build({"INFERQ_NO_SPLIT_K": 1})
        stream_prefetch.ensure(torch.float32)
        assert rings == [False]  # one ring for the sets and the distances
        stream_prefetch.ensure(torch.bfloat16)
        assert measured == [False] and stream_prefetch.chosen_sets() == {"float32": {1: 1, 2: 1, 3: 2}}
        late = packed_gemm.build({"INFERQ_NO_AVX512": 1})
        assert _sets_of(lib)[0] == [1, 1, 2] and _sets_of(late)[0] == [1, 1, 2]
        assert _sets_of(early)[0] == [1, 1, 1]
        assert _sets_of(lib)[1] == [lib.max_k_sets(r) for r in (1, 2, 3)]  # bfloat16's as built
        monkeypatch.setattr(stream_prefetch, "_tables", {})
        monkeypatch.setattr(stream_prefetch, "_sets", {})
        plan_cache.use(None)
        plan_cache.use(tmp_path)
        stream_prefetch.ensure(torch.float32)
        assert measured == [False] and stream_prefetch.chosen_sets() == {"float32": {1: 1, 2: 1, 3: 2}}
    finally:
        plan_cache.use(None)


def test_timed_row_counts_cover_every_row_count():
    """Each row count takes the distance of the nearest timed count at or above it; beyond them, the largest."""
    best = {1: 0, 2: 8192, 4: 2048, 8: 4096}
    table = stream_prefetch._table(best)
    assert len(table) == stream_prefetch.MAX_ROWS + 1
    assert table[:2] == [0, 0] and table[2] == 8192 and table[3:5] == [2048, 2048]
    assert table[5:9] == [4096] * 4 and table[12] == 4096


@needs_packed
def test_measured_once_then_read_from_the_plan_file(fresh, tmp_path, monkeypatch):
    """ensure() measures where this machine's plan file has no distances, stores them, sets them in every
    library registered before and after; a new process (nothing in memory) reads the file instead."""
    monkeypatch.setattr(plan_cache, "_active", None)
    monkeypatch.setattr(stream_prefetch, "PROBE_BYTES", 8 << 20)  # a quick, small measurement
    monkeypatch.setattr(stream_prefetch, "ROUNDS", 2)
    plan_cache.use(tmp_path)
    try:
        measured = []
        real = stream_prefetch.measure

        def counted(lib, bf16, rounds=2, one_pass=None):
            best = real(lib, bf16, rounds=rounds, one_pass=one_pass)
            measured.append(best)
            return {**best, 1: 16384}  # a choice the defaults do not make, to see it arrive everywhere

        monkeypatch.setattr(stream_prefetch, "measure", counted)
        stream_prefetch.register(packed_gemm._load())  # (built before this test's empty registry)
        early = packed_gemm.build({"INFERQ_NO_SPLIT_K": 1})  # registered before the choice (bind does it)
        table = stream_prefetch.ensure(torch.bfloat16)
        assert len(measured) == 1 and set(measured[0]) == set(stream_prefetch.PROBE_ROWS)
        assert all(v in stream_prefetch.CANDIDATES for v in measured[0].values())
        assert table[1] == 16384 and stream_prefetch.ensure(torch.bfloat16) is table and len(measured) == 1
        late = packed_gemm.build({"INFERQ_NO_AVX512": 1})
        for lib in (early, late, packed_gemm._load()):
            assert [lib.get_prefetch_ahead(1, r) for r in range(len(table))] == table
            assert lib.get_prefetch_ahead(0, 1) == stream_prefetch.DEFAULT  # float32's not chosen yet
        monkeypatch.setattr(stream_prefetch, "_tables", {})
        plan_cache.use(None)
        plan_cache.use(tmp_path)
        assert stream_prefetch.ensure(torch.bfloat16) == table and len(measured) == 1
        assert stream_prefetch.chosen() == {"bfloat16": table}
    finally:
        plan_cache.use(None)


class _FakeLib:
    """A library's prefetch table alone, with every value it was set to (the tuner's tests need no CPU kernel)."""

    def __init__(self, ahead: int) -> None:
        self.table = {(b, r): ahead for b in (0, 1) for r in range(stream_prefetch.MAX_ROWS + 1)}
        self.sets: list[tuple[int, int, int]] = []

    def set_prefetch_ahead(self, bf16, rows, ahead):
        self.sets.append((bf16, rows, ahead))
        self.table[(bf16, rows)] = ahead

    def get_prefetch_ahead(self, bf16, rows):
        return self.table[(bf16, rows)]


def _serve(tuner, lib, speed, steps: int, rows: int = 1, noise: float = 0.02, seed: int = 0) -> list[int]:
    """``steps`` steps through the tuner, each taking ``speed[distance in the library]`` seconds times a drift
    (the machine slowing by half over the run, a context growing) and noise; the distances the steps ran with."""
    g = torch.Generator().manual_seed(seed)
    ran = []
    for i in range(steps):
        ahead = tuner.choose(rows)
        assert ahead == lib.get_prefetch_ahead(1, rows)  # what the step runs with is what the library has
        drift = 1.0 + 0.5 * i / steps
        tuner.record(rows, speed[ahead] * drift * (1.0 + noise * float(torch.randn(1, generator=g))))
        ran.append(ahead)
    return ran


def test_online_tuner_adopts_a_faster_distance_and_keeps_it(fresh, tmp_path, monkeypatch):
    """Started from a distance 8% slower than no prefetch, on a machine that drifts and jitters 2% a step: the
    tuner adopts no prefetch (in every registered library, the plan file), trials cost one step in EVERY, and
    each trial's distance is taken back after its step."""
    monkeypatch.setattr(plan_cache, "_active", None)
    plan_cache.use(tmp_path)
    try:
        lib, other = _FakeLib(16384), _FakeLib(16384)
        stream_prefetch._libs.append(other)
        speed = {0: 0.0100, 2048: 0.0110, 4096: 0.0108, 8192: 0.0109, 16384: 0.0108}
        tuner = stream_prefetch.OnlineTuner(lib, True, 8)
        ran = _serve(tuner, lib, speed, 16 * 4 * tuner.WINDOW + 64)
        assert stream_prefetch.chosen()["bfloat16"][1] == 0
        assert other.get_prefetch_ahead(1, 1) == 0 and lib.get_prefetch_ahead(1, 1) == 0
        assert plan_cache.lookup("stream_prefetch", ("bfloat16", torch.get_num_threads()))[1] == 0
        assert tuner.trials <= len(ran) // tuner.EVERY + 1
        assert ran[-32:].count(0) >= 30  # kept: the others only as trials
        restored = [s for s in lib.sets if s[2] == 16384]
        assert restored, "a trial's distance was never taken back"
    finally:
        plan_cache.use(None)


def test_online_tuner_does_not_move_on_noise(fresh, tmp_path, monkeypatch):
    """Distances within 1% of each other under 3% noise per step: nothing is adopted over a long run, the
    trials come SETTLED times rarer once every challenger has had a block judged, and a row count the tuner does not
    cover (0: a step with chunks; beyond its rows) is neither set nor timed."""
    monkeypatch.setattr(plan_cache, "_active", None)
    plan_cache.use(tmp_path)
    try:
        lib = _FakeLib(4096)
        speed = {0: 0.0101, 2048: 0.0100, 4096: 0.0100, 8192: 0.0099, 16384: 0.0100}
        tuner = stream_prefetch.OnlineTuner(lib, True, 8)
        ran = _serve(tuner, lib, speed, 3000, noise=0.03, seed=5)
        assert stream_prefetch.chosen() == {} and lib.get_prefetch_ahead(1, 1) == 4096
        filling = tuner.EVERY * (len(stream_prefetch.CANDIDATES) - 1) * tuner.WINDOW  # steps until every block is judged
        settled = (3000 - filling) // (tuner.EVERY * tuner.SETTLED)
        assert filling // tuner.EVERY + settled - 2 <= tuner.trials <= filling // tuner.EVERY + settled + 2
        assert ran.count(4096) == 3000 - tuner.trials
        sets = len(lib.sets)
        assert tuner.choose(0) is None and tuner.choose(9) is None and len(lib.sets) == sets
    finally:
        plan_cache.use(None)
