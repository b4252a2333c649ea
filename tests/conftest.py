"""Shared fixtures: a throw-away PostgreSQL database per test run (migrated to head), settings that
point at it and at the real Redis, with a unique stream prefix per test so tests never see each
other's queues. Real services only: Redis 127.0.0.1:6379 and PostgreSQL 127.0.0.1:5432 (started by
the README's test command when they are down)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from inferq.db import make_engine, make_sessionmaker
from inferq.settings import Settings

# Each test process measures its own kernel plans (as it always did): a plan kept on disk by an earlier run, or by
# a benchmark, would stand in for a planner a test replaces (tests/unit/test_plan_cache.py tests the cache itself).
os.environ.setdefault("INFERQ_KERNEL_PLAN_CACHE", "false")

PG_ADMIN_URL = os.environ.get("INFERQ_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
TEST_REDIS_URL = os.environ.get("INFERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _with_db(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A new PostgreSQL database migrated with Alembic (its URL); dropped on exit."""
    from inferq.migrate import upgrade

    name = f"inferq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = _with_db(PG_ADMIN_URL, name)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test run, shared by its tests; a module whose assertions count
    every row (the reconciler's) overrides it with a database of its own (``fresh_database``)."""
    with fresh_database() as url:
        yield url


@pytest.fixture
def stream_prefix() -> str:
    return f"inferq-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def settings(pg_url: str, stream_prefix: str, tmp_path) -> Settings:
    return Settings(
        database_url=pg_url,
        redis_url=TEST_REDIS_URL,
        stream_prefix=stream_prefix,
        data_dir=tmp_path / "data",
        webhook_allowlist="127.0.0.1,localhost,::1",
        kv_cache_memory="64MiB",
        log_json=True,
    )


@pytest.fixture
def db(settings: Settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def redis_client(settings: Settings):
    import redis

    client = redis.Redis.from_url(settings.redis_url)
    yield client
    # drop this test's keys
    for key in client.scan_iter(match=f"{settings.stream_prefix}:*", count=1000):
        client.delete(key)
    client.close()
