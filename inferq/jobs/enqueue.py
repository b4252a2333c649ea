"""Enqueueing: the job's msgpack message XADDed to its tier's stream, and its id added to the enqueued set
(the reconciler's cheap index of which queued jobs have a message), in one MULTI."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from inferq.contract import encode_message, stream_key
from inferq.db import Job, unix_time
from inferq.settings import Settings


def enqueued_key(prefix: str) -> str:
    """Redis set of job ids that have a message in a job stream (the reconciler's cheap index)."""
    return f"{prefix}:enqueued"


def enqueue(redis: Any, settings: Settings, job: Job, cache_namespace: str) -> str:
    """XADD the job's message to its stream and remember it in the enqueued set (one MULTI)."""
    deadline = unix_time(job.deadline_at)
    payload = encode_message(job.id, job.tenant_id, cache_namespace, job.model, job.tier, job.priority or 0,
                             job.request, deadline, unix_time(job.queued_at) or time.time())
    pipe = redis.pipeline(transaction=True)
    pipe.xadd(stream_key(settings.stream_prefix, job.model, job.tier), {"m": payload})
    pipe.sadd(enqueued_key(settings.stream_prefix), job.id)
    msg_id, _ = pipe.execute()
    return msg_id.decode() if isinstance(msg_id, bytes) else msg_id


def enqueue_many(redis: Any, settings: Settings, jobs_ns: Sequence[tuple[Job, str]]) -> None:
    """``enqueue`` for several jobs in one MULTI (one round trip)."""
    pipe = redis.pipeline(transaction=True)
    enq = enqueued_key(settings.stream_prefix)
    for job, ns in jobs_ns:
        payload = encode_message(job.id, job.tenant_id, ns, job.model, job.tier, job.priority or 0, job.request,
                                 unix_time(job.deadline_at), unix_time(job.queued_at) or time.time())
        pipe.xadd(stream_key(settings.stream_prefix, job.model, job.tier), {"m": payload})
    pipe.sadd(enq, *[job.id for job, _ in jobs_ns])
    pipe.execute()
