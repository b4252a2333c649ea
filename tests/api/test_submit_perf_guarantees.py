"""The guarantees the fast submission path must keep, under concurrency (real PostgreSQL and Redis): quotas
are not overshot by concurrent submitters, within one process or across several (each engine below stands
for an API process with its own quota bounds); a 429 only comes from an exact count; idempotency gives
one job per key; tenants stay isolated; a 202 means the row is committed; NUL characters are refused.
Correctness only: nothing here is timed."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from inferq import jobs
from inferq.contract import JobCreate, decode_message
from inferq.db import Job, Price, Tenant, make_engine, make_sessionmaker

pytestmark = pytest.mark.integration

BODY = {"prompt_ids": [100, 101, 102, 103, 104, 105, 106, 107], "max_tokens": 8, "tier": "batch"}


@pytest.fixture
def engines(settings) -> Iterator[Callable[[], Any]]:
    """``new() -> sessionmaker`` on an engine of its own (a separate "process": its own quota bounds)."""
    made = []

    def new():
        engine = make_engine(settings.database_url)
        made.append(engine)
        return make_sessionmaker(engine)

    yield new
    for e in made:
        e.dispose()


def _tenant(db, make_tenant, **quotas) -> Tenant:
    tk = make_tenant(**quotas)
    with db() as s:
        t = s.get(Tenant, tk.tenant_id)
        s.expunge(t)
    return t


def _race(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(i)`` for i in range(n) on n threads released together; exceptions are returned, not raised."""
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        barrier.wait()
        try:
            return fn(i)
        except Exception as exc:  # noqa: BLE001 - the caller sorts outcomes
            return exc

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(run, range(n)))


def _queued(db, tenant_id: str) -> int:
    with db() as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status == "queued"))


def _stream_ids(redis_client, settings, tier="batch") -> list[str]:
    return [decode_message(f[b"m"])["job_id"]
            for _, f in jobs.queued_entries(redis_client, settings.stream_prefix, settings.model, tier)]


def test_queued_quota_exact_across_threads_and_processes(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, max_queued_jobs=5)
    factories = [engines() for _ in range(3)]

    def go(i: int) -> list[Any]:
        out = []
        for _ in range(3):
            try:
                out.append(jobs.submit(factories[i % 3], redis_client, settings, tenant, JobCreate(**BODY)))
            except jobs.QuotaExceeded as exc:
                out.append(exc)
        return out

    outcomes = [o for batch in _race(12, go) for o in batch]
    accepted = [o for o in outcomes if isinstance(o, tuple)]
    refused = [o for o in outcomes if isinstance(o, jobs.QuotaExceeded)]
    assert len(accepted) == 5 and len(refused) == 31, outcomes
    assert all(r.limit == "queued_jobs" and r.retry_after >= 1 for r in refused)
    assert _queued(db, tenant.id) == 5
    assert sorted(_stream_ids(redis_client, settings)) == sorted(j.id for j, _ in accepted)


def test_a_429_comes_only_from_an_exact_count(db, engines, settings, redis_client, make_tenant):
    """The bound a process keeps only errs high; once jobs leave the queue, the exact recount admits again."""
    tenant = _tenant(db, make_tenant, max_queued_jobs=3)
    a = engines()
    ids = [jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))[0].id for _ in range(3)]
    with pytest.raises(jobs.QuotaExceeded):
        jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))
    for jid in ids[:2]:
        assert jobs.cancel(db, redis_client, settings, jid).status == "cancelled"
    jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))  # a's bound says full: recounted
    jobs.submit(engines(), redis_client, settings, tenant, JobCreate(**BODY))
    with pytest.raises(jobs.QuotaExceeded):
        jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))
    assert _queued(db, tenant.id) == 3


def test_a_process_sees_the_other_processes_admissions(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, max_queued_jobs=6)
    a, b = engines(), engines()
    for _ in range(3):
        jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))
    for _ in range(3):
        jobs.submit(b, redis_client, settings, tenant, JobCreate(**BODY))
    with pytest.raises(jobs.QuotaExceeded) as e:  # a's own bound (3) is fresh, but b's three jobs count
        jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))
    assert e.value.limit == "queued_jobs"
    assert _queued(db, tenant.id) == 6


def test_token_rate_limit_concurrent_equals_sequential(db, engines, settings, redis_client, make_tenant):
    body = {**BODY, "max_tokens": 100}
    sequential = _tenant(db, make_tenant, tokens_per_minute=1000)
    n_seq = 0
    while True:
        try:
            jobs.submit(db, redis_client, settings, sequential, JobCreate(**body))
            n_seq += 1
        except jobs.QuotaExceeded as exc:
            assert exc.limit == "tokens_per_minute" and 1 <= exc.retry_after <= 60
            break
        assert n_seq < 100
    assert n_seq > 2
    concurrent = _tenant(db, make_tenant, tokens_per_minute=1000)
    factories = [engines() for _ in range(2)]
    outcomes = _race(12, lambda i: jobs.submit(factories[i % 2], redis_client, settings, concurrent, JobCreate(**body)))
    accepted = [o for o in outcomes if isinstance(o, tuple)]
    assert len(accepted) == n_seq, outcomes
    assert all(o.limit == "tokens_per_minute" for o in outcomes if not isinstance(o, tuple))


def test_ledger_tokens_written_elsewhere_count_at_once(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, tokens_per_minute=500)
    api, worker = engines(), engines()
    job, _ = jobs.submit(api, redis_client, settings, tenant, JobCreate(**BODY))  # api's bound: fresh
    with worker() as s:  # a worker process finishes it: the ledger now holds 495 tokens
        assert jobs.finish(s, job.id, jobs.Outcome(status="cancelled", prompt_tokens=300, completion_tokens=195),
                           from_statuses=("queued",))
        s.commit()
    need = jobs.estimate_tokens(JobCreate(**BODY).request_params())  # 8 prompt ids + max_tokens 8
    assert need == 16
    with pytest.raises(jobs.QuotaExceeded) as e:  # 495 + 16 > 500
        jobs.submit(api, redis_client, settings, tenant, JobCreate(**BODY))
    assert e.value.limit == "tokens_per_minute"
    # and what still fits is accepted (the exact rule: used + need <= limit), from either process
    small = {**BODY, "prompt_ids": [1], "max_tokens": 4}  # needs 5: 495 + 5 = 500
    jobs.submit(api, redis_client, settings, tenant, JobCreate(**small))


def test_tier_cap_exact_for_concurrent_submissions(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant)
    with db() as s:  # the shared test database holds other tests' queued jobs: race in the fuller tier
        queued = {tier: s.scalar(select(func.count()).select_from(Job).where(Job.status == "queued",
                                                                             Job.tier == tier))
                  for tier in ("batch", "interactive")}
    full, other = sorted(queued, key=queued.get, reverse=True)
    capped = settings.model_copy(update={"tier_queue_cap": queued[full] + 4})
    factories = [engines() for _ in range(2)]
    body = JobCreate(**{**BODY, "tier": full})
    outcomes = _race(10, lambda i: jobs.submit(factories[i % 2], redis_client, capped, tenant, body))
    accepted = [o for o in outcomes if isinstance(o, tuple)]
    assert len(accepted) == 4, outcomes
    assert all(isinstance(o, jobs.QuotaExceeded) and o.limit == "tier_queue"
               for o in outcomes if not isinstance(o, tuple))
    # the other tier is not full
    jobs.submit(factories[0], redis_client, capped, tenant, JobCreate(**{**BODY, "tier": other}))


def test_idempotency_one_job_per_key_under_concurrency(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant)
    factories = [engines() for _ in range(3)]
    outcomes = _race(12, lambda i: jobs.submit(factories[i % 3], redis_client, settings, tenant, JobCreate(**BODY),
                                               idempotency_key="same-key"))
    assert all(isinstance(o, tuple) for o in outcomes), outcomes
    assert len({j.id for j, _ in outcomes}) == 1
    assert sum(created for _, created in outcomes) == 1
    assert _stream_ids(redis_client, settings) == [outcomes[0][0].id]  # enqueued once
    other = _race(6, lambda i: jobs.submit(factories[i % 3], redis_client, settings, tenant,
                                           JobCreate(**{**BODY, "max_tokens": 9}), idempotency_key="same-key"))
    assert all(isinstance(o, jobs.Conflict) and o.job_id == outcomes[0][0].id for o in other), other


def test_idempotent_retry_answered_even_over_quota(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, max_queued_jobs=1)
    a = engines()
    job, created = jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY), idempotency_key="k")
    again, created2 = jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY), idempotency_key="k")
    assert created and not created2 and again.id == job.id
    with pytest.raises(jobs.QuotaExceeded):
        jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY), idempotency_key="k2")
    with pytest.raises(jobs.Conflict):
        jobs.submit(engines(), redis_client, settings, tenant, JobCreate(**{**BODY, "seed": 1}), idempotency_key="k")


def test_tenants_are_isolated(db, engines, settings, redis_client, make_tenant):
    full = _tenant(db, make_tenant, max_queued_jobs=1)
    other = _tenant(db, make_tenant, max_queued_jobs=1)
    a = engines()
    j1, _ = jobs.submit(a, redis_client, settings, full, JobCreate(**BODY), idempotency_key="shared")
    with pytest.raises(jobs.QuotaExceeded):
        jobs.submit(a, redis_client, settings, full, JobCreate(**BODY))
    j2, created = jobs.submit(a, redis_client, settings, other, JobCreate(**BODY), idempotency_key="shared")
    assert created and j2.id != j1.id and j2.tenant_id == other.id


def test_first_use_of_a_model_creates_one_price(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant)
    model = f"m-{uuid.uuid4().hex[:8]}"
    factories = [engines() for _ in range(2)]
    outcomes = _race(8, lambda i: jobs.submit(factories[i % 2], redis_client, settings, tenant,
                                              JobCreate(**{**BODY, "model": model})))
    assert all(isinstance(o, tuple) and o[1] for o in outcomes), outcomes
    with db() as s:
        prices = s.scalars(select(Price).where(Price.model == model)).all()
        assert [(p.tier, p.version) for p in prices] == [("batch", 1)]
        assert {s.get(Job, j.id).price_id for j, _ in outcomes} == {prices[0].id}


def test_returned_job_is_the_committed_row(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant)
    job, _ = jobs.submit(engines(), redis_client, settings, tenant,
                         JobCreate(**{**BODY, "deadline_seconds": 30, "priority": 5, "metadata": {"k": ["v", 1]},
                                      "webhook_url": "http://127.0.0.1:9/hook"}), idempotency_key="row")
    with db() as s:  # another connection sees it at once
        row = s.get(Job, job.id)
        assert row is not None and row.status == "queued" and row.attempts == 0
        for attr in ("tenant_id", "model", "tier", "priority", "request", "idempotency_key", "request_hash",
                     "webhook_url", "meta", "price_id", "created_at", "queued_at", "deadline_at"):
            assert getattr(row, attr) == getattr(job, attr), attr
        assert 29.9 < (row.deadline_at - row.created_at).total_seconds() <= 30


# --- several submissions at once (the API's groups: jobs.submit_many) -----------------------------------------


def test_group_admits_exactly_up_to_the_queued_quota(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, max_queued_jobs=5)
    a = engines()
    jobs.submit(a, redis_client, settings, tenant, JobCreate(**BODY))  # a fresh bound: the group goes together
    outcomes = jobs.submit_many(a, redis_client, settings, [(tenant, JobCreate(**BODY), None)] * 8)
    accepted = [o for o in outcomes if isinstance(o, tuple)]
    assert [isinstance(o, tuple) for o in outcomes] == [True] * 4 + [False] * 4, outcomes
    assert all(isinstance(o, jobs.QuotaExceeded) and o.limit == "queued_jobs" for o in outcomes[4:])
    with db() as s:  # one statement: the group's rows share their timestamp
        assert len({s.get(Job, j.id).created_at for j, _ in accepted}) == 1
    assert _queued(db, tenant.id) == 5
    assert len(_stream_ids(redis_client, settings)) == 5


def test_groups_across_threads_and_processes_keep_the_quota(db, engines, settings, redis_client, make_tenant):
    tenant = _tenant(db, make_tenant, max_queued_jobs=9)
    factories = [engines() for _ in range(2)]
    for f in factories:
        jobs.submit(f, redis_client, settings, tenant, JobCreate(**BODY))
    outcomes = [o for group in _race(6, lambda i: jobs.submit_many(
        factories[i % 2], redis_client, settings, [(tenant, JobCreate(**BODY), None)] * 3)) for o in group]
    accepted = [o for o in outcomes if isinstance(o, tuple)]
    assert len(accepted) == 7, outcomes
    assert all(isinstance(o, jobs.QuotaExceeded) for o in outcomes if not isinstance(o, tuple))
    assert _queued(db, tenant.id) == 9


def test_group_token_rate_limit_equals_sequential(db, engines, settings, redis_client, make_tenant):
    body = {**BODY, "max_tokens": 100}
    sequential = _tenant(db, make_tenant, tokens_per_minute=1000)
    n_seq = 0
    while not isinstance(jobs.submit_many(db, redis_client, settings, [(sequential, JobCreate(**body), None)])[0],
                         Exception):
        n_seq += 1
        assert n_seq < 100
    grouped = _tenant(db, make_tenant, tokens_per_minute=1000)
    a = engines()
    outcomes = jobs.submit_many(a, redis_client, settings, [(grouped, JobCreate(**body), None)] * 12)
    assert sum(isinstance(o, tuple) for o in outcomes) == n_seq, outcomes
    assert all(o.limit == "tokens_per_minute" for o in outcomes if not isinstance(o, tuple))


def test_group_mixes_tenants_keys_and_errors(db, engines, settings, redis_client, make_tenant):
    one, two = _tenant(db, make_tenant), _tenant(db, make_tenant, max_queued_jobs=1)
    a = engines()
    first, _ = jobs.submit(a, redis_client, settings, one, JobCreate(**BODY), idempotency_key="k")
    items = [(one, JobCreate(**BODY), None), (two, JobCreate(**BODY), None), (one, JobCreate(**BODY), "k"),
             (one, JobCreate(**{**BODY, "seed": 3}), "k"), (two, JobCreate(**BODY), None),
             (one, JobCreate(**{**BODY, "deadline_seconds": 30, "priority": 5, "metadata": {"x": [1]},
                                "webhook_url": "http://127.0.0.1:9/hook"}), None)]
    out = jobs.submit_many(a, redis_client, settings, items)
    assert isinstance(out[0], tuple) and out[0][1] and out[0][0].tenant_id == one.id
    assert isinstance(out[1], tuple) and out[1][1] and out[1][0].tenant_id == two.id
    assert out[2][0].id == first.id and out[2][1] is False  # idempotent retry
    assert isinstance(out[3], jobs.Conflict)
    assert isinstance(out[4], jobs.QuotaExceeded)  # the second tenant's quota is its own
    job = out[5][0]
    with db() as s:  # the returned job is the committed row
        row = s.get(Job, job.id)
        for attr in ("tenant_id", "model", "tier", "priority", "request", "idempotency_key", "request_hash",
                     "webhook_url", "meta", "price_id", "created_at", "queued_at", "deadline_at"):
            assert getattr(row, attr) == getattr(job, attr), attr
    assert sorted(_stream_ids(redis_client, settings)) == sorted([first.id, out[0][0].id, out[1][0].id, job.id])


# --- over HTTP -------------------------------------------------------------------------------------------


def _post_all(url: str, n: int, headers: dict[str, str], body: dict[str, Any]) -> list[httpx.Response]:
    def one(_i: int) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=30) as c:
            return c.post("/v1/jobs", json=body, headers=headers)

    return _race(n, one)


def test_http_concurrent_submissions_respect_the_quota(serve, settings, redis_client, make_tenant, db):
    t = make_tenant(max_queued_jobs=4)
    url = serve(settings)
    answers = _post_all(url, 16, t.headers, BODY)
    assert sorted(r.status_code for r in answers) == [202] * 4 + [429] * 12, [r.text for r in answers]
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "quota_exceeded"
    accepted = {r.json()["id"] for r in answers if r.status_code == 202}
    with db() as s:
        assert set(s.scalars(select(Job.id).where(Job.tenant_id == t.tenant_id))) == accepted


def test_http_concurrent_idempotent_retries(serve, settings, redis_client, make_tenant):
    t = make_tenant()
    url = serve(settings)
    answers = _post_all(url, 8, {**t.headers, "Idempotency-Key": "order-7"}, BODY)
    assert sorted(r.status_code for r in answers) == [200] * 7 + [202], [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    conflict = _post_all(url, 4, {**t.headers, "Idempotency-Key": "order-7"}, {**BODY, "max_tokens": 9})
    assert [r.status_code for r in conflict] == [409] * 4


def test_http_concurrent_mixed_submissions_each_get_their_own_answer(serve, settings, redis_client, make_tenant, db):
    """Concurrent requests are submitted in groups: a refused webhook, idempotent retries and plain jobs in the
    same burst each get the answer they would get alone."""
    t = make_tenant()
    url = serve(settings)

    def one(i: int) -> tuple[int, httpx.Response]:
        headers, body = dict(t.headers), dict(BODY)
        if i % 4 == 0:
            body["webhook_url"] = "http://10.0.0.1/hook"  # private: refused (422)
        elif i % 4 == 1:
            headers["Idempotency-Key"] = "mixed"
        with httpx.Client(base_url=url, timeout=30) as c:
            return i, c.post("/v1/jobs", json=body, headers=headers)

    answers = _race(24, one)
    by_kind: dict[int, list[httpx.Response]] = {0: [], 1: [], 2: []}
    for i, r in answers:
        by_kind[min(i % 4, 2)].append(r)
    assert all(r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "webhook_url" for r in by_kind[0])
    assert sorted(r.status_code for r in by_kind[1]) == [200] * 5 + [202]
    assert len({r.json()["id"] for r in by_kind[1]}) == 1
    assert all(r.status_code == 202 for r in by_kind[2])
    with db() as s:
        stored = set(s.scalars(select(Job.id).where(Job.tenant_id == t.tenant_id)))
    assert stored == {r.json()["id"] for r in by_kind[1] + by_kind[2]}


@pytest.mark.parametrize(("patch", "field"), [
    ({"metadata": {"note": "a\x00b"}}, "metadata"),
    ({"metadata": {"k\x00": 1}}, "metadata"),
    ({"metadata": {"deep": [1, {"x": ["ok", "\x00"]}]}}, "metadata"),
    ({"model": "m\x00"}, "model"),
    ({"webhook_url": "http://127.0.0.1:9/\x00"}, "webhook_url"),
    ({"prompt_ids": None, "prompt": "\x00"}, "prompt"),
    ({"prompt_ids": None, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\x00"}]},
     "messages.1.content"),
    ({"stop": ["fine", "x\x00"]}, "stop.1"),
])
def test_http_nul_characters_are_refused(client, tenant, db, patch, field):
    body = {k: v for k, v in {**BODY, **patch}.items() if v is not None}
    r = client.post("/v1/jobs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "validation_error"
    assert field in [f["field"] for f in err["fields"]], err
    assert any("NUL" in f["reason"] for f in err["fields"])
    with db() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant.tenant_id)) == 0
