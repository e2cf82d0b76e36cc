"""Section-by-section merging of recipes and suites (YAML or dict settings)."""

from __future__ import annotations

import copy


def deep_merge(
    base: dict, override: dict | None, *, strict: bool = False, opaque: tuple[str, ...] = (), where: str = ""
) -> dict:
    """A deep copy of `base` with `override` merged in, nested dicts section by section.

    strict: a key of `override` that `base` lacks is an error naming its dotted path and the
    allowed keys.  opaque: keys whose dict values replace the base's whole (a model config or a
    sparse_config is one value, not a section).  where: the dotted prefix of `base` in errors.
    """
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if strict and key not in base:
            raise ValueError(f"unknown recipe key {where + key!r}; allowed: {sorted(base)}")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in opaque:
            out[key] = deep_merge(out[key], value, strict=strict, opaque=opaque, where=f"{where}{key}.")
        else:
            out[key] = copy.deepcopy(value)
    return out
