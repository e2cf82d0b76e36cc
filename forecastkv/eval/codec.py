"""Text <-> token ids for any tokenizer the harness is given.

`TextCodec` wraps a Hugging Face tokenizer (`encode` without special tokens, `decode` skipping
them); `ByteCodec` maps UTF-8 bytes to ids (mod `vocab_size`) for tiny test models (re-exported
from `forecastkv.bytes_codec`, the implementation training shares).
"""

from __future__ import annotations

from typing import Sequence

from forecastkv.bytes_codec import ByteCodec

__all__ = ["ByteCodec", "TextCodec", "as_codec"]


class TextCodec:
    """A Hugging Face tokenizer without its special tokens (the harness adds none)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def as_codec(tokenizer) -> "TextCodec | ByteCodec":
    """A codec for `tokenizer`: a codec passes through, anything else is wrapped as a HF tokenizer."""
    if isinstance(tokenizer, (TextCodec, ByteCodec)):
        return tokenizer
    return TextCodec(tokenizer)
