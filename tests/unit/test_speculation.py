"""Prompt-lookup proposals and how the scheduler grants them (pure Python, no model)."""

from __future__ import annotations

import random

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from worker.ngram import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: longest n first, latest earlier occurrence of the last n tokens, what followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_proposals_follow_the_latest_longest_match():
    req = Request("a", [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    p = NgramProposer(min_n=1, max_n=3)
    # "5 6" occurs at 0 (-> 7 8 1) and at 5 (-> 9 2 5): the latest wins
    assert p.propose(req, 3) == [9, 2, 5]
    req.output_token_ids += [7]  # now "5 6 7" matches the start
    assert p.propose(req, 2) == [8, 1]
    assert NgramProposer(min_n=2, max_n=3).propose(Request("b", [1, 2, 3, 4]), 4) == []
    assert p.propose(req, 0) == []


def test_incremental_index_agrees_with_brute_force():
    rng = random.Random(4)
    for trial in range(40):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        req = Request(f"r{trial}", list(tokens))
        p = NgramProposer(min_n=1 + trial % 2, max_n=3 + trial % 3)
        for _ in range(30):
            k = rng.randrange(1, 6)
            assert p.propose(req, k) == brute_force(req.all_token_ids, k, p.min_n, p.max_n)
            req.output_token_ids += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        p.forget(req.request_id)
        assert not p._indexes


def running(sched: Scheduler, req: Request) -> Request:
    """Admit ``req`` and compute its prompt, leaving it decoding with one sampled token (every request in the
    step samples token 7: each reaches its end, the prompts being shorter than the budget)."""
    sched.add_request(req)
    out = sched.schedule()
    sched.postprocess(out, [7 for _ in out.scheduled])
    assert req.is_decoding
    return req


def test_proposals_use_only_what_ordinary_tokens_leave():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=12), bm)
    a = running(sched, Request("a", [1, 2, 3], SamplingParams(max_tokens=50)))
    a.spec_token_ids = [9, 9, 9, 9, 9]
    sched.add_request(Request("b", list(range(1, 10)), SamplingParams(max_tokens=5)))  # a 9-token prefill
    out = sched.schedule()
    # a: 1 decode token; b: its 9 prompt tokens; only 2 of the budget's 12 are left for a's proposals
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 3), ("b", 9)]
    assert a.spec_token_ids == [9, 9]


def test_proposals_never_take_blocks_or_preempt():
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64), bm)
    a = running(sched, Request("a", [1, 2], SamplingParams(max_tokens=5)))
    b = running(sched, Request("b", [4, 5], SamplingParams(max_tokens=5)))  # a decoded once meanwhile
    assert (a.num_computed_tokens, b.num_computed_tokens, bm.num_free) == (3, 2, 0)
    a.spec_token_ids = [1, 2, 3]  # a's own next token fits its block; its proposals would need a third
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.spec_token_ids == [] and not out.preempted


def test_rejected_proposals_return_their_blocks_and_count():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64), bm)
    a = running(sched, Request("a", [1, 2, 3], SamplingParams(max_tokens=50)))  # 3 prompt + 1 output
    a.spec_token_ids = [5, 6, 7, 8, 9, 10]
    out = sched.schedule()
    assert out.scheduled == [(a, 7)] and len(a.block_table) == 3  # 3 + 7 tokens computed -> 3 blocks
    sched.postprocess(out, [[5, 6, 42]])  # two accepted, then the model's own token
    assert a.output_token_ids == [7, 5, 6, 42]
    assert a.num_computed_tokens == 6 and len(a.block_table) == 2  # the block of rejected ones came back
    assert (a.num_spec_proposed, a.num_spec_accepted, a.num_spec_drafts) == (6, 2, 1) and a.spec_token_ids == []
    assert a.is_decoding and a.status is RequestStatus.RUNNING


def test_a_stop_inside_accepted_proposals_ends_there():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64), bm)
    a = running(sched, Request("a", [1, 2, 3], SamplingParams(max_tokens=50, stop_token_ids=[6])))
    a.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    finished = sched.postprocess(out, [[5, 6, 7, 8]])
    assert finished == [a] and a.output_token_ids == [7, 5, 6]
    b = running(sched, Request("b", [1, 2, 3], SamplingParams(max_tokens=3)))
    b.spec_token_ids = [5, 6]
    out = sched.schedule()
    assert sched.postprocess(out, [[5, 6, 9]]) == [b] and b.output_token_ids == [7, 5, 6]  # max_tokens 3
    assert bm.num_free == bm.num_blocks


def test_worker_metrics_count_speculative_tokens():
    """The engine's running totals of proposed and accepted tokens reach Prometheus as counters, by the
    increase since the last copy (their ratio is the acceptance rate)."""
    from types import SimpleNamespace

    from worker.metrics import WorkerMetrics

    m = WorkerMetrics(model="tiny")
    stats = SimpleNamespace(preemptions=0, busy_seconds=0.0, steps=10, spec_proposed_tokens=40, spec_accepted_tokens=30,
                            spec_drafts=12, prefix_hit_rate=0.0)
    engine = SimpleNamespace(stats=stats, scheduler=None, block_manager=None)
    m.engine_stats(engine)
    stats.spec_proposed_tokens, stats.spec_accepted_tokens, stats.spec_drafts, stats.steps = 100, 61, 30, 25
    m.engine_stats(engine)
    m.engine_stats(engine)  # no change: nothing added twice

    def value(name: str) -> float | None:
        return m.registry.get_sample_value(name, {"model": "tiny"})

    assert value("inferq_spec_proposed_tokens_total") == 100
    assert value("inferq_spec_accepted_tokens_total") == 61
    assert value("inferq_spec_drafts_total") == 30 and value("inferq_engine_steps_total") == 25
