"""SSE against a real worker that is still generating (``python -m worker.service``, tiny random model):
a client that reconnects with ``Last-Event-ID`` gets exactly the text it missed, no gap and no repeat, while
the job keeps producing; and when Redis goes away mid-stream the stream ends with one ``event: error``
(the error envelope), not a cut connection (docs/API.md, server-sent events). Real uvicorn, PostgreSQL and a
private Redis; the API reaches that Redis through a TCP proxy the error test cuts."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from api.tenants import create_key, create_tenant
from inferq import jobs
from inferq.contract import events_key
from inferq.db import Tenant
from tests.service_behaviour_helpers import ENDLESS, Service, make_long_context_model
from tests.service_fixtures import TcpProxy, private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]


@pytest.fixture(scope="module")
def svc(pg_url, private_redis, tmp_path_factory):  # noqa: F811
    s = Service(pg_url, private_redis.url, make_long_context_model(tmp_path_factory.mktemp("model")),
                tmp_path_factory.mktemp("svc"))
    s.main = s.start_worker()
    yield s
    s.close()


@pytest.fixture
def redis_proxy(private_redis):  # noqa: F811
    proxy = TcpProxy("127.0.0.1", private_redis.port)
    yield proxy
    proxy.close()


@pytest.fixture
def api(svc, serve, redis_proxy):
    """An API client for a new tenant of ``svc`` (its Redis through ``redis_proxy``), and that tenant."""
    settings = svc.settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{redis_proxy.port}/0"})
    name = f"t-{uuid.uuid4().hex[:10]}"
    create_tenant(svc.db, name)
    key = create_key(svc.db, name).key
    with svc.db() as s:
        tenant = s.query(Tenant).filter_by(name=name).one()
        s.expunge(tenant)
    with httpx.Client(base_url=serve(settings), timeout=30, headers={"Authorization": f"Bearer {key}"}) as c:
        yield c, tenant


def sse_events(resp: httpx.Response) -> Iterator[tuple[str, str | None, dict]]:
    """(event, id, data) as the events arrive."""
    event, id_, data = None, None, []
    for line in resp.iter_lines():
        if line == "":
            if event is not None or data:
                yield event or "message", id_, json.loads("\n".join(data))
            event, id_, data = None, None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("id:"):
            id_ = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def read_deltas(c: httpx.Client, job_id: str, n: int | None, last_id: str | None = None) -> list[tuple[str, str | None, dict]]:
    """The events of one connection: ``n`` deltas then hang up, or (``n`` None) up to the end."""
    headers = {"Last-Event-ID": last_id} if last_id else {}
    got = []
    with c.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
        assert r.status_code == 200, r.read()
        for ev in sse_events(r):
            got.append(ev)
            if n is not None and sum(e[0] == "delta" for e in got) >= n:
                break
    return got


def _entry_ids(svc: Service, job_id: str) -> list[str]:
    return [i.decode() for i, _ in svc.redis.xrange(events_key(svc.prefix, job_id))]


def _written_after(svc: Service, job_id: str, entry_id: str) -> int:
    ids = _entry_ids(svc, job_id)
    return len(ids) - ids.index(entry_id) - 1


def test_resume_with_last_event_id_while_the_worker_is_producing(svc, api):
    c, tenant = api
    job_id = svc.submit(tenant=tenant, max_tokens=ENDLESS, ignore_eos=True)
    first = read_deltas(c, job_id, 5)
    assert [e[0] for e in first] == ["delta"] * 5
    # the worker goes on while nobody listens
    wait_for(lambda: _written_after(svc, job_id, first[-1][1]) >= 5, 30, what="deltas written after the client left")
    assert svc.job(job_id).status == "running"
    second = read_deltas(c, job_id, 5, last_id=first[-1][1])
    ids = _entry_ids(svc, job_id)
    at = ids.index(first[-1][1])
    assert [e[1] for e in second] == ids[at + 1: at + 6]  # resumed right after the last one seen
    jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
    rest = read_deltas(c, job_id, None, last_id=second[-1][1])
    assert rest[-1][0] == "final" and {e[0] for e in rest[:-1]} <= {"delta"}
    final = rest[-1][2]
    assert final["status"] == "cancelled" and final["id"] == job_id
    streamed = "".join(e[2]["text"] for e in first + second + rest[:-1])
    assert streamed == final["text"] and final["usage"]["completion_tokens"] > 10


def test_redis_lost_mid_stream_ends_with_an_error_event(svc, api, redis_proxy):
    c, tenant = api
    job_id = svc.submit(tenant=tenant, max_tokens=ENDLESS, ignore_eos=True)
    events = []
    try:
        with c.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            assert r.status_code == 200
            for ev in sse_events(r):
                events.append(ev)
                if len(events) == 3:
                    redis_proxy.cut()  # the API's Redis connections break; the worker's do not
    finally:
        redis_proxy.restore()
        jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
    kinds = [e[0] for e in events]
    assert kinds[:3] == ["delta"] * 3 and kinds[-1] == "error" and set(kinds[:-1]) == {"delta"}, kinds
    err = events[-1][2]["error"]
    assert err["type"] == "unavailable" and err["message"].startswith("redis unavailable"), err
    assert svc.wait_status([job_id], timeout=60) == {job_id: "cancelled"}
