"""Real worker subprocesses (``python -m worker.service``) on a tiny random model, against the real
PostgreSQL and a private real Redis server: end-to-end jobs, dead letters, cancellation, deadlines, the
ledger against the engine's busy time, Redis FLUSHALL, kill -9 with jobs in flight, a PostgreSQL outage
(through a TCP proxy we cut) and SIGTERM hand-back."""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path

import msgpack
import pytest
from sqlalchemy import func, select

from inferq import jobs
from inferq.contract import JobCreate, dead_letter_key, events_key, model_id, stream_key
from inferq.db import Job, Result, UsageEntry, make_engine, make_sessionmaker
from inferq.settings import Settings
from tests.service_fixtures import (  # noqa: F401
    TcpProxy,
    WorkerProcess,
    assert_ledger_cost,
    free_port,
    make_tenant,
    private_redis,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]

# tokens of a job that finishes on its own, but not at once (1-10 s, depending on the machine): 1000 took
# 0.1 s each on a Zen 5, so four finished and the first worker took the next ones before the second read any
LONG = 4000
# a job that does not end on its own while a test watches it (it is cancelled, expires or its worker goes),
# so the tests below never depend on how fast a machine generates: 15000 tokens took under a minute on a
# 2-core machine, and the time grows faster than the length (attention reads the whole context)
ENDLESS = 60000
TERMINAL = ("succeeded", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.tiny_models import make_tiny_model

    # its own model name: jobs are queued per model, and the reconcilers of other modules' workers (same
    # database) re-queue any queued job under its model, so a shared name would let them trade jobs
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", name="tiny-llama-faults",
                           max_position_embeddings=ENDLESS + 64)


class Service:
    """One queue namespace: settings for the workers' environment, and helpers for the test side."""

    def __init__(self, pg_url: str, redis_url: str, model: Path, tmp: Path, **overrides) -> None:
        self.prefix = f"wf-{uuid.uuid4().hex[:8]}"
        self.env = dict(database_url=pg_url, redis_url=redis_url, stream_prefix=self.prefix, model=str(model),
                        device="cpu", dtype="float32", kv_cache_memory="128MiB", torch_threads=1, max_num_seqs=4,
                        heartbeat_seconds=0.3, claim_idle_ms=2000, reconcile_interval_seconds=1.0,
                        shutdown_grace_seconds=0.5, db_retry_max_seconds=60, log_json="true", log_level="INFO",
                        # these tests hold every slot to keep jobs queued: no read-ahead of a lane the worker
                        # holds none of (fair share's newcomers), which would start one of them at once
                        fair_read_ahead=0)
        self.env.update(overrides)
        self.settings = Settings(**{**self.env, "database_url": pg_url, "log_json": True})
        self.engine = make_engine(pg_url)
        self.db = make_sessionmaker(self.engine)
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self.tmp = tmp
        self.model = model_id(str(model))
        self.tenant = make_tenant(self.db)
        self.workers: list[WorkerProcess] = []

    def start_worker(self, args: list[str] | None = None, **env) -> WorkerProcess:
        name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:4]}"
        w = WorkerProcess({**self.env, **env}, self.tmp / f"{name}.log", name, args=args)
        self.workers.append(w)
        return w

    def submit(self, **kw) -> str:
        kw.setdefault("model", self.model)
        if not any(k in kw for k in ("prompt", "messages", "prompt_ids")):
            kw["prompt_ids"] = [5, 17, 33, 41, 7, 9]
        kw.setdefault("temperature", 0)
        job, created = jobs.submit(self.db, self.redis, self.settings, self.tenant, JobCreate(**kw))
        assert created
        return job.id

    def job(self, job_id: str) -> Job:
        with self.db() as s:
            return s.get(Job, job_id)

    def statuses(self, ids) -> dict[str, str]:
        with self.db() as s:
            return dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(list(ids)))).all())

    def wait_status(self, ids, statuses=TERMINAL, timeout=60.0) -> dict[str, str]:
        ids = list(ids)
        last: dict[str, str] = {}

        def reached():
            last.update(self.statuses(ids))
            return bool(last) and all(v in statuses for v in last.values()) and dict(last)

        try:
            return wait_for(reached, timeout, what=f"jobs to reach {statuses}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {last}") from None  # the statuses at the end, not the start

    def rows(self, job_id: str) -> tuple[list[Result], list[UsageEntry]]:
        with self.db() as s:
            return (s.scalars(select(Result).where(Result.job_id == job_id)).all(),
                    s.scalars(select(UsageEntry).where(UsageEntry.job_id == job_id)).all())

    def assert_one_result(self, job_id: str) -> tuple[Result, UsageEntry]:
        """The job's one result row and one ledger row; the ledger charges exactly its tokens at the prices."""
        results, ledger = self.rows(job_id)
        assert len(results) == 1 and len(ledger) == 1, (job_id, results, ledger)
        assert_ledger_cost(self.settings, ledger[0])
        return results[0], ledger[0]

    def wait_first_tokens(self, ids, timeout: float = 60.0) -> None:
        """Until every job has produced a token (so a cancel or a kill finds work already done and billed)."""
        def all_started() -> bool:
            with self.db() as s:
                return s.scalar(select(func.count()).select_from(Job).where(
                    Job.id.in_(list(ids)), Job.first_token_at.is_not(None))) == len(ids)

        wait_for(all_started, timeout, what="a first token of every job")

    def stats(self, worker: WorkerProcess) -> dict[str, str]:
        raw = self.redis.hgetall(jobs.worker_key(self.prefix, worker.name))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self._cancel_leftovers()
        self.redis.close()
        self.engine.dispose()

    def _cancel_leftovers(self) -> None:
        """Cancel this namespace's unfinished jobs (e.g. those handed back at SIGTERM): no later test's worker
        or reconciler inherits an ENDLESS job."""
        with self.db() as s:
            ids = s.scalars(select(Job.id).where(Job.tenant_id == self.tenant.id,
                                                 Job.status.in_(("queued", "running")))).all()
        for jid in ids:
            jobs.cancel(self.db, self.redis, self.settings, jid)


@pytest.fixture(scope="module")
def svc(pg_url, private_redis, tiny_model, tmp_path_factory):  # noqa: F811
    """The long-lived worker of this module. Its PostgreSQL connections go through a TCP proxy that
    test_postgres_outage cuts; the test side talks to PostgreSQL directly."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    s = Service(pg_url, private_redis.url, tiny_model, tmp_path_factory.mktemp("svc"))
    s.proxy = proxy
    s.metrics_port = free_port()
    s.main = s.start_worker(["--metrics-port", str(s.metrics_port)], database_url=proxied)
    wait_for(lambda: s.stats(s.main) or not s.main.alive(), 150, what="the worker to start")
    assert s.main.alive(), s.main.log_text()[-3000:]
    yield s
    s.close()
    proxy.close()


def _dump_logs(service: Service) -> str:
    return "\n".join(f"--- {w.name}\n" + w.log_text()[-4000:] for w in service.workers)


# ----------------------------------------------------------------------------------------------------------
# one long-lived worker
# ----------------------------------------------------------------------------------------------------------


def test_end_to_end(svc):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(svc.settings.model)
    ids = [svc.submit(prompt_ids=[5, 6, 7, 8], max_tokens=12, ignore_eos=True),
           svc.submit(prompt="Once upon a time", max_tokens=10, tier="batch", seed=3, temperature=0.8),
           svc.submit(messages=[{"role": "user", "content": "Hello"}], max_tokens=8),
           svc.submit(prompt_ids=[9, 10, 11], max_tokens=16, ignore_eos=True, tier="batch")]
    try:
        assert set(svc.wait_status(ids, timeout=120).values()) == {"succeeded"}
    finally:
        if not all(v == "succeeded" for v in svc.statuses(ids).values()):
            print(_dump_logs(svc))
    for jid in ids:
        result, ledger = svc.assert_one_result(jid)
        job = svc.job(jid)
        assert job.attempts == 1 and job.worker == svc.main.name
        assert job.started_at and job.first_token_at and job.finished_at
        assert ledger.completion_tokens == len(result.token_ids) > 0 and ledger.compute_seconds > 0
        assert ledger.price_id == job.price_id and ledger.tier == job.tier  # cost: checked by assert_one_result
        # the event stream: deltas that add up to the text, then one done event
        events = svc.redis.xrange(events_key(svc.prefix, jid))
        kinds = [f[b"event"].decode() for _, f in events]
        assert kinds[-1] == "done" and kinds.count("done") == 1
        text = "".join(json.loads(f[b"data"])["text"] for _, f in events if f[b"event"] == b"delta")
        assert text == result.text
        assert json.loads(events[-1][1][b"data"])["usage"]["completion_tokens"] == ledger.completion_tokens
        assert svc.redis.ttl(events_key(svc.prefix, jid)) > 0
    _, first = svc.assert_one_result(ids[0])
    assert (first.prompt_tokens, first.completion_tokens) == (4, 12)
    _, second = svc.assert_one_result(ids[1])
    assert second.prompt_tokens == len(tok.encode("Once upon a time"))
    # acknowledged and deleted: nothing pending, nothing left in the streams
    for tier in ("interactive", "batch"):
        assert jobs.queue_counts(svc.redis, svc.prefix, svc.model, tier, svc.settings.consumer_group) == (0, 0)
    # Prometheus metrics
    import httpx

    def scrape() -> str:
        text = httpx.get(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).text
        return text if f'inferq_jobs_finished_total{{model="{svc.model}",status="succeeded",tier="batch"}} 2.0' in text else ""

    body = wait_for(scrape, 60, what="metrics")
    for name in ("inferq_queue_depth", "inferq_time_to_first_token_seconds_bucket", "inferq_e2e_seconds_count",
                 "inferq_kv_cache_usage_ratio", "inferq_tokens_total", "inferq_engine_busy_seconds"):
        assert name in body, name


def test_malformed_messages_are_dead_lettered(svc):
    stream = stream_key(svc.prefix, svc.model, "interactive")
    svc.redis.xadd(stream, {"m": b"\xc1not msgpack"})
    svc.redis.xadd(stream, {"m": msgpack.packb({"v": 99, "job_id": "x"})})
    svc.redis.xadd(stream, {"other": b"field"})
    jid = svc.submit(max_tokens=4)
    svc.wait_status([jid], ("succeeded",))
    dead = wait_for(lambda: len(svc.redis.xrange(dead_letter_key(svc.prefix))) >= 3 and
                    svc.redis.xrange(dead_letter_key(svc.prefix)), 10, what="dead letters")
    errors = [f[b"error"].decode() for _, f in dead]
    assert any("schema version" in e for e in errors) and any("msgpack" in e for e in errors)
    assert svc.main.alive()
    assert svc.redis.xlen(stream) == 0


def test_cancel_queued_and_running(svc):
    """Jobs that cannot end on their own end ``cancelled`` only if the cancel reaches them: no clock needed."""
    running = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(4)]  # fills max_num_seqs=4
    svc.wait_status(running, ("running",), timeout=60)
    svc.wait_first_tokens(running)
    queued = svc.submit(max_tokens=ENDLESS, ignore_eos=True)  # stays in the stream: no capacity
    time.sleep(0.3)  # room for a wrong claim to happen
    assert svc.job(queued).status == "queued"
    assert jobs.cancel(svc.db, svc.redis, svc.settings, queued).status == "cancelled"
    for jid in running:
        jobs.cancel(svc.db, svc.redis, svc.settings, jid)
    svc.wait_status(running, ("cancelled",), timeout=60)
    for jid in running:
        result, ledger = svc.assert_one_result(jid)
        assert result.finish_reason == "abort" and len(result.token_ids) == ledger.completion_tokens
        assert 0 < ledger.completion_tokens < ENDLESS and ledger.compute_seconds > 0  # pays for what ran
    result, ledger = svc.assert_one_result(queued)
    assert ledger.completion_tokens == 0 and ledger.cost_micros == 0 and result.finish_reason == "abort"
    # the cancelled queued job's message is consumed and acknowledged, never run
    wait_for(lambda: jobs.queue_counts(svc.redis, svc.prefix, svc.model, "interactive",
                                       svc.settings.consumer_group)[0] == 0, 30, what="stream drained")
    assert svc.job(queued).attempts == 0


def _expire_in_flight(svc, deadlines=(2.0, 8.0, 30.0)) -> str:
    """A job that expires while running, after its first token. Whether a deadline outlasts the claim and the
    first step depends on the machine, so longer deadlines are tried until one does (the first, on most)."""
    for seconds in deadlines:
        jid = svc.submit(max_tokens=ENDLESS, ignore_eos=True, deadline_seconds=seconds)
        svc.wait_status([jid], ("expired",), timeout=seconds + 60)
        if svc.job(jid).first_token_at is not None:
            return jid
    raise AssertionError(f"no job produced a token within deadlines of {deadlines} s")


def test_deadlines_in_queue_and_in_flight(svc):
    """In the queue: with every slot held by jobs that cannot end, a queued job can only expire unclaimed.
    In flight: a running job is stopped at its deadline (never before it) and pays for what it computed."""
    blockers = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(4)]  # fills max_num_seqs=4
    svc.wait_status(blockers, ("running",), timeout=60)
    in_queue = svc.submit(max_tokens=ENDLESS, ignore_eos=True, deadline_seconds=0.5)
    svc.wait_status([in_queue], ("expired",), timeout=60)
    result, ledger = svc.assert_one_result(in_queue)
    assert ledger.completion_tokens == 0 and ledger.cost_micros == 0 and result.finish_reason == "deadline"
    assert svc.job(in_queue).started_at is None and svc.job(in_queue).attempts == 0
    jobs.cancel(svc.db, svc.redis, svc.settings, blockers[0])  # one slot for the in-flight case
    in_flight = _expire_in_flight(svc)
    job = svc.job(in_flight)
    assert job.started_at is not None and job.finished_at >= job.deadline_at
    result, ledger = svc.assert_one_result(in_flight)
    assert result.finish_reason == "deadline" and 0 < ledger.completion_tokens == len(result.token_ids) < ENDLESS
    for jid in blockers[1:]:
        jobs.cancel(svc.db, svc.redis, svc.settings, jid)
    assert set(svc.wait_status(blockers, timeout=60).values()) == {"cancelled"}


def test_redis_flushall_while_jobs_queued(svc):
    """Every slot is held by a job that cannot end, so the short jobs are surely still queued (their messages
    only in Redis) when Redis is flushed: the reconciler must re-add them, and the running jobs still end
    with their results once cancelled."""
    long_ids = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(4)]
    svc.wait_status(long_ids, ("running",), timeout=60)
    queued = [svc.submit(max_tokens=6, ignore_eos=True, tier=t) for t in ("interactive", "batch", "batch")]
    try:
        assert set(svc.statuses(queued).values()) == {"queued"}
        svc.redis.flushall()
    finally:  # endless jobs left running would starve every later test of this module's worker
        for jid in long_ids:
            jobs.cancel(svc.db, svc.redis, svc.settings, jid)
    assert set(svc.wait_status(long_ids, timeout=60).values()) == {"cancelled"}, _dump_logs(svc)
    assert set(svc.wait_status(queued, timeout=60).values()) == {"succeeded"}, _dump_logs(svc)
    for jid in long_ids + queued:
        svc.assert_one_result(jid)
    for jid in queued:
        assert svc.job(jid).attempts == 1
    assert svc.main.alive()


def test_postgres_outage(svc):
    """Jobs that cannot end on their own are cancelled while the worker is cut off PostgreSQL (the test
    talks to it directly; the cancel reaches the worker through Redis): their results are held through the
    outage and written once it is over, exactly once, by the same attempt. Jobs accepted meanwhile wait."""
    ids = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(3)]
    svc.wait_status(ids, ("running",), timeout=60)
    svc.wait_first_tokens(ids)
    log_before = len(svc.main.log_text())
    svc.proxy.cut()
    for jid in ids:
        jobs.cancel(svc.db, svc.redis, svc.settings, jid)
    during = [svc.submit(max_tokens=10, ignore_eos=True) for _ in range(2)]  # accepted meanwhile
    wait_for(lambda: "database unavailable" in svc.main.log_text()[log_before:], 60, what="the worker to notice")
    time.sleep(1)  # the worker holds the cancelled jobs' results meanwhile
    assert set(svc.statuses(ids).values()) == {"running"}
    assert set(svc.statuses(during).values()) == {"queued"}
    svc.proxy.restore()
    st = svc.wait_status(ids + during, timeout=60)
    assert st == {**{j: "cancelled" for j in ids}, **{j: "succeeded" for j in during}}, _dump_logs(svc)
    for jid in ids + during:
        svc.assert_one_result(jid)
        assert svc.job(jid).attempts == 1
    for jid in ids:
        assert 0 < svc.assert_one_result(jid)[1].completion_tokens < ENDLESS
    assert svc.main.alive()


def test_kill9_worker_jobs_finish_elsewhere(svc):
    a = svc.start_worker(database_url=svc.settings.database_url)
    wait_for(lambda: svc.stats(a), 150, what="the second worker to start")
    ids = [svc.submit(max_tokens=LONG, ignore_eos=True) for _ in range(6)]  # 4 fit on the first worker

    def running_on(w):
        with svc.db() as s:
            return s.scalars(select(Job.id).where(Job.id.in_(ids), Job.status == "running",
                                                  Job.worker == w.name)).all()

    wait_for(lambda: running_on(a), 120, interval=0.05, what="jobs running on the second worker")
    a.proc.send_signal(signal.SIGSTOP)  # frozen: what runs on it now is exactly what the kill interrupts
    victims = running_on(a)
    assert victims
    a.kill9()
    more = [svc.submit(max_tokens=20, ignore_eos=True) for _ in range(2)]
    assert set(svc.wait_status(ids + more, timeout=120).values()) == {"succeeded"}, _dump_logs(svc)
    for jid in ids + more:
        svc.assert_one_result(jid)
    for jid in victims:  # restarted exactly once, by the survivor
        job = svc.job(jid)
        assert job.worker == svc.main.name and job.attempts == 2, (jid, job.worker, job.attempts)
    with svc.db() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(
            Job.tenant_id == svc.tenant.id, Job.status == "running")) == 0
    assert "reclaimed idle messages" in svc.main.log_text()


def test_ledger_matches_busy_time(svc):
    ids = [svc.submit(max_tokens=40 + 10 * i, ignore_eos=True, tier=("batch" if i % 2 else "interactive"))
           for i in range(6)]
    svc.wait_status(ids, ("succeeded",), timeout=60)
    # every job this worker ran (all tests above) is in the ledger; compare at a quiet moment
    wait_for(lambda: svc.stats(svc.main).get("in_flight") == "0", 10, what="worker idle")
    time.sleep(0.5)
    busy = float(svc.stats(svc.main)["busy_seconds"])
    with svc.db() as s:
        total, completion = s.execute(
            select(func.sum(UsageEntry.compute_seconds), func.sum(UsageEntry.completion_tokens))
            .join(Job, Job.id == UsageEntry.job_id).where(Job.worker == svc.main.name)).one()
        results = s.scalars(select(Result).join(Job, Job.id == Result.job_id)
                            .where(Job.worker == svc.main.name)).all()
    assert busy > 0 and total == pytest.approx(busy, rel=0.01)
    assert completion == sum(len(r.token_ids or []) for r in results)
    for jid in ids:
        _, ledger = svc.assert_one_result(jid)
        assert ledger.prompt_tokens == 6 and ledger.completion_tokens == 40 + 10 * ids.index(jid)


def test_sigterm_hands_back_in_flight_jobs(svc):
    back = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(2)]
    svc.wait_status(back, ("running",), timeout=60)
    assert svc.main.terminate(60) == 0  # grace 0.5 s: both cannot have ended by then
    assert set(svc.statuses(back).values()) == {"queued"}
    for jid in back:
        assert svc.rows(jid) == ([], [])
        assert svc.job(jid).worker is None
    queued_msgs = jobs.queued_entries(svc.redis, svc.prefix, svc.model, "interactive")
    assert {msgpack.unpackb(f[b"m"])["job_id"] for _, f in queued_msgs} >= set(back)
    assert "handed jobs back to the queue" in svc.main.log_text()


# ----------------------------------------------------------------------------------------------------------
# a result PostgreSQL refuses for one job (its own worker and namespace: no effect on the tests above)
# ----------------------------------------------------------------------------------------------------------


def test_unstorable_result_fails_only_that_job(pg_url, private_redis, tiny_model, tmp_path):  # noqa: F811
    """A trigger refuses the `results` row of marked jobs: `text` jobs with a DataError unless the row is an
    error result, `all` jobs with an IntegrityError always. The worker fails just those jobs (with the
    reason), acknowledges their messages, keeps running and finishes the others."""
    from sqlalchemy import text

    svc2 = Service(pg_url, private_redis.url, tiny_model, tmp_path)
    fn = f"poison_{uuid.uuid4().hex[:8]}"
    with svc2.engine.begin() as conn:
        conn.execute(text(f"""
            CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE mark text;
            BEGIN
                SELECT metadata ->> 'poison' INTO mark FROM jobs WHERE id = NEW.job_id;
                IF mark = 'text' AND NEW.finish_reason <> 'error' THEN
                    RAISE EXCEPTION 'poisoned result of %', NEW.job_id USING ERRCODE = '22000';
                ELSIF mark = 'all' THEN
                    RAISE EXCEPTION 'poisoned row of %', NEW.job_id USING ERRCODE = '23514';
                END IF;
                RETURN NEW;
            END $$"""))
        conn.execute(text(f"CREATE TRIGGER {fn} BEFORE INSERT ON results FOR EACH ROW EXECUTE FUNCTION {fn}()"))
    try:
        w = svc2.start_worker()
        wait_for(lambda: svc2.stats(w) or not w.alive(), 150, what="the worker to start")
        assert w.alive(), w.log_text()[-3000:]
        good = [svc2.submit(max_tokens=8, ignore_eos=True) for _ in range(2)]
        bad_text = svc2.submit(max_tokens=8, ignore_eos=True, metadata={"poison": "text"})
        bad_all = svc2.submit(max_tokens=8, ignore_eos=True, metadata={"poison": "all"})
        good += [svc2.submit(max_tokens=8, ignore_eos=True) for _ in range(2)]
        st = svc2.wait_status(good + [bad_text, bad_all], timeout=60)
        assert w.alive(), w.log_text()[-4000:]
        assert st == {**{j: "succeeded" for j in good}, bad_text: "failed", bad_all: "failed"}, _dump_logs(svc2)
        for jid in good:
            svc2.assert_one_result(jid)
        job = svc2.job(bad_text)
        assert "could not store the result" in job.error and f"poisoned result of {bad_text}" in job.error
        assert job.attempts == 1
        result, ledger = svc2.assert_one_result(bad_text)  # the failure itself is stored: empty error result
        assert result.finish_reason == "error" and result.text == ""
        assert ledger.status == "failed" and ledger.completion_tokens == 8  # billed for what was computed
        assert_ledger_cost(svc2.settings, ledger)
        job = svc2.job(bad_all)
        assert "could not store the result" in job.error and f"poisoned row of {bad_all}" in job.error
        assert job.attempts == 1 and svc2.rows(bad_all)[0] == []
        # acknowledged (and deleted), and the stream readers were told
        wait_for(lambda: jobs.queue_counts(svc2.redis, svc2.prefix, svc2.model, "interactive",
                                           svc2.settings.consumer_group) == (0, 0), 10, what="no pending messages")
        for jid in (bad_text, bad_all):
            last = svc2.redis.xrevrange(events_key(svc2.prefix, jid), count=1)
            assert json.loads(last[0][1][b"data"])["status"] == "failed"
        # and it keeps serving
        after = svc2.submit(max_tokens=4, ignore_eos=True)
        assert svc2.wait_status([after], timeout=60)[after] == "succeeded"
        assert w.alive()
        assert "job result could not be stored" in w.log_text()
    finally:
        with svc2.engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER IF EXISTS {fn} ON results"))
            conn.execute(text(f"DROP FUNCTION IF EXISTS {fn}()"))
        svc2.close()
