"""A byte-level tokenizer: no vocabulary file, no download, any UTF-8 instruction (the reference policy's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET


def tokenize(text: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(ids, mask)`` of length ``max_len``; text longer than fits is cut before EOS."""
    body = [b + BYTE_OFFSET for b in text.encode("utf-8")][: max_len - 2]
    ids = [BOS_ID, *body, EOS_ID]
    out = torch.full((max_len,), PAD_ID, dtype=torch.long)
    out[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(max_len, dtype=torch.bool)
    mask[: len(ids)] = True
    return out, mask


def detokenize(ids: torch.Tensor) -> str:
    raw = bytes(int(i) - BYTE_OFFSET for i in ids.tolist() if int(i) >= BYTE_OFFSET)
    return raw.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ByteTokenizer:
    """``tokenize`` at a fixed length, as a picklable callable (it travels into dataloader workers)."""

    max_len: int

    def __call__(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize(text, self.max_len)

    def encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize(text, self.max_len)
