"""Character-level corpora: tiny Shakespeare (90/10 split) or WikiText-2 (valid.txt to train on,
test.txt held out). Copies live in data/ (see data/README.md for provenance)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
DEFAULT_DATA = DATA_DIR / "tinyshakespeare" / "input.txt"


@dataclass
class Corpus:
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor
    vocab: list[str]
    name: str
    path: str = ""  # where it was read from (recorded in checkpoints: inspection names Engram slots by its n-grams)
    digest: str = ""  # text_digest of its texts (recorded in checkpoints: a resume on another text is refused)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def read_texts(path: str | Path | None = None) -> tuple[Path, str, str]:
    """(the path, the training text, the validation text) of a text file (split 90/10) or a
    WikiText-2 folder (valid.txt / test.txt)."""
    p = Path(path) if path else DEFAULT_DATA
    if p.is_dir():
        if not ((p / "valid.txt").exists() and (p / "test.txt").exists()):
            raise FileNotFoundError(f"--data: folder {p} needs valid.txt and test.txt (WikiText-2 layout)")
        return p, (p / "valid.txt").read_text(), (p / "test.txt").read_text()
    if p.exists():
        text = p.read_text()
        cut = int(0.9 * len(text))
        return p, text[:cut], text[cut:]
    raise FileNotFoundError(f"--data: no such file or folder: {p}")


def text_digest(train_text: str, val_text: str) -> str:
    """What tells two texts apart where their paths cannot (a text moved, another one at the same
    path): a resume compares it, the vocabulary alone let a run go on over another text."""
    return hashlib.sha256(f"{len(train_text)}:{train_text}{val_text}".encode()).hexdigest()[:32]


def load_corpus(path: str | Path | None = None) -> Corpus:
    """A text file (split 90/10) or a WikiText-2 folder (valid.txt / test.txt), as characters."""
    p, train_text, val_text = read_texts(path)
    vocab = sorted(set(train_text) | set(val_text))
    index = {ch: i for i, ch in enumerate(vocab)}

    def encode(s: str) -> torch.Tensor:
        return torch.tensor([index[c] for c in s], dtype=torch.int64)

    return Corpus(encode(train_text), encode(val_text), vocab, p.name, str(p.resolve()),
                  text_digest(train_text, val_text))


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of block_size tokens and their next-token targets."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    offs = torch.arange(block_size)
    x = data[starts[:, None] + offs]
    y = data[starts[:, None] + offs + 1]
    return x, y
