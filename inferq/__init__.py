"""inferq: a message-queue-driven asynchronous LLM inference service.

This package is the small shared core: typed settings, logging, the job contract (the msgpack message
and the request schema shared by the API, Celery and the worker), the database models and the CLI.
It never imports torch at module level, so the API can use it.
"""

__version__ = "0.1.0"
