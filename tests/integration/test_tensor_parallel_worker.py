"""A real tensor-parallel worker (``python -m worker.service`` with INFERQ_TENSOR_PARALLEL_SIZE=2) over the real
PostgreSQL and a private Redis: when one of its ranks is killed mid-job, the worker exits non-zero within a
bounded time (it does not hang), and its jobs are finished by another worker through the ordinary reclaim
path, each exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from inferq.db import Job
from tests.integration.test_tensor_parallel import _children
from tests.integration.test_worker_faults import LONG, Service, _dump_logs
from tests.service_fixtures import private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.tiny_models import make_tiny_model

    # its own model name: jobs are queued per model (see test_worker_faults.py)
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", name="tiny-llama-tp-worker",
                           max_position_embeddings=LONG + 64)


def test_dead_rank_ends_the_worker_and_its_jobs_finish_elsewhere(pg_url, private_redis, tiny_model, tmp_path):  # noqa: F811
    svc = Service(pg_url, private_redis.url, tiny_model, tmp_path)
    try:
        tp = svc.start_worker(tensor_parallel_size=2)
        wait_for(lambda: svc.stats(tp) or not tp.alive(), 150, what="the tensor-parallel worker to start")
        assert tp.alive(), tp.log_text()[-3000:]
        ids = [svc.submit(max_tokens=LONG, ignore_eos=True) for _ in range(3)]

        def running_on_tp():
            with svc.db() as s:
                return s.scalars(select(Job.id).where(Job.id.in_(ids), Job.status == "running",
                                                      Job.worker == tp.name)).all()

        wait_for(lambda: len(running_on_tp()) == len(ids), 60, interval=0.05, what="jobs running on the TP worker")
        ranks = _children(tp.proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        status = tp.proc.wait(30)
        assert status != 0 and time.monotonic() - killed < 15, status
        assert "tensor parallelism failed" in tp.log_text(), tp.log_text()[-3000:]
        survivor = svc.start_worker()  # TP=1: picks the dead worker's pending messages up once idle
        assert set(svc.wait_status(ids, timeout=180).values()) == {"succeeded"}, _dump_logs(svc)
        for jid in ids:
            svc.assert_one_result(jid)
            job = svc.job(jid)
            assert job.worker == survivor.name and job.attempts == 2, (jid, job.worker, job.attempts)
    finally:
        svc.close()
