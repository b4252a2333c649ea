"""Bad input at the command line gives one line naming the problem and the fix, a non-zero exit code,
and no traceback."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _inferq(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unreachable_database():
    proc = _inferq("migrate", env={"INFERQ_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"})
    _assert_one_line_error(proc, "cannot reach the database", "INFERQ_DATABASE_URL")


def test_malformed_settings_value_and_file(tmp_path):
    _assert_one_line_error(_inferq("migrate", env={"INFERQ_BLOCK_SIZE": "many"}), "block_size")
    bad = tmp_path / "inferq.toml"
    bad.write_text("block_size = [\n")
    _assert_one_line_error(_inferq("migrate", env={"INFERQ_CONFIG": str(bad)}), "inferq.toml")
    _assert_one_line_error(_inferq("migrate", env={"INFERQ_CONFIG": str(tmp_path / "none.toml")}), "does not exist")


def test_missing_model_path(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"id": "a", "prompt": "hi"}\n')
    proc = _inferq("generate", "--input", str(requests), "--output", str(tmp_path / "out.jsonl"),
                   "--model", str(tmp_path / "no-such-model"))
    _assert_one_line_error(proc, "no-such-model")


def test_unreachable_redis_for_worker(tmp_path):
    proc = _inferq("worker", env={"INFERQ_REDIS_URL": "redis://127.0.0.1:1/0",
                                  "INFERQ_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"})
    _assert_one_line_error(proc, "cannot reach Redis", "INFERQ_REDIS_URL")


def test_debug_shows_the_traceback():
    proc = _inferq("--debug", "migrate", env={"INFERQ_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/x"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr
