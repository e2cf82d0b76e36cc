"""Text <-> token ids for any tokenizer the harness is given.

`TextCodec` wraps a Hugging Face tokenizer (`encode` without special tokens, `decode` skipping
them); `ByteCodec` maps UTF-8 bytes to ids (mod `vocab_size`) for tiny test models.
"""

from __future__ import annotations

from typing import Sequence


class ByteCodec:
    """UTF-8 bytes as token ids (mod `vocab_size`); ids below 128 decode back to ASCII."""

    def __init__(self, vocab_size: int = 256, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.name = f"bytes-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


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
