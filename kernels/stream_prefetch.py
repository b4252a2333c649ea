"""How far ahead a decode-sized packed product prefetches its weight's stream, measured once per machine.

Why: at one to a few rows a product reads each weight line once and does little arithmetic per line, so its
speed is set by how many lines are in flight: the software prefetch in ``csrc/packed_gemm.c`` asks for the line
a fixed distance ahead. The right distance is the rate one core consumes the weight times the memory latency,
both facts about the machine (and, on a VM, its neighbours): 4 KB, tuned by Little's law on an early machine,
held one bfloat16 row's stream to 0.8 of its speed on a Zen 4 VM, where the hardware's streamer alone did
best, while four and eight rows (the arithmetic pacing the stream) ran 1.35-1.6x slower with no software
prefetch. So the distance per panel element width and row count is timed here, side by side, when a model
first needs it, and kept in this machine's plan file (:mod:`kernels.plan_cache`). A prefetch is only a hint:
no distance changes a result.

Every library built from ``packed_gemm.c`` (the packed GEMM's own and the fused decode step's) has the table;
:func:`register` applies the chosen distances to a library when it is built, and :func:`ensure` measures (or
reads) them and applies them to every library registered so far. A measurement is a snapshot of a machine
whose memory behaviour changes within minutes, so :class:`OnlineTuner` keeps checking it while the fused
decode step runs, and :func:`adopt` takes what it finds.

The same pass picks how many accumulator sets a float32 tile of one to three rows splits k over
(packed_gemm.c's ``k_sets``: 1, 2 or 4), timed before the distances, which then run with it. Several sets keep
one FMA chain's latency from pacing the stream; on a Xeon with AMX one set streamed float32 faster (the fused
step 1.17x, this probe agreeing). bfloat16 panels keep the kernels' sets: there this probe and the fused step
disagreed (one set 1.05-1.1x faster here, 0.93-0.96x there), and a choice the probe cannot judge is not made.
The count changes the sums' rounding, so it is only chosen where a plan file shares it with every process on
the machine (without one, processes measuring apart could round differently: they keep the default), is
applied to every library alike, and is never re-tuned while serving.

The probe reads from memory, not from the last-level cache: its passes walk a ring of panels larger than this
CPU's L3 (sysfs says how large; one Xeon here had 480 MiB, which held the old 96 MB probe whole, so every
distance was judged on cache reads at 50 GB/s, not the 30 GB/s a model's step streams at).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import hugepages, plan_cache

CANDIDATES = (0, 2048, 4096, 8192, 16384)  # bytes ahead (0: none); 4096 is the kernels' default
DEFAULT = 4096
PROBE_ROWS = (1, 2, 4, 8)  # row counts timed; the others take the nearest timed one at or above them
MAX_ROWS = 12  # packed_gemm.c's AHEAD_ROWS
PROBE_BYTES = 96 << 20  # the weights one timing pass reads (the ring they are read from: _ring_bytes)
ROUNDS = 12
MARGIN = 0.01  # a distance replaces the default only where it is this much faster (medians of paired ratios)
SETS_ROWS = (1, 2, 3)  # the row counts whose tiles may split k (packed_gemm.c's k_sets)
SETS = (1, 2, 4)  # accumulator sets a tile may take (at most the build's max_k_sets)

log = logging.getLogger(__name__)
_lock = threading.Lock()
_libs: list[ctypes.CDLL] = []
_tables: dict[bool, list[int]] = {}  # bf16 -> bytes ahead for rows 0..MAX_ROWS
_sets: dict[bool, dict[int, int]] = {}  # bf16 -> accumulator sets by row count in SETS_ROWS


def bind(lib: ctypes.CDLL) -> None:
    """Declare the tables' setters and getters on a library built from packed_gemm.c."""
    lib.set_prefetch_ahead.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.get_prefetch_ahead.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.get_prefetch_ahead.restype = ctypes.c_int64
    lib.set_k_sets.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.get_k_sets.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.get_k_sets.restype = ctypes.c_int
    lib.max_k_sets.argtypes = [ctypes.c_int]
    lib.max_k_sets.restype = ctypes.c_int


def register(lib: ctypes.CDLL) -> None:
    """Give ``lib`` the distances chosen so far, and every later choice."""
    bind(lib)
    with _lock:
        _libs.append(lib)
        for bf16, sets in _sets.items():
            _apply_sets(lib, bf16, sets)
        for bf16, table in _tables.items():
            _apply(lib, bf16, table)


def ensure(dtype: torch.dtype) -> list[int] | None:
    """The distances for ``dtype``'s panels (float32 or bfloat16) at the current thread count: read from this
    machine's plan file or measured now, then set in every registered library (once per process). None where
    the packed GEMM does not run here."""
    from kernels import packed_gemm

    lib = packed_gemm._load()
    if lib is None or dtype not in packed_gemm.DTYPES:
        return None
    bf16 = dtype == torch.bfloat16
    key = (str(dtype).removeprefix("torch."), torch.get_num_threads())
    with _lock:
        if bf16 in _tables:
            return _tables[bf16]
        probe = functools.cache(functools.partial(_probe, lib, bf16))  # one ring for both measurements
        sets = _sets_from_plan(plan_cache.lookup("k_sets", key), lib)
        if sets is None and not bf16 and plan_cache.active():
            sets = measure_sets(lib, bf16, one_pass=probe())
            plan_cache.store("k_sets", key, [sets[r] for r in SETS_ROWS])
            log.info("decode tiles' accumulator sets measured for %s panels: %s by rows", key[0], sets)
        if sets is not None:
            _sets[bf16] = sets
            for each in {id(x): x for x in (*_libs, lib)}.values():  # before the distances are timed
                _apply_sets(each, bf16, sets)
        table = plan_cache.lookup("stream_prefetch", key)
        if not _valid(table):
            table = _table(measure(lib, bf16, one_pass=probe()))
            plan_cache.store("stream_prefetch", key, table)
            log.info("decode tiles' prefetch distance measured for %s panels: %s bytes ahead by rows", key[0],
                     table)
        _tables[bf16] = table
        for each in _libs:
            _apply(each, bf16, table)
    return table


def adopt(bf16: bool, rows: int, ahead: int) -> None:
    """Make ``ahead`` the distance for ``rows`` rows of ``bf16`` panels: in every registered library, this
    process's table and this machine's plan file (so the next process starts from it)."""
    with _lock:
        table = list(_tables.get(bf16) or [DEFAULT] * (MAX_ROWS + 1))
        table[rows] = ahead
        _tables[bf16] = table
        for each in _libs:
            each.set_prefetch_ahead(int(bf16), rows, ahead)
        key = ("bfloat16" if bf16 else "float32", torch.get_num_threads())
        plan_cache.store("stream_prefetch", key, table)
    log.info("decode tiles' prefetch distance changed while serving: %s panels, %d rows, %d bytes ahead",
             key[0], rows, ahead)


def _valid(kept) -> bool:
    return isinstance(kept, list) and len(kept) == MAX_ROWS + 1 and all(isinstance(b, int) and b >= 0 for b in kept)


def _apply(lib: ctypes.CDLL, bf16: bool, table: list[int]) -> None:
    for rows, ahead in enumerate(table):
        lib.set_prefetch_ahead(int(bf16), rows, ahead)


def _apply_sets(lib: ctypes.CDLL, bf16: bool, sets: dict[int, int]) -> None:
    for rows, count in sets.items():  # (a build that takes fewer, e.g. INFERQ_NO_SPLIT_K, keeps its own)
        lib.set_k_sets(int(bf16), rows, count)


def _sets_from_plan(kept, lib: ctypes.CDLL) -> dict[int, int] | None:
    """The sets a plan file holds ([count for rows in SETS_ROWS]), where each is one this build takes."""
    if not (isinstance(kept, list) and len(kept) == len(SETS_ROWS)):
        return None
    sets = dict(zip(SETS_ROWS, kept, strict=True))
    if not all(isinstance(c, int) and c in SETS and c <= lib.max_k_sets(r) for r, c in sets.items()):
        return None
    return sets


def _table(best: dict[int, int]) -> list[int]:
    """Bytes ahead for rows 0..MAX_ROWS from the timed row counts: each takes the nearest timed count at or
    above it (the largest beyond them)."""
    table = []
    for rows in range(MAX_ROWS + 1):
        timed = [m for m in PROBE_ROWS if m >= rows] or [PROBE_ROWS[-1]]
        table.append(best[timed[0]])
    return table


def l3_bytes() -> int:
    """The largest CPU cache sysfs reports (the last level), 0 where it reports none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def _ring_bytes() -> int:
    """The panels a probe's passes walk: at least two passes, and half as much again as the L3, so a pass never
    finds the panels it reads still cached from an earlier one."""
    return max(2 * PROBE_BYTES, (l3_bytes() * 3 // 2 + PROBE_BYTES - 1) // PROBE_BYTES * PROBE_BYTES)


def _probe(lib: ctypes.CDLL, bf16: bool):
    """A function running one timing pass (PROBE_BYTES of [2048, 1024] panels in huge pages, the next stretch of
    a ring past the L3 each call) at ``rows`` rows: seconds taken."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    n, k = 2048, 1024
    one = n * k * (2 if bf16 else 4)
    per_pass = max(1, PROBE_BYTES // one)
    panels = hugepages.zeros((max(1, _ring_bytes() // one), n // 16, k, 16), dtype)
    panels.fill_(0.5)
    x = torch.full((max(PROBE_ROWS), k), 0.25)
    y = torch.empty(max(PROBE_ROWS), n)
    product = lib.gemm_bf16 if bf16 else lib.gemm
    at = [0]

    def one_pass(rows: int) -> float:
        first = at[0] if at[0] + per_pass <= len(panels) else 0
        at[0] = first + per_pass
        t0 = time.perf_counter()
        for w in panels[first:first + per_pass]:
            product(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, rows, n, k, 0)
        return time.perf_counter() - t0

    return one_pass


def _fastest(timed, candidates: tuple[int, ...], default: int, rounds: int) -> int:
    """The candidate whose passes (``timed(candidate)``: seconds) take the least time against the default's in
    the same round (the order rotated each round), by the median ratio; the default unless that is MARGIN
    faster."""
    timed(default)  # warm
    ratios: dict[int, list[float]] = {c: [] for c in candidates}
    for r in range(rounds):
        order = candidates[r % len(candidates):] + candidates[:r % len(candidates)]
        times = {c: timed(c) for c in order}
        for c in candidates:
            ratios[c].append(times[c] / times[default])
    medians = {c: statistics.median(v) for c, v in ratios.items()}
    fastest = min(medians, key=medians.get)
    return fastest if medians[fastest] < 1.0 - MARGIN else default


def measure(lib: ctypes.CDLL, bf16: bool, rounds: int = ROUNDS, one_pass=None) -> dict[int, int]:
    """The best distance per row count in PROBE_ROWS: each candidate's pass over PROBE_BYTES of panels timed
    against the default's (:func:`_fastest`), with the library's accumulator sets as they are set. ``one_pass``:
    a :func:`_probe` already built (its ring is hundreds of MB), else one is built here."""
    one_pass = one_pass or _probe(lib, bf16)
    saved = [lib.get_prefetch_ahead(int(bf16), r) for r in range(MAX_ROWS + 1)]

    def timed(rows: int, ahead: int) -> float:
        lib.set_prefetch_ahead(int(bf16), rows, ahead)
        return one_pass(rows)

    try:
        return {rows: _fastest(functools.partial(timed, rows), CANDIDATES, DEFAULT, rounds) for rows in PROBE_ROWS}
    finally:
        for r, ahead in enumerate(saved):
            lib.set_prefetch_ahead(int(bf16), r, ahead)


def measure_sets(lib: ctypes.CDLL, bf16: bool, rounds: int = ROUNDS, one_pass=None) -> dict[int, int]:
    """The best accumulator sets per row count in SETS_ROWS among those the build takes, the most of them (the
    kernels' default) kept unless another is MARGIN faster (:func:`_fastest`), at the default distance;
    ``one_pass`` as :func:`measure`'s."""
    one_pass = one_pass or _probe(lib, bf16)
    saved = {r: lib.get_k_sets(int(bf16), r) for r in SETS_ROWS}
    ahead = [lib.get_prefetch_ahead(int(bf16), r) for r in SETS_ROWS]

    def timed(rows: int, sets: int) -> float:
        lib.set_k_sets(int(bf16), rows, sets)
        return one_pass(rows)

    best = {}
    try:
        for rows in SETS_ROWS:
            lib.set_prefetch_ahead(int(bf16), rows, DEFAULT)
            candidates = tuple(c for c in SETS if c <= lib.max_k_sets(rows))
            best[rows] = _fastest(functools.partial(timed, rows), candidates, candidates[-1], rounds)
    finally:
        for r in SETS_ROWS:
            lib.set_k_sets(int(bf16), r, saved[r])
        for r, a in zip(SETS_ROWS, ahead, strict=True):
            lib.set_prefetch_ahead(int(bf16), r, a)
    return best


def chosen() -> dict[str, list[int]]:
    """The distances chosen so far, for logs and benchmark records: ``{"float32"|"bfloat16": [bytes by rows]}``."""
    with _lock:
        return {("bfloat16" if bf16 else "float32"): list(t) for bf16, t in _tables.items()}


def chosen_sets() -> dict[str, dict[int, int]]:
    """The accumulator sets chosen so far: ``{"float32"|"bfloat16": {rows: sets}}``."""
    with _lock:
        return {("bfloat16" if bf16 else "float32"): dict(t) for bf16, t in _sets.items()}


@dataclass
class _Slot:
    """One row count's trials: the last plain step's time, the trial running or waiting for the plain step
    after it, each challenger's ratios so far in its block (trial over the mean of the plain steps either side)."""
    steps: int = 0
    turn: int = 0
    before: float | None = None
    trial: tuple[int, int] | None = None  # (challenger, the distance to set back) while a trial step runs
    pending: tuple[int, float, float] | None = None  # (challenger, its time per step, the plain step before)
    ratios: dict[int, list[float]] = field(default_factory=dict)
    judged: set[int] = field(default_factory=set)  # challengers with a block judged since the last adoption


class OnlineTuner:
    """Re-checks the prefetch distance of the fused decode step (kernels/decode_step.py) while it serves.

    Why: :func:`ensure` measures once per machine, but a VM's memory behaviour changes under it (a Zen 3 VM,
    session 29: the distance measured at load was 16 KB for one float32 row; half an hour later no software
    prefetch made the served step 1.08x faster, side by side, and a fresh measurement agreed). So one step in
    ``EVERY`` of each row count runs a challenger distance (the others in turn) and its time is judged
    against the mean of the plain steps just before and after it, which cancels a drifting machine and a
    growing context. Each ``WINDOW`` ratios of a challenger are judged as a block: it is adopted
    (:func:`adopt`) where their mean, plus twice its standard error, is under ``1 - MARGIN`` (a block, not a
    sliding window, and a bound, not the mean alone: on a noisy VM a test repeated every trial would
    sooner or later adopt a distance that is no faster). Once every challenger has had a block judged (and
    until the next adoption) the trials come ``SETTLED`` times rarer. What it costs: trials of distances 15%
    slower take 1% of the time while the blocks fill (about 770 steps of a row count) and 0.3% after; no
    distance changes a result. :meth:`choose` before a step, :meth:`record` after it."""

    EVERY = 16
    SETTLED = 3
    WINDOW = 12
    MARGIN = 0.03

    def __init__(self, lib: ctypes.CDLL, bf16: bool, max_rows: int) -> None:
        self.lib, self.bf16 = lib, bf16
        self._slots = [_Slot() for _ in range(min(max_rows, MAX_ROWS) + 1)]
        self.trials = 0  # trial steps run (tests read it)

    def current(self, rows: int) -> int:
        """The distance a plain step of ``rows`` rows runs with (read while no trial is set)."""
        table = _tables.get(self.bf16)
        return table[rows] if table else int(self.lib.get_prefetch_ahead(int(self.bf16), rows))

    def choose(self, rows: int) -> int | None:
        """The distance the next step of ``rows`` rows runs with, set in the library where it is a trial;
        None where this row count is not tuned (that step is not to be recorded)."""
        if not 0 < rows < len(self._slots):
            return None
        slot, current = self._slots[rows], self.current(rows)
        slot.steps += 1
        if slot.before is None or slot.pending is not None or slot.steps % self._every(slot):
            return current
        rivals = [c for c in CANDIDATES if c != current]
        slot.trial = (rivals[slot.turn % len(rivals)], current)
        slot.turn += 1
        self.lib.set_prefetch_ahead(int(self.bf16), rows, slot.trial[0])
        self.trials += 1
        return slot.trial[0]

    def _every(self, slot: _Slot) -> int:
        """Steps per trial: EVERY until every challenger has had a block judged, SETTLED times more after."""
        return self.EVERY * self.SETTLED if len(slot.judged) >= len(CANDIDATES) - 1 else self.EVERY

    def record(self, rows: int, seconds_per_step: float) -> None:
        """The step :meth:`choose` set up took ``seconds_per_step`` (a window of several steps in one call: its
        time per step); a trial's distance is taken back here."""
        slot = self._slots[rows]
        if slot.trial is not None:
            challenger, current = slot.trial
            slot.trial = None
            self.lib.set_prefetch_ahead(int(self.bf16), rows, current)
            slot.pending = (challenger, seconds_per_step, slot.before)
            return
        if slot.pending is not None:
            challenger, trial, before = slot.pending
            slot.pending = None
            ratios = slot.ratios.setdefault(challenger, [])
            ratios.append(2 * trial / (before + seconds_per_step))
            if len(ratios) == self.WINDOW:
                self._judge(slot, rows, challenger, slot.ratios.pop(challenger))
        slot.before = seconds_per_step

    def _judge(self, slot: _Slot, rows: int, challenger: int, ratios: list[float]) -> None:
        bound = statistics.fmean(ratios) + 2.0 * statistics.stdev(ratios) / len(ratios) ** 0.5
        if bound < 1.0 - self.MARGIN:
            adopt(self.bf16, rows, challenger)
            self.lib.set_prefetch_ahead(int(self.bf16), rows, challenger)  # (registered or not)
            slot.ratios.clear()  # judged against the old distance
            slot.judged.clear()
        else:
            slot.judged.add(challenger)
