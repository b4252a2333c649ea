"""Engine options that ``inferq generate`` (worker/cli.py) and ``inferq worker`` (worker/service_cli.py) both
take, declared once so their flags and help cannot drift apart. Imports typer only (the CLIs load torch when
they run, not when they parse)."""

from __future__ import annotations

import typer

SPECULATIVE_METHOD = typer.Option(None, "--speculative-method",
                                  help="off, ngram (prompt lookup), draft (a smaller model, --speculative-draft-model) "
                                       "or early-exit (the model's first layers); docs/ENGINE.md.")
SPECULATIVE_DRAFT_MODEL = typer.Option(None, "--speculative-draft-model",
                                       help="Draft model (same tokenizer) of the draft method.")
SPECULATIVE_EARLY_EXIT_LAYERS = typer.Option(None, "--speculative-early-exit-layers",
                                             help="Layers of the early-exit draft (default: a third of the model's).")
NUM_SPECULATIVE_TOKENS = typer.Option(None, "--num-speculative-tokens",
                                      help="Most tokens proposed per request and step.")
TENSOR_PARALLEL_SIZE = typer.Option(None, "--tensor-parallel-size", min=1,
                                    help="Split the model across this many ranks (processes) started by this one; "
                                         "docs/ENGINE.md, Tensor parallelism.")
QUANTIZATION = typer.Option(None, "--quantization",
                            help="none, int8, w8a16, w8a8, int4, w4a8, or auto (the default model's own 4-bit GGUF blocks, a "
                                 "GPTQ/AWQ checkpoint's 4-bit weights); docs/ENGINE.md, Quantised weights.")
KV_CACHE_MEMORY = typer.Option(None, "--kv-cache-memory", help="KV-cache pool size, e.g. 2GiB.")
MAX_NUM_SEQS = typer.Option(None, "--max-num-seqs", help="Most requests running at once.")

