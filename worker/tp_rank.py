"""One tensor-parallel rank: its shard of the model, and (ranks 1..N-1) the loop that runs the steps rank 0 sends.

Ranks other than 0 are child processes of the worker (``python -m worker.tp_rank SPEC``, started by
``worker.tp_driver``). They schedule nothing: each message from rank 0 is a KV-cache allocation, a step's
flattened inputs (they run the forward on their shard, taking part in its all-reduces and the logits
gather) or stop. A rank whose parent dies exits at once, rather than waiting for messages that never come.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inferq.log import configure_logging, get_logger
from kernels.attention_api import AttentionBackend, AttentionMetadata
from worker.model import CausalLM
from worker.tensor_parallel import GatheredHead, ShardLoader, VocabParallelEmbedding
from worker.tp_comm import AllocateMessage, Groups, StepMessage, connect, receive

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RankSpec:
    """What a child rank needs to start (passed as JSON on its command line)."""

    model_dir: str
    rank: int
    world: int
    port: int
    dtype: str  # float32 | bfloat16 | float16 (already resolved by rank 0)
    device: str
    attention_backend: str | None
    threads: int
    timeout: float
    parent_pid: int
    log_level: str = "INFO"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: rank r drives GPU r; CPU: every rank on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def load_shard(model_dir: str | Path, groups: Groups, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """This rank's ``CausalLM``: the sharded checkpoint, the row-parallel all-reduce hook, and the
    vocabulary-parallel lookup and head wrapped around the shard's own."""
    loader = ShardLoader(groups.rank, groups.world)
    model = CausalLM.from_pretrained(model_dir, dtype=dtype, device=device, transform=loader)
    lay = loader.layout
    assert lay is not None
    model.all_reduce = groups.all_reduce
    # (the lookup is the model's private callable: the shard's rows, tied to its head or not)
    model._embed_rows = VocabParallelEmbedding(model._embed_rows, lay.vocab_start, lay.vocab_end,
                                               groups.all_reduce)
    model.lm_head = GatheredHead(model.lm_head, groups.gather_columns, lay.vocab_rows)
    return model


def run_step(model: CausalLM, kv_caches: list, backend: AttentionBackend, msg: StepMessage,
             device: torch.device) -> torch.Tensor:
    """The forward of one step on this rank's shard (the same inputs rank 0 runs)."""
    meta = AttentionMetadata.build(**msg.arrays(), block_size=msg.block_size, device=device, scale=model.scale)
    with torch.inference_mode():
        return model.forward(msg.input_ids.to(device), msg.positions.to(device), kv_caches, meta, backend,
                             logits_indices=msg.logits_indices.to(device), max_position=msg.max_position)


def serve(model: CausalLM, groups: Groups, backend: AttentionBackend, device: torch.device) -> int:
    """Run rank 0's messages until it says stop; the number of steps run."""
    kv_caches: list = []
    steps = 0
    while (msg := receive(groups)) is not None:
        if isinstance(msg, AllocateMessage):
            kv_caches = model.allocate_kv_cache(msg.num_blocks, msg.block_size, msg.dtype, prefault=msg.prefault)
            continue
        run_step(model, kv_caches, backend, msg, device)
        steps += 1
    return steps


def watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Exit (status 1) as soon as the worker that started this rank is gone: orphaned ranks would otherwise
    sit in the idle wait for a week."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    from kernels.backend import get_backend

    spec = RankSpec(**json.loads(argv[0]))
    configure_logging(spec.log_level)
    watch_parent(spec.parent_pid)
    torch.set_num_threads(spec.threads)
    device = rank_device(torch.device(spec.device), spec.rank)
    groups = connect("127.0.0.1", spec.port, spec.rank, spec.world, spec.timeout, device)
    model = load_shard(spec.model_dir, groups, _DTYPES[spec.dtype], device)
    backend = get_backend(device, spec.attention_backend)
    groups.barrier().wait()
    log.info("tensor-parallel rank ready", rank=spec.rank, world=spec.world, heads=model.config.num_heads,
             kv_heads=model.config.num_kv_heads, threads=spec.threads)
    steps = serve(model, groups, backend, device)
    log.info("tensor-parallel rank stopped", rank=spec.rank, steps=steps)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:  # noqa: BLE001 - any failure: say why on stderr, exit non-zero (rank 0 notices)
        log.exception("tensor-parallel rank failed")
        code = 1
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown of torch (seconds), nothing left to flush
