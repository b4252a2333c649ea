"""Database models (SQLAlchemy 2). PostgreSQL is the source of truth; the same schema runs on SQLite
for the zero-setup mode. Migrations in ``migrations/`` must match these models."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def as_aware(t: dt.datetime | None) -> dt.datetime | None:
    """A timestamp read back from the database as an aware UTC datetime (SQLite hands back naive UTC)."""
    if t is not None and t.tzinfo is None:
        return t.replace(tzinfo=dt.timezone.utc)
    return t


def to_utc(t: dt.datetime | None) -> dt.datetime | None:
    """An aware timestamp (e.g. PostgreSQL's, in the session's time zone) converted to UTC."""
    return t.astimezone(dt.timezone.utc) if t is not None else None


def unix_time(t: dt.datetime | None) -> float | None:
    """Unix seconds of a database timestamp (naive means UTC), or None."""
    t = as_aware(t)
    return t.timestamp() if t is not None else None


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, dt.datetime: DateTime(timezone=True)}


# Legal job status transitions; enforced by conditional UPDATEs (see inferq/jobs/lifecycle.py) so two workers
# can never both finish a job. "running -> queued" is a hand-back (shutdown, reclaimed message).
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "expired")
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired"})
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "cancelled", "expired", "failed"}),
    "running": frozenset({"queued", "succeeded", "failed", "cancelled", "expired"}),
}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    cache_namespace: Mapped[str] = mapped_column(String(64), comment="Prefix-cache salt; equal values share cached prefixes.")
    webhook_secret: Mapped[str] = mapped_column(String(128))
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    fair_share_weight: Mapped[float] = mapped_column(
        Float, default=1.0, server_default=text("1.0"),
        comment="Share of its tier's admitted tokens relative to other busy tenants (scheduler/fairness.py).")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True, comment="Shown to users to identify the key.")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, comment="sha256 hex of the full key.")
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Price(Base):
    """Prices in integer micro-dollars per 1M tokens, per (model, tier), versioned: a job pays the
    version in force when it was accepted."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("model", "tier", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(16))
    version: Mapped[int] = mapped_column(Integer)
    prompt_per_mtok: Mapped[int] = mapped_column(BigInteger)
    cached_prompt_per_mtok: Mapped[int] = mapped_column(BigInteger)
    completion_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_status_model_tier", "status", "model", "tier"),
        # the webhook poller's scan: terminal jobs with a webhook, finished recently (or never stamped)
        Index("ix_jobs_webhook_finished", "finished_at", postgresql_where=text("webhook_url IS NOT NULL"),
              sqlite_where=text("webhook_url IS NOT NULL")),
        # exact quota recounts: a tenant's queued jobs without walking its whole history
        Index("ix_jobs_tenant_queued", "tenant_id", postgresql_where=text("status = 'queued'"),
              sqlite_where=text("status = 'queued'")),
    )
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    request: Mapped[dict[str, Any]] = mapped_column(comment="prompt|messages|prompt_ids and sampling parameters")
    status: Mapped[str] = mapped_column(String(16), default="queued")
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    queued_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    first_token_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    deadline_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Result(Base):
    __tablename__ = "results"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    text: Mapped[str] = mapped_column(Text, default="")
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    token_ids: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class UsageEntry(Base):
    """The token-cost ledger: exactly one row per terminal job (unique job_id)."""

    __tablename__ = "usage_ledger"
    __table_args__ = (Index("ix_usage_tenant_created", "tenant_id", "created_at"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # speculative decoding: tokens proposed and verified, and of those accepted (billing stays per output token)
    spec_proposed_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    spec_accepted_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    compute_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_pending", "status", "next_attempt_at"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending", comment="pending | delivered | failed")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    history: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True, comment="one entry per attempt")


def cost_micros(prompt: int, cached: int, completion: int, price: Price | None) -> int:
    """Integer micro-dollars, rounded half up: uncached prompt, cached prompt and completion tokens at
    their per-1M-token prices."""
    if price is None:
        return 0
    nano = (prompt - cached) * price.prompt_per_mtok + cached * price.cached_prompt_per_mtok
    nano += completion * price.completion_per_mtok
    return (nano + 500_000) // 1_000_000


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine; SQLite gets WAL and a busy timeout so the API and worker can share it."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    if "poolclass" not in kwargs:
        kwargs.update(pool_size=10, max_overflow=20)
    return create_engine(url, pool_pre_ping=True, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


# --- the OpenAI-compatible Files and Batch APIs (inferq/batch_files.py, inferq/batches.py) ---------------------


class StoredFile(Base):
    """A file of the Files API: an uploaded batch input, or a batch's output or error file. Its bytes are in
    ``file_parts`` (why PostgreSQL, and why parts: inferq/batch_files.py)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, comment="file-<hex>")
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32), comment="batch | batch_output")
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    line_count: Mapped[int] = mapped_column(Integer, default=0, comment="non-blank lines (a batch's requests)")
    last_line: Mapped[int] = mapped_column(Integer, default=0, comment="number of the last non-blank line")
    endpoints: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True,
                                                             comment="request url -> first line using it")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class FilePart(Base):
    """A run of whole lines of a file, in order (``seq``); lines are numbered from 1 over the whole file."""

    __tablename__ = "file_parts"
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_line: Mapped[int] = mapped_column(Integer)
    last_line: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(Integer, default=0, comment="non-blank lines in this part")
    content: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """A batch of the Batch API: its input file's lines become batch-tier jobs (``batch_requests`` links them)."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant_created", "tenant_id", "created_at", "id"),
                      Index("ix_batches_status", "status"))
    id: Mapped[str] = mapped_column(String(40), primary_key=True, comment="batch_<hex>")
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(32))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), default="validating")
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    next_line: Mapped[int] = mapped_column(Integer, default=1, comment="every line before it is linked or failed")
    completed: Mapped[int] = mapped_column(Integer, default=0, comment="final request count (set when it ends)")
    failed: Mapped[int] = mapped_column(Integer, default=0, comment="final request count (set when it ends)")
    errors: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(100), nullable=True, comment="the process driving it")
    lease_until: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column()
    in_progress_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    finalizing_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    completed_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    failed_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    expired_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    cancelling_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    cancelled_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)


class BatchRequest(Base):
    """One line of a batch: the job it became, or (``job_id`` NULL) why it never became one."""

    __tablename__ = "batch_requests"
    __table_args__ = (Index("ix_batch_requests_job", "job_id"),)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, comment="{code, message}")
