"""What makes a saved checkpoint load anywhere: `config.json`'s `auto_map` and the small remote-code
files that plain transformers imports with `trust_remote_code=True` (`save_with_remote_code`), the
record of where the weights came from, and the tokenizer files copied beside them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..atomic import file_mode, write_atomic, write_text_atomic
from .checkpoint_dir import resolve_directory

# file -> (the module of the installed package it re-exports, the class, the Auto class it serves)
REMOTE_CODE = {
    "configuration_forecastkv.py": ("forecastkv.modeling.configuration", "ForecastKVConfig", "AutoConfig"),
    "modeling_forecastkv.py": ("forecastkv.modeling.modeling", "ForecastKVForCausalLM", "AutoModelForCausalLM"),
}


REMOTE_CODE_TEXT = '''"""{cls} for `trust_remote_code=True` loading.

The code is not copied here: this file imports it from the installed `forecastkv` package
(`pip install forecastkv`), so a directory written by `save_pretrained` / `forecastkv convert` loads
with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in any process.
"""

from {module} import {cls}

__all__ = ["{cls}"]
'''


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def auto_map() -> dict[str, str]:
    """config.json's `auto_map`: each Auto class -> "<module file stem>.<class>" of `REMOTE_CODE`."""
    return {auto: f"{file[: -len('.py')]}.{cls}" for file, (_, cls, auto) in REMOTE_CODE.items()}


def save_with_remote_code(model, save, directory, *args, **kwargs):
    """Run transformers' `save(directory, ...)` for `model`, then add what plain transformers needs
    to load the directory: the `REMOTE_CODE` modules and `auto_map` in config.json.

    A model loaded through `trust_remote_code` has its classes registered for the Auto classes,
    which would make transformers copy the package's own source files beside the weights; that is
    switched off for the call (the modules written here import the installed package instead)."""
    classes = (type(model), type(model.config))
    registered = [cls.__dict__.get("_auto_class", None) for cls in classes]
    for cls in classes:
        cls._auto_class = None
    try:
        result = save(directory, *args, **kwargs)
    finally:
        for cls, value in zip(classes, registered):
            if value is None:
                del cls._auto_class  # back to the inherited None
            else:
                cls._auto_class = value
    directory = Path(directory)
    for file, (module, cls, _) in REMOTE_CODE.items():
        write_text_atomic(directory / file, REMOTE_CODE_TEXT.format(module=module, cls=cls))
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    raw["auto_map"] = auto_map()
    write_text_atomic(config_file, json.dumps(raw, indent=2, sort_keys=True) + "\n")
    mode = file_mode()
    for weights in directory.glob("*.safetensors"):  # safetensors writes them 0600, the other files get the umask's
        weights.chmod(mode)
    source = getattr(model, "source_directory", None)
    if source is not None and Path(source).resolve() != directory.resolve():
        copy_tokenizer_files(source, directory, replace=False)  # a served directory needs its tokenizer
    return result


def record_source(model, directory: Path):
    """Remember the directory `model` was loaded from: `save_pretrained` copies its tokenizer files."""
    model.source_directory = directory
    return model


def copy_tokenizer_files(source: str | os.PathLike, target: str | os.PathLike, replace: bool = True) -> list[str]:
    """Copy the tokenizer files of checkpoint `source` (a directory or hub id) into `target`,
    atomically, byte for byte (replace=False: keep those `target` has, e.g. from a
    `tokenizer.save_pretrained`).  Returns the names copied (empty: the source has no tokenizer)."""
    import shutil

    directory = resolve_directory(source)
    copied = []
    for name in TOKENIZER_FILES:
        if (directory / name).is_file() and (replace or not (Path(target) / name).exists()):
            write_atomic(Path(target) / name, lambda tmp, src=directory / name: shutil.copyfile(src, tmp))
            copied.append(name)
    return copied
