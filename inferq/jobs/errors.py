"""The submission errors the API and the Celery tasks turn into answers (409, 429), and the idempotent-retry
rule that decides between an earlier job and a 409."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferq.db import Job


class JobError(Exception):
    """Base class of the submission errors the API turns into HTTP answers."""


class Conflict(JobError):
    """The idempotency key was used before with a different body (HTTP 409)."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class QuotaExceeded(JobError):
    """A quota or rate limit is exhausted (HTTP 429); ``retry_after`` is in seconds."""

    def __init__(self, message: str, retry_after: float, limit: str = "") -> None:
        super().__init__(message)
        self.retry_after = max(1, int(math.ceil(retry_after)))
        self.limit = limit


def idempotent_retry(job: Job, fingerprint: str) -> tuple[Job, bool]:
    """The answer to a submission whose idempotency key is taken by ``job``: that job (``created`` False)
    when the bodies match, else ``Conflict``."""
    if job.request_hash != fingerprint:
        raise Conflict("idempotency key already used with a different request body", job_id=job.id)
    return job, False
