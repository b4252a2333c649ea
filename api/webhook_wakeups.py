"""What the webhook dispatcher waits on between rounds: a PostgreSQL notification, a due retry, or a timeout.

Polling the jobs table twice a second (two transactions a poll) was most of an idle API process's CPU and
delayed each webhook by up to half a second. On PostgreSQL a trigger on ``jobs`` (migration 0006) sends
``NOTIFY inferq_webhooks`` in the transaction that makes a job with a webhook terminal, so the dispatcher sleeps
on its own ``LISTEN`` connection until a job needs it, the earliest pending retry is due, or ``idle_seconds``
pass (a backstop only: after its connection is replaced the dispatcher runs a round before it sleeps again, so a
notification sent meanwhile is not missed). Other databases (SQLite for ``inferq up``) keep polling.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from inferq.db import WebhookDelivery, as_aware, utcnow
from inferq.log import get_logger

log = get_logger("inferq.webhooks")

CHANNEL = "inferq_webhooks"  # the channel migration 0006's trigger notifies
STOP_CHECK_SECONDS = 1.0


class Wakeups:
    """``wait(poll_seconds, stop)``: returns when the dispatcher should run again."""

    def __init__(self, session_factory: sessionmaker, idle_seconds: float = 5.0) -> None:
        self.session_factory = session_factory
        self.idle_seconds = idle_seconds
        self._engine = session_factory.kw["bind"]
        self._listen = self._engine.dialect.name == "postgresql"
        self._conn: Any = None  # the LISTEN connection; only the dispatcher's thread uses it

    def wait(self, poll_seconds: float, stop: threading.Event) -> None:
        """Sleep until there may be work: on PostgreSQL a notification, the next pending retry or
        ``idle_seconds``; elsewhere ``poll_seconds``. Returns within a second of ``stop`` being set."""
        if not self._listen:
            stop.wait(poll_seconds)
            return
        try:
            if self._conn is None:
                # LISTEN, then let the caller's round run again: a job that finished between its last round
                # and this LISTEN sent its notification to nobody
                self._conn = self._connect()
                return
            deadline = time.monotonic() + self._until_next_retry()
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                # in slices, so a ``stop`` is seen within one (no query in between)
                if any(True for _ in self._conn.notifies(timeout=min(left, STOP_CHECK_SECONDS), stop_after=1)):
                    return
        except Exception as exc:  # noqa: BLE001 - the database is down or the connection broke: poll until back
            log.warning("webhook wake-ups unavailable; polling", error=repr(exc)[:300])
            self.close()
            stop.wait(poll_seconds)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def _connect(self) -> Any:
        """A driver connection detached from the engine's pool (it stays in ``LISTEN`` for good)."""
        fairy = self._engine.raw_connection()
        conn = fairy.driver_connection
        fairy.detach()
        conn.autocommit = True
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def _until_next_retry(self) -> float:
        """Seconds until the earliest pending delivery is due, at most ``idle_seconds`` (0: due now)."""
        with self.session_factory() as s:
            due = s.scalar(select(func.min(WebhookDelivery.next_attempt_at))
                           .where(WebhookDelivery.status == "pending"))
        if due is None:
            return self.idle_seconds
        return min(self.idle_seconds, max(0.0, (as_aware(due) - utcnow()).total_seconds()))
