"""``inferq worker``: run one worker process (registered by deploy/cli.py). Torch loads only when it runs."""

from __future__ import annotations

import typer


def worker(
    model: str | None = typer.Option(None, "--model", help="Model name or local Hugging Face directory (default: INFERQ_MODEL)."),
    name: str | None = typer.Option(None, "--name", help="Consumer name in the Redis group (default: host-pid-random)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Serve Prometheus metrics on this port."),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    kv_cache_memory: str | None = typer.Option(None, "--kv-cache-memory", help="KV-cache pool size, e.g. 2GiB."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Most requests running at once."),
    speculative_method: str | None = typer.Option(None, "--speculative-method",
                                                  help="off or ngram (prompt lookup); docs/ENGINE.md."),
    num_speculative_tokens: int | None = typer.Option(None, "--num-speculative-tokens",
                                                      help="Most tokens proposed per request and step."),
) -> None:
    """Consume jobs from the Redis streams of one model, run them on the engine, write results and the
    ledger to the database. SIGTERM: finish in-flight jobs within shutdown_grace_seconds, hand the rest
    back to the queue, exit 0."""
    from inferq.settings import load_settings
    from worker.service import exit_now, run_worker

    overrides = {k: v for k, v in {"model": model, "worker_name": name, "device": device,
                                   "kv_cache_memory": kv_cache_memory, "max_num_seqs": max_num_seqs,
                                   "speculative_method": speculative_method,
                                   "num_speculative_tokens": num_speculative_tokens}.items()
                 if v is not None}
    exit_now(run_worker(load_settings(**overrides), metrics_port=metrics_port))
