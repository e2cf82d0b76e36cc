"""UTF-8 bytes as token ids: the tokenizer of tiny test models that ship none.

One implementation for training (`forecastkv.training.data.ByteTokenizer`, `data.tokenizer:
"bytes"`) and evaluation (`forecastkv.eval.codec.ByteCodec`, `tokenizer: bytes`).  This module
imports nothing, so training need not import the eval package (nor eval the training one).
"""

from __future__ import annotations

from typing import Sequence


class ByteCodec:
    """UTF-8 bytes as token ids (each byte mod `vocab_size`); ids below 128 decode back to ASCII.

    eos_token_id: what packing appends after each document (`training.data.tokenize_documents`)
    and generation stops at; None for none.  Eval passes the model config's (an id or a list),
    training's `ByteTokenizer` 0.
    """

    def __init__(self, vocab_size: int = 256, eos_token_id: int | None = None) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"ByteCodec vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.name = f"bytes-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        """Ids of `text`'s UTF-8 bytes, one per byte (no special tokens)."""
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` (each taken mod 256 as a byte; invalid UTF-8 becomes U+FFFD)."""
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")
