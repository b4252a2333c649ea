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
                                                  help="off, ngram (prompt lookup), draft (a smaller model, "
                                                  "--speculative-draft-model) or early-exit (the model's first "
                                                  "layers); docs/ENGINE.md."),
    speculative_draft_model: str | None = typer.Option(None, "--speculative-draft-model",
                                                       help="Draft model (same tokenizer) of the draft method."),
    speculative_early_exit_layers: int | None = typer.Option(None, "--speculative-early-exit-layers",
                                                             help="Layers of the early-exit draft (default: a "
                                                             "third of the model's)."),
    num_speculative_tokens: int | None = typer.Option(None, "--num-speculative-tokens",
                                                      help="Most tokens proposed per request and step."),
    tensor_parallel_size: int | None = typer.Option(None, "--tensor-parallel-size", min=1,
                                                    help="Split the model across this many ranks started by the "
                                                         "worker (docs/ENGINE.md, Tensor parallelism)."),
    quantization: str | None = typer.Option(None, "--quantization",
                                            help="none, int8, w8a8, int4, or auto (the default model's own 4-bit "
                                            "GGUF blocks); docs/ENGINE.md, Quantised weights."),
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
