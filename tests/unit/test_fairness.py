"""Fair sharing between tenants (issue 18): deficit round robin by tokens over the tenants of a tier, in the
queue on its own and inside the real scheduler."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import fairness
from scheduler.block_manager import BlockManager
from scheduler.fairness import FairQueue, admission_cost
from scheduler.request import Request, SamplingParams, Tier
from scheduler.scheduler import Scheduler, SchedulerConfig

_ids = itertools.count()


def req(tenant: str, n_prompt: int = 60, max_tokens: int = 40, weight: float = 1.0, priority: int = 0,
        tier: Tier = Tier.BATCH) -> Request:
    """A request of ``n_prompt + max_tokens`` tokens (100 by default), with unique prompt tokens."""
    return Request(f"{tenant}-{next(_ids)}", [1000 + next(_ids) for _ in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens), tier=tier, priority=priority, tenant=tenant,
                   weight=weight)


def drain(q: FairQueue, limit: int | None = None) -> list[Request]:
    """Pop everything (or ``limit`` requests) in admission order."""
    order = []
    while (r := q.peek()) is not None and (limit is None or len(order) < limit):
        assert q.peek() is r  # peeking again without a pop changes nothing
        q.pop(r)
        order.append(r)
    return order


def test_light_tenant_is_interleaved_not_served_after_the_heavy_backlog():
    q = FairQueue(quantum=100)
    heavy = [req("heavy") for _ in range(50)]
    light = [req("light") for _ in range(5)]
    for r in heavy + light:  # the whole heavy backlog arrived first
        q.add(r)
    order = drain(q)
    positions = [order.index(r) for r in light]
    assert positions == [1, 3, 5, 7, 9]  # one turn each: heavy, light, heavy, light...
    assert [r for r in order if r.tenant == "heavy"] == heavy  # FIFO within a tenant


def test_without_fair_share_the_light_tenant_waits_for_the_backlog():
    q = FairQueue(quantum=100, fair=False)
    heavy, light = [req("heavy") for _ in range(50)], [req("light") for _ in range(5)]
    for r in heavy + light:
        q.add(r)
    assert drain(q) == heavy + light


@pytest.mark.parametrize("quantum", [50, 100, 1000])
def test_weights_two_to_one_give_two_to_one_tokens(quantum):
    q = FairQueue(quantum=quantum)
    for _ in range(300):
        q.add(req("gold", weight=2.0))
        q.add(req("bronze", weight=1.0))
    tokens = Counter()
    for r in drain(q, limit=240):  # both tenants stay backlogged
        tokens[r.tenant] += admission_cost(r)
    assert tokens["gold"] / tokens["bronze"] == pytest.approx(2.0, rel=0.1)


def test_costs_are_tokens_not_requests():
    # Long requests (1000 tokens) against short ones (100): equal weights give equal tokens, so ten short
    # requests for each long one.
    q = FairQueue(quantum=100)
    for _ in range(50):
        q.add(req("long", n_prompt=900, max_tokens=100))
    for _ in range(500):
        q.add(req("short"))
    tokens = Counter()
    for r in drain(q, limit=220):
        tokens[r.tenant] += admission_cost(r)
    assert tokens["long"] / tokens["short"] == pytest.approx(1.0, rel=0.15)


def test_one_tenant_alone_keeps_priority_then_fifo():
    q, plain = FairQueue(quantum=10), FairQueue(quantum=10, fair=False)
    rs = [req("solo", priority=p) for p in (0, 2, 0, 1, 2, 0)]
    for r in rs:
        q.add(r)
        plain.add(r)
    preempted = req("solo", priority=1)
    q.add(preempted, front=True)
    plain.add(preempted, front=True)
    expected = [rs[1], rs[4], preempted, rs[3], rs[0], rs[2], rs[5]]
    assert drain(q) == expected == drain(plain)


def test_idle_tenant_loses_its_deficit_and_remove_works():
    q = FairQueue(quantum=1000)
    a = req("a")
    q.add(a)
    assert q.peek() is a
    q.pop(a)  # a's turn: 1000 granted, 100 charged; then its queue is empty
    assert q.tenants() == [] and len(q) == 0 and q.peek() is None
    b1, b2, a2 = req("b"), req("b"), req("a")
    for r in (b1, b2, a2):
        q.add(r)
    q.remove(b1)  # aborted while waiting
    assert list(q) == [b2, a2] and q.tenants() == ["b", "a"]
    with pytest.raises(ValueError):
        q.remove(b1)
    assert drain(q) == [b2, a2]


def test_picking_the_next_request_does_not_scan_the_waiting_requests(monkeypatch):
    costs = Counter()

    def counting_cost(r: Request) -> int:
        costs["calls"] += 1
        return r.max_total_tokens

    monkeypatch.setattr(fairness, "admission_cost", counting_cost)
    q = FairQueue(quantum=7)  # every request needs several rounds of quanta: the skip path runs
    for _ in range(2000):
        q.add(req("x"))
        q.add(req("y", weight=3.0))
    drain(q, limit=100)
    assert costs["calls"] < 100 * 8  # a few per admission, not thousands


# --- inside the scheduler -------------------------------------------------------------------------------------

def make(fair: bool = True, **cfg) -> Scheduler:
    cfg = {"max_num_seqs": 4, "max_batched_tokens": 64, "batch_min_share": 0.0, **cfg}
    return Scheduler(SchedulerConfig(fair_share=fair, **cfg), BlockManager(256, 16, True))


def step(s: Scheduler) -> list[Request]:
    """One step with a fake model (token 7 at the end of each scheduled chunk); returns the admitted ones."""
    running_before = {id(r) for r in s.running}
    out = s.schedule()
    s.postprocess(out, [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled])
    return [r for r, _ in out.scheduled if id(r) not in running_before]


def first_admission_step(s: Scheduler, target: Request, limit: int = 2000) -> int:
    for i in range(limit):
        if target in step(s):
            return i
    raise AssertionError("never admitted")


@pytest.mark.parametrize("tier", list(Tier))
def test_scheduler_admits_the_light_tenant_within_a_few_steps(tier):
    def run(fair: bool) -> int:
        s = make(fair)
        for _ in range(50):
            s.add_request(req("heavy", n_prompt=20, max_tokens=8, tier=tier))
        light = req("light", n_prompt=20, max_tokens=8, tier=tier)
        s.add_request(light)
        return first_admission_step(s, light)

    assert run(fair=True) <= 3
    assert run(fair=False) > 50  # behind the whole backlog otherwise


@pytest.mark.parametrize("tier", list(Tier))
def test_a_tenant_without_seats_takes_one_from_the_tenant_holding_them_all(tier):
    """Every seat is held by a heavy tenant's long decodes: a light tenant's request is admitted the next
    step, preempting the heavy tenant's latest request; seat claims stop once the two hold equal shares (and
    the preempted tenant cannot claim back: no ping-pong), and without fair share nothing is preempted."""
    def run(fair: bool) -> tuple[Scheduler, list[Request], list[int]]:
        s = make(fair, max_num_seqs=4)
        heavy = [req("heavy", n_prompt=20, max_tokens=500, tier=tier) for _ in range(8)]
        for r in heavy:
            s.add_request(r)
        for _ in range(3):
            step(s)
        assert [r.tenant for r in s.running] == ["heavy"] * 4
        when = []
        for _ in range(2):
            light = req("light", n_prompt=20, max_tokens=500, tier=tier)
            s.add_request(light)
            when.append(first_admission_step(s, light, limit=30))
        s.add_request(req("light", n_prompt=20, max_tokens=500, tier=tier))  # a third waits: 2 + 2 is fair
        return s, heavy, when

    s, heavy, when = run(fair=True)
    assert when == [0, 0]  # each is admitted at once
    assert Counter(r.tenant for r in s.running) == {"heavy": 2, "light": 2}
    assert s.num_preemptions == 2 and heavy[3].num_preemptions == heavy[2].num_preemptions == 1  # latest first
    for _ in range(20):  # 2 + 2: no further claim either way
        step(s)
    assert s.num_preemptions == 2 and Counter(r.tenant for r in s.running) == {"heavy": 2, "light": 2}

    with pytest.raises(AssertionError, match="never admitted"):
        run(fair=False)  # the seats stay with the heavy tenant's long decodes


def test_seat_claims_follow_the_weights():
    """A tenant of weight 3 holds 3 seats to a weight-1 tenant's 1 once both want more than their share."""
    s = make(max_num_seqs=4)
    for _ in range(6):
        s.add_request(req("a", n_prompt=20, max_tokens=500))
    for _ in range(3):
        step(s)
    for _ in range(6):
        s.add_request(req("b", n_prompt=20, max_tokens=500, weight=3.0))
    for _ in range(10):
        step(s)
    assert Counter(r.tenant for r in s.running) == {"a": 1, "b": 3}


def test_scheduler_keeps_interactive_before_batch_and_priority_within_a_tenant():
    s = make(max_num_seqs=1, fair_share_quantum=5)  # a turn admits one 5-token request
    batch = req("a", n_prompt=4, max_tokens=1, tier=Tier.BATCH, priority=100)
    low = req("a", n_prompt=4, max_tokens=1, tier=Tier.INTERACTIVE)
    high = req("a", n_prompt=4, max_tokens=1, tier=Tier.INTERACTIVE, priority=5)
    other = req("b", n_prompt=4, max_tokens=1, tier=Tier.INTERACTIVE)
    for r in (batch, low, high, other):
        s.add_request(r)
    order: list[Request] = []
    while s.has_unfinished():
        order += step(s)
    assert order == [high, other, low, batch]  # tenant a's best first, b's turn, a's next; batch last


def test_set_fair_share_requeues_the_waiting_requests():
    s = make()
    heavy = [req("heavy") for _ in range(6)]
    light = req("light")
    for r in [*heavy, light]:
        s.add_request(r)
    s.set_fair_share(False)
    assert list(s.waiting[Tier.BATCH]) == [*heavy, light]
    s.set_fair_share(True)
    assert s.waiting[Tier.BATCH].tenants() == ["heavy", "light"] and len(s.waiting[Tier.BATCH]) == 7


# --- the weight's way from the tenant row to the request ------------------------------------------------------

def _job_message(**kw):
    from inferq.contract import JobMessage

    return JobMessage(job_id="j1", tenant_id="t1", cache_namespace="ns1", model="tiny", tier="batch", priority=0,
                      request={"prompt_ids": [5, 6, 7], "max_tokens": 2}, enqueued_at=1_700_000_000.0, **kw)


def test_the_message_carries_the_weight_and_old_messages_decode():
    import msgpack

    from inferq.contract import JobMessage, MessageError

    default = _job_message()
    assert "weight" not in msgpack.unpackb(default.encode())  # the default leaves the wire map as it was
    assert JobMessage.decode(default.encode()).weight == 1.0
    heavy = _job_message(weight=2.5)
    assert msgpack.unpackb(heavy.encode())["weight"] == 2.5 and JobMessage.decode(heavy.encode()) == heavy
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(MessageError, match="weight"):
            JobMessage.decode(msgpack.packb({**default.to_wire(), "weight": bad}))


def test_the_driver_gives_the_request_its_tenant_and_weight():
    from unittest.mock import MagicMock

    from inferq.settings import Settings
    from worker.driver import EngineDriver
    from worker.streams import Message

    engine = MagicMock()
    engine.encode.side_effect = lambda prompt_ids: prompt_ids
    driver = EngineDriver(engine, Settings(), MagicMock(), MagicMock())
    assert driver.start(Message("s", "1-0", None, job=_job_message(weight=3.0)), 1, False) is None
    added = engine.add_request.call_args.args[0]
    assert (added.tenant, added.weight, added.cache_namespace) == ("t1", 3.0, "ns1")


def test_tenant_weight_column_set_and_enqueued(tmp_path):
    from types import SimpleNamespace

    import msgpack

    from api.tenants import TenantError, create_tenant, set_fair_share_weight
    from inferq.db import Base, make_engine, make_sessionmaker
    from inferq.jobs.enqueue import message_for
    from inferq.jobs.submission import tenant_weight

    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    Base.metadata.create_all(engine)
    db = make_sessionmaker(engine)
    tenant = create_tenant(db, "acme")
    assert tenant_weight(tenant) == 1.0
    tenant = set_fair_share_weight(db, "acme", 2.0)
    assert tenant_weight(tenant) == 2.0
    with pytest.raises(TenantError):
        set_fair_share_weight(db, "acme", 0.0)
    job = SimpleNamespace(id="j1", tenant_id=tenant.id, model="m", tier="batch", priority=0,
                          request={"prompt": "hi"}, deadline_at=None, queued_at=None)
    assert msgpack.unpackb(message_for(job, "ns", tenant_weight(tenant)))["weight"] == 2.0
    engine.dispose()


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(1, 10),
                               st.sampled_from(list(Tier)), st.integers(0, 2), st.integers(0, 6), st.booleans()),
                     min_size=1, max_size=16),
       weights=st.tuples(*[st.sampled_from([0.5, 1.0, 3.0])] * 3), num_blocks=st.integers(11, 40),
       budget=st.integers(1, 40), seqs=st.integers(1, 6), share=st.sampled_from([0.0, 0.1, 0.5]),
       quantum=st.sampled_from([1, 16, 64, 4096]))
def test_random_multi_tenant_workloads_always_finish(reqs, weights, num_blocks, budget, seqs, share, quantum):
    """Liveness and accounting with several tenants and weights: staggered arrivals, shared prefixes, aborts;
    each tenant's requests of one tier and priority start in arrival order."""
    s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_batched_tokens=budget, batch_min_share=share,
                                  fair_share_quantum=quantum), BlockManager(num_blocks, 4, True))
    weight = dict(zip("abc", weights, strict=True))
    pending = [(arrive, Request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8][:n] + [100 + i] * n, SamplingParams(max_tokens=m),
                                tier=tier, priority=prio, tenant=t, weight=weight[t]), abort)
               for i, (t, n, m, tier, prio, arrive, abort) in enumerate(reqs)]
    started: list[Request] = []
    added: list[Request] = []
    for step_no in range(800):
        for arrive, r, abort in pending:
            if arrive == step_no:
                s.add_request(r)
                added.append(r)
            if abort and step_no == 3 and not r.is_finished and r.request_id in s.requests:
                s.abort(r.request_id)
        if step_no > 6 and not s.has_unfinished():
            break
        started += [r for r in step(s) if r.num_preemptions == 0 and r not in started]
        assert len(s.running) <= seqs
    else:
        raise AssertionError("hang")
    assert s.bm.num_free == s.bm.num_blocks and all(r.is_finished for _, r, _ in pending)
    for group in {(r.tenant, r.tier, r.priority) for r in started}:
        mine = [r for r in started if (r.tenant, r.tier, r.priority) == group]
        assert mine == sorted(mine, key=added.index)


def test_the_benchmark_simulation_serves_the_light_tenant_early():
    """``python -m bench fairness``'s noise-free part: the real scheduler with a fake model, TTFT in steps."""
    import random

    from bench import fairness as bench_fairness

    rng = random.Random(0)
    light = bench_fairness._items(1000, 4, rng, (16, 64), 8)
    heavy = bench_fairness._items(1000, 10 * 4 + 12, rng, (16, 64), 8)
    sim = bench_fairness.simulate(light, heavy, backlog=12, max_num_seqs=4)
    assert sim["alone"]["light_ttft_p95_s"] == 1.0  # one step: its prefill samples the first token
    assert sim["fair on"]["light_ttft_p95_s"] <= 2.0 < 10 < sim["fair off"]["light_ttft_p95_s"]
    assert sim["fair on"]["heavy_requests"] == sim["fair off"]["heavy_requests"] >= 40
