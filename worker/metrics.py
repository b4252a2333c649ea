"""Prometheus metrics of one worker process (its own registry, served by ``--metrics-port``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("inferq_queue_depth", "Messages in the job stream not yet finished (waiting + pending).",
                                 ["stream"], registry=r)
        self.queue_pending = Gauge("inferq_queue_pending", "Messages delivered to a worker and not yet acknowledged.",
                                   ["stream"], registry=r)
        self.queue_oldest_age = Gauge("inferq_queue_oldest_age_seconds", "Age of the oldest unfinished message.",
                                      ["stream"], registry=r)
        self.running = Gauge("inferq_requests_running", "Requests the engine is running.", registry=r)
        self.waiting = Gauge("inferq_requests_waiting", "Requests admitted to the engine and waiting to run.", registry=r)
        self.inflight = Gauge("inferq_jobs_in_flight", "Jobs this worker holds (running, waiting or being finalized).",
                              registry=r)
        self.kv_usage = Gauge("inferq_kv_cache_usage_ratio", "Share of KV-cache blocks in use.", registry=r)
        self.prefix_hit_rate = Gauge("inferq_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache.",
                                     registry=r)
        self.preemptions = Gauge("inferq_preemptions", "Preemptions since the worker started.", registry=r)
        self.busy_seconds = Gauge("inferq_engine_busy_seconds", "Seconds the engine spent in steps.", registry=r)
        self.tokens = Counter("inferq_tokens", "Tokens processed, by kind (prompt, cached_prompt, completion).",
                              ["tier", "kind"], registry=r)
        self.jobs = Counter("inferq_jobs_finished", "Jobs that reached a terminal status on this worker.",
                            ["tier", "status"], registry=r)
        self.dead_letters = Counter("inferq_dead_letters", "Malformed messages moved to the dead-letter stream.",
                                    registry=r)
        self.reclaimed = Counter("inferq_messages_reclaimed", "Messages reclaimed from other (dead) workers.",
                                 registry=r)
        self.handed_back = Counter("inferq_jobs_handed_back", "Jobs handed back to the queue at shutdown.", registry=r)
        self.db_errors = Counter("inferq_db_errors", "Database operations that failed (outages).", registry=r)
        self.result_write_errors = Counter("inferq_result_write_errors",
                                           "Jobs failed because their result could not be stored.", registry=r)
        self.queue_time = Histogram("inferq_queue_seconds", "Acceptance to start.", ["tier"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("inferq_time_to_first_token_seconds", "Acceptance to first token.", ["tier"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("inferq_time_per_output_token_seconds", "Mean time between output tokens.", ["tier"],
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("inferq_e2e_seconds", "Acceptance to terminal status.", ["tier"],
                             buckets=_LATENCY_BUCKETS, registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def engine_stats(self, engine: Any) -> None:
        """Copy gauges from the engine (its ``stats``, scheduler and block manager; missing parts are skipped)."""
        stats = getattr(engine, "stats", None)
        sched = getattr(engine, "scheduler", None)
        bm = getattr(engine, "block_manager", None)
        values = (
            (self.running, lambda: len(sched.running)),
            (self.waiting, lambda: sched.num_waiting),
            (self.kv_usage, lambda: bm.usage),
            (self.prefix_hit_rate, lambda: stats.prefix_hit_rate),
            (self.preemptions, lambda: stats.preemptions),
            (self.busy_seconds, lambda: stats.busy_seconds),
        )
        for gauge, get in values:
            try:
                value = get()
            except Exception:
                continue
            if isinstance(value, (int, float)):
                gauge.set(value)

    def job_finished(self, tier: str, status: str, *, prompt: int, cached: int, completion: int,
                     queue: float | None, ttft: float | None, tpot: float | None, e2e: float | None) -> None:
        self.jobs.labels(tier, status).inc()
        self.tokens.labels(tier, "prompt").inc(prompt)
        self.tokens.labels(tier, "cached_prompt").inc(cached)
        self.tokens.labels(tier, "completion").inc(completion)
        for hist, value in ((self.queue_time, queue), (self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
            if value is not None and value >= 0:
                hist.labels(tier).observe(value)
