"""Scheduler rules: priorities, budget, chunked prefill, preemption, batch share, abort, deadlines, static."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams, Tier
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

_ids = itertools.count()


def make(num_blocks=64, block_size=4, prefix_cache=True, **cfg) -> Scheduler:
    cfg.setdefault("batch_min_share", 0.0)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix_cache))


def req(n_prompt=4, max_tokens=4, tier=Tier.BATCH, priority=0, name=None, tokens=None, **kw) -> Request:
    tokens = tokens if tokens is not None else [1000 + next(_ids) for _ in range(n_prompt)]  # unique: no hits
    return Request(name or f"r{next(_ids)}", tokens, SamplingParams(max_tokens=max_tokens, **kw),
                   tier=tier, priority=priority)


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake model: a request whose step reaches its end gets ``token``."""
    out = s.schedule()
    for r, n in out.scheduled:  # what the runner relies on: enough slots for the computed tokens
        assert len(r.block_table) * s.bm.block_size >= r.num_computed_tokens + n
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
    assert out.num_batched_tokens <= s.config.max_batched_tokens
    s.postprocess(out, [token if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled])
    return out


def drain(s: Scheduler, limit: int = 1000) -> int:
    for i in range(limit):
        if not s.has_unfinished():
            return i
        run_step(s)
    raise AssertionError("scheduler did not finish (hang)")


def ids(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r, _ in out.scheduled]


def test_runs_to_completion_and_frees_everything():
    s = make()
    rs = [req(5, max_tokens=3) for _ in range(4)]
    for r in rs:
        s.add_request(r)
    drain(s)
    assert all(r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [7, 7, 7] for r in rs)
    assert s.bm.num_free == s.bm.num_blocks and not s.running and s.num_waiting == 0


def test_eos_stop_token_and_ignore_eos():
    s = make()
    a = req(max_tokens=5)
    a.eos_token_ids = (7,)
    b = req(max_tokens=5, stop_token_ids=[7])
    c = req(max_tokens=5, ignore_eos=True)
    c.eos_token_ids = (7,)
    for r in (a, b, c):
        s.add_request(r)
    drain(s)
    assert a.finish_reason is b.finish_reason is FinishReason.STOP and a.output_token_ids == [7]
    assert c.finish_reason is FinishReason.LENGTH and len(c.output_token_ids) == 5


def test_max_model_len_stops_with_length():
    s = make(max_model_len=6)
    r = req(4, max_tokens=100)
    s.add_request(r)
    drain(s)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 6


def test_interactive_first_then_priority_then_arrival():
    s = make(max_batched_tokens=4, max_num_seqs=1)
    b = req(4, tier=Tier.BATCH, priority=100)
    i_lo = req(4, tier=Tier.INTERACTIVE, priority=0)
    i_hi = req(4, tier=Tier.INTERACTIVE, priority=5)
    i_lo2 = req(4, tier=Tier.INTERACTIVE, priority=0)
    for r in (b, i_lo, i_hi, i_lo2):
        s.add_request(r)
    order = []
    while s.has_unfinished():
        out = run_step(s)
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
    assert order == [i_hi.request_id, i_lo.request_id, i_lo2.request_id, b.request_id]


def test_chunked_prefill_under_tiny_budget():
    s = make(max_batched_tokens=3)
    r = req(10, max_tokens=2)
    s.add_request(r)
    chunks = []
    while s.has_unfinished():
        out = run_step(s)
        chunks += [n for _, n in out.scheduled]
    assert chunks == [3, 3, 3, 1, 1]  # 10 prompt tokens in 4 steps, then one decode
    assert r.output_token_ids == [7, 7]


def test_decodes_and_prefill_chunks_share_the_budget():
    s = make(max_batched_tokens=5)
    a = req(2, max_tokens=10)
    s.add_request(a)
    run_step(s)  # a prefilled, now decoding
    b = req(20, max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert out.scheduled == [(a, 1), (b, 4)]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for _ in range(5):
        s.add_request(req())
    out = run_step(s)
    assert len(out.scheduled) == 2 and len(s.running) == 2


def test_preemption_victim_order_and_front_requeue():
    # 6 blocks of 4 tokens. Three batch requests, 4-token prompts, long outputs: they outgrow the pool.
    s = make(num_blocks=6, block_size=4)
    rs = [req(4, max_tokens=12) for _ in range(3)]
    waiting_later = req(4, max_tokens=1)
    for r in rs:
        s.add_request(r)
    preempted = []
    for _ in range(20):
        out = run_step(s)
        preempted += out.preempted
        if preempted:
            break
    victim = preempted[0]
    assert victim is rs[2]  # latest arrival among equals
    assert victim.num_computed_tokens == 0 and victim.block_table == [] and victim.num_preemptions == 1
    assert victim.output_token_ids  # outputs are kept (recomputed as part of its tokens)
    s.add_request(waiting_later)
    assert s.waiting[Tier.BATCH][0] is victim  # back at the front, ahead of a newer arrival
    assert s.num_preemptions >= 1
    drain(s)
    assert all(len(r.output_token_ids) == 12 for r in rs)
    assert s.bm.num_free == s.bm.num_blocks


def test_preemption_victim_is_lowest_priority_first():
    s = make(num_blocks=6, block_size=4)
    lo = req(4, max_tokens=12, priority=0)
    hi = req(4, max_tokens=12, priority=9)
    mid = req(4, max_tokens=12, priority=5)
    for r in (lo, hi, mid):
        s.add_request(r)
    for _ in range(20):
        out = run_step(s)
        if out.preempted:
            assert out.preempted[0] is lo
            return
    pytest.fail("expected a preemption")


def test_interactive_preempts_batch_when_blocks_run_out():
    s = make(num_blocks=8, block_size=4, max_batched_tokens=64)
    b1, b2 = req(16, max_tokens=16), req(16, max_tokens=16)
    s.add_request(b1)
    s.add_request(b2)
    run_step(s)  # both batch requests hold 2 blocks each: pool full
    assert s.bm.num_free == 0
    i = req(4, tier=Tier.INTERACTIVE, max_tokens=2)
    s.add_request(i)
    out = run_step(s)
    assert out.preempted == [b2] and (i, 4) in out.scheduled
    assert s.waiting[Tier.BATCH][0] is b2


def test_interactive_preempts_batch_for_a_seat():
    # Every seat taken by batch work: an arriving interactive request takes the least important one's seat
    # (latest arrival), which goes back to the front of its queue; batch never takes a seat from batch.
    s = make(num_blocks=64, block_size=4, max_batched_tokens=64, max_num_seqs=2, batch_min_share=0.25)
    b1, b2, b3 = req(4, max_tokens=8), req(4, max_tokens=8), req(4, max_tokens=8)
    for r in (b1, b2, b3):
        s.add_request(r)
    run_step(s)
    assert {r.request_id for r in s.running} == {b1.request_id, b2.request_id}
    i = req(4, tier=Tier.INTERACTIVE, max_tokens=2)
    s.add_request(i)
    out = run_step(s)
    assert out.preempted == [b2] and (i, 4) in out.scheduled  # b1, the batch head, is protected
    assert s.waiting[Tier.BATCH][:2] == [b2, b3] and len(s.running) == 2
    drain(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (b1, b2, b3, i))


def test_batch_head_keeps_running_and_gets_its_share():
    # The batch head is never preempted by interactive work and gets >= 25% of every step's budget.
    s = make(num_blocks=64, block_size=4, max_batched_tokens=8, batch_min_share=0.25)
    b = req(40, max_tokens=2)
    s.add_request(b)
    for _ in range(6):
        s.add_request(req(30, tier=Tier.INTERACTIVE, max_tokens=2))
    for _ in range(4):
        out = run_step(s)
        got = dict((r.request_id, n) for r, n in out.scheduled)
        assert got.get(b.request_id, 0) >= 2, out.scheduled
        assert out.num_batched_tokens == 8  # interactive gets the rest
    # Without a share, interactive work would take every token.
    s2 = make(num_blocks=64, block_size=4, max_batched_tokens=8, batch_min_share=0.0)
    b2 = req(40, max_tokens=2)
    s2.add_request(b2)
    for _ in range(6):
        s2.add_request(req(30, tier=Tier.INTERACTIVE, max_tokens=2))
    assert b2 not in [r for r, _ in run_step(s2).scheduled]


def test_batch_head_is_protected_from_interactive_preemption():
    s = make(num_blocks=8, block_size=4, max_batched_tokens=64, batch_min_share=0.1)
    b1, b2 = req(16, max_tokens=16), req(16, max_tokens=16)
    s.add_request(b1)
    s.add_request(b2)
    run_step(s)
    for _ in range(3):
        s.add_request(req(8, tier=Tier.INTERACTIVE, max_tokens=2))
    preempted = []
    for _ in range(30):
        preempted += run_step(s).preempted
    assert b2 in preempted and b1 not in preempted
    drain(s)
    assert b1.finish_reason is b2.finish_reason is FinishReason.LENGTH


def test_interactive_leaves_a_seat_for_the_waiting_batch_head():
    s = make(max_num_seqs=2, batch_min_share=0.1)
    for _ in range(3):
        s.add_request(req(4, tier=Tier.INTERACTIVE, max_tokens=5))
    b = req(4, max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert b in [r for r, _ in out.scheduled] and len(out.scheduled) == 2


def _batch_tokens(out: SchedulerOutput) -> int:
    return sum(n for r, n in out.scheduled if r.tier is Tier.BATCH)


def test_batch_step_cap_applies_while_interactive_traffic_is_about():
    """With ``batch_step_tokens`` set, a step holds at most that many batch tokens while an interactive request
    waits or runs, and for ``interactive_window_s`` after; outside that window batch work gets the whole
    budget again. Interactive work itself is not capped."""
    s = make(num_blocks=256, max_batched_tokens=64, max_num_seqs=16, batch_step_tokens=10, interactive_window_s=60)
    for _ in range(8):
        s.add_request(req(40, max_tokens=20))  # 320 prompt tokens: prefill work for many steps
    assert _batch_tokens(run_step(s)) == 64  # no interactive traffic yet: the whole budget
    s.add_request(req(30, max_tokens=3, tier=Tier.INTERACTIVE, name="i"))
    out = run_step(s)
    assert ids(out)[0] == "i" and dict((r.request_id, n) for r, n in out.scheduled)["i"] == 30
    assert _batch_tokens(out) == 10
    while "i" in s.requests:
        assert _batch_tokens(run_step(s)) <= 10
    assert _batch_tokens(run_step(s)) == 10  # gone, but within the window
    s.config.interactive_window_s = 0.0
    assert _batch_tokens(run_step(s)) == 64  # the window has passed: full steps again


def test_abort_frees_blocks_at_once_and_is_reported():
    s = make()
    a, w = req(8, max_tokens=10), req(8)
    s.add_request(a)
    run_step(s)
    s.add_request(w)
    held = s.bm.num_free
    assert s.abort(a.request_id) is a
    assert s.bm.num_free > held and a.block_table == [] and a.finish_reason is FinishReason.ABORT
    assert s.abort(w.request_id, FinishReason.ABORT) is w and s.num_waiting == 0
    assert s.abort("nope") is None
    out = run_step(s)
    assert out.finished == [a, w] and not out.scheduled and not s.has_unfinished()


def test_deadline_expires_waiting_and_running():
    s = make()
    a = req(4, max_tokens=50)
    a.deadline = time.monotonic() + 3600
    b = req(4)
    b.deadline = time.monotonic() - 1
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert out.finished == [b] and b.finish_reason is FinishReason.DEADLINE
    a.deadline = time.monotonic() - 1
    out = run_step(s)
    assert out.finished == [a] and a.finish_reason is FinishReason.DEADLINE and a.block_table == []
    assert s.bm.num_free == s.bm.num_blocks and not s.has_unfinished()


def test_capacity_tracks_queue_and_free_blocks():
    s = make(num_blocks=10, block_size=4, max_num_seqs=4)
    assert s.capacity() == (4, 40)
    s.add_request(req(8))
    assert s.capacity() == (3, 32)
    run_step(s)
    assert s.capacity()[0] == 3
    for _ in range(3):
        s.add_request(req(4))
    assert s.capacity()[0] == 0
    s2 = make(num_blocks=2, block_size=4)
    s2.add_request(req(7, max_tokens=1))
    s2.add_request(req(7, max_tokens=1))
    assert s2.capacity() == (0, 0)  # waiting work already needs every free slot


def test_never_fitting_request_is_rejected_not_hung():
    s = make(num_blocks=4, block_size=4)  # 16 slots
    ok = req(10, max_tokens=7)  # needs 16 slots: the 17th token never needs KV
    bad = req(10, max_tokens=8)
    assert s.add_request(ok)
    assert not s.add_request(bad)
    assert bad.finish_reason is FinishReason.ERROR and "KV blocks" in bad.error
    long_prompt = req(20, max_tokens=1)
    s2 = make(max_model_len=16)
    assert not s2.add_request(long_prompt) and "context" in long_prompt.error
    out = run_step(s)
    assert bad in out.finished
    drain(s)
    assert ok.finish_reason is FinishReason.LENGTH


def test_prompt_filling_the_context_needs_kv_for_every_prompt_token():
    s = make(num_blocks=2, block_size=4, max_model_len=9)
    r = req(9, max_tokens=5)  # 9 prompt tokens need 3 blocks although max_total_tokens - 1 == 8
    assert not s.add_request(r) and "KV blocks" in r.error
    s2 = make(num_blocks=3, block_size=4, max_model_len=9)
    r2 = req(9, max_tokens=5)
    assert s2.add_request(r2)
    drain(s2)
    assert r2.finish_reason is FinishReason.LENGTH and r2.num_output_tokens == 1


def test_whole_pool_request_runs_alone_eventually():
    s = make(num_blocks=4, block_size=4)
    big = req(10, max_tokens=7)
    small = [req(4, max_tokens=6) for _ in range(3)]
    for r in [*small, big]:
        s.add_request(r)
    drain(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in [*small, big])


def test_static_policy_admits_nothing_mid_batch():
    s = make(max_num_seqs=2, policy="static")
    a, b = req(4, max_tokens=1), req(4, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert set(ids(out)) == {a.request_id, b.request_id}
    c = req(4, max_tokens=1)
    s.add_request(c)
    seen_c = []
    while b.status is not RequestStatus.FINISHED:
        seen_c += [r for r, _ in run_step(s).scheduled if r is c]
    assert not seen_c and a.is_finished  # c waited although a's slot was free
    out = run_step(s)
    assert ids(out) == [c.request_id]
    # Continuous batching would have admitted c right away.
    s2 = make(max_num_seqs=2)
    a2, b2 = req(4, max_tokens=1), req(4, max_tokens=5)
    s2.add_request(a2)
    s2.add_request(b2)
    run_step(s2)
    c2 = req(4, max_tokens=1)
    s2.add_request(c2)
    assert c2 in [r for r, _ in run_step(s2).scheduled]


def test_prefix_hit_skips_cached_tokens_in_budget():
    s = make(num_blocks=32, block_size=4, max_batched_tokens=64)
    shared = list(range(12))
    a = req(tokens=shared + [50, 51], max_tokens=1)
    s.add_request(a)
    drain(s)
    b = req(tokens=shared + [60, 61], max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert out.scheduled == [(b, 2)] and b.num_cached_tokens == 12
    assert s.bm.prefix_hits == 12


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req(name="x"))
    with pytest.raises(ValueError):
        s.add_request(req(name="x"))


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from(list(Tier)), st.integers(0, 2),
                            st.integers(0, 6), st.booleans()), min_size=1, max_size=14),
    num_blocks=st.integers(11, 40), budget=st.integers(1, 40), seqs=st.integers(1, 6),
    share=st.sampled_from([0.0, 0.1, 0.5]), policy=st.sampled_from(["continuous", "static"]),
)
def test_random_workloads_always_finish(reqs, num_blocks, budget, seqs, share, policy):
    """Liveness and accounting under random mixes: staggered arrivals, shared prefixes, aborts."""
    s = make(num_blocks=num_blocks, block_size=4, max_batched_tokens=budget, max_num_seqs=seqs,
             batch_min_share=share, policy=policy)
    pending = [(arrive, req(tokens=[1, 2, 3, 4, 5, 6, 7, 8][:n] + [100 + i] * n, max_tokens=m, tier=tier,
                            priority=prio), abort)
               for i, (n, m, tier, prio, arrive, abort) in enumerate(reqs)]
    added, aborted = [], set()
    for step in range(600):
        for arrive, r, abort in pending:
            if arrive == step:
                if s.add_request(r):
                    added.append((r, abort))
        if step > 6 and not s.has_unfinished():
            break
        out = run_step(s)
        assert len(s.running) <= seqs
        for r, abort in added:
            if abort and step == 3 and not r.is_finished:
                assert s.abort(r.request_id) is r
                aborted.add(r.request_id)
        used = sum(len(r.block_table) for r in s.running)
        assert s.bm.num_blocks - s.bm.num_free <= used  # shared blocks are counted once
        assert all(not r.block_table for q in s.waiting.values() for r in q)
        assert out.num_batched_tokens <= budget
    else:
        raise AssertionError(f"hang: running={[(r.request_id, r.tier.value, r.num_computed_tokens, r.num_tokens, len(r.block_table)) for r in s.running]} "
                             f"waiting={[(r.request_id, r.tier.value, r.num_tokens) for q in s.waiting.values() for r in q]} free={s.bm.num_free}")
    assert s.bm.num_free == s.bm.num_blocks
    for r, _ in added:  # an admitted request ends only by running to max_tokens or by our abort
        assert r.is_finished
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT, (r.request_id, r.finish_reason, r.error)
        else:
            assert r.finish_reason is FinishReason.LENGTH, (r.request_id, r.finish_reason, r.error)
            assert r.num_output_tokens == r.sampling.max_tokens
