"""Turning infrastructure failures into one-line messages that say what is wrong and how to fix it."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing command error: printed as one line, exit status 1 (no traceback)."""


class ModelError(Exception):
    """The model cannot be found, read or served (message names the path and the fix)."""


def describe(exc: BaseException) -> str | None:
    """One line for the failures a user can fix (unreachable services, bad model paths), else None."""
    from inferq.settings import get_settings

    if isinstance(exc, ModelError) or type(exc).__name__ == "ModelError":
        return str(exc)
    try:
        import sqlalchemy.exc

        if isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)):
            reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
            return (f"cannot reach the database ({reason}); check INFERQ_DATABASE_URL "
                    f"(now {_hide(get_settings().database_url)}) and that the server is running")
    except ImportError:
        pass
    try:
        import redis.exceptions

        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            return (f"cannot reach Redis ({exc}); check INFERQ_REDIS_URL (now {get_settings().redis_url}) "
                    "and that the server is running")
    except ImportError:
        pass
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"{exc.strerror}: {exc.filename}"
    return None


def _hide(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        if ":" in creds:
            return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url
