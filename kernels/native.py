"""Build and load the small C kernels of the CPU path (decode and prefill attention, packed GEMM).

The C sources live in ``kernels/csrc/`` (package data, so an installed wheel has them too): one ``.c`` per op
and ``simd.h``, the helpers they share. :func:`build` compiles a library from some of them once per machine with
the system C compiler (``cc -O3 -march=native -fopenmp -Wall -Wextra``, a second or two) into
``~/.cache/inferq/kernels/``, keyed by a hash of every source and header, the flags, the defines, the compiler
and the CPU's flags, installs it atomically and loads it with ctypes: no torch headers and no build step at
install time. The libraries link ``libgomp.so.1``, which resolves to the copy torch already loaded, so they
share torch's OpenMP threads and ``torch.set_num_threads``. Where no compiler is found or the build fails,
:func:`build` returns None (the reason logged) and the caller keeps its pure-torch path.

Build options, ``build(name, sources, defines={...})`` (``-D`` macros read by ``csrc/simd.h``; the instruction
sets themselves come from the compiler's own macros under ``-march=native``):

- ``INFERQ_NO_AVX512``: leave the AVX-512 code out even on an AVX-512 CPU, i.e. the build an AVX2-only CPU
  gets (tests and side-by-side timings of the AVX2 paths).
- ``INFERQ_NO_AVX2``: leave every vector path out (the attention kernels keep their portable loops; the
  packed GEMM, which has none, then fails to build).
- ``INFERQ_NO_SPLIT_K`` (packed GEMM): one accumulator set per row tile even for decode-sized tiles, the
  before of the split-k change, for side-by-side timings (``bench/latency.py``'s weights-alone pass).

The attention kernels also switch paths at run time (``cpu_attention.use_avx512`` / ``use_generic``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-Wall", "-Wextra")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA, which the GEMM kernels need (they have no portable path)."""
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def cache_dir() -> Path:
    return Path.home() / ".cache" / "inferq" / "kernels"


def source_dir() -> Traversable:
    """``kernels/csrc`` of the installed package."""
    return importlib.resources.files("kernels") / "csrc"


def _define_flags(defines: Mapping[str, object] | None) -> list[str]:
    return [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]


def _texts(sources: Sequence[str]) -> dict[str, str]:
    """Every file a build reads: the named sources and all headers of csrc (any of them may be included)."""
    src = source_dir()
    headers = sorted(f.name for f in src.iterdir() if f.name.endswith(".h"))
    return {name: (src / name).read_text() for name in [*sources, *headers]}


def build(name: str, sources: Sequence[str], defines: Mapping[str, object] | None = None) -> ctypes.CDLL | None:
    """Compile the csrc files ``sources`` into one library (once per machine and content) and load it; None,
    with the reason logged, where that fails. ``defines``: ``-D`` macros (value None: a bare ``-DNAME``)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler found: %s uses the torch path", name)
        return None
    try:
        texts = _texts(sources)
    except OSError as exc:
        log.warning("reading the sources of %s failed (torch path used): %s", name, exc)
        return None
    dflags = _define_flags(defines)
    parts = [f"{n}\0{t}" for n, t in texts.items()] + [" ".join(FLAGS), " ".join(dflags), cc, cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"{name}_{key}.so"
    if not lib_path.exists():
        started = time.monotonic()
        log.info("building C kernels %s (once per machine; cached in %s)", name, lib_path.parent)
        if not _compile(name, cc, sources, texts, dflags, lib_path):
            return None
        log.info("built C kernels %s in %.1f s", name, time.monotonic() - started)
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as exc:
        log.warning("loading %s failed (torch path used): %s", name, exc)
        return None


def _compile(name: str, cc: str, sources: Sequence[str], texts: dict[str, str], dflags: list[str],
             lib_path: Path) -> bool:
    try:
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            src = source_dir()
            if not isinstance(src, Path):  # csrc inside a zip: compile copies (diagnostics then name the copies)
                src = Path(tmp)
                for fname, text in texts.items():
                    (src / fname).write_text(text)
            tmp_lib = Path(tmp) / f"{name}.so"
            cmd = [cc, *FLAGS, *dflags, "-I", str(src), *(str(src / s) for s in sources), "-o", str(tmp_lib), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                log.warning("building %s failed (torch path used): %s", name, proc.stderr.strip()[-2000:])
                return False
            if proc.stderr.strip():
                log.warning("building %s: compiler warnings: %s", name, proc.stderr.strip()[-2000:])
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building %s failed (torch path used): %s", name, exc)
        return False
