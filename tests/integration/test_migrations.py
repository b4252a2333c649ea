"""Alembic: upgrade from empty and downgrade to base work on PostgreSQL and SQLite, and the migrated
schema matches the SQLAlchemy models (no pending autogenerate diff)."""

import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from inferq.db import Base
from inferq.migrate import downgrade, upgrade
from tests.conftest import PG_ADMIN_URL, _with_db

pytestmark = pytest.mark.integration


def _assert_round_trip(url: str) -> None:
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations differ: {diff}"
        assert {"jobs", "tenants", "usage_ledger", "prices", "webhook_deliveries"} <= set(inspect(conn).get_table_names())
    downgrade(url)
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()


def test_postgres_upgrade_downgrade():
    name = f"inferq_mig_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        _assert_round_trip(_with_db(PG_ADMIN_URL, name))
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_sqlite_upgrade_downgrade(tmp_path):
    _assert_round_trip(f"sqlite:///{tmp_path / 'inferq.db'}")
