"""The model registry from the test side (inferq/models_registry.py): make a model known, as ``inferq up``
does for its default model, or register a stand-in worker for it, as a worker's heartbeat does, so that API
tests without a real worker can submit jobs and be ready."""

from __future__ import annotations

import redis

from inferq.contract import model_id
from inferq.models_registry import ServedModel, WorkerRegistration, announce
from inferq.settings import Settings

NOTHING_PUBLISHED = ServedModel(max_model_len=None, tokenizer_json=None, chat_template=None, template_vars={})


def announce_default_model(settings: Settings) -> None:
    """Make ``settings.model`` known: jobs for it are accepted before (or without) a worker. A Redis the test
    made unreachable is left alone."""
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2)
    try:
        announce(client, settings.stream_prefix, model_id(settings.model))
    except redis.ConnectionError:
        pass
    finally:
        client.close()


def register_worker(settings: Settings, worker: str = "test-worker", served: ServedModel = NOTHING_PUBLISHED,
                    model: str | None = None) -> WorkerRegistration:
    """A stand-in worker serving ``model`` (default: the settings' model) for the next minute: what ``served``
    says (by default nothing but its name) is published as a worker publishes it."""
    client = redis.Redis.from_url(settings.redis_url)
    reg = WorkerRegistration(client, settings.stream_prefix, model_id(model or settings.model), worker, served,
                             heartbeat_seconds=20.0)
    reg.publish()
    return reg
