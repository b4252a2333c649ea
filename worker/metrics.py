"""Prometheus metrics of one worker process (its own registry, served by ``--metrics-port``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _ForModel:
    """A metric whose first label is ``model``, bound to this worker's model: ``labels(*rest)`` takes the
    other labels, and a metric with no other label is used directly (``inc``/``set``/``observe``)."""

    def __init__(self, metric: Any, model: str) -> None:
        self._metric, self._model = metric, model

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model, *values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metric.labels(self._model), name)


class WorkerMetrics:
    """Every series carries ``model`` (as vLLM's ``model_name``), so the metrics of several models' workers
    can be summed or told apart. Things that only go up are counters (``_total``); gauges are levels."""

    def __init__(self, registry: CollectorRegistry | None = None, model: str = "") -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        # the engine's running totals last copied into the counters
        self._engine_totals = {"preemptions": 0.0, "busy_seconds": 0.0, "steps": 0.0, "spec_proposed_tokens": 0.0,
                               "spec_accepted_tokens": 0.0, "spec_drafts": 0.0}

        def metric(kind: Any, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> _ForModel:
            m = kind(name, doc, ["model", *labels], registry=self.registry, **kw)
            if not labels:
                m.labels(model)  # exported (at 0) from the start, as an unlabelled metric would be
            return _ForModel(m, model)

        self.queue_depth = metric(Gauge, "inferq_queue_depth",
                                  "Messages in a tier's job streams (its own and its tenants' lanes) not yet finished (waiting + pending).",
                                  ("stream",))
        self.queue_pending = metric(Gauge, "inferq_queue_pending",
                                    "Messages delivered to a worker and not yet acknowledged.", ("stream",))
        self.queue_oldest_age = metric(Gauge, "inferq_queue_oldest_age_seconds", "Age of the oldest unfinished message.",
                                       ("stream",))
        self._fleet_metrics(metric)
        self.running = metric(Gauge, "inferq_requests_running", "Requests the engine is running.")
        self.waiting = metric(Gauge, "inferq_requests_waiting", "Requests admitted to the engine and waiting to run.")
        self.inflight = metric(Gauge, "inferq_jobs_in_flight",
                               "Jobs this worker holds (running, waiting or being finalized).")
        self.kv_usage = metric(Gauge, "inferq_kv_cache_usage_ratio", "Share of KV-cache blocks in use.")
        self.prefix_hit_rate = metric(Gauge, "inferq_prefix_cache_hit_rate",
                                      "Share of prompt tokens served from the prefix cache.")
        self.preemptions = metric(Counter, "inferq_preemptions", "Preemptions since the worker started.")
        self.busy_seconds = metric(Counter, "inferq_engine_busy_seconds", "Seconds the engine spent in steps.")
        self.weight_bytes = metric(Gauge, "inferq_model_weight_bytes",
                                   "Bytes of model weights a forward reads (quantised ones as stored).")
        self.kv_bytes_per_token = metric(Gauge, "inferq_kv_cache_bytes_per_token",
                                         "KV-cache bytes one token takes (all layers, K and V).")
        self._speculation_metrics(metric)
        self.tokens = metric(Counter, "inferq_tokens",
                             "Tokens processed, by kind. The kinds are disjoint: prompt_cached (served from the "
                             "prefix cache) + prompt_uncached (computed) = prompt tokens; their sum with "
                             "completion is every token.", ("tier", "kind"))
        self.jobs = metric(Counter, "inferq_jobs_finished", "Jobs that reached a terminal status on this worker.",
                           ("tier", "status"))
        self.dead_letters = metric(Counter, "inferq_dead_letters", "Malformed messages moved to the dead-letter stream.")
        self.reclaimed = metric(Counter, "inferq_messages_reclaimed", "Messages reclaimed from other (dead) workers.")
        self.handed_back = metric(Counter, "inferq_jobs_handed_back", "Jobs handed back to the queue at shutdown.")
        self.db_errors = metric(Counter, "inferq_db_errors", "Database operations that failed (outages).")
        self.result_write_errors = metric(Counter, "inferq_result_write_errors",
                                          "Jobs failed because their result could not be stored.")
        self.queue_time = metric(Histogram, "inferq_queue_seconds", "Acceptance to start.", ("tier",),
                                 buckets=_LATENCY_BUCKETS)
        self.ttft = metric(Histogram, "inferq_time_to_first_token_seconds", "Acceptance to first token.", ("tier",),
                           buckets=_LATENCY_BUCKETS)
        self.tpot = metric(Histogram, "inferq_time_per_output_token_seconds", "Mean time between output tokens.",
                           ("tier",), buckets=_TPOT_BUCKETS)
        self.e2e = metric(Histogram, "inferq_e2e_seconds", "Acceptance to terminal status.", ("tier",),
                          buckets=_LATENCY_BUCKETS)

    def _speculation_metrics(self, metric: Any) -> None:
        """vLLM's spec_decode counters under our names: accepted / proposed is the acceptance rate, accepted /
        drafts the mean accepted length, proposed / steps the proposals per engine step."""
        self.spec_proposed = metric(Counter, "inferq_spec_proposed_tokens",
                                    "Speculative tokens proposed and verified (finished requests).")
        self.spec_accepted = metric(Counter, "inferq_spec_accepted_tokens",
                                    "Speculative tokens accepted (each saved a model step); divided by "
                                    "inferq_spec_proposed_tokens_total: the acceptance rate.")
        self.spec_drafts = metric(Counter, "inferq_spec_drafts",
                                  "Verified (request, step) pairs that held proposals (finished requests); "
                                  "inferq_spec_accepted_tokens_total divided by this: the mean accepted length.")
        self.steps = metric(Counter, "inferq_engine_steps",
                            "Engine steps run; inferq_spec_proposed_tokens_total divided by this: the proposals "
                            "per step.")

    def _fleet_metrics(self, metric: Any) -> None:
        """What an autoscaler and the cache-aware router are judged by (issue 17)."""
        self.queue_backlog = metric(Gauge, "inferq_queue_backlog",
                                    "Messages in a tier's job streams not yet delivered to any worker (the "
                                    "autoscaling signal: depth minus pending).", ("stream",))
        self.seats = metric(Gauge, "inferq_engine_seats", "Requests this worker's engine can run at once "
                            "(max_num_seqs).")
        self.seats_busy = metric(Gauge, "inferq_engine_seats_busy", "Seats of this worker's engine running a "
                                 "request, per tier.", ("tier",))
        self.routed_taken_over = metric(Counter, "inferq_routed_messages_taken_over",
                                        "Routed jobs this worker took from another worker's lane (the owner gone, "
                                        "or the job waited cache_routing_max_wait_ms).")

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def engine_stats(self, engine: Any) -> None:
        """Copy the engine's levels into the gauges and its running totals into the counters (by the
        increase since the last copy); missing parts are skipped."""
        stats = getattr(engine, "stats", None)
        sched = getattr(engine, "scheduler", None)
        bm = getattr(engine, "block_manager", None)
        levels = (
            (self.running, lambda: len(sched.running)),
            (self.waiting, lambda: sched.num_waiting),
            (self.kv_usage, lambda: bm.usage),
            (self.prefix_hit_rate, lambda: stats.prefix_hit_rate),
            (self.weight_bytes, lambda: engine.runner.weight_bytes),
            (self.kv_bytes_per_token, lambda: engine.runner.kv_bytes_per_token),
        )
        for gauge, get in levels:
            value = _number(get)
            if value is not None:
                gauge.set(value)
        self._seat_stats(sched)
        for name, counter in (("preemptions", self.preemptions), ("busy_seconds", self.busy_seconds),
                              ("steps", self.steps), ("spec_proposed_tokens", self.spec_proposed),
                              ("spec_accepted_tokens", self.spec_accepted), ("spec_drafts", self.spec_drafts)):
            value = _number(lambda name=name: getattr(stats, name))
            if value is not None and value > self._engine_totals[name]:
                counter.inc(value - self._engine_totals[name])
                self._engine_totals[name] = value

    def _seat_stats(self, sched: Any) -> None:
        """Seats in all and busy per tier, from the scheduler's config and running list (skipped if absent)."""
        total = _number(lambda: sched.config.max_num_seqs)
        if total is not None:
            self.seats.set(total)
        running = getattr(sched, "running", None)
        if running is None:
            return
        busy = dict.fromkeys(("interactive", "batch"), 0)
        for req in list(running):
            tier = getattr(getattr(req, "tier", None), "value", None) or str(getattr(req, "tier", "batch"))
            busy[tier] = busy.get(tier, 0) + 1
        for tier, count in busy.items():
            self.seats_busy.labels(tier).set(count)

    def seats_by_tier(self) -> dict[str, float]:
        """The busy seats per tier as last set (for the worker's stats hash)."""
        out: dict[str, float] = {}
        for metric in self.seats_busy._metric.collect():
            for sample in metric.samples:
                if sample.labels.get("model") == self.model:
                    out[sample.labels["tier"]] = sample.value
        return out

    def job_finished(self, tier: str, status: str, *, prompt: int, cached: int, completion: int,
                     queue: float | None, ttft: float | None, tpot: float | None, e2e: float | None) -> None:
        self.jobs.labels(tier, status).inc()
        self.tokens.labels(tier, "prompt_uncached").inc(max(0, prompt - cached))
        self.tokens.labels(tier, "prompt_cached").inc(cached)
        self.tokens.labels(tier, "completion").inc(completion)
        for hist, value in ((self.queue_time, queue), (self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
            if value is not None and value >= 0:
                hist.labels(tier).observe(value)


def _number(get: Any) -> float | None:
    try:
        value = get()
    except Exception:
        return None
    return value if isinstance(value, (int, float)) else None
