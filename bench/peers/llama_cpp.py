"""llama.cpp's ``llama-server`` (parallel slots, continuous batching) as a peer.

The server is built from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist (cmake), once, into
``~/.cache/inferq/llama.cpp``: ``python -m bench.peers.llama_cpp build``. The model is converted from the same
local HF directory with llama.cpp's own ``convert_hf_to_gguf.py`` (f32 or bf16, matching the run's dtype).
Requests are token ids (``/completion`` with a token-array prompt), greedy, ``ignore_eos``, ``n_predict`` per
request, sent concurrently so the server's slots batch them.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.workloads import Workload

SDIST = "llama-cpp-python"


def home() -> Path:
    from inferq.settings import Settings

    # next to the model cache (~/.cache/inferq by default)
    return Settings().model_cache_dir.parent / "llama.cpp"


def server_binary() -> Path | None:
    for p in (home() / "build" / "bin" / "llama-server", home() / "bin" / "llama-server"):
        if p.is_file():
            return p
    found = shutil.which("llama-server")
    return Path(found) if found else None


def source_dir() -> Path | None:
    hits = sorted(glob.glob(str(home() / "src" / "*" / "vendor" / "llama.cpp")))
    return Path(hits[-1]) if hits else None


def unavailable_reason() -> str | None:
    if server_binary() is None:
        return ("llama-server is not built (optional peer; build it once with `python -m bench.peers.llama_cpp "
                "build`, ~10 min of compiling on 2 cores)")
    if source_dir() is None or not (source_dir() / "convert_hf_to_gguf.py").exists():
        return "llama.cpp's convert_hf_to_gguf.py is missing (rebuild with `python -m bench.peers.llama_cpp build`)"
    return None


def build(jobs: int = 2, log=print) -> Path:
    """Download the llama-cpp-python sdist with pip and build llama-server from its vendored llama.cpp."""
    root = home()
    (root / "src").mkdir(parents=True, exist_ok=True)
    if source_dir() is None:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                            SDIST], check=True)
            (sdist,) = glob.glob(os.path.join(tmp, "*.tar.gz"))
            with tarfile.open(sdist) as tf:
                tf.extractall(root / "src")
    src = source_dir()
    if src is None:
        raise RuntimeError("the llama-cpp-python sdist has no vendor/llama.cpp")
    bdir = root / "build"
    log(f"building llama-server from {src}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(bdir), "--target", "llama-server", "llama-quantize", "-j", str(jobs)],
                   check=True)
    binary = server_binary()
    if binary is None:
        raise RuntimeError("llama-server did not build")
    return binary


# llama.cpp's quantised types compared with inferq's formats: q8_0 straight from the converter; q4_0 by
# llama-quantize from the f32 file; gguf-shipped: the file a GGUF-converted model came from (the default model's
# own Q4_1, the very blocks inferq's --quantization auto serves)
QUANTISED = ("q8_0", "q4_0", "gguf-shipped")


def _quantize(model_dir: Path, kind: str, out: Path, log=print) -> Path:
    binary = server_binary()
    tool = binary.parent / "llama-quantize" if binary is not None else None
    if tool is None or not tool.is_file():
        raise RuntimeError("llama-quantize is not built (rebuild with `python -m bench.peers.llama_cpp build`)")
    f32 = convert(model_dir, "float32", log=log)
    log(f"quantising {f32.name} to {kind.upper()}")
    subprocess.run([str(tool), str(f32), str(out.with_suffix(".tmp")), kind.upper()], check=True,
                   capture_output=True)
    out.with_suffix(".tmp").rename(out)
    return out


def convert(model_dir: Path, dtype: str, log=print) -> Path:
    """GGUF of ``model_dir`` in f32 / bf16 / q8_0 with llama.cpp's converter, q4_0 with llama-quantize, or the
    GGUF the model was converted from (``gguf-shipped``); cached next to the build."""
    if dtype == "gguf-shipped":
        from worker.model import gguf_source

        shipped = gguf_source(Path(model_dir))
        if shipped is None:
            raise RuntimeError(f"{model_dir} was not converted from a GGUF")
        return shipped
    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}[dtype]
    out = home() / "gguf" / f"{Path(model_dir).name}-{outtype}.gguf"
    if out.exists():
        return out
    if outtype == "q4_0":
        out.parent.mkdir(parents=True, exist_ok=True)
        return _quantize(Path(model_dir), outtype, out, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    assert src is not None
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    tmp = out.with_suffix(".tmp")
    log(f"converting {model_dir} to {out.name}")
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
                    "--outfile", str(tmp)], check=True, env=env, capture_output=True)
    tmp.rename(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, model_dir: Path, dtype: str, *, parallel: int = 16, threads: int = 2,
                 ctx_per_slot: int = 1024, log=print, startup_timeout: float = 300) -> None:
        binary = server_binary()
        if binary is None:
            raise RuntimeError(unavailable_reason())
        gguf = convert(Path(model_dir), dtype, log=log)
        self.parallel = parallel
        self.note = ""
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-np", str(parallel),
               "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
               "-b", "2048", "-ub", "512", "--no-webui"]
        try:
            self._start(cmd, startup_timeout)
        except RuntimeError as exc:
            if "exited" not in str(exc):
                raise
            # seen on an AMX Xeon: the vendored build segfaults loading any quantised GGUF with weight
            # repacking on; without it the server runs (and the result says so)
            log(f"llama-server exited at load; retrying with --no-repack ({str(exc)[-200:]})")
            self.note = "--no-repack (the repacked path crashed at load)"
            self._start([*cmd, "--no-repack"], startup_timeout)

    def _start(self, cmd: list[str], startup_timeout: float) -> None:
        import httpx

        self.port = _free_port()
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=900)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"llama-server exited: {self._log.read()[-2000:].decode(errors='replace')}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy")

    def _one(self, ids: list[int], n: int) -> list[int]:
        r = self.client.post("/completion", json={"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                                  "ignore_eos": True, "cache_prompt": False,
                                                  "return_tokens": True, "samplers": ["top_k"]})
        r.raise_for_status()
        return list(r.json().get("tokens") or [])

    def generate(self, workload: Workload) -> dict:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(workload.items)) as pool:
            outs = list(pool.map(lambda it: self._one(it.prompt_ids, it.max_tokens), workload.items))
        wall = time.perf_counter() - t0
        useful = sum(min(len(o), it.max_tokens) if o else it.max_tokens for o, it in zip(outs, workload.items, strict=False))
        return {"wall_s": wall, "output_tokens": useful, "prompt_tokens": workload.prompt_tokens, "outputs": outs}

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        print(build())
    else:
        print(json.dumps({"binary": str(server_binary()), "reason": unavailable_reason()}))
