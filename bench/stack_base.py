"""What every benchmark stack of real processes shares (``bench.tiers.Stack``: an API and a worker;
``bench.routing.TwoWorkerStack``: several workers): a throw-away PostgreSQL database migrated to head, a fresh
Redis stream prefix, a tenant with limits no benchmark reaches, and the clean-up of all three with the
subprocesses, whether the benchmark finished or failed part-way (``with`` or ``start``/``stop``).
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ThrowawayStack:
    """Subclasses start their processes in :meth:`start` (after :meth:`create_database`) and list them in
    ``self.procs`` as (name, Popen)."""

    def __init__(self, log=print) -> None:
        from inferq.settings import Settings

        self.log = log
        self.base = Settings()
        self.tag = uuid.uuid4().hex[:10]
        self.db_name = f"inferq_bench_{self.tag}"
        self.prefix = f"inferq-bench-{self.tag}"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.db_url: str | None = None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def _admin_url(self) -> str:
        from sqlalchemy.engine import make_url

        return make_url(self.base.database_url).set(database="postgres").render_as_string(hide_password=False)

    def create_database(self):
        """The database, migrated, with the "bench" tenant (``self.tenant``); returns a session factory on it (its
        engine is ``self.engine``, disposed by :meth:`stop`)."""
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        from api.tenants import create_tenant
        from inferq.db import make_engine, make_sessionmaker
        from inferq.migrate import upgrade

        admin = create_engine(self._admin_url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        admin.dispose()
        self.db_url = make_url(self.base.database_url).set(database=self.db_name).render_as_string(hide_password=False)
        upgrade(self.db_url)
        self.engine = make_engine(self.db_url)
        sessions = make_sessionmaker(self.engine)
        self.tenant = create_tenant(sessions, "bench", max_queued_jobs=1_000_000, tokens_per_minute=1_000_000_000)
        return sessions

    def stop(self, wait_s: float = 40) -> None:
        """Terminate the processes (newest first; killed after ``wait_s``), delete the prefix's Redis keys, drop
        the database. Each part runs even if an earlier one failed."""
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self._clear_redis()
        if getattr(self, "engine", None) is not None:
            self.engine.dispose()
            self.engine = None
        self._drop_database()

    def _clear_redis(self) -> None:
        try:
            import redis

            r = redis.Redis.from_url(self.base.redis_url)
            for k in r.scan_iter(match=f"{self.prefix}:*", count=1000):
                r.delete(k)
            r.close()
        except Exception as exc:  # noqa: BLE001 - clean-up is best effort; say what was left
            self.log(f"could not clear the Redis prefix {self.prefix}: {exc}")

    def _drop_database(self) -> None:
        if not self.db_url:
            return
        try:
            from sqlalchemy import create_engine, text

            admin = create_engine(self._admin_url(), isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            admin.dispose()
        except Exception as exc:  # noqa: BLE001
            self.log(f"could not drop {self.db_name}: {exc}")
        self.db_url = None
