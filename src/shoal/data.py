"""Data for the bundled models, made in code from what every Python install has (nothing downloaded).

``CharData``: the characters of the Python standard library's own source files, as next-token
batches (GPT) or masked-language-model batches (BERT). ``Stripes``: synthetic images of oriented
stripes in noise, one class per orientation (ResNet).
"""

from __future__ import annotations

import functools
import math
import re
import sysconfig
from pathlib import Path

import torch

from .models.bert import IGNORE

__all__ = ["CharData", "Stripes", "stdlib_text"]

MAX_BYTES = 1_000_000


@functools.lru_cache(maxsize=4)
def stdlib_text(max_bytes: int = MAX_BYTES) -> str:
    """The first ``max_bytes`` characters of the stdlib's top-level ``*.py`` files in name order,
    as printable ASCII (tabs become four spaces, other characters outside it are dropped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for f in sorted(root.glob("*.py")):
        s = f.read_text(encoding="utf-8", errors="replace").replace("\t", "    ")
        s = re.sub(r"[^\n -~]", "", s)
        parts.append(s)
        n += len(s)
        if n >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"CharData: no *.py files in the stdlib directory {root}")
    return "".join(parts)[:max_bytes]


class CharData:
    """Character-level text: a vocabulary of the characters that occur, and a train/val split.

    ``mask_id`` (== ``vocab_size``) is one extra token for masked-LM inputs: a BERT's vocabulary is
    ``vocab_size + 1``.
    """

    def __init__(self, max_bytes: int = MAX_BYTES, val_fraction: float = 0.1):
        text = stdlib_text(max_bytes)
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.mask_id = self.vocab_size
        self._lookup = torch.zeros(128, dtype=torch.long)
        self._lookup[[ord(c) for c in self.chars]] = torch.arange(self.vocab_size)
        data = self.encode(text)
        n = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:n], data[n:]

    def encode(self, s: str) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(s.encode("ascii")), dtype=torch.uint8)
        return self._lookup[raw.long()]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < self.vocab_size else "_" for i in torch.as_tensor(ids).tolist())

    def _windows(self, split: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        data = {"train": self.train, "val": self.val}[split]
        if len(data) <= length:
            raise ValueError(f"CharData: the {split} split has {len(data)} characters, too few for length {length}")
        start = torch.randint(len(data) - length, (batch,), generator=gen)
        return data[start[:, None] + torch.arange(length)]

    def batch(self, split: str, batch: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token prediction: inputs (batch, block) and the same windows shifted by one."""
        w = self._windows(split, batch, block + 1, gen)
        return w[:, :-1], w[:, 1:]

    def masked_batch(
        self, split: str, batch: int, block: int, gen: torch.Generator, p: float = 0.15
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked LM (BERT): a fraction ``p`` of positions is picked; of those 80% become ``mask_id``,
        10% a random character and 10% stay. Targets: the original character there, ``IGNORE`` elsewhere."""
        x = self._windows(split, batch, block, gen)
        pick = torch.rand(x.shape, generator=gen) < p
        if not pick.any():  # at least one target, so the loss is defined
            pick.view(-1)[0] = True
        y = torch.where(pick, x, IGNORE)
        r = torch.rand(x.shape, generator=gen)
        noise = torch.randint(self.vocab_size, x.shape, generator=gen)
        x = torch.where(pick & (r < 0.8), self.mask_id, x)
        x = torch.where(pick & (r >= 0.8) & (r < 0.9), noise, x)
        return x, y


class Stripes:
    """Images (channels, size, size) of stripes in noise; class k has its stripes at angle k * pi / classes
    (plus a little jitter). Frequency, phase, colour and noise are random: only the orientation tells."""

    def __init__(self, classes: int = 6, size: int = 32, channels: int = 3, noise: float = 0.5):
        self.classes, self.size, self.channels, self.noise = classes, size, channels, noise

    def batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (batch, channels, size, size) float32 and labels (batch,) int64."""
        y = torch.randint(self.classes, (batch,), generator=gen)
        u = lambda *shape: torch.rand(*shape, generator=gen)
        angle = (y + (u(batch) - 0.5) * 0.5) * math.pi / self.classes
        freq = 2 + 3 * u(batch)  # cycles across the image
        phase = 2 * math.pi * u(batch)
        grid = torch.arange(self.size, dtype=torch.float32) / self.size
        yy, xx = torch.meshgrid(grid, grid, indexing="ij")
        along = angle.cos()[:, None, None] * xx + angle.sin()[:, None, None] * yy
        wave = torch.sin(2 * math.pi * freq[:, None, None] * along + phase[:, None, None])
        colour = 0.5 + u(batch, self.channels)
        x = colour[:, :, None, None] * wave[:, None] + self.noise * torch.randn(
            batch, self.channels, self.size, self.size, generator=gen
        )
        return x, y
