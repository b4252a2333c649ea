"""Paged KV-cache bookkeeping: ref-counted blocks, an LRU free queue and a prefix cache of full blocks.

Pure Python (no torch). The model runner owns the tensors; this module only decides which block ids a
request's tokens live in (``request.block_table``).

Prefix cache: a *full* block is keyed by a chained SHA-256 of (parent key, the block's token ids, the
request's ``cache_namespace``), so a key names the whole prefix up to that block, and tenants with
different namespaces never share a block. A block whose last user is freed goes to the tail of the free
queue but keeps its key, so a later request with the same prefix can revive it; the key is dropped only
when the block is handed out again (lazy eviction, least recently freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...], namespace: str) -> bytes:
    """Key of a full block. SHA-256 rather than ``hash()``: keys are shared across tenants, so they must
    not be forgeable by a client choosing token ids to collide with someone else's prefix."""
    h = hashlib.sha256(parent)
    ns = namespace.encode()
    h.update(len(ns).to_bytes(4, "little"))
    h.update(ns)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    key: bytes | None = None  # prefix-cache key while the block holds a registered full block


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of :meth:`BlockManager.lookup`: cached blocks for the head of a request's tokens."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0


class BlockManager:
    """Hands out KV blocks to requests and keeps full blocks reusable across requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ref-count-0 blocks in LRU order (head = evicted first); OrderedDict gives O(1) pop/remove.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix key -> block id
        self._num_registered: dict[str, int] = {}  # request id -> its leading blocks already in the cache
        self.prefix_queries = 0  # prompt tokens looked up (successful admissions)
        self.prefix_hits = 0  # of which served from the cache

    # --- queries ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first ``num_blocks`` full blocks (memoised on the request: tokens of a
        full block never change, preemption included)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            tokens, bs = request.all_token_ids, self.block_size
            parent = hashes[-1] if hashes else b""
            for i in range(len(hashes), num_blocks):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_namespace)
                hashes.append(parent)
        return hashes

    def lookup(self, request: Request) -> PrefixHit:
        """Longest cached prefix of a waiting request, in whole blocks, always leaving at least the last
        token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_cache:
            return PrefixHit()
        hit: list[int] = []
        for key in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hit.append(block_id)
        return PrefixHit(tuple(hit), len(hit) * self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks an allocation would take (revived free cached blocks included)."""
        if hit is None:  # running request: grow the table
            return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_table))
        revived = sum(1 for b in hit.blocks if self.blocks[b].ref_cnt == 0)
        return cdiv(hit.num_tokens + num_new_tokens, self.block_size) - len(hit.blocks) + revived

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None, reserve: int = 0) -> bool:
        """Whether :meth:`allocate` (waiting request, ``hit`` from :meth:`lookup`) or :meth:`append_slots`
        (``hit`` None) would succeed while leaving ``reserve`` blocks free."""
        return self.blocks_needed(request, num_new_tokens, hit) + reserve <= len(self.free_queue)

    # --- mutations -------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """First allocation of a waiting request: take the cached prefix ``hit`` (looked up now if None)
        plus fresh blocks for ``num_new_tokens`` more tokens. Sets ``num_computed_tokens`` to the hit."""
        assert not request.block_table, f"{request.request_id} already holds blocks"
        if hit is None:
            hit = self.lookup(request)
        if not self.can_allocate(request, num_new_tokens, hit):
            return False
        for block_id in hit.blocks:
            self._touch(block_id)
        request.block_table = list(hit.blocks)
        request.num_computed_tokens = hit.num_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(hit.num_tokens, request.num_prompt_tokens)
        self._num_registered[request.request_id] = len(hit.blocks)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += hit.num_tokens
        self._grow(request, num_new_tokens)
        return True

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of a running request; False if blocks ran out."""
        if not self.can_allocate(request, num_new_tokens):
            return False
        self._grow(request, num_new_tokens)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache (after a step)."""
        if not self.enable_prefix_cache:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        keys = self.block_hashes(request, full)
        for i in range(done, full):
            block = self.blocks[request.block_table[i]]
            # An identical block computed concurrently by another request may already be registered;
            # keep that one and leave this copy unkeyed (it is freed like any other block).
            if block.key is None and keys[i] not in self.cached:
                block.key = keys[i]
                self.cached[keys[i]] = block.block_id
        self._num_registered[request.request_id] = full

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's computed tokens (after a step that rejected speculative
        proposals). They were never registered in the prefix cache, so they go to the head of the free
        queue: the first to be reused, before any block that holds a cached prefix."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        while len(request.block_table) > keep:
            block = self.blocks[request.block_table.pop()]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                self.free_queue.move_to_end(block.block_id, last=False)

    def free(self, request: Request) -> None:
        """Drop the request's references. Blocks are queued tail-first so that a prefix's later blocks
        are evicted before its earlier (more shareable) ones."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
        request.block_table = []
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget all cached keys (e.g. after weights change). Referenced blocks stay allocated."""
        for block in self.blocks:
            block.key = None
        self.cached.clear()

    # --- internals -------------------------------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]  # revived from the free queue with its cached content
        block.ref_cnt += 1

    def _grow(self, request: Request, num_new_tokens: int) -> None:
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_table)
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:  # lazy eviction of the LRU cached block
                del self.cached[block.key]
                block.key = None
            block.ref_cnt = 1
            request.block_table.append(block_id)
