"""Contract of the OpenAI-compatible routes: ``schemathesis run --checks all`` over ``POST /v1/chat/completions``
and ``POST /v1/completions`` against the live app with a real worker (tiny random model), Redis and
PostgreSQL: no 5xx, every answer (JSON or ``chat.completion.chunk`` event stream) as documented, bodies
valid by the document accepted and invalid ones refused. tests/api/test_contract.py covers every other route
(without a worker, so it leaves these two out: they wait for the answer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from inferq.contract import model_id
from inferq.db import Job
from tests.api.test_contract import ROOT
from tests.api.test_e2e import inferq_worker, model_settings  # noqa: F401 - fixtures
from tests.service_fixtures import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROUTES = ("/v1/chat/completions", "/v1/completions")
HOOKS = Path(__file__).with_name("schemathesis_openai_hooks.py")  # model, max_tokens, token ids: see there
MAX_EXAMPLES = 30  # per operation (fuzzing); with 4-token answers the whole run takes about half a minute
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A long context (16k positions): a generated prompt, up to four tokens per character, always fits."""
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", max_position_embeddings=16384)


def _worker_ready(url: str, key: str, model: str) -> bool:
    """The worker serves the model and has published its context and tokenizer (so prompts are counted)."""
    r = httpx.get(f"{url}/v1/models/{model}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.status_code == 200 and r.json().get("workers", 0) >= 1 and bool(r.json().get("max_model_len"))


def test_schemathesis_openai_routes_with_a_worker(serve, model_settings, inferq_worker, make_tenant,  # noqa: F811
                                                  tmp_path, db):
    """Every check (``--checks all``, none left out), the coverage and fuzzing phases (the routes have no
    examples and no links, so schemathesis skips the other two), deterministic and bounded: each generated
    request the document allows runs to its end on the worker (JSON answers and event streams, both tiers by
    the ``X-Inferq-Tier`` header); the request bodies the document publishes are checked against the routes'
    own checks in tests/api/test_openai.py."""
    url = serve(model_settings)
    tenant = make_tenant()
    key = tenant.key
    model = model_id(model_settings.model)
    wait_for(lambda: _worker_ready(url, key, model), 120, 0.5, what="the worker to publish its model")
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json", "--checks", "all",
           "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--request-timeout", "30",
           # `--checks all` includes a response-time limit (10 s by default): this is a contract test, not a timing
           # one, and on a busy 2-core machine one answer queued behind the others took 10.6 s (a full suite run);
           # the limit is the request timeout, so a hang still fails
           "--max-response-time", "30",
           # unsanitized: schemathesis masks every key with "token" in its name, max_tokens included
           "--workers", "1", "--no-color", "--output-sanitize", "false", "-H", f"Authorization: Bearer {key}",
           *[arg for path in ROUTES for arg in ("--include-path", path)]]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "PYTHONPATH": str(ROOT), "INFERQ_CONTRACT_MODEL": model,
           "INFERQ_CONTRACT_MAX_TOKENS": str(MAX_TOKENS)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    report = out.stdout + out.stderr
    assert inferq_worker.alive(), inferq_worker.log_text()[-3000:]
    assert out.returncode == 0, report[-12000:]
    tested = re.search(r"Tested:\s+(\d+)", report)
    assert tested and int(tested.group(1)) == len(ROUTES), report[-3000:]
    cases = re.search(r"(\d+) generated", report)
    assert cases and int(cases.group(1)) >= 2 * MAX_EXAMPLES, report[-3000:]
    with db() as s:
        ended = Counter(s.execute(select(Job.status, Job.tier).where(Job.tenant_id == tenant.tenant_id)).all())
    # the accepted requests really ran, in both tiers, and every one of them ran to its end
    assert set(ended) == {("succeeded", "interactive"), ("succeeded", "batch")}, ended
    assert ended["succeeded", "interactive"] >= 2 * MAX_EXAMPLES, ended
