"""``inferq generate``: offline batch generation from a JSONL file (registered by deploy/cli.py).

torch is imported only inside the command, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer


def _read_lines(path: Path) -> tuple[list[Any], dict[int, str]]:
    """Parsed JSON per non-blank line, plus the JSON errors by position (the line becomes an error)."""
    items: list[Any] = []
    errors: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                errors[len(items)] = f"line {lineno}: invalid JSON ({exc.msg})"
                items.append(None)
    return items, errors


def generate(
    input: Path = typer.Option(..., "--input", "-i", help="JSONL requests, one per line.", exists=True, dir_okay=False),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL results, in input order."),
    model: str | None = typer.Option(None, "--model", help="Model name or local Hugging Face directory."),
    policy: str | None = typer.Option(None, "--policy", help="continuous (default) or static batching."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Most requests running at once."),
    max_batched_tokens: int | None = typer.Option(None, "--max-batched-tokens", help="Token budget per step."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per KV-cache block."),
    kv_cache_memory: str | None = typer.Option(None, "--kv-cache-memory", help="KV-cache pool size, e.g. 2GiB."),
    dtype: str | None = typer.Option(None, "--dtype", help="auto, float32, bfloat16 or float16."),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype",
                                              help="auto (the model's dtype), float32, bfloat16 or float16."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable prefix caching."),
    stats: Path | None = typer.Option(None, "--stats", help="Write engine statistics (JSON) here."),
) -> None:
    """Generate completions for every line of INPUT; bad lines get an error result, never stop the run."""
    from inferq.log import configure_logging
    from inferq.settings import load_settings
    from worker.llm import LLM

    overrides: dict[str, Any] = {k: v for k, v in dict(
        model=model, policy=policy, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
        block_size=block_size, kv_cache_memory=kv_cache_memory, dtype=dtype, kv_cache_dtype=kv_cache_dtype).items() if v is not None}
    if no_prefix_cache:
        overrides["enable_prefix_cache"] = False
    settings = load_settings(**overrides)
    configure_logging(settings.log_level, settings.log_json)

    items, json_errors = _read_lines(input)
    llm = LLM(settings=settings)
    valid = [(i, x) for i, x in enumerate(items) if i not in json_errors]
    with _progress(len(items)) as advance:
        advance(len(json_errors))
        results = llm.generate([x for _, x in valid], on_progress=advance)
    ordered: list[dict[str, Any] | None] = [None] * len(items)
    for i, e in json_errors.items():
        ordered[i] = {"id": None, "error": e}
    for (i, _), r in zip(valid, results, strict=True):
        ordered[i] = r
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        for row in ordered:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    st = llm.engine.stats.to_dict()
    n_err = sum(1 for r in ordered if r and "error" in r)
    if stats is not None:
        stats.parent.mkdir(parents=True, exist_ok=True)
        stats.write_text(json.dumps({"policy": settings.policy, "model": settings.model, "lines": len(items),
                                     "errors": n_err, **st}, indent=2) + "\n")
    typer.echo(f"{len(items)} requests ({n_err} errors), {st['completion_tokens']} tokens generated in "
               f"{st['wall_seconds']:.1f}s -> {output}", err=True)


class _progress:
    """A rich progress bar on stderr when it is a terminal; otherwise a no-op."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar: Any = None

    def __enter__(self):
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(transient=True, console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task("generating", total=self.total)
        return self.advance

    def advance(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
