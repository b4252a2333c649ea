"""inferq: a message-queue-driven asynchronous LLM inference service.

This package is the small shared core: typed settings, logging, the job contract (the msgpack message
and the request schema shared by the API, Celery and the worker), the database models and the CLI.
It never imports torch at module level, so the API can use it.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("inferq")  # one source of truth: pyproject.toml's version, as installed
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
