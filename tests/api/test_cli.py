"""The API area's CLI in subprocesses: `inferq tenants create|show`, `inferq keys create|revoke`, and
`inferq api` serving the app (a real uvicorn process) that accepts the created key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.registry_helpers import register_worker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _env(settings) -> dict[str, str]:
    return {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
            "INFERQ_STREAM_PREFIX": settings.stream_prefix, "INFERQ_LOG_JSON": "true"}


def inferq(settings, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", "from deploy.cli import main; main()", *args], env=_env(settings),
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def _fields(text: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def test_tenants_and_keys(settings, redis_client, tmp_path):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    created = _fields(inferq(settings, "tenants", "create", name, "--max-queued-jobs", "5").stdout)
    key = created["api key"]
    assert key.startswith("iq_") and created["key prefix"] == key[:11]
    assert len(created["webhook secret"]) >= 32
    dup = inferq(settings, "tenants", "create", name, ok=False)
    assert dup.returncode == 1 and "already exists" in dup.stderr

    admin_key = inferq(settings, "keys", "create", name, "--admin").stdout.strip()
    assert admin_key.startswith("iq_") and admin_key != key

    shown = inferq(settings, "tenants", "show", name).stdout
    assert created["key prefix"] in shown and admin_key[:11] in shown and "max queued jobs:    5" in shown
    assert key not in shown and admin_key not in shown  # only prefixes are ever shown again

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from deploy.cli import main; main()", "api", "--port", str(port),
                             "--no-webhooks"], env=_env(settings), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "api.log").open("wb"))
    register_worker(settings, "w-cli")  # a stand-in worker: the API is ready and knows the default model
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc, tmp_path / "api.log")
        with httpx.Client(base_url=base) as c:
            r = c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 202, r.text
            assert c.get("/v1/admin/usage", headers={"Authorization": f"Bearer {admin_key}"}).status_code == 200
            revoked = inferq(settings, "keys", "revoke", created["key prefix"]).stdout
            assert revoked.startswith(f"revoked {created['key prefix']}")
            deadline = time.monotonic() + 15  # the API caches key lookups for a few seconds
            while time.monotonic() < deadline:
                if c.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 401:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError("revoked key still accepted")
    finally:
        proc.terminate()
        proc.wait(20)
    assert "revoked" in inferq(settings, "tenants", "show", name).stdout
    missing = inferq(settings, "keys", "revoke", "iq_00000000", ok=False)
    assert missing.returncode == 1 and "no API key" in missing.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"inferq api exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("inferq api not ready")
