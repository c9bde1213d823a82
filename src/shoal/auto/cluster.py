"""A described cluster, and what a collective costs on it.

``Cluster`` holds a device's peak rates (FLOP/s per dtype, HBM bandwidth, memory) and its links as
levels (``Link``: NVLink inside a node, InfiniBand across), each with an alpha (latency) and a beta
(seconds per byte). ``all_reduce``/``reduce_scatter``/``all_gather``/``send_recv`` price a collective
over a group by the alpha-beta model, ring or tree, hierarchically over the levels the group spans.
Every constant of a preset says where it comes from.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, replace
from functools import cache

import torch

from ..comm import BUCKET_BYTES
from ..mesh import Mesh
from ..runtime import _cores, _share
from ..sbp import Broadcast, Partial
from ..tensor import from_local
from ..world import is_initialized, world

__all__ = ["Link", "Cluster", "ring_all_reduce", "PRESETS"]


@dataclass(frozen=True, slots=True)
class Link:
    """One level of the interconnect: ``size`` devices share it (a node of 8 for NVLink; None: every
    device, the top level); ``alpha`` seconds per message step; ``bandwidth`` bytes/s each device
    sends (and receives) at once on this level, already scaled by the achievable fraction.
    ``in_process``: the devices are one process's (virtual devices): a collective is tensor work there
    (sums, concatenations) whose memory traffic moves at ``bandwidth``, after ``alpha`` per collective."""

    name: str
    size: int | None
    alpha: float
    bandwidth: float
    in_process: bool = False


@dataclass(frozen=True, slots=True)
class Cluster:
    """``devices`` identical devices. ``flops``: peak FLOP/s by dtype name ("bf16", "fp32"...);
    ``memory``: bytes per device; ``hbm``: achievable memory bandwidth, bytes/s; ``links``: levels,
    innermost first. ``gemm_efficiency``: the fraction of peak a large matrix multiply reaches;
    ``gemm_half``: the GEMM dimension at which a dimension's tile/wave losses halve the rate (the
    smooth curve ``d / (d + gemm_half)`` per output dimension); ``op_overhead``: seconds per kernel;
    ``view_overhead``: seconds per view op (no kernel: where the host runs each op from Python under
    one lock, as shoal's runtime does on CPU devices, a view costs what a kernel's call does; on a GPU
    the host runs ahead of the kernels and views cost nothing);
    ``fuse``: chains of memory-bound ops run as one kernel (GPU: Megatron-LM's fused kernels, inductor);
    ``census``: tensor parallelism runs the collectives shoal's dispatch picks (``auto.census``, read off
    the compiled step on this process's devices), not Megatron-LM's two all-reduces per layer each way;
    ``traced_kernels``: its devices run the kernels of shoal's step as traced on this process's device
    type (``census.kernels``: CPU's fused attention, dispatch's copies and slices), so compute is priced
    from them; elsewhere from the model's profile (a GPU's kernels are not the trace's: the published
    Megatron-LM runs materialize attention's scores, a CPU trace runs flash attention);
    ``bucket_bytes``: the data-parallel gradients are all-reduced in buckets of this many bytes per
    device, each paying its collective's latency (shoal's ``comm.BUCKET_BYTES`` for the device type)."""

    name: str
    devices: int
    flops: dict
    memory: float
    hbm: float
    links: tuple[Link, ...]
    gemm_efficiency: float
    gemm_half: float
    op_overhead: float
    view_overhead: float = 0.0
    fuse: bool = False
    census: bool = False
    traced_kernels: bool = False
    bucket_bytes: float = BUCKET_BYTES["cuda"]

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"Cluster: devices must be at least 1, got {self.devices}")
        if not self.links or self.links[-1].size is not None:
            raise ValueError("Cluster: links must end with a level spanning every device (size=None)")
        if any(link.in_process for link in self.links) and len(self.links) > 1:
            raise ValueError("Cluster: a level of devices in one process (in_process=True) must be the only level")

    @staticmethod
    def preset(name: str, devices: int, fresh: bool = False) -> Cluster:
        """A described cluster of ``devices``: "a100-80gb" (DGX A100 nodes of 8) or "local" (this
        machine's virtual devices, rates measured by a short micro-benchmark, cached per process;
        ``fresh``: measured again now, for a machine whose speed drifts)."""
        if name not in PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; choose one of {', '.join(PRESETS)}")
        if fresh:
            for measured in (_measured, _measured_compiled_op, _measured_all_reduce):
                measured.cache_clear()
        return replace(PRESETS[name](devices), devices=devices)

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ValueError(f"cluster {self.name!r} has no peak rate for {dtype!r}; it has {', '.join(self.flops)}")
        return self.flops[dtype]

    def levels(self, n: int, stride: int) -> list[tuple[Link, int]]:
        """How a group of ``n`` devices spaced ``stride`` apart splits over the link levels: (link,
        devices of the group that link joins), innermost first; the product of the counts is ``n``."""
        out, left, span = [], n, stride
        for link in self.links:
            if left == 1:
                break
            if link.size is None:
                out.append((link, left))
                break
            inside = max(1, min(left, link.size // span)) if span < link.size else 1
            if inside > 1:
                out.append((link, inside))
                left //= inside
            span = max(span * inside, link.size)
        return out

    def all_reduce(self, nbytes: float, n: int, stride: int = 1) -> float:
        """Seconds to all-reduce ``nbytes`` over ``n`` devices ``stride`` apart: hierarchical (reduce-
        scatter inside each level, all-reduce of the shard above, all-gather back), each level by the
        faster of ring and tree; in one process (``Link.in_process``) the sums of the shards."""
        if self.links[-1].in_process:
            return _in_process("all_reduce", nbytes, n, self.links[-1])
        t, size = 0.0, float(nbytes)
        for link, k in self.levels(n, stride):
            t += min(ring_all_reduce(size, k, link), _tree_all_reduce(size, k, link))
            size /= k
        return t

    def reduce_scatter(self, nbytes: float, n: int, stride: int = 1) -> float:
        """Seconds to reduce-scatter ``nbytes`` (the whole tensor) over the group: half a ring all-reduce."""
        return self.collective("reduce_scatter", nbytes, n, stride)

    def all_gather(self, nbytes: float, n: int, stride: int = 1) -> float:
        """Seconds to all-gather ``nbytes`` (the whole tensor): the bytes of a reduce-scatter, the other way."""
        return self.collective("all_gather", nbytes, n, stride)

    def all_to_all(self, nbytes: float, n: int, stride: int = 1) -> float:
        """Seconds to re-split ``nbytes`` (the whole tensor) over the group: each device keeps 1/n of
        its shard and sends the rest, n - 1 steps of an all-gather of the shard."""
        return self.collective("all_to_all", nbytes, n, stride)

    def collective(self, kind: str, nbytes: float, n: int, stride: int = 1) -> float:
        """Seconds of one of ``shoal.comm``'s collectives by its name, over ``nbytes`` (the whole tensor)."""
        if kind not in _TRAFFIC:
            raise ValueError(f"cluster {self.name!r}: no price for collective {kind!r}; it prices "
                             f"{', '.join(_TRAFFIC)}")
        if self.links[-1].in_process:
            return _in_process(kind, nbytes, n, self.links[-1])
        if kind == "transfer":
            return self.send_recv(nbytes, across=False)
        if kind == "all_to_all":
            nbytes, kind = nbytes / n, "all_gather"
        return self.all_reduce(nbytes, n, stride) * (1 if kind == "all_reduce" else 0.5)

    def send_recv(self, nbytes: float, across: bool) -> float:
        """Seconds to send ``nbytes`` to a neighbour, inside the innermost level or (``across``) over the top one."""
        link = self.links[-1] if across else self.links[0]
        if link.in_process:
            return _in_process("transfer", nbytes, 2, link)
        return link.alpha + nbytes / link.bandwidth


# bytes of memory a collective in one process reads and writes, in units of the whole tensor, over n
# devices (``shoal.comm`` on one process: a reduction adds the shards one by one, each sum reading two
# tensors and writing one, and every device shares the result; a gather concatenates, a transfer copies)
_TRAFFIC = {"all_reduce": lambda n: 3 * (n - 1), "reduce_scatter": lambda n: 3 * (n - 1),
            "all_gather": lambda n: 2, "all_to_all": lambda n: 2, "transfer": lambda n: 2}


def _in_process(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of a collective that is tensor work in one process: ``alpha`` (the call and the hand-offs
    between the devices' threads and the collective's) plus its memory traffic at ``bandwidth``."""
    if n <= 1:
        return 0.0
    return link.alpha + _TRAFFIC[kind](n) * nbytes / link.bandwidth


def ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(n-1) steps, each moving ``nbytes / n``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.alpha


def _tree_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Double binary tree (NCCL's tree): pipelined reduce up and broadcast down, log2(n) steps each
    way, each device's two trees moving the whole buffer once in and once out."""
    if n <= 1:
        return 0.0
    return 2 * nbytes / link.bandwidth + 2 * math.ceil(math.log2(n)) * link.alpha


def _a100_80gb(devices: int) -> Cluster:
    return Cluster(
        name="a100-80gb",
        devices=8,
        # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB: BF16/FP16 tensor 312 TFLOP/s dense,
        # TF32 156 TFLOP/s dense, FP32 19.5 TFLOP/s; 80 GB HBM2e at 2,039 GB/s
        flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        memory=80e9,
        # achievable HBM bandwidth: ~80% of 2,039 GB/s, what streaming kernels reach on A100
        # (BabelStream/STREAM-triad results on A100-80GB: ~1.6-1.7 TB/s)
        hbm=0.8 * 2039e9,
        links=(
            # NVLink3: 12 links x 50 GB/s = 600 GB/s per GPU both directions, 300 GB/s each way, all 8 GPUs
            # of a DGX A100 through NVSwitch; NCCL all-reduce bus bandwidth on one DGX A100 ~230 GB/s
            # (nccl-tests), i.e. ~77% achievable; ~3 us per step (NCCL small-message latency in a node)
            Link("nvlink", size=8, alpha=3e-6, bandwidth=0.77 * 300e9),
            # HDR InfiniBand 200 Gb/s = 25 GB/s per port, 8 compute ports per DGX A100 node, one per GPU
            # (DGX A100 user guide); NCCL inter-node bus bandwidth ~185 of 200 GB/s per node, ~92%;
            # ~8 us per step across nodes (IB + NCCL proxy latency)
            Link("infiniband", size=None, alpha=8e-6, bandwidth=0.92 * 25e9),
        ),
        # cuBLAS BF16 GEMMs on A100 reach ~250-270 TFLOP/s (80-87% of 312) on large square shapes
        # (NVIDIA's "Matrix Multiplication Background" guide, cuBLAS benchmarks); 0.85 for a shape of
        # infinite extent. Tile 128 x 128 (x 32) CTAs: a dimension of d loses ~ d/(d + 128) to tile
        # quantization, partial waves and pipeline fill (the same guide's wave/tile quantization).
        gemm_efficiency=0.85,
        gemm_half=128.0,
        # CUDA kernel launch latency ~3-5 us; most hides behind the queue, ~2 us each is exposed
        op_overhead=2e-6,
        # Megatron-LM fuses bias+GeLU, scale+mask+softmax and bias+dropout+add (Narayanan et al. SC'21,
        # section 4.2): a chain of elementwise ops reads its input and writes its output once
        fuse=True,
    )


def _typical(fn, reps: int = 5) -> float:
    """The median of ``reps`` timed calls of ``fn`` after one warm-up call: the measured steps it
    predicts are medians too, so a calibration taken at the machine's fastest moment would under-predict
    them on a shared machine."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _together(make, at_once: int, threads: int, reps: int = 20) -> float:
    """Seconds of one call when ``at_once`` threads make the call at the same time, each on its own
    tensors (``make()`` returns a thread's call) and ``threads`` intra-op threads: the slowest thread of
    a round, the median of ``reps`` rounds. The threads live through all rounds and set their intra-op
    count once, as the runtime's worker threads do (``runtime._serve``): a thread started per round
    would start its own OpenMP team on its first kernel and measure that instead. Kernels release the
    GIL, so the threads' kernels share the cores as the workers' do."""
    if at_once == 1:
        return _typical(make(), reps)
    start, took = threading.Barrier(at_once + 1), [[0.0] * reps for _ in range(at_once)]

    def run(i: int) -> None:
        torch.set_num_threads(threads)
        call = make()
        call()
        for r in range(reps):
            start.wait()
            t0 = time.perf_counter()
            call()
            took[i][r] = time.perf_counter() - t0

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(at_once)]
    for t in workers:
        t.start()
    for _ in range(reps):
        start.wait()
    for t in workers:
        t.join()
    return statistics.median(max(t[r] for t in took) for r in range(reps))


@cache
def _measured(threads: int, at_once: int = 1) -> tuple[float, float, float]:
    """(matmul FLOP/s, memory bandwidth bytes/s, seconds per op) of this machine's CPU on ``threads``
    intra-op threads while ``at_once`` such streams compute together (they share caches, memory
    bandwidth and clock: each runs slower than one alone): the median of 20 runs of a 512^3 fp32
    matmul and a 32 MiB copy, and of a tiny add alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def matmul_call():
            a, b = torch.randn(512, 512), torch.randn(512, 512)
            return lambda: a @ b

        def copy_call():
            src = torch.randn(8 * 2**20)
            dst = torch.empty_like(src)
            return lambda: dst.copy_(src)

        matmul = 2 * 512**3 / _together(matmul_call, at_once, threads)
        bandwidth = 2 * 8 * 2**20 * 4 / _together(copy_call, at_once, threads)
        x = torch.randn(8)
        overhead = _typical(lambda: [x.add(1.0) for _ in range(100)]) / 100
    finally:
        torch.set_num_threads(before)
    return matmul, bandwidth, overhead


def _device_rates(devices: int) -> tuple[float, float, float]:
    """(matmul FLOP/s, bandwidth, plain torch's seconds per op) of one of ``devices`` virtual devices
    computing at once: the runtime runs each device's kernels on its share of the caller's intra-op
    threads (``runtime._share``), as many devices at once as the cores hold them, so each gets that
    share's measured rate times the devices running at once over the devices."""
    share = _share(torch.get_num_threads(), min(devices, _cores()))
    at_once = min(devices, max(1, _cores() // share))
    matmul, bandwidth, overhead = _measured(share, at_once)
    return matmul * at_once / devices, bandwidth * at_once / devices, overhead


@cache
def _measured_compiled_op(devices: int) -> float | None:
    """Seconds a step of shoal's compiled runtime takes per op that every one of ``devices`` virtual
    devices runs: the slope between compiled chains of 10 and 110 tiny adds on a mesh of ``devices``.
    The devices' segments run on actor threads that share the cores and the GIL, so this is what one
    op of a device's program adds to the step, all devices included; None without such a world."""
    if not is_initialized() or world().size < devices:
        return None
    from ..graph.api import compile as compile_step  # the runtime, measured as the step runs on it

    mesh = Mesh(list(range(devices)))
    x = from_local({mesh.devices[i]: torch.ones(8) for i in mesh.local_positions}, mesh, Broadcast(), shape=(8,))

    def seconds(k: int) -> float:
        def chain(t):
            for _ in range(k):
                t = t + 1.0
            return t
        step = compile_step(chain)
        return _typical(lambda: step(x), 20)

    return max(seconds(110) - seconds(10), 0.0) / 100


@cache
def _measured_all_reduce(devices: int) -> tuple[float, float] | None:
    """(alpha, bandwidth) of ``_in_process`` fitted to shoal's own all-reduce (Partial -> Broadcast) as
    the compiled runtime runs it between the devices' work, of a small and a 1 MiB fp32 tensor over
    ``devices`` virtual devices: the slope between steps of 1 and 21 rounds of an all-reduce, about a
    millisecond of matmuls on each device that read its result, and the op making it partial again,
    less the same rounds without the collectives. The devices share the cores, so a collective waits
    for the last device's work and the devices wait for it: between busy devices this costs about
    twice what it does between idle ones, and a training step's collectives sit between busy ones.
    None without such a world."""
    if devices < 2 or not is_initialized() or world().size < devices:
        return None
    from ..graph.api import compile as compile_step

    mesh = Mesh(list(range(devices)))
    local = {mesh.devices[i]: torch.randn(128, 128) / 128**0.5 for i in mesh.local_positions}
    w = from_local(local, mesh, Broadcast(), shape=(128, 128))

    def seconds(n: int) -> float:
        def rounds(k: int, sync: bool):
            def chain(t, u):
                for _ in range(k):
                    if sync:
                        t = t.to_global(mesh, Broadcast())
                    u = torch.tanh(u @ w + t[0])
                    for _ in range(3):
                        u = torch.tanh(u @ w)
                    t = t + u[0, 0]
                    if sync:
                        t = t.to_global(mesh, Partial("sum"))
                return t, u
            step = compile_step(chain)
            x = from_local({d: torch.ones(n) for d in local}, mesh, Partial("sum") if sync else Broadcast(),
                           shape=(n,))
            step(x, w)

            def timed() -> float:
                t0 = time.perf_counter()
                step(x, w)
                return time.perf_counter() - t0
            return timed

        # the four steps in turn, each repetition's difference apart: the machine's speed drifts
        steps = [rounds(21, True), rounds(21, False), rounds(1, True), rounds(1, False)]
        diffs = []
        for _ in range(15):
            a, b, c, d = (f() for f in steps)
            diffs.append((a - b - c + d) / 20)
        return max(statistics.median(diffs), 0.0)

    small, large = seconds(64), seconds(2**18)
    traffic = _TRAFFIC["all_reduce"](devices) * 4
    bandwidth = traffic * (2**18 - 64) / max(large - small, 1e-9)
    return max(small - traffic * 64 / bandwidth, 0.0), bandwidth


def _local(devices: int) -> Cluster:
    matmul, bandwidth, overhead = _device_rates(devices)
    # without a world of ``devices``: plain torch's per-op cost for each device, run one after another,
    # and a collective as one op's call and a copy's bandwidth
    alpha, link_bandwidth = _measured_all_reduce(devices) or (overhead, bandwidth * devices)
    overhead = _measured_compiled_op(devices) or overhead * devices
    return Cluster(
        name="local",
        devices=devices,
        # measured on this machine (``_device_rates``): virtual devices share its cores, each on the intra-op
        # threads the runtime gives it; each op's runtime overhead is paid under the GIL, so it is the
        # compiled runtime's per-op step time over all devices (``_measured_compiled_op``)
        flops={"fp32": matmul, "bf16": matmul, "fp16": matmul},
        memory=float("inf"),  # host memory; not a limit the search should hit
        hbm=bandwidth,
        # virtual devices' collectives are sums and copies in one process (``_in_process``), fitted to
        # shoal's own compiled all-reduce where the world has the devices
        links=(Link("process", size=None, alpha=alpha, bandwidth=link_bandwidth, in_process=True),),
        gemm_efficiency=1.0,  # the measured rate already is the achievable one
        gemm_half=16.0,  # CPU kernels block by ~16 floats (AVX-512 width)
        op_overhead=overhead,
        view_overhead=overhead,
        census=True,  # shoal's runtime runs the plans here: its dispatch's collectives, counted,
        traced_kernels=True,  # and its kernels
        bucket_bytes=BUCKET_BYTES["cpu"],
    )


PRESETS = {"a100-80gb": _a100_80gb, "local": _local}
