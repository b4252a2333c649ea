"""``inferq generate``: offline batch generation from a JSONL file (registered by deploy/cli.py).

torch is imported only inside the command, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import typer

from worker import cli_options as opts


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: stop generating, keep what finished. A KeyboardInterrupt, so that no
    ``except Exception`` inside the engine mistakes it for a failed request."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise _Interrupted(signum)


def _read_lines(path: Path) -> tuple[list[Any], list[int], dict[int, str]]:
    """Parsed JSON per non-blank line, the file line number of each, and the JSON errors by position
    (such a line becomes an error row)."""
    items: list[Any] = []
    linenos: list[int] = []
    errors: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            linenos.append(lineno)
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                errors[len(items)] = f"line {lineno}: invalid JSON ({exc.msg})"
                items.append(None)
    return items, linenos, errors


# Long: the command's options are its documentation
def generate(
    input: Path = typer.Option(..., "--input", "-i", help="JSONL requests, one per line.", exists=True, dir_okay=False),
    output: Path = typer.Option(..., "--output", "-o",
                                help="JSONL results, written as each line finishes; in input order once all have."),
    ordered: bool = typer.Option(False, "--ordered",
                                 help="Keep OUTPUT in input order at every moment (a finished line waits for the "
                                      "lines before it), not only at the end."),
    allow_failures: bool = typer.Option(False, "--allow-failures",
                                        help="Exit 0 even when some lines failed (they still get an error row)."),
    progress_interval: float = typer.Option(10.0, "--progress-interval", min=0.0,
                                            help="Seconds between progress log lines when stderr is not a terminal."),
    model: str | None = typer.Option(None, "--model", help="Model name or local Hugging Face directory."),
    policy: str | None = typer.Option(None, "--policy", help="continuous (default) or static batching."),
    max_num_seqs: int | None = opts.MAX_NUM_SEQS,
    max_batched_tokens: int | None = typer.Option(None, "--max-batched-tokens", help="Token budget per step."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per KV-cache block."),
    kv_cache_memory: str | None = opts.KV_CACHE_MEMORY,
    dtype: str | None = typer.Option(None, "--dtype", help="auto, float32, bfloat16 or float16."),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype",
                                              help="auto (the model's dtype; bfloat16 under quantised float32 "
                                                   "weights), float32, bfloat16, float16, int8 or fp8_e4m3."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable prefix caching."),
    speculative_method: str | None = opts.SPECULATIVE_METHOD,
    speculative_draft_model: str | None = opts.SPECULATIVE_DRAFT_MODEL,
    speculative_early_exit_layers: int | None = opts.SPECULATIVE_EARLY_EXIT_LAYERS,
    num_speculative_tokens: int | None = opts.NUM_SPECULATIVE_TOKENS,
    tensor_parallel_size: int | None = opts.TENSOR_PARALLEL_SIZE,
    quantization: str | None = opts.QUANTIZATION,
    stats: Path | None = typer.Option(None, "--stats", help="Write engine statistics (JSON) here."),
) -> None:
    """Generate completions for every line of INPUT. Bad lines get an error row and never stop the run;
    the exit status is 1 if any line failed (unless --allow-failures). SIGINT/SIGTERM stop the run and keep
    every finished line in OUTPUT (exit 130/143)."""
    from inferq.log import configure_logging
    from inferq.settings import load_settings

    overrides: dict[str, Any] = {k: v for k, v in dict(
        model=model, policy=policy, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
        tensor_parallel_size=tensor_parallel_size, quantization=quantization,
        block_size=block_size, kv_cache_memory=kv_cache_memory, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        speculative_method=speculative_method, num_speculative_tokens=num_speculative_tokens,
        speculative_draft_model=speculative_draft_model,
        speculative_early_exit_layers=speculative_early_exit_layers).items() if v is not None}
    if no_prefix_cache:
        overrides["enable_prefix_cache"] = False
    settings = load_settings(**overrides)
    configure_logging(settings.log_level, settings.log_json)
    items, linenos, json_errors = _read_lines(input)
    run = _BatchRun(settings, output, items, linenos, ordered=ordered, progress_interval=progress_interval)
    interrupted = run.run(json_errors)
    n_err = run.progress.failed
    if stats is not None:
        stats.parent.mkdir(parents=True, exist_ok=True)
        stats.write_text(json.dumps({"policy": settings.policy, "model": settings.model, "lines": len(items),
                                     "errors": n_err, **run.llm.engine.stats.to_dict()}, indent=2) + "\n")
    run.summary(interrupted)
    if interrupted is not None:
        raise typer.Exit(128 + interrupted)
    if n_err and not allow_failures:
        raise typer.Exit(1)


class _BatchRun:
    """One ``inferq generate`` run: the engine, the result file and the progress display."""

    def __init__(self, settings: Any, output: Path, items: list[Any], linenos: list[int], *, ordered: bool,
                 progress_interval: float) -> None:
        from worker.generate_io import BatchProgress, ResultWriter
        from worker.llm import LLM

        self.items, self.linenos, self.output = items, linenos, output
        self.llm = LLM(settings=settings)
        self.writer = ResultWriter(output, ordered=ordered)
        self.progress = BatchProgress(len(items), progress_interval)

    def _finished(self, position: int, row: dict[str, Any]) -> None:
        self.writer.add(position, {"line": self.linenos[position], **row})
        self.progress.line_done(failed="error" in row)

    def run(self, json_errors: dict[int, str]) -> int | None:
        """Generate every valid line; the signal number if interrupted, else None."""
        valid = [i for i in range(len(self.items)) if i not in json_errors]
        previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i, error in json_errors.items():
                self._finished(i, {"id": None, "error": error})
            self.llm.generate([self.items[i] for i in valid], on_result=lambda j, row: self._finished(valid[j], row),
                              on_tokens=self.progress.add_tokens)
        except _Interrupted as exc:
            return exc.signum
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.progress.close()
            self.writer.finish(complete=len(self.writer.rows) == len(self.items))
        return None

    def summary(self, interrupted: int | None) -> None:
        p = self.progress
        typer.echo(f"{p.done}/{p.total} lines ({p.failed} failed), {p.tokens} tokens generated in "
                   f"{p.elapsed:.1f}s ({p.tok_s:.1f} tok/s) -> {self.output}", err=True)
        if interrupted is not None:
            typer.echo(f"interrupted by {signal.Signals(interrupted).name}: {p.total - p.done} lines did not "
                       f"finish; the {p.done} finished ones are in {self.output}", err=True)
        elif p.failed:
            typer.echo(f"{p.failed} lines failed (see their \"error\"); exit status 1 unless --allow-failures",
                       err=True)
