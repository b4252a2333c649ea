"""Build and load the small C kernels of the CPU path (decode attention, packed GEMM).

Each kernel's C source is compiled once per machine with the system C compiler (``cc -O3 -march=native
-fopenmp``, about a second) into ``~/.cache/inferq/kernels/``, keyed by a hash of the source, the flags and
the CPU's flags, and loaded with ctypes: no torch headers and no build step at install time. The libraries
link ``libgomp.so.1``, which resolves to the copy torch already loaded, so they share torch's OpenMP threads
and its ``torch.set_num_threads``. Where no compiler is found or the build fails, :func:`build` returns None
and the caller keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    return Path.home() / ".cache" / "inferq" / "kernels"


def build(name: str, source: str) -> ctypes.CDLL | None:
    """Compile ``source`` (once per machine) and load it; None, with the reason logged, where that fails."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler found: %s uses the torch path", name)
        return None
    key = hashlib.sha256("\0".join([source, " ".join(FLAGS), cc, cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    lib_path = out_dir / f"{name}_{key}.so"
    if not lib_path.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                tmp_lib = Path(tmp) / f"{name}.so"
                proc = subprocess.run([cc, *FLAGS, str(src), "-o", str(tmp_lib), "-lm"],
                                      capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    log.warning("building %s failed (torch path used): %s", name, proc.stderr.strip()[-2000:])
                    return None
                os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building %s failed (torch path used): %s", name, exc)
            return None
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as exc:
        log.warning("loading %s failed (torch path used): %s", name, exc)
        return None
