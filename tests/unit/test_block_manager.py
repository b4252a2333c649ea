"""Block manager: allocation, prefix caching, LRU eviction, and a stateful property test of its invariants."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from scheduler.block_manager import BlockManager, hash_block
from scheduler.request import Request, SamplingParams

_ids = itertools.count()


def req(tokens, ns="", max_tokens=16) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens), cache_namespace=ns)


def compute(bm: BlockManager, r: Request, n: int) -> None:
    """What a step does for the block manager: tokens become computed, full blocks get cached."""
    r.num_computed_tokens += n
    bm.cache_blocks(r)


def test_allocate_and_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req(range(10))
    assert bm.allocate(r, 10)
    assert len(r.block_table) == 3 and bm.num_free == 5 and bm.usage == pytest.approx(3 / 8)
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == 0
    bm.free(r)
    assert r.block_table == [] and bm.num_free == 8 and bm.usage == 0


def test_allocate_fails_cleanly_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req(range(9))
    assert not bm.can_allocate(r, 9, bm.lookup(r))
    assert not bm.allocate(r, 9)
    assert r.block_table == [] and bm.num_free == 2


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = req(range(3))
    assert bm.allocate(r, 3)
    compute(bm, r, 3)
    r.output_token_ids.append(99)  # 4 tokens: the 4th still fits block 0
    assert bm.append_slots(r, 1) and len(r.block_table) == 1
    compute(bm, r, 1)
    r.output_token_ids.append(98)
    assert bm.append_slots(r, 1) and len(r.block_table) == 2


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req(range(12))
    bm.allocate(a, 12)
    compute(bm, a, 12)
    # Same 12 tokens: only 2 blocks may be reused (the last token must be computed for its logits).
    b = req(range(12))
    assert bm.lookup(b).num_tokens == 8
    assert bm.allocate(b, 4)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_cnt == 2
    # Longer prompt sharing the prefix: all three full blocks hit.
    c = req(list(range(12)) + [7, 7])
    assert bm.lookup(c).num_tokens == 12
    assert bm.prefix_hits == 8 and bm.prefix_queries == 24


def test_freed_cached_blocks_are_revived_then_lazily_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    compute(bm, a, 5)
    bm.free(a)
    assert bm.num_free == 4 and len(bm.cached) == 2  # freed but still cached
    b = req([1, 2, 3, 4, 9])
    hit = bm.lookup(b)
    assert hit.num_tokens == 4
    assert bm.allocate(b, 1, hit) and bm.num_free == 1
    bm.free(b)
    # Fill the pool with unrelated tokens: every cached block must be evicted (key dropped) on reuse.
    c = req(range(100, 108))
    assert bm.allocate(c, 8)
    assert bm.cached == {} and all(blk.key is None for blk in bm.blocks)
    assert bm.lookup(req([1, 2, 3, 4, 5])).num_tokens == 0


def test_reviving_free_cached_blocks_counts_against_free_space():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    compute(bm, a, 5)
    bm.free(a)  # free queue: the never-used block, then a's blocks tail-first; 2 of them cached
    c = req([60, 61, 62, 63])
    assert bm.allocate(c, 4) and bm.num_free == 2 and len(bm.cached) == 2
    b = req([1, 2, 3, 4, 9])
    hit = bm.lookup(b)
    assert hit.num_tokens == 4
    # The 2 hit blocks are themselves the only free ones: reviving them leaves none for the 5th token.
    assert not bm.can_allocate(b, 1, hit)
    assert not bm.allocate(b, 1, hit)
    assert bm.num_free == 2 and b.block_table == []


def test_eviction_order_prefers_tail_blocks_of_a_freed_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    bm.allocate(a, 7)
    compute(bm, a, 7)
    first = a.block_table[0]
    bm.free(a)
    b = req([50, 51, 52])  # needs 2 blocks: the partial and the last full block go first
    bm.allocate(b, 3)
    assert first not in b.block_table
    assert bm.lookup(req([1, 2, 3, 4, 5, 6, 7])).num_tokens == 4  # first two blocks survived


def test_namespace_isolation():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req(range(9), ns="tenant-a")
    bm.allocate(a, 9)
    compute(bm, a, 9)
    assert bm.lookup(req(range(9), ns="tenant-b")).num_tokens == 0
    assert bm.lookup(req(range(9), ns="")).num_tokens == 0
    assert bm.lookup(req(range(9), ns="tenant-a")).num_tokens == 8
    # The namespace is length-prefixed: ("ab", tokens) and ("a", "b"+tokens) cannot alias.
    assert hash_block(b"", [1], "ab") != hash_block(b"", [1], "a")


def test_prefix_cache_disabled():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_cache=False)
    a = req(range(9))
    bm.allocate(a, 9)
    compute(bm, a, 9)
    assert bm.cached == {} and bm.lookup(req(range(9))).num_tokens == 0


def test_duplicate_concurrent_blocks_register_once():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = req(range(8)), req(range(8))
    bm.allocate(a, 8)
    bm.allocate(b, 8)  # nothing cached yet: separate blocks
    compute(bm, a, 8)
    compute(bm, b, 8)
    assert len(bm.cached) == 2 and all(bm.blocks[x].key is None for x in b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 16


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / chunked compute / decode / fork-by-shared-prefix / free / evict-by-filling.

    A shadow copy of the KV contents (token id written per slot) checks that a cache hit always serves
    exactly the request's tokens, and that no step ever writes into a block someone else references."""

    BS, NB = 4, 24
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NB, self.BS)
        self.reqs: dict[str, Request] = {}
        self.pending: dict[str, int] = {}  # tokens allocated but not yet computed
        self.kv: dict[int, list[int | None]] = {b: [None] * self.BS for b in range(self.NB)}

    # --- helpers -----------------------------------------------------------------------------------
    def _write(self, r: Request, n: int) -> None:
        start = r.num_computed_tokens
        toks = r.all_token_ids
        for pos in range(start, start + n):
            block = r.block_table[pos // self.BS]
            assert self.bm.blocks[block].ref_cnt == 1, "wrote into a shared block"
            assert self.bm.blocks[block].key is None, "wrote into a cached block"
            self.kv[block][pos % self.BS] = toks[pos]
        compute(self.bm, r, n)

    def _admit(self, tokens: list[int], chunk: int, ns: str) -> Request | None:
        r = req(tokens, ns=ns)
        hit = self.bm.lookup(r)
        n = min(chunk, r.num_tokens - hit.num_tokens)
        if not self.bm.allocate(r, n, hit):
            assert r.block_table == [] and r.num_computed_tokens == 0
            return None
        # Served prefix must hold exactly this request's tokens.
        for i, block in enumerate(r.block_table[: hit.num_tokens // self.BS]):
            assert self.kv[block] == tokens[i * self.BS : (i + 1) * self.BS]
        assert r.num_cached_tokens % self.BS == 0 and r.num_cached_tokens < r.num_tokens
        self.reqs[r.request_id] = r
        self.pending[r.request_id] = n
        return r

    # --- rules -------------------------------------------------------------------------------------
    @rule(target=live, prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 12, []]),
          tail=st.lists(st.integers(0, 6), max_size=10), chunk=st.integers(1, 16), ns=st.sampled_from(["", "t"]))
    def allocate(self, prefix, tail, chunk, ns):
        tokens = prefix + tail or [0]
        r = self._admit(tokens, chunk, ns)
        return r.request_id if r else "none"

    @rule(target=live, parent=live, extra=st.lists(st.integers(0, 6), max_size=6), chunk=st.integers(1, 16))
    def fork(self, parent, extra, chunk):
        """A new request whose prompt extends a live one's computed tokens (shared-prefix hits)."""
        p = self.reqs.get(parent)
        if p is None or p.num_computed_tokens == 0:
            return "none"
        r = self._admit(p.all_token_ids[: p.num_computed_tokens] + extra, chunk, p.cache_namespace)
        return r.request_id if r else "none"

    @rule(rid=live, chunk=st.integers(1, 16), out=st.integers(0, 6))
    def step(self, rid, chunk, out):
        """Compute the pending tokens, then grow by another prefill chunk or a decoded token."""
        r = self.reqs.get(rid)
        if r is None:
            return
        self._write(r, self.pending[rid])
        self.pending[rid] = 0
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(out)
            n = 1
        else:
            n = min(chunk, r.num_tokens - r.num_computed_tokens)
        if self.bm.append_slots(r, n):
            self.pending[rid] = n

    @rule(rid=consumes(live))
    def free(self, rid):
        r = self.reqs.pop(rid, None)
        if r is not None:
            self.pending.pop(rid)
            self.bm.free(r)

    @rule(size=st.integers(1, 24 * 4))
    def fill(self, size):
        """A big unrelated request that evicts whatever cached free blocks it needs, then goes away."""
        r = req([100] * size)
        if self.bm.allocate(r, size, self.bm.lookup(r)):
            self.bm.free(r)

    # --- invariants ----------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        bm = self.bm
        refs = Counter(b for r in self.reqs.values() for b in r.block_table)
        for r in self.reqs.values():
            assert len(set(r.block_table)) == len(r.block_table), "block twice in one table"
            assert len(r.block_table) * self.BS >= r.num_computed_tokens + self.pending[r.request_id]
        for blk in bm.blocks:
            assert blk.ref_cnt == refs.get(blk.block_id, 0), "refcount != live references"
            assert (blk.ref_cnt == 0) == (blk.block_id in bm.free_queue), "leaked or double-freed"
        assert len(bm.free_queue) + len(refs) == bm.num_blocks
        for key, b in bm.cached.items():
            assert bm.blocks[b].key == key
        assert sum(blk.key is not None for blk in bm.blocks) == len(bm.cached)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
