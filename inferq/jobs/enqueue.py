"""Enqueueing: the job's msgpack message XADDed to its tier's stream (its tenant's lane of it under fair
share), and its id added to the enqueued set
(the reconciler's cheap index of which queued jobs have a message), in one MULTI.

A job whose message cannot be encoded (text with a lone surrogate, an integer msgpack cannot hold: rows
stored before ``JobCreate`` refused them) raises ``Unenqueueable`` and is never put on a stream; the
reconciler then fails it with the reason, instead of retrying it forever."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis as redis_lib

from inferq.contract import DEFAULT_WEIGHT, encode_message, lanes_key, new_jobs_channel, stream_key
from inferq.db import Job, unix_time
from inferq.jobs import routes
from inferq.settings import Settings


class Unenqueueable(ValueError):
    """Jobs whose stream message cannot be encoded: ``reasons`` maps each job id to why. Retrying cannot help."""

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"job {job_id}: {why}" for job_id, why in reasons.items()))
        self.reasons = reasons


def enqueued_key(prefix: str) -> str:
    """Redis set of job ids that have a message in a job stream (the reconciler's cheap index)."""
    return f"{prefix}:enqueued"


def _push(pipe: Any, settings: Settings, job: Job, payload: bytes, owner: str | None = None,
          announce: bool = True) -> str:
    """Queue the XADD of ``payload``: to the tenant's lane of the tier (registered in the lanes set) under fair
    share, else to the tier's one stream; with an ``owner`` (cache-aware routing, ``inferq.jobs.routes``), to
    that worker's routed lane of it instead (fairness lanes are kept: one routed lane per lane and owner). The
    model's busy workers are told (the stream's name) on ``new_jobs_channel`` unless ``announce`` is False (the
    caller announces the returned stream itself)."""
    prefix = settings.stream_prefix
    lane = stream_key(prefix, job.model, job.tier, job.tenant_id if settings.fair_share else None)
    if owner is not None:
        lane = routes.push_routed(pipe, prefix, job.model, job.tier, lane, owner, payload)
    else:
        pipe.xadd(lane, {"m": payload})
        if settings.fair_share:
            pipe.sadd(lanes_key(prefix, job.model, job.tier), lane)
    if announce:
        pipe.publish(new_jobs_channel(prefix, job.model), lane)
    return lane


def _owner(redis: Any, settings: Settings, job: Job, cache_namespace: str) -> str | None:
    return routes.choose_owner(redis, settings, job.model, job.request or {}, cache_namespace)


def message_for(job: Job, cache_namespace: str, weight: float = DEFAULT_WEIGHT) -> bytes:
    """The job's stream message (``weight``: its tenant's fair-share weight); ``Unenqueueable`` when msgpack
    cannot encode what the row holds."""
    try:
        return encode_message(job.id, job.tenant_id, cache_namespace, job.model, job.tier, job.priority or 0,
                              job.request, unix_time(job.deadline_at), unix_time(job.queued_at) or time.time(),
                              weight)
    except (UnicodeError, OverflowError, TypeError, ValueError) as exc:
        raise Unenqueueable({job.id: f"the job's message cannot be encoded: {type(exc).__name__}: "
                                     f"{str(exc).encode('ascii', 'backslashreplace').decode()[:300]}"}) from exc


def enqueue(redis: Any, settings: Settings, job: Job, cache_namespace: str, weight: float = DEFAULT_WEIGHT) -> str:
    """XADD the job's message to its stream and remember it in the enqueued set (one MULTI). ``weight``: the
    tenant's fair-share weight (carried in the message; the default when a caller has no tenant row at hand)."""
    payload = message_for(job, cache_namespace, weight)
    owner = _owner(redis, settings, job, cache_namespace)
    pipe = redis.pipeline(transaction=True)
    _push(pipe, settings, job, payload, owner)
    pipe.sadd(enqueued_key(settings.stream_prefix), job.id)
    msg_id = pipe.execute()[0]
    return msg_id.decode() if isinstance(msg_id, bytes) else msg_id


def enqueue_many(redis: Any, settings: Settings, jobs_ns: Sequence[tuple[Job, str] | tuple[Job, str, float]]) -> None:
    """``enqueue`` for several jobs in one MULTI (one round trip); each item is ``(job, cache namespace)`` or
    ``(job, cache namespace, fair-share weight)``. A job that cannot be encoded does not hold up the others:
    they are enqueued, then ``Unenqueueable`` names the ones left out."""
    payloads: list[tuple[Job, bytes, str | None]] = []
    bad: dict[str, str] = {}
    for job, ns, *weight in jobs_ns:
        try:
            payloads.append((job, message_for(job, ns, *weight), _owner(redis, settings, job, ns)))
        except Unenqueueable as exc:
            bad.update(exc.reasons)
    if payloads:
        pipe = redis.pipeline(transaction=True)
        lanes = {(job.model, _push(pipe, settings, job, payload, owner, announce=False))
                 for job, payload, owner in payloads}
        for model, lane in sorted(lanes):  # one notice per stream, not per job (a Batch API file has thousands)
            pipe.publish(new_jobs_channel(settings.stream_prefix, model), lane)
        pipe.sadd(enqueued_key(settings.stream_prefix), *[job.id for job, _, _ in payloads])
        pipe.execute()
    if bad:
        raise Unenqueueable(bad)


def tier_streams(redis: Any, prefix: str, model: str, tier: str) -> list[str]:
    """Every stream a tier's jobs may wait in: the tier's own stream, then its tenants' lanes, then the
    routed lanes (cache-aware routing)."""
    lanes = sorted(m.decode() if isinstance(m, bytes) else m for m in redis.smembers(lanes_key(prefix, model, tier)))
    return [stream_key(prefix, model, tier), *lanes, *sorted(routes.routed_lanes(redis, prefix, model, tier))]


def queued_entries(redis: Any, prefix: str, model: str, tier: str) -> list[tuple[Any, dict]]:
    """The entries (id, fields) of all of a tier's streams, in the order they were added (ops and tests)."""
    entries = [e for stream in tier_streams(redis, prefix, model, tier) for e in redis.xrange(stream)]
    return sorted(entries, key=lambda e: tuple(map(int, (e[0].decode() if isinstance(e[0], bytes) else e[0]).split("-"))))


def queue_counts(redis: Any, prefix: str, model: str, tier: str, group: str) -> tuple[int, int]:
    """(entries, pending) over all of a tier's streams: the jobs waiting or held un-acknowledged by a worker
    (entries count both: an entry is deleted when acknowledged), and those held."""
    entries = pending = 0
    for stream in tier_streams(redis, prefix, model, tier):
        entries += redis.xlen(stream)
        try:
            pending += redis.xpending(stream, group)["pending"]
        except redis_lib.ResponseError:  # no group yet: no worker has read the stream
            pass
    return entries, pending
