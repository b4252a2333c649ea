"""The Celery application: same Redis as the job transport (``settings.broker_url`` /
``settings.result_backend``, both default to ``redis_url``), a queue named after ``settings.stream_prefix``
(default ``inferq``) plus Celery's default queue ``celery``.

Tasks (``api/tasks.py``): ``inferq.submit`` → job id; ``inferq.generate`` → the finished job as
``GET /v1/jobs/{id}`` returns it. Keyword arguments are the REST body fields plus ``api_key`` (and
optionally ``idempotency_key``; ``timeout`` for generate).

Client side, without importing inferq::

    from celery import Celery
    app = Celery(broker="redis://127.0.0.1:6379/0", backend="redis://127.0.0.1:6379/0")
    r = app.send_task("inferq.generate", kwargs={"api_key": KEY, "prompt": "Hi", "max_tokens": 16})
    print(r.get(timeout=120)["text"])

The worker consumes Celery's default queue too (``settings.celery_consume_default_queue``), so ``queue=``
may be left out; ``queue="inferq"`` still works. Task failures a client causes (``Unauthorized``,
``InvalidRequest``, quota, conflict) and failed or timed-out jobs are expected outcomes: the worker logs
them as one line ("raised expected"), never as an error with a traceback (``api.tasks``' ``throws``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.app.defaults import DEFAULTS

from inferq.settings import Settings, get_settings

CELERY_DEFAULT_QUEUE: str = DEFAULTS["task_default_queue"]  # "celery": where a client's send_task goes by default


def queue_name(settings: Settings) -> str:
    return settings.stream_prefix


def consumed_queues(settings: Settings) -> list[str]:
    """The queues ``inferq celery-worker`` consumes: its own and, unless turned off, Celery's default one, so
    that the natural ``send_task("inferq.generate", kwargs=...)`` without ``queue=`` is served, not left
    waiting until the client's timeout."""
    queues = [queue_name(settings)]
    if settings.celery_consume_default_queue and CELERY_DEFAULT_QUEUE not in queues:
        queues.append(CELERY_DEFAULT_QUEUE)
    return queues


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("inferq", broker=settings.broker_url, backend=settings.result_backend, include=["api.tasks"])
    app.conf.update(
        task_default_queue=queue_name(settings),
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=24 * 3600,
        result_extended=True,
        task_acks_late=True,  # a worker that dies mid-task leaves the message for another
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        worker_hijack_root_logger=False,
        enable_utc=True,
    )
    app.inferq_settings = settings  # type: ignore[attr-defined]
    return app


_app: Celery | None = None


def get_app() -> Celery:
    """The process-wide Celery app built from the process settings (``celery -A api.celery_app worker``)."""
    global _app
    if _app is None:
        _app = make_celery()
    return _app


def __getattr__(name: str) -> Any:
    if name in ("app", "celery_app", "celery"):
        return get_app()
    raise AttributeError(name)
