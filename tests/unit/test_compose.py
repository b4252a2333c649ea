"""compose.yaml cannot run here (no Docker engine), so check it by reading: every INFERQ_* name it
sets is a real setting, every inferq service has a health check, and the commands name real CLI
commands."""

from pathlib import Path

import yaml

from deploy.cli import app
from inferq.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_settings_names_exist():
    compose = _compose()
    fields = set(Settings.model_fields)
    seen = set()
    for name, svc in compose["services"].items():
        for key in (svc.get("environment") or {}):
            if key.startswith("INFERQ_"):
                seen.add(key)
                assert key.removeprefix("INFERQ_").lower() in fields, f"{name}: {key} is not a setting"
    assert {"INFERQ_DATABASE_URL", "INFERQ_REDIS_URL"} <= seen


def test_compose_services_and_health_checks():
    services = _compose()["services"]
    assert {"postgres", "redis", "api", "worker", "celery"} <= set(services)
    for name in ("postgres", "redis", "api", "worker", "celery"):
        assert "healthcheck" in services[name], f"{name} has no health check"
    assert _compose()["volumes"], "named volumes keep data across restarts"


def test_compose_commands_are_cli_commands():
    import typer.main

    click_app = typer.main.get_command(app)
    names = set(click_app.commands)  # type: ignore[attr-defined]
    for name, svc in _compose()["services"].items():
        cmd = svc.get("command")
        if svc.get("build") and cmd:
            assert cmd[0] in names, f"{name}: `inferq {cmd[0]}` is not a command"
