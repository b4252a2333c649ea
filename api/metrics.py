"""Prometheus metrics of the API process (module-level: one set per process, however many apps)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.routing import Match

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
        where = {"path": scope.get("path"), "root_path": scope.get("root_path", "")}  # a Mount rewrites these

        async def _send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            path = _route_template(scope, where)
            method = scope.get("method", "")
            REQUESTS.labels(method, path, str(status)).inc()
            LATENCY.labels(method, path).observe(time.perf_counter() - start)


def _route_template(scope: dict, where: dict[str, Any]) -> str:
    """The template of the route that served the request (bounded label values), ``unmatched`` for none.
    FastAPI's own routes leave it in ``scope["route"]``; Starlette's (``/openapi.json``, the docs assets
    mount) do not, so those are matched again here, as the router matched them, from the original path."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    app = scope.get("app")
    if app is None or scope.get("endpoint") is None:  # nothing served it (404 before any route)
        return "unmatched"
    original = {**scope, **where}
    for candidate in app.router.routes:
        if candidate.matches(original)[0] == Match.FULL:
            return getattr(candidate, "path", None) or "unmatched"
    return "unmatched"
