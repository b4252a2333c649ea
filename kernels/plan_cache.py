"""Kernel plans measured once per machine and kept on disk, so every process on a host runs the same forms.

Why: ``cpu_gemm.plan`` and ``quant_gemm.plan`` time each weight shape's layout and per-bucket form when a model
loads: 3-4 s of a 4-8 s SmolLM2 load on 2 cores, paid again by every worker start. And on a busy machine their
near-ties fall differently in different processes: the same shapes were planned to different layouts in a
benchmark's process and in the worker beside it, so the two ran different kernels. A plan is a fact about this
CPU, these kernels and this thread count, and the file is keyed by exactly that: the CPU model and its flags,
torch's version, and a digest of the kernels' sources (``kernels/``: planners and C alike); the thread count is
part of each plan's own key. Anything else gets a file of its own, measured afresh.

One JSON file per fingerprint; a write merges with what is on disk and replaces the file atomically, so workers
starting together lose at most a plan, which the next load measures again. ``use(None)`` turns it off (each
process measures, as without it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from kernels.native import cpu_flags, cpu_model

_KERNELS = Path(__file__).resolve().parent
_lock = threading.Lock()
_active: PlanCache | None = None


class PlanCache:
    """The plans of one machine fingerprint: ``{planner: {key: plan}}`` in ``<dir>/<fingerprint>.json``."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"{fingerprint()}.json"
        self._plans = self._read()

    def get(self, planner: str, key: tuple) -> Any | None:
        return self._plans.get(planner, {}).get(repr(key))

    def put(self, planner: str, key: tuple, plan: Any) -> None:
        """Record ``plan``, merged with the file as it is now (another process may have written since)."""
        merged = self._read()
        for name, plans in self._plans.items():
            merged.setdefault(name, {}).update(plans)
        merged.setdefault(planner, {})[repr(key)] = plan
        self._plans = merged
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plans-")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full disk: the plan still holds for this process
            pass

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or torn by hand: measure again
            return {}
        return data if isinstance(data, dict) else {}


def fingerprint() -> str:
    """What a plan depends on besides its shape and threads: the CPU, torch, and the kernels' sources."""
    import torch

    h = hashlib.sha256()
    h.update(cpu_model().encode())
    h.update(" ".join(sorted(cpu_flags().split())).encode())
    h.update(torch.__version__.encode())
    for path in sorted(p for p in _KERNELS.rglob("*") if p.suffix in (".py", ".c", ".h")):
        h.update(path.relative_to(_KERNELS).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def use(directory: Path | None) -> None:
    """Plans from now on are looked up in (and added to) ``directory``'s file for this machine; None: none."""
    global _active
    with _lock:
        if directory is None:
            _active = None
        elif _active is None or _active.path.parent != Path(directory):
            _active = PlanCache(Path(directory))


def active() -> bool:
    """Whether plans are kept in a file (shared by this machine's processes) rather than measured per process."""
    with _lock:
        return _active is not None


def lookup(planner: str, key: tuple) -> Any | None:
    with _lock:
        return _active.get(planner, key) if _active is not None else None


def store(planner: str, key: tuple, plan: Any) -> None:
    with _lock:
        if _active is not None:
            _active.put(planner, key, plan)
