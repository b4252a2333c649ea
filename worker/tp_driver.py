"""Rank 0 of a tensor-parallel model, inside the worker process: starts ranks 1..N-1 and stands in for the model.

``ModelRunner`` keeps doing everything it does at TP=1 (step preparation, sampling) and the engine keeps its one
scheduler, block manager and prefix cache: :class:`TPDriver` has the ``CausalLM`` methods the runner calls.
Each ``forward`` first broadcasts the step's flattened inputs to the other ranks, then runs rank 0's shard;
the other ranks run theirs at the same time (``worker.tp_rank``), the row-parallel all-reduces keep the ranks
in step, and the logits are gathered to rank 0. The KV budget is the worker's: ``kv_bytes_per_block`` counts
every rank's share of a block, so the pool has as many blocks as at TP=1, each rank holding its KV heads.

Failure: a rank that exits is seen before each step (its process has a return code) or inside a collective
(gloo reports the closed connection; a hung rank hits ``timeout``). Either way the driver logs which rank and
why, stops the other ranks and raises :class:`TensorParallelError`; the worker process then exits non-zero
and its jobs are re-delivered by the queue's reclaim path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from inferq.log import get_logger
from kernels.attention_api import AttentionBackend, AttentionMetadata
from worker.model import CausalLM, ModelConfig, load_config
from worker.tensor_parallel import TensorParallelError, check_divisible
from worker.tp_comm import AllocateMessage, StepMessage, connect, host_store, joined_key, send, stop_header
from worker.tp_rank import RankSpec, dtype_name, load_shard, rank_device

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT = 600.0  # the other ranks' start: import torch, read and shard the checkpoint, plan the GEMMs
POLL = 0.02


def _start_rank(spec: RankSpec) -> subprocess.Popen:
    """A fresh interpreter (not a fork of the worker: no copied threads, Redis or database connections); run
    from the repository root, so ``-m worker.tp_rank`` imports this checkout."""
    return subprocess.Popen([sys.executable, "-m", "worker.tp_rank", spec.to_json()], cwd=str(ROOT))


def _stop_ranks(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """Wait up to ``grace`` for the ranks to exit, then kill what is left (each by its own pid)."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class TPDriver:
    """A tensor-parallel model of ``world`` ranks, driven from this process (rank 0)."""

    def __init__(self, model_dir: str | Path, *, world: int, dtype: torch.dtype, device: torch.device,
                 attention_backend: str | None = None, threads: int | None = None, timeout: float = 60.0,
                 log_level: str = "INFO") -> None:
        self.config: ModelConfig = load_config(model_dir)  # the whole model's
        check_divisible(self.config, world)  # before starting anything
        self.world = world
        self.timeout = timeout
        self.failed: str | None = None
        per_rank = max(1, (threads or os.cpu_count() or 1) // world)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(per_rank)
        store = host_store(world, timeout)
        where = str(Path(model_dir).resolve())
        self.procs = [_start_rank(RankSpec(where, r, world, store.port, dtype_name(dtype), device.type,
                                           attention_backend, per_rank, timeout, os.getpid(), log_level))
                      for r in range(1, world)]
        self._finalizer = weakref.finalize(self, _stop_ranks, self.procs, 0.0)
        log.info("starting tensor-parallel ranks", world=world, threads_per_rank=per_rank,
                 pids=[p.pid for p in self.procs])
        try:
            self._wait_joined(store)
            self.groups = connect("127.0.0.1", store.port, 0, world, timeout, rank_device(device, 0), store=store)
            self._store = store
            self.model: CausalLM = load_shard(model_dir, self.groups, dtype, rank_device(device, 0))
            self._wait(self.groups.barrier(), "the other ranks to load their shards", LOAD_TIMEOUT)
        except Exception as exc:
            raise self._fail(f"start-up failed: {exc}") from exc
        except BaseException:  # interrupted (SIGINT): no ranks left behind
            self._finalizer()
            raise
        log.info("tensor-parallel model ready", world=world, heads_per_rank=self.model.config.num_heads,
                 kv_heads_per_rank=self.model.config.num_kv_heads)

    # -- the CausalLM surface ModelRunner uses ---------------------------------------------------------

    @property
    def scale(self) -> float:
        return self.model.scale

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def layers(self) -> list:
        """Refused: every rank holds a slice of every layer, so nothing in this process can run some of the
        layers alone (the early-exit draft does; the n-gram and draft-model proposers work)."""
        raise TensorParallelError("the early-exit draft cannot run on a tensor-parallel model (each rank holds a "
                                  "slice of every layer); use speculative_method ngram or draft")

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """A block's bytes over all ranks (each holds its KV heads of it)."""
        return self.world * self.model.kv_bytes_per_block(block_size, dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                          prefault: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank allocates its shard of the same ``num_blocks`` blocks; rank 0's is returned."""
        dtype = dtype or self.model.dtype
        self._call(lambda: send(self.groups, AllocateMessage(num_blocks, block_size, dtype, prefault).header()))
        return self.model.allocate_kv_cache(num_blocks, block_size, dtype, prefault=prefault)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, logits_indices: torch.Tensor | None = None,
                max_position: int | None = None, argmax_only=False) -> torch.Tensor:
        """Logits of the step (rank 0's gathered rows), as ``CausalLM.forward`` returns them (every value exact:
        ``argmax_only`` is taken for the signature's sake)."""
        if logits_indices is None:
            logits_indices = torch.arange(input_ids.shape[0], device=input_ids.device)
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        msg = StepMessage(input_ids.cpu(), positions.cpu(), meta.slot_mapping.cpu(), meta.block_tables.cpu(),
                          meta.seq_lens.cpu(), meta.query_start_loc.cpu(), logits_indices.cpu(), max_position,
                          meta.block_size)

        def step() -> torch.Tensor:
            send(self.groups, msg.header(), msg.payload())
            return self.model.forward(input_ids, positions, kv_caches, meta, backend, logits_indices, max_position)

        return self._call(step)

    __call__ = forward

    # -- liveness and shutdown -------------------------------------------------------------------------

    def _call(self, fn):
        """``fn()`` (collectives with the other ranks), after checking they are alive; a failure stops them all
        and raises TensorParallelError."""
        if self.failed is not None:
            raise TensorParallelError(f"tensor parallelism stopped earlier: {self.failed}")
        self._check_alive()
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as exc:
            # a collective failed (or rank 0's own forward, which leaves the other ranks inside one): the ranks
            # are out of step for good
            raise self._fail(f"a step failed: {exc}") from exc

    def _dead(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every rank process that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise self._fail("rank process exited: " + ", ".join(f"rank {r} status {c}" for r, c in dead))

    def _wait_joined(self, store: dist.Store) -> None:
        """Wait until every rank has reached the store, watching the processes (a rank that fails to start,
        e.g. on an import error, is reported at once instead of after a rendezvous timeout)."""
        keys = [joined_key(r) for r in range(1, self.world)]
        deadline = time.monotonic() + LOAD_TIMEOUT
        while not store.check(keys):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"timed out after {LOAD_TIMEOUT:.0f}s waiting for the ranks to start")
            time.sleep(POLL)

    def _wait(self, work: dist.Work, what: str, limit: float) -> None:
        """Wait for ``work`` while watching the rank processes (a rank that dies while loading is seen at once)."""
        deadline = time.monotonic() + limit
        while not work.is_completed():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"timed out after {limit:.0f}s waiting for {what}")
            time.sleep(POLL)
        work.wait()

    def _fail(self, reason: str) -> TensorParallelError:
        """Stop every rank, log why, and return the error to raise (this worker cannot go on)."""
        if self.failed is None:  # (logged once: a start-up failure passes through here twice)
            self.failed = reason
            log.error("tensor parallelism failed; stopping all ranks (the worker must exit; its jobs are reclaimed)",
                      reason=reason, exited=[{"rank": r, "status": c} for r, c in self._dead()])
        self._finalizer()  # kills the ranks still running
        torch.set_num_threads(self._threads_before)
        return TensorParallelError(reason)

    def close(self) -> None:
        """Tell the ranks to stop and wait for them (killing any that do not exit within a few seconds)."""
        if self.failed is None and not self._dead():
            try:
                send(self.groups, stop_header())
            except (RuntimeError, dist.DistBackendError) as exc:
                log.warning("could not tell the tensor-parallel ranks to stop", error=str(exc))
        self.failed = self.failed or "closed"
        _stop_ranks(self.procs)
        self._finalizer.detach()
        torch.set_num_threads(self._threads_before)
