"""The worker's autoscaling gauges (issue 17, item 3): busy engine seats per tier and all seats, from the
scheduler; the queue backlog gauge sits beside depth and pending."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from scheduler.request import Tier
from worker.metrics import WorkerMetrics


def test_busy_seats_per_tier_and_all_seats_are_exported():
    m = WorkerMetrics(model="m")
    running = [SimpleNamespace(tier=Tier.INTERACTIVE)] * 3 + [SimpleNamespace(tier=Tier.BATCH)]
    engine = SimpleNamespace(scheduler=SimpleNamespace(running=running, num_waiting=0,
                                                       config=SimpleNamespace(max_num_seqs=8)))
    m.engine_stats(engine)
    text = generate_latest(m.registry).decode()
    assert 'inferq_engine_seats_busy{model="m",tier="interactive"} 3.0' in text
    assert 'inferq_engine_seats_busy{model="m",tier="batch"} 1.0' in text
    assert 'inferq_engine_seats{model="m"} 8.0' in text
    assert m.seats_by_tier() == {"interactive": 3.0, "batch": 1.0}
    engine.scheduler.running = []
    m.engine_stats(engine)
    assert m.seats_by_tier() == {"interactive": 0.0, "batch": 0.0}


def test_queue_backlog_is_exported_per_tier_stream():
    m = WorkerMetrics(model="m")
    m.queue_backlog.labels("p:jobs:m:interactive").set(5)
    assert 'inferq_queue_backlog{model="m",stream="p:jobs:m:interactive"} 5.0' in generate_latest(m.registry).decode()
