"""Issue 18 regressions over real HTTP, Redis and PostgreSQL: request bodies over the size limit are 413,
webhook URLs that reach a private IPv4 host
through an IPv6 transition form are refused, and a PostgreSQL outage in the middle of the service's life
(the admission path's pooled raw connections break) answers 503 with a reason on every route, never a 500,
and the service recovers by itself."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sqlalchemy.engine import make_url

from inferq.db import Job
from tests.service_fixtures import TcpProxy

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("url", [
    "http://[64:ff9b::a9fe:a9fe]/latest/meta-data",  # NAT64 of 169.254.169.254
    "http://[64:ff9b:1::a00:1]/x",  # local-use NAT64 of 10.0.0.1
    "http://[2002:7f00:1::]/x",  # 6to4 of 127.0.0.1
    "http://[2002:a00:1::1]/x",  # 6to4 of 10.0.0.1
    "http://[::127.0.0.1]/x",  # IPv4-compatible loopback
    "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/x",  # Teredo: client 192.0.2.45 (documentation range)
])
def test_ipv6_forms_of_private_ipv4_are_refused(client, tenant, url):
    r = client.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
    assert r.status_code == 422, (url, r.text)
    assert r.json()["error"]["fields"][0]["field"] == "webhook_url"


def test_ipv6_forms_of_public_ipv4_are_accepted(client, tenant):
    for url in ("http://[64:ff9b::808:808]/hook", "http://[2002:808:808::1]/hook"):  # 8.8.8.8
        r = client.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
        assert r.status_code == 202, (url, r.text)


@pytest.fixture
def proxied(settings):
    url = make_url(settings.database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    yield proxy, settings.model_copy(update={"database_url": through})
    proxy.close()


def test_database_outage_mid_life_is_503_then_recovers(serve, proxied, tenant, redis_client):
    proxy, settings = proxied
    with httpx.Client(base_url=serve(settings), timeout=30) as c:
        for _ in range(3):  # the admission pool now holds live connections through the proxy
            assert c.post("/v1/jobs", json=BODY, headers=tenant.headers).status_code == 202
        proxy.cut()  # every pooled connection breaks; new ones are refused
        for _ in range(6):
            for method, path in (("POST", "/v1/jobs"), ("GET", "/v1/jobs")):
                r = c.request(method, path, json=BODY if method == "POST" else None, headers=tenant.headers)
                assert r.status_code == 503, (method, path, r.status_code, r.text)
                assert r.headers["content-type"].startswith("application/json")
                assert "database unavailable" in r.json()["error"]["message"]
        proxy.restore()
        deadline = time.monotonic() + 30
        while True:  # recovers on its own: no restart, no manual pool reset
            r = c.post("/v1/jobs", json=BODY, headers=tenant.headers)
            if r.status_code == 202 or time.monotonic() > deadline:
                break
            assert r.status_code == 503, r.text
            time.sleep(0.2)
        assert r.status_code == 202, r.text
        assert c.get("/v1/jobs", headers=tenant.headers).status_code == 200


def test_body_over_the_limit_is_413(serve, settings, tenant, redis_client, db):
    small = settings.model_copy(update={"max_request_bytes": 4096})
    with httpx.Client(base_url=serve(small), timeout=30) as c:
        big = {**BODY, "prompt": "word " * 2000}  # ~10 kB of JSON
        r = c.post("/v1/jobs", json=big, headers=tenant.headers)  # declared Content-Length
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "payload_too_large" and "4096 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        r = c.post("/v1/jobs", content=chunks(), headers={**tenant.headers, "content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "payload_too_large"
        assert c.post("/v1/jobs", json=BODY, headers=tenant.headers).status_code == 202  # a normal body still runs
    with db() as s:  # nothing of the refused bodies was stored
        assert s.query(Job).filter(Job.tenant_id == tenant.tenant_id).count() == 1
