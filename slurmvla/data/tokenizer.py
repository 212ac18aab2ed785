"""A byte-level tokenizer: no vocabulary file, no download, any UTF-8 instruction."""

from __future__ import annotations

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
