"""``inferq generate`` as a batch tool: results reach the file as each line finishes, so an interrupt
(SIGINT or SIGTERM) keeps every finished line; progress is logged when stderr is not a terminal; a summary
ends the run; the exit status says whether any line failed. Real processes on a tiny random model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_fixtures import FakeRunner
from worker.llm import LLM

SHORT = 3  # tokens of the short lines


def test_llm_hands_over_each_result_as_its_line_finishes():
    """``on_result`` sees a row the moment its line finishes (short lines before a long one, refused lines
    at once), and ``on_tokens`` counts every generated token: what the CLI builds on."""
    llm = LLM(runner=FakeRunner(num_blocks=64, block_size=4), tokenizer=None, block_size=4, max_num_seqs=4)
    lines = [{"id": "long", "prompt_ids": [1, 2], "max_tokens": 12}, {"id": "bad", "prompt": ""},
             {"id": "s1", "prompt_ids": [3], "max_tokens": 2}, {"id": "s2", "prompt_ids": [4], "max_tokens": 3}]
    seen: list[str] = []
    tokens: list[int] = []
    results = llm.generate(lines, on_result=lambda i, row: seen.append(row["id"]), on_tokens=tokens.append)
    assert seen == ["bad", "s1", "s2", "long"]
    assert [r["id"] for r in results] == ["long", "bad", "s1", "s2"]  # the return value stays in input order
    assert sum(tokens) == 12 + 2 + 3


# --- the CLI on a real tiny model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    # a long context, so that one line can run far longer than any test waits
    return make_tiny_model(tmp_path_factory.mktemp("batch"), arch="qwen2", max_position_embeddings=100_000)


def _cli(tiny: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "generate", "--input", str(inp), "--output", str(out),
            "--model", str(tiny), "--kv-cache-memory", "64MiB", "--dtype", "float32", *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(INFERQ_DEVICE="cpu", INFERQ_TORCH_THREADS="1", INFERQ_LOG_JSON="true")
    return env


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _progress_lines(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{") and '"generate progress"' in line:
            out.append(json.loads(line))
    return out


@pytest.mark.integration
def test_failed_lines_make_the_exit_status_non_zero(tiny, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([
        json.dumps({"id": "a", "prompt_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0}),
        "",  # blank: skipped, but it still counts in the line numbers
        "{not json",
        json.dumps({"id": "b", "prompt": "Hello", "max_tokens": 5, "temperature": 0}),
        json.dumps({"id": "bad", "prompt_ids": [1], "colour": "red"}),
    ]) + "\n")
    res = subprocess.run(_cli(tiny, inp, out, "--progress-interval", "0"), env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    rows = _rows(out)
    assert [(r["line"], r["id"]) for r in rows] == [(1, "a"), (3, None), (4, "b"), (5, "bad")]  # input order
    assert "invalid JSON" in rows[1]["error"] and "colour" in rows[3]["error"]
    assert len(rows[0]["token_ids"]) == 4 and len(rows[2]["token_ids"]) == 5
    assert "4/4 lines (2 failed), 9 tokens generated" in res.stderr
    assert "--allow-failures" in res.stderr
    progress = _progress_lines(res.stderr)  # not a terminal: structured progress lines instead of a bar
    assert progress and progress[-1]["done"] == 4 and progress[-1]["total"] == 4
    assert {"tokens", "tok_s", "eta_seconds", "failed"} <= set(progress[-1])


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"inferq generate exited ({proc.returncode}) before {what}"
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.integration
@pytest.mark.parametrize(("signum", "ordered"), [(signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["SIGINT", "SIGTERM-ordered"])
def test_interrupt_keeps_the_finished_lines(tiny, tmp_path, signum, ordered):
    """Line 1 could run for many minutes; the four short lines behind it finish first. Interrupted, the run
    exits 128+signal with the short lines' results in the file (completion order as they came, or with
    --ordered held back behind line 1 and written in input order at the interrupt)."""
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "stderr.log"
    lines = [{"id": "long", "prompt_ids": [5, 6], "max_tokens": 90_000, "ignore_eos": True}]
    lines += [{"id": f"s{i}", "prompt_ids": [7, 8, i], "max_tokens": SHORT, "temperature": 0} for i in range(4)]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--progress-interval", "0.2"] + (["--ordered"] if ordered else [])
    with open(err, "w") as stderr:
        proc = subprocess.Popen(_cli(tiny, inp, out, *args), env=_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        if ordered:  # nothing can be written while line 1 runs: watch the progress log instead
            _wait_for(lambda: any(p["done"] == 4 for p in _progress_lines(err.read_text())), proc, "4 lines done")
            assert _rows(out) == []
        else:
            _wait_for(lambda: len(_rows(out)) == 4, proc, "4 rows in the output")
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = _rows(out)
    assert sorted(r["line"] for r in rows) == [2, 3, 4, 5]  # every finished line kept, the long one not
    assert all(len(r["token_ids"]) == SHORT and r["finish_reason"] == "length" for r in rows)
    if ordered:
        assert [r["line"] for r in rows] == [2, 3, 4, 5]
    text = err.read_text()
    assert f"interrupted by {signal.Signals(signum).name}: 1 lines did not finish" in text
    assert "4/5 lines (0 failed)" in text
