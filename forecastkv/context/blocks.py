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
import os
from dataclasses import dataclass

import torch

from ..modeling.cache import model_signature
from .disk import block_hash, identity_root  # noqa: F401 (the names of blocks live beside the disk format, torch-free)

HASH_PIECE = 64 << 20  # bytes of a tensor hashed per piece (a device tensor is copied to the host piece by piece)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes in its own dtype, row-major (every byte, no sampling)."""
    if tensor.device.type == "meta":
        raise ValueError("model_identity needs the weights: this model has tensors on the meta device (not loaded)")
    flat = tensor.detach().reshape(-1)
    digest = hashlib.sha256()
    step = max(1, HASH_PIECE // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        if piece.device.type != "cpu":
            piece = piece.to("cpu")
        digest.update(piece.contiguous().view(torch.uint8).numpy())  # hashlib drops the GIL on large buffers
    return digest.hexdigest()


def weights_digest(model) -> str:
    """sha256 over every parameter's and buffer's name, dtype, shape and every byte of its values.

    Exact: any change of any element (a LoRA merge, a requantised tensor) changes it.  Tensors are
    hashed in parallel threads (hashlib releases the GIL), then combined in `named_parameters` /
    `named_buffers` order, so the digest is the same in every process.  Cost: one pass over the
    weights (benchmarks/context_identity.py measures it)."""
    from concurrent.futures import ThreadPoolExecutor

    named = [("parameter", name, t) for name, t in model.named_parameters()] + [
        ("buffer", name, t) for name, t in model.named_buffers()
    ]
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda item: tensor_sha256(item[2]), named))
    combined = hashlib.sha256()
    for (kind, name, tensor), digest in zip(named, digests):
        combined.update(f"{kind} {name} {dtype_name(tensor.dtype)} {tuple(tensor.shape)} {digest}\n".encode())
    return combined.hexdigest()


# config fields that change the K/V of a token beyond the weights and the geometry
CONFIG_FIELDS = (
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "mup",
    "max_position_embeddings",
    "num_attention_heads",
    "intermediate_size",
    "attention_bias",
    "mlp_bias",
)


def config_digest(config) -> str:
    """sha256 of the config fields that shape a prefill besides the weights (RoPE, norm eps, muP...)."""
    fields = {}
    for key in CONFIG_FIELDS:
        value = getattr(config, key, None)
        fields[key] = value.to_dict() if hasattr(value, "to_dict") else value
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()


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
        "model": {
            "weights": weights_digest(model),
            "config": config_digest(config),
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
        },
        "geometry": geometry,
        "dtype": {"kv": dtype_name(dtype), "cis": dtype_name(dtype) if with_cis else None},
    }


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
