"""worker/publisher.py against the real Redis: commands land in the order handed over, ``submit`` does not wait
for their replies, ``flush`` does, and a refused command or a lost connection is logged without stopping the
publishing after it."""

from __future__ import annotations

import redis

from worker.publisher import DeltaPublisher


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, **kw) -> None:
        self.warnings.append(msg)


def test_commands_land_in_order_and_flush_reads_every_reply(redis_client, settings) -> None:
    key = f"{settings.stream_prefix}:publisher-order"
    pub = DeltaPublisher(redis_client, _Log())
    for i in range(200):
        pipe = redis_client.pipeline(transaction=False)
        pipe.xadd(key, {"i": i})
        pipe.xadd(key, {"i": f"{i}b"})
        pub.submit(pipe)
        assert len(pipe) == 0  # the pipeline was emptied: its commands are the publisher's now
    pub.flush()  # every entry is there once flush returns, in order
    assert pub._unread == 0
    got = [f[b"i"].decode() for _, f in redis_client.xrange(key)]
    assert got == [x for i in range(200) for x in (str(i), f"{i}b")]
    pub.close()


def test_submit_does_not_wait_for_the_reply(redis_client, settings) -> None:
    """While Redis is busy (a script sleeping in it), submit returns with the reply still owed; flush waits."""
    key = f"{settings.stream_prefix}:publisher-wait"
    pub = DeltaPublisher(redis_client, _Log())
    pipe = redis_client.pipeline(transaction=False)
    pipe.eval("local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6;"
              " repeat local n = redis.call('TIME') until n[1] + n[2] / 1e6 > s + 0.3; return 1", 0)
    pipe.xadd(key, {"i": 1})
    pub.submit(pipe)
    assert pub._unread == 2  # written, not answered yet
    pub.flush()
    assert pub._unread == 0 and redis_client.xlen(key) == 1
    pub.close()


def test_a_refused_command_is_logged_and_the_rest_still_land(redis_client, settings) -> None:
    key = f"{settings.stream_prefix}:publisher-errors"
    log = _Log()
    pub = DeltaPublisher(redis_client, log)
    pipe = redis_client.pipeline(transaction=False)
    pipe.execute_command("NO-SUCH-COMMAND")
    pipe.xadd(key, {"i": 1})
    pub.submit(pipe)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd(key, {"i": 2})
    pub.submit(pipe)
    pub.close()
    assert [f[b"i"] for _, f in redis_client.xrange(key)] == [b"1", b"2"]
    assert log.warnings == ["could not publish text deltas"]


def test_a_lost_connection_is_logged_and_the_next_submit_reconnects(redis_client, settings) -> None:
    key = f"{settings.stream_prefix}:publisher-lost"
    log = _Log()
    pub = DeltaPublisher(redis_client, log)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd(key, {"i": 1})
    pub.submit(pipe)
    pub.flush()
    name = f"{settings.stream_prefix}-publisher"
    pub._conn.send_command("CLIENT", "SETNAME", name)
    pub._conn.read_response()
    killer = redis.Redis.from_url(settings.redis_url)
    for c in killer.client_list():
        if c.get("name") == name:
            killer.client_kill(c["addr"])
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd(key, {"i": 2})
    pub.submit(pipe)  # written to a dead connection: the failure shows on this write or on the next read
    pub.flush()
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd(key, {"i": 3})
    pub.submit(pipe)
    pub.close()
    killer.close()
    assert b"3" in [f[b"i"] for _, f in redis_client.xrange(key)]
    assert "could not publish text deltas" in log.warnings
