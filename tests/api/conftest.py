"""API test fixtures: the app served by a real uvicorn server (in a thread, on a free port) against the
real PostgreSQL and Redis of the shared fixtures, and tenants with API keys."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from api.app import create_app
from api.tenants import create_key, create_tenant
from inferq.settings import Settings
from tests.registry_helpers import announce_default_model


class LiveServer:
    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """``serve(settings, announce_model=True, **create_app_kwargs) -> base_url``; servers stop at the end of
    the test. ``announce_model``: make the settings' default model known first (``announce_default_model``)."""
    servers: list[LiveServer] = []

    def _serve(settings: Settings, announce_model: bool = True, **kwargs) -> str:
        if announce_model:
            announce_default_model(settings)
        kwargs.setdefault("webhooks", False)
        server = LiveServer(create_app(settings, **kwargs)).start()
        servers.append(server)
        return server.url

    yield _serve
    for s in servers:
        s.stop()


@dataclass
class TenantKey:
    name: str
    key: str
    prefix: str
    tenant_id: str
    webhook_secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def make_tenant(db) -> Callable[..., TenantKey]:
    def _make(admin: bool = False, **quotas) -> TenantKey:
        name = f"t-{uuid.uuid4().hex[:10]}"
        tenant = create_tenant(db, name, **quotas)
        k = create_key(db, name, admin=admin)
        return TenantKey(name, k.key, k.prefix, tenant.id, tenant.webhook_secret)

    return _make


@pytest.fixture
def tenant(make_tenant) -> TenantKey:
    return make_tenant()


@pytest.fixture
def base_url(serve, settings, redis_client) -> str:
    return serve(settings)


@pytest.fixture
def client(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c
