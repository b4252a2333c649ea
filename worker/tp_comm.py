"""The tensor-parallel ranks' process groups and the messages rank 0 sends the others.

Two groups over one TCP store (rank 0 hosts it on a free port):
- ``control`` (always gloo, CPU tensors): rank 0 broadcasts each step's flattened inputs. Its default
  timeout is long because the other ranks wait in it while the worker is idle; rank 0's own sends use
  ``timeout`` so a dead rank cannot hold it.
- ``data`` (gloo on CPU, nccl on CUDA): the forward's all-reduces and the logits gather, with ``timeout``.

The groups are built directly (``ProcessGroupGloo(store, rank, world)``), not with ``init_process_group``: no
process-global state, so one process can start, stop and start tensor parallelism again (tests do).

A message is a fixed int64 header ``[op, a, b, c, d, e, f, g]`` and, for a step, one int64 payload holding
input ids, positions, slot mapping, block tables, seq lens, query start locs and logits indices back to back:
two broadcasts per step whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

HEADER = 8
OP_STEP, OP_ALLOCATE, OP_STOP = 1, 2, 3
IDLE_TIMEOUT = timedelta(days=7)  # the other ranks' wait for the next message (an idle worker)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Groups:
    """One rank's view of the process groups."""

    rank: int
    world: int
    control: dist.ProcessGroup
    data: dist.ProcessGroup
    timeout: timedelta
    device: torch.device

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place; returns it."""
        self.data.allreduce([t]).wait()
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``[M, n]`` slices side by side, ``[M, world n]``; the others: ``t``."""
        if self.rank != 0:
            self.data.gather([], t, 0).wait()
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.data.gather(parts, t, 0).wait()
        return torch.cat(parts, dim=1)

    def barrier(self) -> dist.Work:
        """An all-reduce of one on the control group (started, not waited on): all ranks got this far."""
        return self.control.allreduce([torch.ones(1)])


def connect(host: str, port: int, rank: int, world: int, timeout: float, device: torch.device,
            store: dist.Store | None = None) -> Groups:
    """This rank's groups; rank 0 passes the store it hosts, the others connect to ``host:port``. Blocks until
    every rank has joined."""
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout))
        store.set(joined_key(rank), "1")  # rank 0 waits for these while watching the processes
    # the data group first: its rendezvous gives up after ``timeout``, the control group's would wait a week
    data_timeout = timedelta(seconds=timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = data_timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, opts)
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, data_timeout)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, IDLE_TIMEOUT)
    return Groups(rank, world, control, data, data_timeout, device)


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def host_store(world: int, timeout: float) -> dist.TCPStore:
    """Rank 0's store on a free local port (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


# --- messages ----------------------------------------------------------------------------------------


@dataclass
class StepMessage:
    """One step's flattened model inputs, as rank 0's ``ModelRunner`` built them (host int64 tensors)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S]
    query_start_loc: torch.Tensor  # [S+1]
    logits_indices: torch.Tensor  # [L]
    max_position: int
    block_size: int

    def header(self) -> torch.Tensor:
        t, (s, b), n = self.input_ids.shape[0], self.block_tables.shape, self.logits_indices.shape[0]
        return torch.tensor([OP_STEP, t, s, b, n, self.max_position, self.block_size, 0], dtype=torch.int64)

    def payload(self) -> torch.Tensor:
        parts = (self.input_ids, self.positions, self.slot_mapping, self.block_tables.reshape(-1), self.seq_lens,
                 self.query_start_loc, self.logits_indices)
        return torch.cat([p.to(torch.int64).reshape(-1) for p in parts])

    @classmethod
    def from_wire(cls, header: list[int], payload: torch.Tensor) -> StepMessage:
        _, t, s, b, n, max_position, block_size, _ = header
        sizes = (t, t, t, s * b, s, s + 1, n)
        ids, pos, slots, tables, seq_lens, qsl, logits = torch.split(payload, sizes)
        return cls(ids, pos, slots, tables.view(s, b), seq_lens, qsl, logits, max_position, block_size)

    def arrays(self) -> dict[str, np.ndarray]:
        """The attention metadata's host arrays (``AttentionMetadata.build`` keywords)."""
        return {"slot_mapping": self.slot_mapping.numpy(), "block_tables": self.block_tables.numpy().astype(np.int32),
                "seq_lens": self.seq_lens.numpy(), "query_start_loc": self.query_start_loc.numpy()}


@dataclass(frozen=True)
class AllocateMessage:
    """Allocate the KV-cache shard: every rank the same blocks, each holding its own KV heads."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    prefault: bool

    def header(self) -> torch.Tensor:
        return torch.tensor([OP_ALLOCATE, self.num_blocks, self.block_size, KV_DTYPES.index(self.dtype),
                             int(self.prefault), 0, 0, 0], dtype=torch.int64)

    @classmethod
    def from_wire(cls, header: list[int]) -> AllocateMessage:
        return cls(header[1], header[2], KV_DTYPES[header[3]], bool(header[4]))


def stop_header() -> torch.Tensor:
    return torch.tensor([OP_STOP] + [0] * (HEADER - 1), dtype=torch.int64)


def send(groups: Groups, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast a message, waiting at most ``groups.timeout`` for each part."""
    groups.control.broadcast(header, 0, groups.timeout).wait()
    if payload is not None:
        groups.control.broadcast(payload, 0, groups.timeout).wait()


def receive(groups: Groups) -> StepMessage | AllocateMessage | None:
    """The other ranks: the next message (None: stop); waits as long as the worker is idle."""
    header = torch.empty(HEADER, dtype=torch.int64)
    groups.control.broadcast(header, 0).wait()
    h = header.tolist()
    if h[0] == OP_STOP:
        return None
    if h[0] == OP_ALLOCATE:
        return AllocateMessage.from_wire(h)
    _, t, s, b, n = h[:5]
    payload = torch.empty(3 * t + s * b + 2 * s + 1 + n, dtype=torch.int64)
    groups.control.broadcast(payload, 0).wait()
    return StepMessage.from_wire(h, payload)
