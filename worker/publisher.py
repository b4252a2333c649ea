"""The worker's text deltas go to Redis without the loop waiting for Redis's reply.

Why: a step's deltas are one pipeline (XADD + EXPIRE per job), and the loop used to wait for its round trip
between two steps. On a small machine that reply waits for a core (Redis, and the API process woken by the
same XADD, share the cores with the engine's threads): 0.4-0.8 ms per token measured on 2 cores, 2-4% of a
single stream's time per output token. Here a step's commands are written to a connection of their own and
the loop goes on to the next step; their replies are read before the next step's commands are written (by
then they have long arrived), or by ``flush``.

A thread executing the pipelines was tried first: it took the round trip off the loop, but the loop then
waited as long for the GIL, held by that thread while it was descheduled on the busy cores.

Order is kept: one connection, commands written in the order handed over; the loop flushes before it
publishes a job's final event (on another connection, after the job's transaction), so a reader never sees
the final event before the job's last delta. A command Redis refuses, or a lost connection, is logged and
dropped, as the loop's own pipeline was: deltas are a live view; the result in PostgreSQL is the record.
"""

from __future__ import annotations

from typing import Any

import redis as redis_lib


class DeltaPublisher:
    """Writes handed-over pipelines' commands to a dedicated connection; reads their replies later."""

    def __init__(self, redis: Any, log: Any) -> None:
        self.redis = redis
        self.log = log
        self._conn: Any = None
        self._unread = 0  # replies owed by Redis for commands written

    def submit(self, pipe: Any) -> None:
        """Write ``pipe``'s queued commands (the pipeline is emptied) after reading the replies still owed."""
        commands = [args for args, _options in pipe.command_stack]
        pipe.reset()
        if not commands:
            return
        try:
            self._read_replies()
            if self._conn is None:
                self._conn = self.redis.connection_pool.get_connection()
            self._conn.send_packed_command(self._conn.pack_commands(commands))
            self._unread = len(commands)
        except redis_lib.RedisError as exc:
            self._drop(exc)

    def flush(self) -> None:
        """Return once Redis has answered every command written so far."""
        try:
            self._read_replies()
        except redis_lib.RedisError as exc:
            self._drop(exc)

    def close(self) -> None:
        self.flush()
        if self._conn is not None:
            self.redis.connection_pool.release(self._conn)
            self._conn = None

    def _read_replies(self) -> None:
        while self._unread:
            self._unread -= 1
            try:
                self._conn.read_response()
            except redis_lib.ResponseError as exc:  # that command failed; the connection is still in step
                self.log.warning("could not publish text deltas", error=str(exc))

    def _drop(self, exc: Exception) -> None:
        """The connection failed: what it owed is lost (logged); the next submit opens a new one."""
        self.log.warning("could not publish text deltas", error=str(exc))
        if self._conn is not None:
            self._conn.disconnect()
            self.redis.connection_pool.release(self._conn)
        self._conn = None
        self._unread = 0
