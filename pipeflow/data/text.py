"""Character-level text from the `.py` files of Python's own standard library (no download), and random tokens."""
from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from torch.utils.data import Dataset


@lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int) -> bytes:
    """The first `max_bytes` bytes of the standard library's .py files, sorted by path: the same bytes on
    every rank and every run of one Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):  # top level only: no site-packages, no tests
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 1024:
        raise RuntimeError(f"found only {len(corpus)} bytes of .py files under {root}; the stdlib dataset needs more")
    return corpus


class StdlibText(Dataset):
    """Byte-level next-token prediction: item i is (bytes[i*L : i*L+L], bytes[i*L+1 : i*L+L+1]).

    `split` 'train' takes the first 90% of the corpus, 'val' the rest (a fixed, deterministic split).
    """

    def __init__(self, seq_len: int, *, split: str = "train", max_bytes: int = 4_000_000) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', found {split!r}")
        corpus = stdlib_corpus(max_bytes)
        cut = int(len(corpus) * 0.9)
        data = corpus[:cut] if split == "train" else corpus[cut:]
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"seq_len {seq_len} is longer than the {split} corpus ({len(self.tokens)} bytes)")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.seq_len
        return self.tokens[s:s + self.seq_len], self.tokens[s + 1:s + self.seq_len + 1]


class SyntheticTokens(Dataset):
    """Seeded random tokens whose target is the input shifted by one (learnable in part)."""

    def __init__(self, seq_len: int, vocab: int, *, size: int = 4096, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]
