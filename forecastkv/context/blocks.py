"""Content-addressed KV blocks: what identifies a block, and moving blocks out of and into caches.

A block is `block_size` consecutive positions of one sequence, every layer's K/V (and NOSA's CIS):
keys, values [L, bs, H, d], cis [L, bs, H] or None.  It is named by a chained hash, vLLM's scheme:

    hash(block i) = sha256(hash(block i-1) or the root, token ids of block i)

so a name covers every token up to and including its block.  The root hashes the `identity`: what
the K/V of a token depend on besides the tokens (the weights, the selection geometry, the selector
that routed the prefill, the dtype).  Two stores that agree on the identity name the same block
the same way; any difference names it differently, so a block can never serve another model.

`layer_rows` copies a cache layer's rows out (to store them); a `ContextStore` keeps them in its
per-layer host pools and hands them to caches (store.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from ..modeling.cache import model_signature

SAMPLES_PER_TENSOR = 4096  # weight elements hashed per parameter: cheap on an 8B model, any retrain changes them


def weights_digest(model) -> str:
    """sha256 of every parameter's name, shape and an evenly strided sample of its values (fp32),
    so two checkpoints of one architecture (or another set of Forecast heads) differ."""
    digest = hashlib.sha256()
    for name, tensor in model.named_parameters():
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(flat[::stride].float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def model_identity(model, selector: str | None) -> dict:
    """What a stored block must agree on with the cache it fills, in three named parts:
    model (the weights), geometry (layers, KV heads, head_dim, the sparse config, the selector
    whose routing computed the prefill's K/V) and dtype (of K/V and of the CIS)."""
    config = model.config
    sparse = config.sparse
    dtype = next(model.parameters()).dtype
    geometry = dict(model_signature(config))
    geometry["sparse_config"] = None if sparse is None else sparse.to_dict()
    geometry["selector"] = selector if sparse is not None else None
    with_cis = sparse is not None and sparse.policy == "nosa"
    return {
        "model": {"weights": weights_digest(model), "vocab_size": config.vocab_size, "hidden_size": config.hidden_size},
        "geometry": geometry,
        "dtype": {"kv": dtype_name(dtype), "cis": dtype_name(dtype) if with_cis else None},
    }


def identity_root(identity: dict) -> str:
    """The root of the hash chain: sha256 of the identity's canonical JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def block_hash(parent: str, tokens: list[int]) -> str:
    """The name of a block: sha256 over its parent's name and its token ids (int64 little-endian)."""
    digest = hashlib.sha256(parent.encode())
    digest.update(torch.tensor(tokens, dtype=torch.int64).numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def chain_hashes(root: str, ids: list[int], block_size: int, blocks: int) -> list[str]:
    """Names of the first `blocks` full blocks of `ids` (a list of token ids)."""
    names, parent = [], root
    for index in range(blocks):
        parent = block_hash(parent, ids[index * block_size : (index + 1) * block_size])
        names.append(parent)
    return names


def identity_differences(mine: dict, theirs: dict) -> list[str]:
    """Human-readable differences between two identities, part by part ("geometry: head_dim 16 vs 32")."""
    out = []
    for part in sorted(set(mine) | set(theirs)):
        a, b = mine.get(part) or {}, theirs.get(part) or {}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{part}: {key} {b.get(key)!r} (stored) vs {a.get(key)!r} (this model)")
    return out


@dataclass
class BlockRows:
    """One block's rows: keys, values [L, bs, H, d], cis [L, bs, H] or None (host tensors)."""

    keys: torch.Tensor
    values: torch.Tensor
    cis: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.cis) if t is not None)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer `index`'s rows: keys, values [bs, H, d], cis [bs, H] or None."""
        return self.keys[index], self.values[index], None if self.cis is None else self.cis[index]


def sequence_ids(ids) -> list[int]:
    """Token ids as a list: a 1-D tensor, a [1, T] tensor or a list.  A batch is refused."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"the context store takes one sequence at a time, got ids of shape {tuple(ids.shape)}")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]


def layer_rows(layer, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Positions [start, stop) of the one sequence a cache layer holds, copied to the host: keys,
    values [stop - start, H, d], cis [stop - start, H] or None (read through its public `full()`)."""
    keys, values, cis, _ = layer.full()
    return tuple(None if t is None else t[0, start:stop].to("cpu", copy=True) for t in (keys, values, cis))
