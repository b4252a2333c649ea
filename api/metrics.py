"""Prometheus metrics of the API process (module-level: one set per process, however many apps)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

REQUESTS = Counter("inferq_api_requests_total", "HTTP requests handled.", ["method", "route", "status"])
LATENCY = Histogram("inferq_api_request_seconds", "HTTP request latency.", ["method", "route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
SUBMITTED = Counter("inferq_api_jobs_submitted_total", "Jobs accepted (new, not idempotent replays).", ["tier"])
REJECTED = Counter("inferq_api_jobs_rejected_total", "Submissions refused.", ["reason"])
WEBHOOK_ATTEMPTS = Counter("inferq_webhook_attempts_total", "Webhook delivery attempts.", ["outcome"])
SSE_STREAMS = Counter("inferq_api_event_streams_total", "Event streams opened.", ["source"])


def render() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware (cheap): counts and times every HTTP request by route template."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def _send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            REQUESTS.labels(method, path, str(status)).inc()
            LATENCY.labels(method, path).observe(time.perf_counter() - start)
