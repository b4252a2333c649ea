"""Takeover fencing end to end, with two real worker subprocesses: the worker running a job is frozen
(SIGSTOP) past the claim idle time, the other takes the job over, then the first is thawed (SIGCONT). The
job must end with exactly one result and one ledger row, written by the second worker's attempt, and the
first worker must give its copy up without writing anything (PostgreSQL's fence; see
inferq/jobs/lifecycle.py ``claim``/``heartbeat``/``finish``). The unit tests of each fence are in
tests/integration/test_fencing.py."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from inferq import jobs
from tests.service_behaviour_helpers import ENDLESS, Service
from tests.service_fixtures import WorkerProcess, assert_ledger_cost, private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# what a worker logs when it lets go of a job it no longer owns: dropped at its heartbeat, or its finished
# result refused by the fenced ``finish``
LET_GO = ("job taken over by another worker or finished elsewhere; dropping it",
          "job no longer ours (taken over, or finished elsewhere); result discarded")


@pytest.fixture
def svc(pg_url, private_redis, tmp_path) -> Iterator[Service]:  # noqa: F811
    """A namespace whose workers give up a silent job quickly: messages idle 2 s are reclaimed."""
    from tests.tiny_models import make_tiny_model

    # its own model name: the reconcilers of other modules' workers (same database) re-queue their leftover
    # queued jobs under those jobs' model, which these workers would otherwise read
    model = make_tiny_model(tmp_path / "model", arch="llama", name="tiny-llama-takeover",
                            max_position_embeddings=ENDLESS + 64)
    s = Service(pg_url, private_redis.url, model, tmp_path, claim_idle_ms=2000, heartbeat_seconds=0.3)
    yield s
    for w in s.workers:  # never leave a frozen process behind
        if w.alive():
            w.proc.send_signal(signal.SIGCONT)
    s.close()


def _start_workers(svc: Service, n: int) -> list[WorkerProcess]:
    """``n`` workers started together (model loading overlaps), waited for until each reads jobs."""
    started = []
    for _ in range(n):
        name = f"w{len(svc.workers) + 1}-{uuid.uuid4().hex[:4]}"
        w = WorkerProcess(svc.env, svc.tmp / f"{name}.log", name)
        svc.workers.append(w)
        started.append(w)
    for w in started:
        wait_for(lambda w=w: svc.stats(w) or not w.alive(), 150, what=f"worker {w.name} to start")
        assert w.alive(), w.log_text()[-3000:]
    return started


def _log_events(worker: WorkerProcess, job_id: str) -> list[str]:
    """The ``event`` of each JSON log line of ``worker`` about ``job_id``."""
    events = []
    for line in worker.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("job_id") == job_id:
            events.append(str(entry.get("event")))
    return events


def _open_transactions(svc: Service) -> int:
    """Sessions of this database inside a transaction: a worker frozen in one would hold its row locks and
    block the takeover until it is thawed."""
    with svc.engine.connect() as conn:
        return conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()")).scalar_one()


def _freeze(svc: Service, worker: WorkerProcess) -> None:
    """SIGSTOP ``worker`` at a moment when no transaction is open (retrying: transactions take milliseconds)."""
    for _ in range(50):
        worker.proc.send_signal(signal.SIGSTOP)
        if _open_transactions(svc) == 0:
            return
        worker.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: _open_transactions(svc) == 0, 10, interval=0.01, what="no open transaction")
    raise AssertionError("could not freeze the worker outside a transaction")


def test_frozen_worker_is_taken_over_and_its_late_result_refused(svc):
    """Freeze the job's worker until the other one has taken the job over; then thaw it and cancel the job
    while the new owner is frozen in turn, so that the old worker, which still runs its copy, is the first
    to try to finish it. It must let the job go unwritten; the owner writes the one result when thawed."""
    a, b = _start_workers(svc, 2)
    job_id = svc.submit(max_tokens=ENDLESS, ignore_eos=True)  # never ends on its own while the test runs
    svc.wait_status([job_id], ("running",), timeout=60)
    wait_for(lambda: svc.job(job_id).first_token_at is not None, 60, what="the first token")
    first, second = (a, b) if svc.job(job_id).worker == a.name else (b, a)

    _freeze(svc, first)
    wait_for(lambda: (svc.job(job_id).worker, svc.job(job_id).attempts) == (second.name, 2), 60,
             what="the second worker to take the job over")
    _freeze(svc, second)
    first.proc.send_signal(signal.SIGCONT)
    jobs.cancel(svc.db, svc.redis, svc.settings, job_id)  # the old worker hears it first: the owner is frozen
    try:
        wait_for(lambda: {"job finished", *LET_GO} & set(_log_events(first, job_id)), 60,
                 what=f"{first.name} to let the job go (or to finish it)")
    finally:
        second.proc.send_signal(signal.SIGCONT)
    assert "job finished" not in _log_events(first, job_id), _log_events(first, job_id)
    assert svc.wait_status([job_id], timeout=60)[job_id] == "cancelled"

    result, ledger = svc.one_result(job_id)
    job = svc.job(job_id)
    assert (job.worker, job.attempts) == (second.name, 2)
    assert result.finish_reason == "abort" and 0 < ledger.completion_tokens == len(result.token_ids) < ENDLESS
    assert_ledger_cost(svc.settings, ledger)
    assert "job restarted" in _log_events(second, job_id) and "job finished" in _log_events(second, job_id)
    # the old worker holds nothing and keeps serving; the job's message is acknowledged
    wait_for(lambda: svc.stats(first).get("in_flight") == "0", 30, what=f"{first.name} to hold nothing")
    assert first.alive() and second.alive()
    wait_for(lambda: jobs.queue_counts(svc.redis, svc.prefix, svc.model, "interactive",
                                       svc.settings.consumer_group)[1] == 0, 30,
             what="the job's message acknowledged")
    again, again_ledger = svc.one_result(job_id)  # unchanged after the old worker went on
    assert (again.created_at, again.token_ids, again_ledger.id) == (result.created_at, result.token_ids, ledger.id)
    assert "job finished" not in _log_events(first, job_id)
    after = svc.submit(max_tokens=4, ignore_eos=True)
    assert svc.wait_status([after], timeout=60)[after] == "succeeded"
