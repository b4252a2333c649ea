"""The FastAPI application: ``create_app(settings=None)``. Run with ``inferq api`` or
``uvicorn --factory api.app:create_app``. Never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from typing import Any

import redis
import redis.asyncio as aredis
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api import metrics
from api.admission import ModelAdmission
from api.auth import KeyCache
from api.body_limit import BodySizeLimit
from api.docs_pages import install_docs
from api.errors import first_line, install_handlers
from api.events import StreamLimiter
from api.health import RedisHealth
from api.routes_files import upload_body_limit
from api.routes_jobs import SubmitBatcher
from api.schemas import Health, Readiness
from api.validation import NO_NUL_PATTERN
from inferq import __version__
from inferq.db import make_engine, make_sessionmaker
from inferq.jobs.backlog import model_queues
from inferq.log import configure_logging, get_logger
from inferq.models_registry import MAX_NAME_LENGTH as MAX_MODEL_NAME_LENGTH
from inferq.models_registry import NAME_PATTERN as MODEL_NAME_PATTERN
from inferq.models_registry import ModelCatalog
from inferq.settings import Settings, get_settings

log = get_logger("inferq.api")

DESCRIPTION = """\
Asynchronous LLM inference. Submit a job (`POST /v1/jobs`, answered **202** once it is stored), then poll
it (`GET /v1/jobs/{id}`), stream its text (`GET /v1/jobs/{id}/events`, server-sent events) or receive it
on a signed webhook. Usage and cost come from the token-cost ledger (`GET /v1/usage`).

Authenticate with `Authorization: Bearer <api key>` (keys come from `inferq keys create TENANT`).
Every error has the shape `{"error": {"type", "message", "fields"}}`.
"""

TAGS = [
    {"name": "jobs", "description": "Submit, inspect, list, cancel and stream generation jobs."},
    {"name": "usage", "description": "Token usage and cost from the ledger."},
    {"name": "ops", "description": "Health, readiness and Prometheus metrics."},
]


# threads that run the blocking part of submissions (see api/routes_jobs.create_job); 8 measured as fast as
# 16 with a lower p99 on 2 cores (a tenant's submissions serialise on its PostgreSQL lock anyway)
SUBMIT_THREADS = 8
# an event stream waits at most this long for a Redis connection (it should never wait: see async_redis)
SSE_POOL_WAIT_SECONDS = 10.0


class AppState:
    """Everything a request needs: settings, the DB session factory and the Redis clients."""

    def __init__(self, settings: Settings, *, auth_cache_seconds: float) -> None:
        self.settings = settings
        self.engine: Engine = make_engine(settings.database_url, **_engine_kwargs(settings.database_url))
        self.session_factory: sessionmaker = make_sessionmaker(self.engine)
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=5,
                                          health_check_interval=30, max_connections=64)
        self._aredis: dict[int, aredis.Redis] = {}
        self.streams = StreamLimiter(settings.sse_max_streams)
        self.key_cache = KeyCache(auth_cache_seconds)
        self.redis_health = RedisHealth()
        self.models = ModelCatalog(self.redis, settings.stream_prefix)  # what the workers serve (their heartbeats)
        self.admission = ModelAdmission(self.models, settings.model)
        # POST /v1/jobs: the blocking part of a submission (database, XADD) runs here, one hop per request;
        # a few threads keep both the connections and the GIL hand-offs per request low
        self.submit_executor = ThreadPoolExecutor(max_workers=SUBMIT_THREADS,
                                                  thread_name_prefix="inferq-submit")
        self.batcher = SubmitBatcher(self)
        self.dispatcher: Any = None

    def async_redis(self) -> aredis.Redis:
        """An asyncio Redis client bound to the running event loop (SSE streams block on XREAD)."""
        loop = asyncio.get_running_loop()
        client = self._aredis.get(id(loop))
        if client is None:
            # sized to the stream limit (a stream uses one connection at a time), so a connection is always
            # free; blocking (not failing) if that ever is not so
            pool = aredis.BlockingConnectionPool.from_url(
                self.settings.redis_url, max_connections=self.settings.sse_max_streams,
                timeout=SSE_POOL_WAIT_SECONDS, socket_connect_timeout=2, health_check_interval=30)
            client = aredis.Redis.from_pool(pool)
            self._aredis[id(loop)] = client
        return client

    async def aclose(self) -> None:
        for client in self._aredis.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._aredis.clear()

    def close(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.stop()
            self.dispatcher = None
        self.submit_executor.shutdown(wait=True)
        self.redis.close()
        self.engine.dispose()


def _engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("postgresql"):
        # fail fast (503) when the database is unreachable instead of hanging a request
        return {"connect_args": {"connect_timeout": 3}, "pool_timeout": 5}
    return {}


def create_app(settings: Settings | None = None, *, webhooks: bool = True, auth_cache_seconds: float = 5.0) -> FastAPI:
    """Build the API. ``webhooks``: run the webhook dispatcher as a background thread in this process
    (started with the app's lifespan). ``auth_cache_seconds``: how long a key lookup is reused."""
    settings = settings or get_settings()
    configure_logging(settings.log_level, settings.log_json)
    state = AppState(settings, auth_cache_seconds=auth_cache_seconds)
    app = FastAPI(
        title="inferq",
        version=__version__,
        docs_url=None,  # served from the installed package by api.docs_pages, not from a CDN
        redoc_url=None,
        summary="Redis-queue-driven asynchronous LLM inference.",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=_lifespan(state, webhooks=webhooks),
        debug=settings.debug,
    )
    app.state.inferq = state
    install_handlers(app)
    app.add_middleware(metrics.MetricsMiddleware)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes,
                       path_limits={"/v1/files": upload_body_limit(settings)})
    _include_routers(app)
    _install_openapi(app)
    install_docs(app)
    _add_ops_routes(app, state)
    return app


def _lifespan(state: AppState, *, webhooks: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start the webhook dispatcher (when ``webhooks``) with the app; close the clients and pools after it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if webhooks:
            from api.webhooks import WebhookDispatcher

            state.dispatcher = WebhookDispatcher(state.settings, state.session_factory)
            state.dispatcher.start()
        try:
            yield
        finally:
            await state.aclose()
            await run_in_threadpool(state.close)

    return lifespan


def _include_routers(app: FastAPI) -> None:
    from api.routes_batches import router as batches_router
    from api.routes_files import router as files_router
    from api.routes_jobs import router as jobs_router
    from api.routes_models import router as models_router
    from api.routes_openai import router as openai_router
    from api.routes_usage import router as usage_router

    app.include_router(jobs_router)
    app.include_router(usage_router)
    app.include_router(openai_router)
    app.include_router(models_router)
    app.include_router(files_router)
    app.include_router(batches_router)


def _install_openapi(app: FastAPI) -> None:
    """The OpenAPI document, built once on first request, refined by ``_refine_openapi``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _refine_openapi(get_openapi(
                title=app.title, version=app.version, summary=app.summary, description=app.description,
                routes=app.routes, tags=app.openapi_tags))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_ops_routes(app: FastAPI, state: AppState) -> None:
    """``/healthz``, ``/readyz`` and ``/metrics``."""

    @app.get("/healthz", tags=["ops"], response_model=Health, summary="Liveness: the process is up.")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], response_model=Readiness,
             summary="Readiness: database and Redis reachable, and a worker serving a model.",
             responses={503: {"model": Readiness, "description": "A dependency is unreachable or no worker serves "
                              "any model; `checks` says why."}})
    def readyz() -> JSONResponse:
        return _readiness(state)

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics.",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format."}})
    def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


def _readiness(state: AppState) -> JSONResponse:
    """Ready when the database and Redis answer and at least one worker serves a model (its heartbeat in the
    model registry is current); ``models`` lists the live workers of every known model."""
    checks = {"database": "ok", "redis": "ok", "workers": "ok"}
    models: dict[str, list[str]] = {}
    try:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        checks["database"] = f"unreachable: {first_line(exc)}"
    try:
        state.redis.ping()
        models = state.models.serving()
    except Exception as exc:
        checks["redis"] = f"unreachable: {first_line(exc)}"
        checks["workers"] = "unknown: redis unreachable"
    else:
        if not any(models.values()):
            checks["workers"] = ("no worker serves any model yet (a starting worker registers once its model is "
                                 "loaded)" if models else "no worker has registered a model")
    queues: dict[str, dict[str, dict]] = {}
    if checks["redis"] == "ok":
        try:  # the autoscaling signal per model and tier (inferq/jobs/backlog.py); never decides readiness
            queues = model_queues(state.redis, state.settings.stream_prefix, state.settings.consumer_group, models)
        except Exception as exc:
            log.warning("could not read the queue numbers for /readyz", error=first_line(exc))
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ok else "unavailable", "checks": checks, "models": models,
                         "queues": queues}, status_code=200 if ok else 503)


def _refine_openapi(spec: dict[str, Any]) -> dict[str, Any]:
    """What pydantic cannot say about JobCreate (so generated clients and schemathesis know it): exactly
    one of prompt, messages, prompt_ids (a oneOf), and no NUL characters in stored text. FastAPI's stock
    422 is dropped where a route answers its own way (OpenAI-shaped routes answer 400), and optional
    headers are not nullable."""
    schemas = spec.get("components", {}).get("schemas", {})
    _drop_stock_validation_errors(spec)
    _headers_not_nullable(spec)
    job = schemas.get("JobCreate")
    if job is not None:
        props = job.get("properties", {})
        for name in ("model", "prompt"):
            for alt in props.get(name, {}).get("anyOf", []):
                if alt.get("type") == "string":
                    alt["pattern"] = NO_NUL_PATTERN
        for alt in props.get("model", {}).get("anyOf", []):  # a model name (inferq.models_registry.name_problem)
            if alt.get("type") == "string":
                alt.update(pattern=MODEL_NAME_PATTERN, maxLength=MAX_MODEL_NAME_LENGTH)
        stop_items = props.get("stop", {}).get("items")
        if stop_items is not None:
            stop_items["pattern"] = NO_NUL_PATTERN
    content = schemas.get("ChatMessage", {}).get("properties", {}).get("content")
    if content is not None:
        content["pattern"] = NO_NUL_PATTERN
    if job is not None and "oneOf" not in job:
        job["oneOf"] = [  # titled, so that docs and generated clients name the variants
            {"title": "JobCreate with prompt", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"title": "JobCreate with messages", "required": ["messages"],
             "properties": {"messages": {"type": "array"}}},
            {"title": "JobCreate with prompt_ids", "required": ["prompt_ids"],
             "properties": {"prompt_ids": {"type": "array"}}},
        ]
    return spec


def _headers_not_nullable(spec: dict[str, Any]) -> None:
    """An optional header (``str | None``) is documented by FastAPI as "string or null", but a header is
    text or absent: a client that took the null at its word would send the text ``null``."""
    for operations in spec.get("paths", {}).values():
        for op in operations.values():
            for param in op.get("parameters", []) if isinstance(op, dict) else []:
                schema = param.get("schema", {})
                alts = [a for a in schema.get("anyOf", []) if a.get("type") != "null"]
                if param.get("in") == "header" and len(alts) == 1 and len(schema["anyOf"]) == 2:
                    rest = {k: v for k, v in schema.items() if k != "anyOf"}
                    param["schema"] = {**alts[0], **rest}


def _drop_stock_validation_errors(spec: dict[str, Any]) -> None:
    """FastAPI documents a 422 ``HTTPValidationError`` on every route with parameters, but no route answers
    it: inferq's routes document their own 422 (``INVALID``) and the OpenAI-shaped ones answer 400."""
    stock = "#/components/schemas/HTTPValidationError"
    for operations in spec.get("paths", {}).values():
        for op in operations.values():
            responses = op.get("responses", {})
            if stock in json.dumps(responses.get("422", {})):
                del responses["422"]
    schemas = spec.get("components", {}).get("schemas", {})
    if stock not in json.dumps(spec.get("paths", {})):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)


def create_app_without_webhooks() -> FastAPI:
    """Factory for ``inferq api --no-webhooks`` (webhooks delivered by ``inferq webhooks`` elsewhere)."""
    return create_app(webhooks=False)


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``api.app:app`` for ``uvicorn api.app:app``: built on first access from the process settings."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_app()
        return _app
    raise AttributeError(name)
