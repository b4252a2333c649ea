"""structlog configured once: JSON lines when stderr is not a TTY, readable on a TTY.

Bind context with ``structlog.contextvars.bind_contextvars(job_id=..., tenant=..., worker=...)`` or
``log.bind(...)``.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes to whatever sys.stderr is now (test runners and CLI runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    for chatty in ("alembic", "httpx", "httpcore"):  # per-request / per-plugin lines drown the useful ones
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def get_logger(name: str | None = None, **bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name).bind(**bound) if bound else structlog.get_logger(name)
