"""Plans found, not guessed: a cluster's cost model, a step simulator and a parallelism search.

``Cluster`` (presets with sourced constants), ``Parallel`` (one configuration), ``simulate`` (an
``Estimate`` of a step's time and memory per device) and ``search`` (the best configuration that fits);
``layouts.solve`` (per-op layouts by an integer program, ``Layouts``) and ``gpt_layouts`` (the same
for a bundled GPT, beside Megatron's layouts).
"""

from .cluster import Cluster, Link
from .config import SCHEDULES, Parallel
from .layouts import Layouts, gpt_layouts
from .search import search
from .simulate import Estimate, megatron_flops, simulate

__all__ = ["Cluster", "Link", "Parallel", "SCHEDULES", "Estimate", "simulate", "search", "megatron_flops", "Layouts",
           "gpt_layouts"]
