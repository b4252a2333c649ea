"""A busy worker's admission without a Redis round trip per step (worker/streams.py ``read``): once a probe has
found nothing undelivered, ``read`` skips its lag probe until a new job is announced on ``new_jobs_channel``
(every enqueue and every hand-back publishes there) or ``QUIET_PROBE_SECONDS`` pass; a backlog the room left
behind keeps it probing. On a private real Redis, jobs enqueued through ``inferq.jobs.enqueue`` itself."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.service_fixtures import private_redis  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture
def setup(private_redis):  # noqa: F811
    import redis

    from inferq.log import get_logger
    from inferq.settings import Settings
    from worker.metrics import WorkerMetrics
    from worker.streams import StreamConsumer

    settings = Settings(redis_url=private_redis.url, stream_prefix=f"quiet-{uuid.uuid4().hex[:8]}")
    r = redis.Redis.from_url(private_redis.url)
    consumer = StreamConsumer(r, settings, "m", "c1", WorkerMetrics(model="m"), get_logger("test"))
    consumer.ensure_groups()
    consumer.subscribe()
    yield settings, r, consumer
    consumer.pubsub.close()
    r.close()


def _enqueue(settings, r, name: str) -> None:
    from inferq.db import Job
    from inferq.jobs import enqueue

    job = Job(id=name, tenant_id="t", model="m", tier="interactive", priority=0,
              request={"prompt": name, "max_tokens": 1}, deadline_at=None, queued_at=None)
    enqueue(r, settings, job, "ns")


def _read(consumer, n: int = 4) -> list[str]:
    return [m.msg_id for m in consumer.read(n, False, lambda: [])]


def _hear_notices(consumer) -> None:
    """Drain the pub/sub socket the way the loop does each iteration, until the notice has arrived."""
    deadline = time.monotonic() + 5
    while consumer.quiet and time.monotonic() < deadline:
        consumer.cancelled_jobs()
        time.sleep(0.01)


def test_a_quiet_worker_skips_the_probe_until_a_job_is_announced(setup) -> None:
    from inferq.contract import stream_key

    settings, r, consumer = setup
    stream = stream_key(settings.stream_prefix, "m", "interactive")
    assert _read(consumer) == [] and consumer.quiet  # the probe found nothing undelivered: quiet
    # a message added behind the channel's back is not seen while quiet ...
    r.xadd(stream, {"m": b"unannounced"})
    assert _read(consumer) == []
    # ... only once the probe is due again (QUIET_PROBE_SECONDS)
    consumer.next_probe = 0.0
    assert len(_read(consumer)) == 1
    # an enqueued job is announced: the next read finds it, long before the timer
    assert _read(consumer) == [] and consumer.quiet
    consumer.next_probe = time.monotonic() + 3600
    _enqueue(settings, r, "announced")
    _hear_notices(consumer)
    assert not consumer.quiet
    assert len(_read(consumer)) == 1


def test_a_backlog_left_by_the_room_keeps_the_worker_probing(setup) -> None:
    settings, r, consumer = setup
    assert _read(consumer) == [] and consumer.quiet
    consumer.next_probe = time.monotonic() + 3600
    for i in range(3):
        _enqueue(settings, r, f"job-{i}")
    _hear_notices(consumer)
    consumer.cancelled_jobs()  # all three notices heard: one wake-up
    assert len(_read(consumer, 1)) == 1  # room for one: two stay undelivered
    assert not consumer.quiet
    assert len(_read(consumer, 1)) == 1  # read at the next step without another notice
    assert len(_read(consumer, 1)) == 1
    assert _read(consumer, 1) == [] and consumer.quiet


def test_a_handed_back_job_is_announced(setup) -> None:
    settings, r, consumer = setup
    _enqueue(settings, r, "given-back")
    (m,) = consumer.decode(consumer.read(4, False, lambda: []))
    assert _read(consumer) == [] and consumer.quiet
    consumer.next_probe = time.monotonic() + 3600
    pipe = r.pipeline(transaction=True)
    consumer.requeue(pipe, m, m.job.job_id)
    pipe.execute()
    _hear_notices(consumer)
    assert [x.job.job_id for x in consumer.decode(consumer.read(4, False, lambda: []))] == ["given-back"]


def test_a_batch_of_jobs_is_announced_once_per_stream(setup) -> None:
    from inferq.contract import new_jobs_channel
    from inferq.db import Job
    from inferq.jobs import enqueue_many

    settings, r, consumer = setup
    listener = r.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(new_jobs_channel(settings.stream_prefix, "m"))
    assert _read(consumer) == [] and consumer.quiet
    consumer.next_probe = time.monotonic() + 3600
    batch = [(Job(id=f"b{i}", tenant_id=f"t{i % 2}", model="m", tier="batch", priority=0,
                  request={"prompt": "x", "max_tokens": 1}, deadline_at=None, queued_at=None), "ns") for i in range(6)]
    enqueue_many(r, settings, batch)
    heard, deadline = [], time.monotonic() + 5
    while len(heard) < 2 and time.monotonic() < deadline:
        msg = listener.get_message(timeout=0.1)
        if msg:
            heard.append(msg["data"].decode())
    assert sorted(heard) == sorted({s.decode() for s in r.smembers(f"{settings.stream_prefix}:lanes:m:batch")})
    assert listener.get_message(timeout=0.2) is None  # two tenants' lanes: two notices for six jobs
    listener.close()
    consumer.next_lane_refresh = time.monotonic() + 3600  # the lanes are new: the notices alone find them
    _hear_notices(consumer)
    assert len(_read(consumer, 10)) == 6


def test_the_wake_descriptor_turns_readable_on_an_announcement_and_quiet_once_drained(setup) -> None:
    """``wake_fd`` (what the engine's decode-ahead windows poll, worker/engine.py): the pub/sub socket, readable
    once a job (or a cancellation) is announced, quiet again after the loop's ``cancelled_jobs`` drained it."""
    from kernels.decode_step import woken
    from worker.streams import cancel_channel

    settings, r, consumer = setup
    consumer.cancelled_jobs()
    fd = consumer.wake_fd()
    assert fd >= 0 and not woken(fd)
    _enqueue(settings, r, "wakes")
    deadline = time.monotonic() + 5
    while not woken(fd) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert woken(fd)
    consumer.cancelled_jobs()  # the loop's drain, each iteration
    assert not woken(consumer.wake_fd())
    r.publish(cancel_channel(settings.stream_prefix), "some-job")
    deadline = time.monotonic() + 5
    while not woken(fd) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert woken(fd) and consumer.cancelled_jobs() == ["some-job"] and not woken(fd)
    pubsub, consumer.pubsub = consumer.pubsub, None
    assert consumer.wake_fd() == -1  # no subscription: windows keep decode_ahead_ms
    consumer.pubsub = pubsub
