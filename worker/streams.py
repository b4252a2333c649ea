"""The worker's Redis side: its consumer group on the two job streams of one model, and the cancel channel.

Separate from the loop so the queue protocol of docs/SERVICE.md reads in one place:

* ``read``: only as many messages as the caller has room for: first ``XAUTOCLAIM`` of messages idle longer
  than ``claim_idle_ms`` (their worker is dead), then ``XREADGROUP`` interactive before batch, and a short
  BLOCK only when the worker is idle;
* ``decode``: each message becomes a typed ``JobMessage``; malformed ones (or an unknown schema version) go to
  the dead-letter stream and are acknowledged;
* ``keep_alive``: ``XCLAIM ... JUSTID`` resets the idle time of the messages this worker holds, so a live
  worker is never robbed;
* ``ack`` / ``requeue``: XACK + XDEL (+ SREM from the enqueued set) queued on the caller's pipeline, which
  the caller executes only after its database commit (results are committed before the ack);
* ``cancelled_jobs``: job ids published on the cancel channel (pub/sub; resubscribed when lost);
* queue metrics and the worker's stats hash.

The consumer group is created at id 0 and recreated after NOGROUP (e.g. after a FLUSHALL).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis as redis_lib

from inferq import jobs
from inferq.contract import JobMessage, MessageError, cancel_channel, dead_letter_key, stream_key
from inferq.settings import Settings
from worker.metrics import WorkerMetrics


@dataclass
class Message:
    """One stream entry this worker read; it stays pending (un-acknowledged) until the job is done with."""

    stream: str
    msg_id: str
    raw: bytes | None
    job: JobMessage | None = None  # set by StreamConsumer.decode
    reclaimed: bool = False
    deleted: bool = False  # XAUTOCLAIM on Redis < 7 returns deleted entries without fields


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamConsumer:
    """Reads, acknowledges and dead-letters the job streams of ``model`` as consumer ``name``."""

    def __init__(self, redis: Any, settings: Settings, model: str, name: str, metrics: WorkerMetrics,
                 log: Any) -> None:
        self.redis = redis
        self.settings = settings
        self.name = name
        self.prefix = settings.stream_prefix
        self.group = settings.consumer_group
        self.streams = [stream_key(self.prefix, model, "interactive"), stream_key(self.prefix, model, "batch")]
        self.metrics = metrics
        self.log = log
        self.pubsub: Any = None
        self.next_autoclaim = 0.0

    def pipeline(self, transaction: bool = False) -> Any:
        return self.redis.pipeline(transaction=transaction)

    # --- set-up and cancellations --------------------------------------------------------------------------

    def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis_lib.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def subscribe(self) -> None:
        try:
            if self.pubsub is not None:
                self.pubsub.close()
            self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self.pubsub.subscribe(cancel_channel(self.prefix))
        except redis_lib.RedisError as exc:
            self.pubsub = None
            self.log.warning("cannot subscribe to cancellations (the heartbeat still polls them)", error=str(exc))

    def cancelled_jobs(self) -> list[str]:
        """Job ids published on the cancel channel since the last call (never blocks)."""
        if self.pubsub is None:
            return []
        job_ids: list[str] = []
        try:
            while True:
                msg = self.pubsub.get_message(timeout=0)
                if msg is None:
                    break
                if msg.get("type") != "message":
                    continue
                data = msg["data"]
                job_ids.append(data.decode() if isinstance(data, bytes) else str(data))
        except redis_lib.RedisError as exc:
            self.log.warning("cancel subscription lost; resubscribing", error=str(exc))
            self.subscribe()
        return job_ids

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, n: int, block: bool, held: Callable[[], Iterable[Message]]) -> list[Message]:
        """Up to ``n`` messages: idle ones reclaimed from dead workers (when due; never one in ``held()``, the
        messages this worker holds), then new ones, interactive before batch; if there are none and ``block``,
        wait briefly for one."""
        got: list[Message] = []
        try:
            now = time.monotonic()
            if now >= self.next_autoclaim:
                self.next_autoclaim = now + max(0.2, min(self.settings.heartbeat_seconds,
                                                         self.settings.claim_idle_ms / 2000))
                got += self._autoclaim(n, held)
            for stream in self.streams:  # interactive first
                want = n - len(got)
                if want <= 0:
                    break
                got += self._read({stream: ">"}, want, None)
            if not got and block:
                block_ms = int(max(50, min(500, self.settings.heartbeat_seconds * 500)))
                got += self._read({s: ">" for s in self.streams}, 1, block_ms)
        except redis_lib.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.log.warning("consumer group missing (Redis flushed?); recreating it")
            self.ensure_groups()
        return got

    def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Message]:
        resp = self.redis.xreadgroup(self.group, self.name, streams, count=count, block=block)
        out = []
        for stream, entries in resp or []:
            for mid, fields in entries:
                out.append(Message(_text(stream), _text(mid), (fields or {}).get(b"m")))
        return out

    def _autoclaim(self, n: int, held: Callable[[], Iterable[Message]]) -> list[Message]:
        mine = {(m.stream, m.msg_id) for m in held()}
        out: list[Message] = []
        for stream in self.streams:
            if len(out) >= n:
                break
            resp = self.redis.xautoclaim(stream, self.group, self.name, self.settings.claim_idle_ms,
                                         start_id="0-0", count=n - len(out))
            for mid, fields in resp[1]:
                mid = _text(mid)
                if (stream, mid) in mine:
                    continue
                out.append(Message(stream, mid, (fields or {}).get(b"m"), reclaimed=True, deleted=fields is None))
        if out:
            self.metrics.reclaimed.inc(len(out))
            self.log.info("reclaimed idle messages", count=len(out))
        return out

    def decode(self, msgs: list[Message]) -> list[Message]:
        """Decode each message into ``Message.job``; returns the good ones. Deleted entries are acknowledged,
        malformed ones dead-lettered (stream, msg_id, error, raw ``m``) and acknowledged."""
        pipe = self.pipeline()
        good: list[Message] = []
        bad = 0
        for m in msgs:
            if m.deleted:
                bad += 1
                self.ack(pipe, m, None)
                continue
            try:
                if m.raw is None:
                    raise MessageError("no 'm' field")
                m.job = JobMessage.decode(m.raw)
            except MessageError as exc:
                bad += 1
                self.metrics.dead_letters.inc()
                self.log.error("malformed message dead-lettered", stream=m.stream, msg_id=m.msg_id, error=str(exc))
                pipe.xadd(dead_letter_key(self.prefix), {"stream": m.stream, "msg_id": m.msg_id, "error": str(exc),
                                                          "worker": self.name, "m": m.raw or b""})
                self.ack(pipe, m, None)
                continue
            good.append(m)
        if bad:
            pipe.execute()
        return good

    # --- holding, acknowledging, giving back ----------------------------------------------------------------

    def keep_alive(self, held: Iterable[Message]) -> None:
        """Reset the idle time of the held messages: XAUTOCLAIM elsewhere must not take them."""
        by_stream: dict[str, list[str]] = {}
        for m in held:
            by_stream.setdefault(m.stream, []).append(m.msg_id)
        for stream, ids in by_stream.items():
            try:
                self.redis.xclaim(stream, self.group, self.name, 0, ids, justid=True)
            except redis_lib.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    self.ensure_groups()

    def ack(self, pipe: Any, m: Message, job_id: str | None) -> None:
        """Queue XACK + XDEL (the stream holds only unfinished messages) and, for a finished job, its SREM from
        the enqueued set."""
        pipe.xack(m.stream, self.group, m.msg_id)
        pipe.xdel(m.stream, m.msg_id)
        if job_id:
            pipe.srem(jobs.enqueued_key(self.prefix), job_id)

    def requeue(self, pipe: Any, m: Message, job_id: str | None) -> None:
        """Queue a fresh copy of the message (plus the job's enqueued-set entry when ``job_id``) and the ack of
        this one: a job given back at shutdown."""
        pipe.xadd(m.stream, {"m": m.raw})
        if job_id:
            pipe.sadd(jobs.enqueued_key(self.prefix), job_id)
        self.ack(pipe, m, None)

    # --- numbers -----------------------------------------------------------------------------------------------

    def write_stats(self, mapping: Mapping[str, Any], pipe: Any = None) -> None:
        """The worker's live numbers in ``jobs.worker_key`` (a Redis hash, kept a day); on ``pipe`` if given."""
        key = jobs.worker_key(self.prefix, self.name)
        try:
            p = pipe if pipe is not None else self.pipeline()
            p.hset(key, mapping=dict(mapping))
            p.expire(key, 86400)
            if pipe is None:
                p.execute()
        except redis_lib.RedisError as exc:
            self.log.warning("cannot write worker stats", error=str(exc))

    def queue_metrics(self) -> None:
        try:
            pipe = self.pipeline()
            for stream in self.streams:
                pipe.xlen(stream)
                pipe.xrange(stream, count=1)
                pipe.xpending(stream, self.group)
            res = pipe.execute(raise_on_error=False)
        except redis_lib.RedisError:
            return
        now_ms = time.time() * 1000
        for i, stream in enumerate(self.streams):
            depth, first, pending = res[3 * i: 3 * i + 3]
            if isinstance(depth, int):
                self.metrics.queue_depth.labels(stream).set(depth)
            if isinstance(first, list):
                age = 0.0
                if first:
                    mid = _text(first[0][0])
                    age = max(0.0, (now_ms - int(mid.split("-")[0])) / 1000)
                self.metrics.queue_oldest_age.labels(stream).set(age)
            if isinstance(pending, dict):
                self.metrics.queue_pending.labels(stream).set(pending.get("pending", 0))
