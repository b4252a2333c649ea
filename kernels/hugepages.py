"""Large CPU buffers backed by transparent huge pages (2 MiB) where the kernel allows it.

Why: decode attention reads every running sequence's KV blocks, scattered over a cache of hundreds of MiB
per layer pair; with 4 KiB pages nearly every block costs a TLB miss (a nested page walk in a VM). Backing
the pool with 2 MiB pages made the CPU decode-attention kernel 10-20% faster here (AMD EPYC VM,
`transparent_hugepage=madvise`). A decode step also streams every weight once, and the hardware prefetchers
stop at each 4 KiB page boundary: the packed weights kept by the GEMM planner live in huge pages too
(:class:`Arena`, which carves many weights out of shared mappings so none rounds up to a page of its own):
single-stream decode 1.13x with bfloat16 weights, no measurable change with float32; the quantised panels with
their scales 1.08-1.16x, the greedy head screen 1.02-1.03x (docs/BENCHMARKS.md).
Where THP is off, or not Linux, these are ordinary allocations.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, prefault: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is an anonymous mapping advised MADV_HUGEPAGE, 2 MiB aligned. The
    mapping lives as long as the tensor (the tensor holds the mmap object). ``prefault``: write one byte of
    every page now, so the page faults (a VM's are slow: ~3 s per GiB measured here) happen here, not in
    whatever first writes the memory."""
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)  # torch.zeros writes every page
    size = (nbytes + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # room to align the start
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advice)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = (-addr) % HUGE_PAGE
    # anonymous mappings are zero-filled; the pages (huge ones where possible) appear on first write
    t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
    if prefault:
        touch(t)
    return t


def touch(t: torch.Tensor) -> None:
    """Write a zero to the first byte of every 4 KiB page of contiguous ``t`` (which holds zeros)."""
    t.view(-1).view(torch.uint8)[::4096].zero_()


class Arena:
    """Tensors carved one after another out of huge-page-backed mappings of ``chunk_bytes`` (a tensor larger
    than that gets a mapping of its own). A carved tensor keeps its mapping alive; the unused tail of a chunk
    is never written, so it costs address space, not memory."""

    def __init__(self, chunk_bytes: int = 64 << 20, align: int = 64) -> None:
        self.chunk_bytes, self.align = chunk_bytes, align
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised (in practice zero: fresh anonymous pages) contiguous tensor."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            start = -(-self._used // self.align) * self.align
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk = zeros((max(self.chunk_bytes, nbytes),), torch.uint8)
                start = 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes].view(dtype).view(shape)
