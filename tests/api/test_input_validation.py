"""Issue 18, item 2, over real HTTP, PostgreSQL and Redis: a value that cannot be stored or put on a stream
(a lone surrogate anywhere in the body, an integer beyond signed 64 bits, a non-finite number) is a 422
naming the field before anything is written, and the tenant's next submission is unaffected. A row stored
before these checks existed never answers 500 on GET or in the list, and the reconciler fails its job with
the reason instead of retrying its enqueue forever."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from sqlalchemy import select, text

from inferq import jobs
from inferq.db import Job, Result
from inferq.jobs.enqueue import enqueued_key

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}
TOO_BIG = 2**64
LONE = "\ud800"


@pytest.mark.parametrize(("body", "field"), [
    ({**BODY, "metadata": {"note": f"a{LONE}b"}}, "metadata"),
    ({**BODY, "metadata": {"deep": [{"x": LONE}]}}, "metadata"),
    ({**BODY, "metadata": {LONE: 1}}, "metadata"),
    ({**BODY, "metadata": {"n": float("inf")}}, "metadata"),
    ({"messages": [{"role": "user", "content": LONE}], "max_tokens": 8}, "messages.0.content"),
    ({**BODY, "prompt": f"hi {LONE}"}, "prompt"),
    ({**BODY, "model": LONE}, "model"),
    ({**BODY, "stop": ["ok", "\udfff"]}, "stop.1"),
    ({**BODY, "webhook_url": f"http://127.0.0.1/{LONE}"}, "webhook_url"),
    ({**BODY, "top_k": TOO_BIG}, "top_k"),
    ({**BODY, "top_k": 2**63}, "top_k"),
    ({**BODY, "seed": TOO_BIG}, "seed"),
    ({"prompt_ids": [1, TOO_BIG], "max_tokens": 8}, "prompt_ids.1"),
    ({**BODY, "stop_token_ids": [TOO_BIG]}, "stop_token_ids.0"),
])
def test_unstorable_values_are_422_before_anything_is_written(client, tenant, db, body, field):
    # JSON's \ud800 escape is how a lone surrogate arrives over HTTP (ensure_ascii writes it so)
    raw = json.dumps(body).replace("Infinity", "1e400").encode()
    r = client.post("/v1/jobs", content=raw, headers={**tenant.headers, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "validation_error"
    assert field in [f["field"] for f in err["fields"]], err
    with db() as s:
        assert s.scalar(select(Job.id).where(Job.tenant_id == tenant.tenant_id)) is None
    assert client.post("/v1/jobs", json=BODY, headers=tenant.headers).status_code == 202  # the next one runs


def test_lone_surrogate_in_an_unknown_key_is_a_clean_422(client, tenant):
    raw = json.dumps({**BODY, LONE: 1}).encode()
    r = client.post("/v1/jobs", content=raw, headers={**tenant.headers, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/json")


def test_largest_accepted_values_fit_the_stream_message(client, tenant, redis_client, settings):
    """The bounds are exactly what the msgpack message holds: the largest accepted values are enqueued."""
    big = 2**63 - 1
    body = {"prompt_ids": [big], "max_tokens": 8, "top_k": big, "seed": big, "stop_token_ids": [big],
            "metadata": {"huge": TOO_BIG, "emoji": "\U0001F600"}}
    r = client.post("/v1/jobs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    assert redis_client.sismember(enqueued_key(settings.stream_prefix), r.json()["id"])
    assert r.json()["metadata"] == body["metadata"]


def _legacy_row(client, tenant, db, redis_client, settings) -> str:
    """A job as the API stored it before these checks: a lone surrogate in its metadata and prompt, an
    integer msgpack cannot hold, and no stream message (its enqueue failed)."""
    job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]
    with db() as s:
        s.execute(text("UPDATE jobs SET metadata = CAST(:meta AS JSON), request = CAST(:req AS JSON), "
                       "queued_at = :old WHERE id = :id"),
                  {"meta": '{"note": "a\\ud800b", "\\udfff": [1]}',
                   "req": '{"prompt": "hi \\ud800", "max_tokens": 8, "top_k": 18446744073709551616}',
                   "old": dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1), "id": job_id})
        s.commit()
    redis_client.srem(enqueued_key(settings.stream_prefix), job_id)
    return job_id


def test_stored_unencodable_rows_render_and_fail_instead_of_retrying(client, tenant, db, redis_client, settings):
    job_id = _legacy_row(client, tenant, db, redis_client, settings)
    r = client.get(f"/v1/jobs/{job_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"note": "a\ufffdb", "\ufffd": [1]}
    listed = client.get("/v1/jobs", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    assert [j["id"] for j in listed.json()["data"]] == [job_id]

    report = jobs.reconcile(db, redis_client, settings, grace_seconds=0)
    assert report.failed == 1
    view = client.get(f"/v1/jobs/{job_id}", headers=tenant.headers).json()
    assert view["status"] == "failed", view
    assert "cannot be encoded" in view["error"] and view["usage"]["total_tokens"] == 0
    with db() as s:
        assert s.scalar(select(Result.job_id).where(Result.job_id == job_id)) == job_id
    assert jobs.reconcile(db, redis_client, settings, grace_seconds=0).failed == 0  # done with it, not retried


def test_enqueue_many_enqueues_the_others(client, tenant, db, redis_client, settings):
    """One unencodable job in a group neither blocks the others' enqueue nor is silently dropped."""
    good = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]
    bad = _legacy_row(client, tenant, db, redis_client, settings)
    redis_client.srem(enqueued_key(settings.stream_prefix), good)
    with db() as s:
        rows = s.scalars(select(Job).where(Job.id.in_([good, bad]))).all()
        s.expunge_all()
    with pytest.raises(jobs.Unenqueueable) as info:
        jobs.enqueue_many(redis_client, settings, [(job, "ns") for job in rows])
    assert list(info.value.reasons) == [bad]
    assert redis_client.sismember(enqueued_key(settings.stream_prefix), good)
    assert not redis_client.sismember(enqueued_key(settings.stream_prefix), bad)
