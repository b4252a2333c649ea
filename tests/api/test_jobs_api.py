"""REST jobs API over real HTTP (uvicorn) with real PostgreSQL and Redis: submission, idempotency,
every error status, cursor pagination, cancellation."""

from __future__ import annotations

import uuid

import httpx
import pytest

from api.app import create_app
from api.tenants import create_key, revoke_key
from inferq import jobs
from inferq.contract import stream_key
from inferq.db import Job
from tests.registry_helpers import register_worker

pytestmark = pytest.mark.integration

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}


def test_submit_then_get(client, tenant, settings, redis_client):
    r = client.post("/v1/jobs", json=BODY, headers=tenant.headers)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["object"] == "job"
    assert job["links"] == {"self": f"/v1/jobs/{job['id']}", "events": f"/v1/jobs/{job['id']}/events",
                            "cancel": f"/v1/jobs/{job['id']}/cancel"}
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    # queued on the Redis stream of its (model, tier)
    assert jobs.queue_counts(redis_client, settings.stream_prefix, settings.model, "interactive",
                             settings.consumer_group) == (1, 0)
    # in its tenant's lane of that stream (fair share)
    assert redis_client.xlen(stream_key(settings.stream_prefix, settings.model, "interactive", tenant.tenant_id)) == 1

    g = client.get(f"/v1/jobs/{job['id']}", headers=tenant.headers)
    assert g.status_code == 200
    got = g.json()
    assert got["id"] == job["id"] and got["status"] == "queued"
    assert got["text"] is None and got["usage"] is None and got["cost"] is None
    assert got["timings"]["created_at"] and got["timings"]["queued_at"]
    assert got["model"] == settings.model and got["tier"] == "interactive"


def test_stored_before_202(client, tenant, db):
    r = client.post("/v1/jobs", json={**BODY, "metadata": {"k": [1, 2]}, "tier": "batch", "priority": 5},
                    headers=tenant.headers)
    assert r.status_code == 202
    with db() as s:
        job = s.get(Job, r.json()["id"])
        assert job is not None and job.tenant_id == tenant.tenant_id
        assert job.meta == {"k": [1, 2]} and job.tier == "batch" and job.priority == 5


def test_401_without_valid_key(client, tenant, db):
    assert client.post("/v1/jobs", json=BODY).status_code == 401
    r = client.get("/v1/jobs", headers={"Authorization": "Bearer iq_nope_nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert client.get("/v1/usage").status_code == 401
    # a revoked key
    k = create_key(db, tenant.name)
    revoke_key(db, k.prefix)
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {k.key}"}).status_code == 401


def test_revocation_takes_effect(serve, settings, tenant, db, redis_client):
    url = serve(settings, auth_cache_seconds=0)
    k = create_key(db, tenant.name)
    h = {"Authorization": f"Bearer {k.key}"}
    with httpx.Client(base_url=url) as c:
        assert c.get("/v1/jobs", headers=h).status_code == 200
        revoke_key(db, k.prefix)
        assert c.get("/v1/jobs", headers=h).status_code == 401


def test_key_lookup_on_postgres_reads_what_the_orm_reads(db, make_tenant):
    """``lookup_key``'s one-round-trip PostgreSQL path gives the principal the ORM path gives: the tenant's every
    column, the key's prefix and admin flag; nobody for an unknown or a revoked key."""
    from api.auth import _lookup_orm, lookup_key
    from api.tenants import hash_key
    from inferq.db import Tenant

    assert db.kw["bind"].dialect.name == "postgresql"
    admin = make_tenant(admin=True, max_queued_jobs=7, tokens_per_minute=900)
    for key in (admin.key, create_key(db, admin.name).key):
        fast, orm = lookup_key(db, key), _lookup_orm(db, hash_key(key))
        assert fast is not None and orm is not None
        assert (fast.key_prefix, fast.is_admin) == (orm.key_prefix, orm.is_admin)
        assert {c.key: getattr(fast.tenant, c.key) for c in Tenant.__table__.columns} == \
               {c.key: getattr(orm.tenant, c.key) for c in Tenant.__table__.columns}
    assert lookup_key(db, admin.key).is_admin and not lookup_key(db, create_key(db, admin.name).key).is_admin
    revoked = create_key(db, admin.name)
    revoke_key(db, revoked.prefix)
    assert lookup_key(db, revoked.key) is None and lookup_key(db, "iq_" + "0" * 40) is None


def test_404_unknown_and_cross_tenant(client, make_tenant):
    a, b = make_tenant(), make_tenant()
    job_id = client.post("/v1/jobs", json=BODY, headers=a.headers).json()["id"]
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events"):
        r = client.get(path, headers=b.headers)
        assert r.status_code == 404, path
        assert r.json()["error"]["type"] == "not_found"
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=b.headers).status_code == 404
    # B's cancel did nothing
    assert client.get(f"/v1/jobs/{job_id}", headers=a.headers).json()["status"] == "queued"
    # not in B's list
    assert client.get("/v1/jobs", headers=b.headers).json()["data"] == []
    # unknown ids, well-formed or not
    assert client.get(f"/v1/jobs/{uuid.uuid4()}", headers=a.headers).status_code == 404
    assert client.get("/v1/jobs/not-a-uuid", headers=a.headers).status_code == 404
    assert client.get(f"/v1/jobs/{uuid.uuid4()}/events", headers=a.headers).status_code == 404


def test_idempotency(client, tenant):
    h = {**tenant.headers, "Idempotency-Key": "order-1"}
    r1 = client.post("/v1/jobs", json=BODY, headers=h)
    r2 = client.post("/v1/jobs", json=BODY, headers=h)
    assert r1.status_code == 202 and r2.status_code == 200
    assert r1.json()["id"] == r2.json()["id"]
    assert r2.json()["idempotency_key"] == "order-1"
    r3 = client.post("/v1/jobs", json={**BODY, "max_tokens": 9}, headers=h)
    assert r3.status_code == 409 and r3.json()["error"]["type"] == "conflict"
    # keys are per tenant; another key gives another job
    r4 = client.post("/v1/jobs", json=BODY, headers={**tenant.headers, "Idempotency-Key": "order-2"})
    assert r4.status_code == 202 and r4.json()["id"] != r1.json()["id"]
    bad = client.post("/v1/jobs", json=BODY, headers={**tenant.headers, "Idempotency-Key": "x" * 201})
    assert bad.status_code == 422 and bad.json()["error"]["fields"][0]["field"] == "header.idempotency-key"


@pytest.mark.parametrize(("body", "field"), [
    ({**BODY, "max_tokens": 0}, "max_tokens"),
    ({**BODY, "temperature": -1}, "temperature"),
    ({**BODY, "tier": "gold"}, "tier"),
    ({**BODY, "bogus": 1}, "bogus"),
    ({**BODY, "messages": [{"role": "user", "content": "hi"}]}, "body"),
    ({"max_tokens": 3}, "body"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({**BODY, "prompt": "a\x00b"}, "prompt"),  # PostgreSQL cannot store NUL characters in text
    ({**BODY, "stop": ["ok", "\x00"]}, "stop.1"),
    ({"messages": [{"role": "user", "content": "\x00"}]}, "messages.0.content"),
])
def test_422_names_the_field(client, tenant, body, field):
    r = client.post("/v1/jobs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "validation_error"
    assert field in [f["field"] for f in err["fields"]], err
    assert all(f["reason"] for f in err["fields"])


def test_422_not_json(client, tenant):
    r = client.post("/v1/jobs", content=b"{nope", headers={**tenant.headers, "Content-Type": "application/json"})
    assert r.status_code == 422


@pytest.mark.parametrize("url", [
    "http://10.1.2.3/hook", "http://192.168.0.10:8080/hook", "http://169.254.169.254/latest/meta-data",
    "http://[fd00::1]/x", "http://[::ffff:10.0.0.1]/x", "http://100.64.0.1/x", "http://0.0.0.0/x",
    "ftp://example.com/x", "not a url", "http:///nohost",
])
def test_422_private_webhook(client, tenant, url):
    r = client.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
    assert r.status_code == 422, (url, r.text)
    assert r.json()["error"]["fields"][0]["field"] == "webhook_url"


def test_loopback_webhook_needs_allowlist(serve, settings, tenant, redis_client):
    strict = settings.model_copy(update={"webhook_allowlist": ""})
    with httpx.Client(base_url=serve(strict)) as c:
        for url in ("http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://[::1]:9/hook"):
            r = c.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
            assert r.status_code == 422, url
            assert "loopback" in r.json()["error"]["message"]
    cidr = settings.model_copy(update={"webhook_allowlist": "127.0.0.0/8"})
    with httpx.Client(base_url=serve(cidr)) as c:
        r = c.post("/v1/jobs", json={**BODY, "webhook_url": "http://127.0.0.2:9/hook"}, headers=tenant.headers)
        assert r.status_code == 202, r.text
    # the default test settings allow-list 127.0.0.1 and localhost by name
    with httpx.Client(base_url=serve(settings)) as c:
        r = c.post("/v1/jobs", json={**BODY, "webhook_url": "http://localhost:9/hook"}, headers=tenant.headers)
        assert r.status_code == 202


def test_429_tenant_queue(client, make_tenant):
    t = make_tenant(max_queued_jobs=2)
    assert client.post("/v1/jobs", json=BODY, headers=t.headers).status_code == 202
    assert client.post("/v1/jobs", json=BODY, headers=t.headers).status_code == 202
    r = client.post("/v1/jobs", json=BODY, headers=t.headers)
    assert r.status_code == 429 and r.json()["error"]["type"] == "quota_exceeded"
    assert int(r.headers["retry-after"]) >= 1


def test_429_tokens_per_minute(client, make_tenant):
    t = make_tenant(tokens_per_minute=100)
    assert client.post("/v1/jobs", json={**BODY, "max_tokens": 80}, headers=t.headers).status_code == 202
    r = client.post("/v1/jobs", json={**BODY, "max_tokens": 80}, headers=t.headers)
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert "token" in r.json()["error"]["message"]


def test_429_tier_queue_cap(serve, settings, tenant, redis_client):
    capped = settings.model_copy(update={"tier_queue_cap": 0})
    with httpx.Client(base_url=serve(capped)) as c:
        r = c.post("/v1/jobs", json=BODY, headers=tenant.headers)
        assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_503_database_down(serve, settings, tenant):
    down = settings.model_copy(update={"database_url": f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x"})
    with httpx.Client(base_url=serve(down), timeout=30) as c:
        r = c.post("/v1/jobs", json=BODY, headers=tenant.headers)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "unavailable"
        assert "database unavailable" in r.json()["error"]["message"]
        r = c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["checks"]["database"].startswith("unreachable") and r.json()["checks"]["redis"] == "ok"
        assert c.get("/healthz").status_code == 200


def test_503_redis_down(serve, settings, tenant, db):
    down = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{_closed_port()}/0"})
    with httpx.Client(base_url=serve(down), timeout=30) as c:
        r = c.post("/v1/jobs", json=BODY, headers=tenant.headers)
        assert r.status_code == 503, r.text
        assert "redis unavailable" in r.json()["error"]["message"]
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["redis"].startswith("unreachable")
        assert r.json()["checks"]["database"] == "ok"
    # nothing was accepted
    with db() as s:
        assert s.query(Job).filter(Job.tenant_id == tenant.tenant_id).count() == 0


def test_cursor_pagination(client, tenant):
    ids = [client.post("/v1/jobs", json={**BODY, "seed": i}, headers=tenant.headers).json()["id"] for i in range(7)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params, headers=tenant.headers).json()
        pages += 1
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert pages == 3
    assert seen == list(reversed(ids))  # newest first, each once
    # filters
    first = client.get(f"/v1/jobs/{ids[0]}", headers=tenant.headers).json()
    since = client.get("/v1/jobs", params={"since": first["timings"]["created_at"], "limit": 100},
                       headers=tenant.headers).json()
    assert [j["id"] for j in since["data"]] == list(reversed(ids))
    client.post(f"/v1/jobs/{ids[3]}/cancel", headers=tenant.headers)
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=tenant.headers).json()
    assert [j["id"] for j in cancelled["data"]] == [ids[3]]
    queued = client.get("/v1/jobs", params={"status": "queued", "limit": 100}, headers=tenant.headers).json()
    assert len(queued["data"]) == 6
    # bad parameters
    for params in ({"cursor": "garbage!"}, {"limit": 0}, {"limit": 201}, {"status": "done"}, {"since": "yesterday"}):
        r = client.get("/v1/jobs", params=params, headers=tenant.headers)
        assert r.status_code == 422, params
        assert r.json()["error"]["fields"][0]["field"].startswith("query.")


def test_cancel_queued(client, tenant):
    job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant.headers)
    assert r.status_code == 200
    job = r.json()
    assert job["status"] == "cancelled" and job["cancel_requested"] is True
    assert job["finish_reason"] == "abort"
    assert job["cost"] == {"micros": 0, "dollars": "0.000000"}
    assert job["timings"]["finished_at"]
    # cancelling again is a no-op
    again = client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_ops_endpoints(client, tenant, settings):
    assert client.get("/healthz").json() == {"status": "ok"}
    register_worker(settings, "w-ops")  # /readyz wants a worker serving a model (tests/api/test_admission.py)
    r = client.get("/readyz")
    idle = {"backlog": 0, "pending": 0, "oldest_waiting_seconds": 0.0, "busy_seats": 0, "seats": 0}
    assert r.status_code == 200 and r.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok",
                                                 "workers": "ok"}, "models": {settings.model: ["w-ops"]},
                                                 "queues": {settings.model: {"interactive": idle, "batch": idle}}}
    client.post("/v1/jobs", json=BODY, headers=tenant.headers)
    m = client.get("/metrics")
    assert m.status_code == 200
    assert "inferq_api_requests_total" in m.text
    assert 'route="/v1/jobs"' in m.text
    assert "inferq_api_jobs_submitted_total" in m.text


def test_openapi_documents_everything(settings):
    spec = create_app(settings, webhooks=False).openapi()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/events", "/v1/usage",
            "/v1/admin/usage", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    post = spec["paths"]["/v1/jobs"]["post"]
    assert {"200", "202", "401", "409", "422", "429", "503"} <= set(post["responses"])
    # every schema property is described
    missing = []
    for name, schema in spec["components"]["schemas"].items():
        for prop, p in schema.get("properties", {}).items():
            if "description" not in p and "$ref" not in p and "allOf" not in p:
                missing.append(f"{name}.{prop}")
    assert not missing, missing
