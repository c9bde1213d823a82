"""ResNet: a small CIFAR-style residual network with BatchNorm, and its parallel plans.

A 3x3 stem, three stages of basic blocks (width w, 2w, 4w; the later two halve the resolution),
global average pooling and a linear classifier. Plain single-device torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Mesh
from ..parallel import Plan
from ..sbp import S
from . import kinds

__all__ = ["ResNetConfig", "ResNet", "plans"]


@dataclass(frozen=True)
class ResNetConfig:
    num_classes: int = 6
    width: int = 16
    blocks: tuple[int, ...] = (2, 2, 2)  # basic blocks per stage
    in_channels: int = 3


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.stem = nn.Sequential(nn.Conv2d(cfg.in_channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        stages, c_in = [], w
        for i, n in enumerate(cfg.blocks):
            c_out = w * 2**i
            blocks = []
            for j in range(n):  # the first block of every stage but the first halves the resolution
                blocks.append(BasicBlock(c_in, c_out, stride=2 if i > 0 and j == 0 else 1))
                c_in = c_out
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """Class logits (B, classes) for images (B, C, H, W), and the cross entropy if ``targets`` given."""
        h = self.stages(self.stem(x))
        logits = self.fc(h.mean((2, 3)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits, targets)


def plans(mesh: Mesh, kind: str) -> Plan:
    """How a ResNet is laid out on ``mesh`` for plan ``kind`` (dp, tp, dp,tp or zero; see ``kinds``).

    Data parallel splits the batch; BatchNorm still normalizes by the statistics of the whole batch
    (its global meaning). Tensor parallel pairs the two convolutions of each basic block the Megatron
    way: conv1 split on its output channels (exact: each device computes its own channels), with
    bn1's per-channel parameters and running statistics split alike, and conv2 split on its input
    channels, so its output is a partial sum, reduced once before bn2.
    """
    ax = kinds.axes(mesh, kind)
    params = {}
    if ax.tp is not None:
        out_ch, in_ch = ax.layout(tp=S(0)), ax.layout(tp=S(1))
        params = {
            "stages.*.conv1.weight": out_ch,
            "stages.*.bn1.weight": out_ch,
            "stages.*.bn1.bias": out_ch,
            "stages.*.bn1.running_mean": out_ch,
            "stages.*.bn1.running_var": out_ch,
            "stages.*.conv2.weight": in_ch,
        }
    return Plan(params=params, inputs={"": ax.layout(dp=S(0))}, zero=kinds.ZERO.get(kind, 0))
