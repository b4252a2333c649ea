"""Celery tasks ``inferq.submit`` and ``inferq.generate``. Same validation, auth, quotas and submission
as ``POST /v1/jobs`` (``inferq.contract.JobCreate``, ``inferq.jobs.submit``); failures are task failures
whose message says what was wrong."""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Task, shared_task
from pydantic import ValidationError

from api.admission import ModelAdmission
from api.auth import lookup_key
from api.errors import ApiError, validation_fields
from api.validation import body_errors
from api.views import get_job_view
from inferq import jobs
from inferq.contract import JobCreate, events_key
from inferq.db import TERMINAL_STATUSES, make_engine, make_sessionmaker
from inferq.models_registry import ModelCatalog
from inferq.settings import Settings, get_settings


class InferqTaskError(Exception):
    """Base of the task failures (the message is the reason)."""


class InvalidRequest(InferqTaskError):
    pass


class Unauthorized(InferqTaskError):
    pass


class QuotaExceededError(InferqTaskError):
    pass


class ConflictError(InferqTaskError):
    pass


class JobFailed(InferqTaskError):
    pass


class JobTimeout(InferqTaskError):
    pass


# outcomes, not worker errors: Celery logs these as one INFO line ("raised expected"), without a traceback
EXPECTED_FAILURES = (InferqTaskError,)


class _Resources:
    def __init__(self, settings: Settings) -> None:
        import redis

        self.settings = settings
        self.engine = make_engine(settings.database_url)
        self.session_factory = make_sessionmaker(self.engine)
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, health_check_interval=30)
        # the same model checks as POST /v1/jobs: a job no worker can run is refused, never queued forever
        self.admission = ModelAdmission(ModelCatalog(self.redis, settings.stream_prefix), settings.model)


_resources: dict[int, _Resources] = {}
_lock = threading.Lock()


def resources(task: Task) -> _Resources:
    settings = getattr(task.app, "inferq_settings", None) or get_settings()
    key = id(settings)
    res = _resources.get(key)
    if res is None:
        with _lock:
            res = _resources.get(key)
            if res is None:
                res = _resources[key] = _Resources(settings)
    return res


def _submit(res: _Resources, kwargs: dict[str, Any], task_id: str | None = None) -> str:
    """Validate and submit. Without an ``idempotency_key`` the task id is the key: a task redelivered after
    its worker died (``acks_late``) finds the job its first run submitted instead of submitting another."""
    kwargs = dict(kwargs)
    api_key = kwargs.pop("api_key", None)
    idempotency_key = kwargs.pop("idempotency_key", None) or (f"celery-{task_id}" if task_id else None)
    if not isinstance(api_key, str) or not api_key:
        raise Unauthorized("missing api_key")
    principal = lookup_key(res.session_factory, api_key)
    if principal is None:
        raise Unauthorized("invalid or revoked api_key")
    try:
        body = JobCreate.model_validate(kwargs)
    except ValidationError as exc:
        fields = validation_fields(exc.errors())  # type: ignore[arg-type]
        raise InvalidRequest("invalid job: " + "; ".join(f"{f['field']}: {f['reason']}" for f in fields)) from None
    errors = body_errors(body, res.settings.allowlist)
    if errors:
        raise InvalidRequest("invalid job: " + "; ".join(f"{e['field']}: {e['reason']}" for e in errors))
    try:
        admitted = res.admission.admit(body)
    except ApiError as exc:
        raise InvalidRequest(f"invalid job ({exc.type}): {exc.message}") from None
    try:
        job, _created = jobs.submit(res.session_factory, res.redis, res.settings, principal.tenant, admitted.body,
                                    idempotency_key, prompt_tokens=admitted.prompt_tokens)
    except jobs.QuotaExceeded as exc:
        raise QuotaExceededError(f"quota exceeded: {exc} (retry after {exc.retry_after} s)") from None
    except jobs.Conflict as exc:
        raise ConflictError(f"conflict: {exc}") from None
    return job.id


def wait_for_job(res: _Resources, job_id: str, timeout: float) -> dict[str, Any]:
    """Block until the job is terminal: wake on its event stream, confirm in PostgreSQL."""
    key = events_key(res.settings.stream_prefix, job_id)
    last = "0-0"
    deadline = time.monotonic() + timeout
    while True:
        with res.session_factory() as s:
            view = get_job_view(s, job_id)
        if view is None:
            raise JobFailed(f"job {job_id} disappeared")
        if view["status"] in TERMINAL_STATUSES:
            return view
        left = deadline - time.monotonic()
        if left <= 0:
            raise JobTimeout(f"job {job_id} not finished after {timeout:g} s (status {view['status']}); "
                             f"it keeps running: poll GET /v1/jobs/{job_id}")
        try:
            resp: Any = res.redis.xread({key: last}, count=1000, block=int(min(left, 2.0) * 1000))
        except Exception:
            time.sleep(min(left, 1.0))
            continue
        if resp:
            last = resp[0][1][-1][0]


@shared_task(name="inferq.submit", bind=True, throws=EXPECTED_FAILURES)
def submit_task(self: Task, **kwargs: Any) -> str:
    """Validate and submit a job; returns its id."""
    return _submit(resources(self), kwargs, self.request.id)


@shared_task(name="inferq.generate", bind=True, throws=EXPECTED_FAILURES)
def generate_task(self: Task, timeout: float = 600.0, **kwargs: Any) -> dict[str, Any]:
    """Submit a job and wait for it; returns the job as GET /v1/jobs/{id} does. A job that ends failed,
    cancelled or expired is a task failure."""
    res = resources(self)
    job_id = _submit(res, kwargs, self.request.id)
    view = wait_for_job(res, job_id, float(timeout))
    if view["status"] != "succeeded":
        raise JobFailed(f"job {job_id} {view['status']}" + (f": {view['error']}" if view.get("error") else "")
                        + (f" (finish_reason {view['finish_reason']})" if view.get("finish_reason") else ""))
    return view
