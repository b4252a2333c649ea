"""The ``inferq`` command line (the ``inferq`` script runs ``main``). Commands from each area live in that area's
module and are registered here; those modules import torch only inside their functions, so ``inferq api``
never loads it. ``up`` (``deploy.launcher``), ``migrate`` and ``models list`` are defined here."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer

from inferq.errors import CLIError
from inferq.settings import SettingsError

# Plain help (rich_markup_mode=None): typer's rich help prints a type after plain flags, "--debug <bool>",
# as if they took a value.
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="inferq: asynchronous LLM inference over Redis and PostgreSQL.")
models_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Models inferq can serve.")
tenants_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Tenants (who owns jobs, keys and costs).")
keys_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="API keys.")
app.add_typer(models_app, name="models")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")

_debug = False


def _show_version(value: bool) -> None:
    if value:
        from inferq import __version__

        typer.echo(f"inferq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Show the version and exit."),
) -> None:
    global _debug
    _debug = debug


@app.command()
def migrate() -> None:
    """Apply the database migrations to INFERQ_DATABASE_URL."""
    from inferq.migrate import upgrade
    from inferq.settings import get_settings

    settings = get_settings()
    upgrade(settings.database_url)
    typer.echo(f"database migrated: {_safe_url(settings.database_url)}")


@models_app.command("list")
def models_list() -> None:
    """Show the models available here."""
    from inferq.settings import get_settings
    from worker.loader import list_models

    for m in list_models(get_settings()):
        typer.echo("  ".join(f"{k}={v}" for k, v in m.items()))


@app.command()
def up(
    demo: bool = typer.Option(False, "--demo", help="Submit one chat job, print the answer and its cost, then exit."),
    host: str = typer.Option("127.0.0.1", help="API host."),
    port: int = typer.Option(8000, help="API port."),
    model: str | None = typer.Option(None, "--model", help="Model name or local Hugging Face directory."),
    prompt: str = typer.Option("What is the capital of France?", help="The demo question."),
) -> None:
    """Run the whole service on this machine: embedded Redis and SQLite unless INFERQ_REDIS_URL /
    INFERQ_DATABASE_URL are set, the API, one worker and a demo tenant."""
    from deploy.launcher import run_up

    run_up(demo=demo, host=host, port=port, model=model, prompt=prompt)


def _register(target: typer.Typer, name: str, module: str, attr: str) -> None:
    """Register ``module.attr`` as a command (those modules import torch only inside their functions)."""
    import importlib

    fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    target.command(name)(fn)


_register(app, "generate", "worker.cli", "generate")
_register(app, "worker", "worker.service_cli", "worker")
_register(app, "api", "api.cli", "api")
_register(app, "celery-worker", "api.cli", "celery_worker")
_register(app, "webhooks", "api.cli", "webhooks")
_register(app, "report", "api.cli", "report")
_register(app, "bench", "bench.cli", "bench")
_register(tenants_app, "create", "api.cli", "tenants_create")
_register(tenants_app, "show", "api.cli", "tenants_show")
_register(tenants_app, "set-weight", "api.cli", "tenants_set_weight")
_register(keys_app, "create", "api.cli", "keys_create")
_register(keys_app, "revoke", "api.cli", "keys_revoke")


def _safe_url(url: str) -> str:
    from inferq.errors import _hide

    return _hide(url)


def explain(exc: BaseException) -> str | None:
    """A one-line explanation for the errors a user can fix, or None for real bugs."""
    from inferq.errors import describe

    if isinstance(exc, (SettingsError, CLIError)):
        return str(exc)
    return describe(exc)


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # one line for user errors; traceback only with --debug or for bugs
        message = explain(exc)
        if _debug or message is None:
            raise
        typer.echo(f"error: {message}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
