"""CLI commands of the API area, registered by ``deploy/cli.py``: ``inferq api``, ``inferq tenants create|show|set-weight``,
``inferq keys create|revoke``, ``inferq report``, ``inferq celery-worker``, ``inferq webhooks``.
Plain functions with typer defaults; nothing here imports torch."""

from __future__ import annotations

import socket
from typing import Any

import typer

from inferq.errors import CLIError


def _error(message: str) -> Exception:
    return CLIError(message)


def _settings() -> Any:
    from inferq.settings import get_settings

    return get_settings()


def _db() -> Any:
    from inferq.db import make_engine, make_sessionmaker

    return make_sessionmaker(make_engine(_settings().database_url))


def api(
    host: str | None = typer.Option(None, help="Bind address (default: INFERQ_API_HOST, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default: INFERQ_API_PORT, 8000)."),
    workers: int | None = typer.Option(None, min=1,
                                       help="Uvicorn worker processes, each with its own pools and webhook "
                                            "dispatcher (default: INFERQ_API_WORKERS, 1)."),
    webhooks: bool = typer.Option(True, "--webhooks/--no-webhooks",
                                  help="Deliver webhooks from this process (off if `inferq webhooks` runs elsewhere)."),
) -> None:
    """Serve the REST API (FastAPI on uvicorn)."""
    import uvicorn

    from inferq.log import configure_logging

    settings = _settings()
    configure_logging(settings.log_level, settings.log_json)
    factory = "api.app:create_app" if webhooks else "api.app:create_app_without_webhooks"
    uvicorn.run(factory, factory=True, host=host or settings.api_host, port=port or settings.api_port,
                workers=workers or settings.api_workers, log_level=settings.log_level.lower(), access_log=False, proxy_headers=True)


def tenants_create(
    name: str = typer.Argument(..., help="Tenant name (unique)."),
    max_queued_jobs: int | None = typer.Option(None, min=0, help="Cap on queued jobs (default: INFERQ_DEFAULT_MAX_QUEUED_JOBS)."),
    tokens_per_minute: int | None = typer.Option(None, min=0, help="Token rate limit (default: INFERQ_DEFAULT_TOKENS_PER_MINUTE)."),
    key: bool = typer.Option(True, "--key/--no-key", help="Also create a first API key (printed once)."),
    admin: bool = typer.Option(False, "--admin", help="Make that key an admin key."),
) -> None:
    """Create a tenant (random prefix-cache namespace and webhook secret) and, by default, an API key."""
    from api.tenants import TenantError, create_key, create_tenant

    db = _db()
    try:
        tenant = create_tenant(db, name, max_queued_jobs=max_queued_jobs, tokens_per_minute=tokens_per_minute)
        typer.echo(f"tenant:          {tenant.name} ({tenant.id})")
        typer.echo(f"webhook secret:  {tenant.webhook_secret}")
        if key:
            k = create_key(db, tenant.name, admin=admin)
            typer.echo(f"api key:         {k.key}")
            typer.echo(f"key prefix:      {k.prefix}{' (admin)' if admin else ''}")
            typer.echo("The key is shown only now; store it safely.", err=True)
    except TenantError as exc:
        raise _error(str(exc)) from None


def tenants_show(name: str = typer.Argument(..., help="Tenant name.")) -> None:
    """Show a tenant: quotas, webhook secret, keys (prefixes only), jobs by status."""
    from sqlalchemy import func, select

    from api.tenants import TenantError, get_tenant, list_keys
    from inferq.db import Job

    settings = _settings()
    with _db()() as s:
        try:
            t = get_tenant(s, name)
        except TenantError as exc:
            raise _error(str(exc)) from None
        typer.echo(f"tenant:             {t.name} ({t.id})")
        typer.echo(f"created:            {t.created_at.isoformat()}")
        typer.echo(f"max queued jobs:    {t.max_queued_jobs if t.max_queued_jobs is not None else f'{settings.default_max_queued_jobs} (default)'}")
        typer.echo(f"tokens per minute:  {t.tokens_per_minute if t.tokens_per_minute is not None else f'{settings.default_tokens_per_minute} (default)'}")
        typer.echo(f"fair-share weight:  {t.fair_share_weight:g}")
        typer.echo(f"cache namespace:    {t.cache_namespace}")
        typer.echo(f"webhook secret:     {t.webhook_secret}")
        counts = dict(s.execute(select(Job.status, func.count()).where(Job.tenant_id == t.id).group_by(Job.status)).all())
        typer.echo("jobs:               " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"))
        typer.echo("keys:")
        for k in list_keys(s, t):
            state = f"revoked {k.revoked_at.isoformat()}" if k.revoked_at else "active"
            typer.echo(f"  {k.prefix}  {'admin' if k.is_admin else 'user '}  {state}  created {k.created_at.isoformat()}")


def tenants_set_weight(
    name: str = typer.Argument(..., help="Tenant name."),
    weight: float = typer.Argument(..., help="Fair-share weight (> 0; default 1.0): 2 gets twice the tokens of 1."),
) -> None:
    """Set a tenant's fair-share weight: its share of its tier's admitted tokens while other tenants are busy."""
    from api.tenants import TenantError, set_fair_share_weight

    try:
        tenant = set_fair_share_weight(_db(), name, weight)
    except TenantError as exc:
        raise _error(str(exc)) from None
    typer.echo(f"tenant {tenant.name}: fair-share weight {tenant.fair_share_weight:g} (new jobs carry it)")


def keys_create(
    tenant_name: str | None = typer.Argument(None, metavar="TENANT", help="Tenant name (or --tenant NAME)."),
    tenant_option: str | None = typer.Option(None, "--tenant", help="Tenant name (or positionally)."),
    admin: bool = typer.Option(False, "--admin", help="Admin key (may read /v1/admin/usage)."),
) -> None:
    """Create an API key; the key is printed once (only its sha256 is stored)."""
    from api.tenants import TenantError, create_key

    tenant = _one_tenant(tenant_name, tenant_option)
    try:
        k = create_key(_db(), tenant, admin=admin)
    except TenantError as exc:
        raise _error(str(exc)) from None
    typer.echo(k.key)
    typer.echo(f"prefix {k.prefix}{' (admin)' if admin else ''} for tenant {k.tenant}; the key is shown only now", err=True)


def _one_tenant(positional: str | None, option: str | None) -> str:
    """The tenant named either way (both spellings are in use: ``keys create acme``, ``--tenant acme``)."""
    if positional and option and positional != option:
        raise _error(f"two tenants given ({positional!r} and --tenant {option!r}): give one")
    tenant = positional or option
    if not tenant:
        raise _error("give the tenant: inferq keys create NAME (or --tenant NAME)")
    return tenant


def keys_revoke(prefix: str = typer.Argument(..., help="The key's prefix (iq_xxxxxxxx).")) -> None:
    """Revoke an API key (takes effect within a few seconds on running API servers)."""
    from api.tenants import TenantError, revoke_key

    try:
        k = revoke_key(_db(), prefix)
    except TenantError as exc:
        raise _error(str(exc)) from None
    typer.echo(f"revoked {k.prefix} at {k.revoked_at.isoformat() if k.revoked_at else '?'}")


def report(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant (default: all tenants)."),
    since: str | None = typer.Option(None, "--since", help="Start (inclusive): YYYY-MM-DD (UTC) or ISO 8601 "
                                                           "datetime; default 30 days before --until, as /v1/usage."),
    until: str | None = typer.Option(None, "--until", help="End (exclusive); default now."),
    group_by: str = typer.Option("day", "--group-by", help="Comma-separated: day, model, tier (and tenant)."),
    format: str = typer.Option("table", "--format", help="table, csv or json."),
) -> None:
    """Usage and cost from the ledger: the same numbers as GET /v1/usage (by default, the last 30 days)."""
    import datetime as dt

    from sqlalchemy import select

    from api.reports import (
        ReportError,
        build_report,
        parse_group_by,
        parse_when,
        shift,
        to_csv,
        to_json,
        to_table,
    )
    from inferq.db import Tenant, utcnow

    if format not in ("table", "csv", "json"):
        raise _error("--format must be table, csv or json")
    try:
        end = parse_when(until, "--until") or utcnow()
        start = parse_when(since, "--since") or shift(end, -dt.timedelta(days=30))
        groups = parse_group_by(group_by, allow_tenant=True)
    except ReportError as exc:
        raise _error(str(exc)) from None
    assert start is not None
    with _db()() as s:
        tenant_id = None
        if tenant is not None:
            tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
            if tenant_id is None:
                raise _error(f"no tenant named {tenant!r}")
        try:
            rep = build_report(s, since=start, until=end, group_by=groups, tenant_id=tenant_id, tenant_name=tenant)
        except ReportError as exc:
            raise _error(str(exc)) from None
    out = {"csv": to_csv, "json": to_json, "table": to_table}[format](rep)
    typer.echo(out.rstrip("\n"))


def celery_worker(
    concurrency: int = typer.Option(8, min=1, help="Tasks at once (generate tasks mostly wait)."),
    pool: str = typer.Option("threads", help="Celery pool: threads, prefork, solo, ..."),
    loglevel: str = typer.Option("INFO", help="Celery log level."),
    hostname: str | None = typer.Option(None, help="Worker name (default inferq@<host>)."),
) -> None:
    """Run a Celery worker for the inferq.submit and inferq.generate tasks."""
    from api.celery_app import consumed_queues, make_celery

    settings = _settings()
    app = make_celery(settings)
    app.worker_main([
        "worker", f"--concurrency={concurrency}", f"--pool={pool}", f"--loglevel={loglevel}",
        "-Q", ",".join(consumed_queues(settings)), "-n", hostname or f"inferq@{socket.gethostname()}", "--without-gossip",
        "--without-mingle",
    ])


def webhooks(
    poll_interval: float = typer.Option(0.5, help="Seconds between polls when idle, where the database is not "
                                        "PostgreSQL (there, a notification wakes the dispatcher)."),
    concurrency: int = typer.Option(8, min=1, help="Deliveries in flight at once."),
) -> None:
    """Deliver webhooks (run this when the API runs with --no-webhooks, or for more delivery capacity)."""
    import signal
    import threading

    from api.webhooks import WebhookDispatcher
    from inferq.log import configure_logging, get_logger

    settings = _settings()
    configure_logging(settings.log_level, settings.log_json)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dispatcher = WebhookDispatcher(settings, _db(), poll_interval=poll_interval, concurrency=concurrency)
    get_logger("inferq.webhooks").info("webhook dispatcher started")
    try:
        dispatcher.run(stop)
    finally:
        dispatcher.stop()
