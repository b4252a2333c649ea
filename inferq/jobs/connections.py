"""The psycopg connections of the PostgreSQL admission path: a SQLAlchemy ``QueuePool`` of their own beside
the engine's, taken from the engine (its URL and connect arguments) and disposed with it.

Apart, because the engine's pool pings every connection it hands out (a round trip as costly as the
submission's statement); this one pings only when the server has said something since the connection went
idle (its socket is readable: a terminated backend's error, a restart's EOF) or after ``PING_AFTER_SECONDS``
idle, so a submission at idle pays no round trip for it. SQLAlchemy's pool rather
than ``psycopg_pool``, because it connects in the caller's thread: an unreachable database fails the
submission at once with the driver's reason (503), and the first submission after an outage reconnects,
where ``psycopg_pool``'s background connector makes callers wait out its timeout and reconnection back-off.
"""

from __future__ import annotations

import select
import time
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

PING_AFTER_SECONDS = 30.0
_RETURNED = "inferq_returned"  # connection info key: time.monotonic() of the last check-in


class AdmissionConnections:
    """``get()`` a pooled psycopg connection (idle, no transaction open), use it, ``put()`` it back."""

    def __init__(self, engine: Engine, keep: int = 16) -> None:
        engine_ref = weakref.ref(engine)  # weak: the engine keys the registry this lives in

        def connect() -> Any:
            engine = engine_ref()
            if engine is None:  # pragma: no cover - callers hold the engine
                raise RuntimeError("the engine is gone")
            fairy = engine.raw_connection()  # connect errors come out as SQLAlchemy's (-> 503)
            conn: Any = fairy.driver_connection
            fairy.detach()  # ours from now on
            # Plan the admission with its real parameters each time: the generic plan PostgreSQL switches to
            # after five executions costs time that grows with the jobs table; a custom plan does not.
            conn.execute("SET plan_cache_mode = force_custom_plan")
            conn.commit()
            return conn

        # keep up to ``keep`` idle connections, open more when busy (closed on return); most recent first
        self.pool = QueuePool(connect, pool_size=keep, max_overflow=-1, use_lifo=True, reset_on_return=None)
        event.listen(self.pool, "checkout", _ping_if_idle)
        event.listen(self.pool, "checkin", _stamp_return)
        event.listen(engine, "engine_disposed", lambda *_: self.close())

    def get(self) -> PoolProxiedConnection:
        """A pooled connection; its psycopg connection is ``.driver_connection``."""
        return self.pool.connect()

    def put(self, pooled: PoolProxiedConnection) -> None:
        conn = pooled.driver_connection
        if conn is None or conn.closed or conn.broken or conn.info.transaction_status != 0:  # 0: idle
            pooled.invalidate()  # closed, and replaced by a new connection when next needed
            return
        pooled.close()

    def close(self) -> None:
        self.pool.dispose()


def _stamp_return(dbapi_conn: Any, record: Any) -> None:
    record.info[_RETURNED] = time.monotonic()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Checkout hook: a dead connection raises ``DisconnectionError``, and the pool replaces it."""
    if dbapi_conn.closed or dbapi_conn.broken:
        raise sa_exc.DisconnectionError("connection closed")
    returned = record.info.get(_RETURNED)  # None: a fresh connection
    if returned is not None and (time.monotonic() - returned > PING_AFTER_SECONDS or _readable(dbapi_conn)):
        try:
            dbapi_conn.execute("SELECT 1").fetchone()
            dbapi_conn.rollback()
        except Exception as exc:  # noqa: BLE001 - a dead connection: the pool takes another
            raise sa_exc.DisconnectionError(str(exc)) from exc


def _readable(conn: Any) -> bool:
    """Whether an idle connection's socket has input: nothing is owed to an idle client, so this is the server
    closing it (or a notice); the ping then finds out. No round trip."""
    try:
        poller = select.poll()
        poller.register(conn.pgconn.socket, select.POLLIN)
        return bool(poller.poll(0))
    except Exception:  # noqa: BLE001 - no usable socket: the ping finds out why
        return True
