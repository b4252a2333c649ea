"""``inferq worker``: run one worker process (registered by deploy/cli.py). Torch loads only when it runs."""

from __future__ import annotations

import typer

from worker import cli_options as opts


def worker(
    model: str | None = typer.Option(None, "--model", help="Model name or local Hugging Face directory (default: INFERQ_MODEL)."),
    name: str | None = typer.Option(None, "--name", help="Consumer name in the Redis group (default: host-pid-random)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Serve Prometheus metrics on this port."),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    kv_cache_memory: str | None = opts.KV_CACHE_MEMORY,
    max_num_seqs: int | None = opts.MAX_NUM_SEQS,
    speculative_method: str | None = opts.SPECULATIVE_METHOD,
    speculative_draft_model: str | None = opts.SPECULATIVE_DRAFT_MODEL,
    speculative_early_exit_layers: int | None = opts.SPECULATIVE_EARLY_EXIT_LAYERS,
    num_speculative_tokens: int | None = opts.NUM_SPECULATIVE_TOKENS,
    tensor_parallel_size: int | None = opts.TENSOR_PARALLEL_SIZE,
    quantization: str | None = opts.QUANTIZATION,
) -> None:
    """Consume jobs from the Redis streams of one model, run them on the engine, write results and the
    ledger to the database. SIGTERM: finish in-flight jobs within shutdown_grace_seconds, hand the rest
    back to the queue, exit 0."""
    from inferq.settings import load_settings
    from worker.service import exit_now, run_worker

    overrides = {k: v for k, v in {"model": model, "worker_name": name, "device": device,
                                   "tensor_parallel_size": tensor_parallel_size,
                                   "quantization": quantization,
                                   "kv_cache_memory": kv_cache_memory, "max_num_seqs": max_num_seqs,
                                   "speculative_method": speculative_method,
                                   "num_speculative_tokens": num_speculative_tokens,
                                   "speculative_draft_model": speculative_draft_model,
                                   "speculative_early_exit_layers": speculative_early_exit_layers}.items()
                 if v is not None}
    exit_now(run_worker(load_settings(**overrides), metrics_port=metrics_port))
