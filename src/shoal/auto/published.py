"""Published training runs the cost model is checked against (A100 80GB, 312 TFLOP/s bf16 peak,
vocabulary 51,200, sequence 2,048, dropout 0.1 as Megatron-LM's default).

``SC21``: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: full recomputation, their TP and PP, data parallel over the rest;
TFLOP/s per GPU by their count (``megatron_flops``). Issue 20 calibrates on four rows
(``calibration``); the other six are held out. ``KORTHIKANTI``: Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), Tables 3 and 5 (no data parallelism):
step seconds with full recomputation, and with sequence parallelism and selective recomputation
(and that run's model FLOPs utilization). Nothing here was fitted to but the calibration rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.gpt import GPT, GPTConfig

__all__ = ["Run", "Throughput", "Recomputation", "SC21", "KORTHIKANTI"]


@dataclass(frozen=True)
class Run:
    """A published run's model (a GPT of ``layers`` x ``hidden``, ``heads`` heads) and plan."""

    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int

    def model(self) -> GPT:
        """The bundled GPT of this shape on the meta device."""
        with torch.device("meta"):
            return GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=self.layers, n_head=self.heads,
                                 n_embd=self.hidden, dropout=0.1))


@dataclass(frozen=True)
class Throughput(Run):
    tflops: float = 0.0  # achieved per GPU, Megatron-LM's count
    calibration: bool = False  # one of the four calibration rows


@dataclass(frozen=True)
class Recomputation(Run):
    micro_batch: int = 1
    virtual_stages: int = 1  # interleaved 1F1B when > 1
    full_seconds: float = 0.0  # a step with full recomputation
    selective_seconds: float = 0.0  # with sequence parallelism and selective recomputation
    selective_mfu: float = 0.0

    def estimates(self):
        """The simulator's (``auto.simulate``) for the two runs: full recomputation without sequence
        parallelism, and selective recomputation with it."""
        from .cluster import Cluster
        from .config import Parallel
        from .simulate import simulate

        model, cluster = self.model(), Cluster.preset("a100-80gb", devices=self.gpus)
        plan = dict(tp=self.tp, pp=self.pp, dp=self.gpus // (self.tp * self.pp), micro_batch=self.micro_batch,
                    schedule="interleaved" if self.virtual_stages > 1 else "1f1b",
                    virtual_stages=self.virtual_stages, zero=0)
        return tuple(simulate(model, cluster, Parallel(**plan, recompute=r, sequence_parallel=sp), batch=self.batch,
                              seq=2048) for r, sp in (("full", False), ("selective", True)))


def _sc21(heads, hidden, layers, tp, pp, gpus, batch, tflops, calibration=False) -> Throughput:
    return Throughput(heads, hidden, layers, tp, pp, gpus, batch, tflops, calibration)


SC21 = (_sc21(24, 2304, 24, 1, 1, 32, 512, 137, True), _sc21(32, 3072, 30, 2, 1, 64, 512, 138),
        _sc21(32, 4096, 36, 4, 1, 128, 512, 142), _sc21(48, 6144, 40, 8, 1, 256, 1024, 135, True),
        _sc21(64, 8192, 48, 8, 2, 512, 1536, 138), _sc21(80, 10240, 60, 8, 4, 1024, 1792, 140),
        _sc21(96, 12288, 80, 8, 8, 1536, 2304, 148, True), _sc21(128, 16384, 96, 8, 16, 1920, 2160, 155),
        _sc21(128, 20480, 105, 8, 35, 2520, 2520, 163), _sc21(160, 25600, 128, 8, 64, 3072, 3072, 163, True))

KORTHIKANTI = (Recomputation(64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 0.415),
               Recomputation(96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514),
               Recomputation(128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560),
               Recomputation(160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 0.563))
