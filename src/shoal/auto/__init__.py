"""Plans found, not guessed: a cluster's cost model, a step simulator and a parallelism search.

``Cluster`` (presets with sourced constants), ``Parallel`` (one configuration), ``simulate`` (an
``Estimate`` of a step's time and memory per device) and ``search`` (the best configuration that fits).
"""

from .cluster import Cluster, Link
from .config import Parallel
from .search import search
from .simulate import Estimate, megatron_flops, simulate

__all__ = ["Cluster", "Link", "Parallel", "Estimate", "simulate", "search", "megatron_flops"]
