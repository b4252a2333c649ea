"""Shared benchmark helpers: machine description, model resolution, percentiles, result files, tables."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from kernels.native import cpu_model  # noqa: F401 - re-exported: the benchmarks' machine line

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info(dtype: str | Sequence[str] | None = None) -> dict:
    """CPU model, cores, torch/transformers versions and the dtype(s) of the run."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory_gib": _mem_gib(),
        "isa": sorted(f for f in cpu_flags() if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile",
                                                      "avx512_fp16", "avx_vnni"}),
        "cuda": torch.cuda.is_available(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    if dtype is not None:
        info["dtype"] = dtype
    info["code"] = code_version()
    return info


def code_version() -> dict:
    """The commit and the modified engine files: the engine changes under the benchmarks while it is tuned."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        changed = sorted(line[3:] for line in dirty if line[3:] and not line[3:].startswith(("bench/", "tests/",
                                                                                           "docs/")))
        return {"commit": head, "modified": changed}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def machine_line(info: dict) -> str:
    return (f"machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads), "
            f"torch {info['torch']}, transformers {info.get('transformers', '?')}, dtype {info.get('dtype', '?')}")


def resolve_model_dir(model: str | None) -> Path:
    """A local HF directory for ``model`` (a name known to ``worker.loader`` or a path)."""
    from inferq.settings import Settings

    settings = Settings()
    name = model or settings.model
    p = Path(name).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    from worker.loader import resolve_model  # lands with the engine

    return Path(resolve_model(name, settings))


def percentile(values: Iterable[float], q: float) -> float | None:
    v = sorted(x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not v:
        return None
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(v) - 1)
    return v[f] + (v[c] - v[f]) * (k - f)


def mean(values: Iterable[float]) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def results_dir(out: str | Path | None) -> Path:
    d = Path(out) if out else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(out_dir: Path, stem: str, data: dict) -> Path:
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def save_figure(fig, out_dir: Path, stem: str) -> Path:
    path = out_dir / f"{stem}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:,.{digits}f}"
    return str(v)


def table(rows: list[dict], columns: list[tuple[str, str]] | None = None, digits: int = 2) -> str:
    """A Markdown table of ``rows`` with ``columns`` as (key, header) pairs."""
    if not rows:
        return "(no rows)"
    columns = columns or [(k, k) for k in rows[0]]
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), digits) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def target_line(name: str, target: str, measured: float | None, ok: bool | None) -> str:
    verdict = "n/a" if ok is None else ("MET" if ok else "MISSED")
    m = "-" if measured is None else f"{measured:.3g}"
    return f"target vs measured: {name}: target {target}, measured {m} -> {verdict}"


def finish_run(result: dict, *, t_start: float, load_start, out, tag: str, plot, report, log) -> dict:
    """A service benchmark's last steps: elapsed time and load averages recorded, the JSON and the plot
    written, the report logged."""
    result["elapsed_s"] = time.perf_counter() - t_start
    result["loadavg_start"], result["loadavg_end"] = load_start, os.getloadavg()
    out_dir = results_dir(out)
    write_json(out_dir, tag, result)
    plot(result, out_dir, tag)
    log(report(result))
    return result


def target_lines(targets: list[dict]) -> list[str]:
    """A benchmark's ``targets`` (dicts of target, measured, met) as report lines."""
    return [target_line(t["target"], "", t["measured"], t["met"]).replace("target , ", "") for t in targets]


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
