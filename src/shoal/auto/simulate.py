"""The cost model: a training step's time and memory per device for a configuration on a cluster.

``simulate(model, cluster, cfg, batch=, seq=)`` prices one representative layer's ops (``profile``)
on the device, adds tensor-parallel collectives (Megatron-LM's pattern, or on a cluster of this
process's devices the ones shoal compiles for the plan: ``census``), pipeline send/recv and bubble
(the ``runtime.schedules`` orders on the virtual clock, or their closed forms), the data-parallel
gradient reduction (overlapped with the last backward) and the optimizer update, and counts memory
by kind: states, what each layer keeps for backward under the recomputation chosen (none; selective:
attention's core run again; full: each block's input only) times the layers in flight, and the
communication buffers. ``Estimate`` holds the result.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..parallel.memory import byte_size
from ..runtime import schedules
from .census import census
from .cluster import Cluster
from .config import Parallel, check
from .profile import OpCost, Profile, gpt_config, profile

__all__ = ["Estimate", "simulate", "estimate", "megatron_flops", "bubble_fraction", "in_flight", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# bytes per parameter: (weights, gradients, optimizer state) under Adam. Mixed precision as Megatron-LM
# runs it: bf16 weights, fp32 gradient accumulation and reduction (--accumulate-allreduce-grads-in-fp32),
# fp32 master weights + two moments (ZeRO paper's K = 12); fp32: weights, gradients, two moments.
_STATES = {"bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}
# bytes an Adam update moves per parameter: read gradient, master, m, v; write master, m, v; (mixed
# precision) write the low-precision weights
_UPDATE = {"bf16": 30, "fp16": 30, "fp32": 28}
# kernels an Adam update launches per device: torch's fused AdamW (what shoal's compiled steps run)
# and Megatron-LM's FusedAdam go over every parameter tensor in one (multi-tensor) kernel, plus the
# host's step-count increment
_ADAM_KERNELS = 2


@dataclass
class Estimate:
    """A configuration's predicted step. ``breakdown``: seconds per step by compute / exposed
    communication (tp, pp, dp) / bubble / optimizer; ``memory``: bytes on the fullest device by kind;
    ``tflops_per_device``: Megatron-LM's count (``megatron_flops``); ``model_tflops_per_device`` and
    ``mfu``: the model's own FLOPs (no recomputation) against the peak."""

    cfg: Parallel
    cluster: Cluster
    batch: int
    seq: int
    step_seconds: float
    tflops_per_device: float
    model_tflops_per_device: float
    mfu: float
    memory: dict[str, float]
    breakdown: dict[str, float]
    runner_up: Estimate | None = field(default=None, repr=False)
    # (the integer program's per-op layouts, Megatron's priced alike) for one tp group (``search``)
    layouts: tuple | None = field(default=None, repr=False)
    traced: bool = False  # the tp collectives are those of shoal's traced step (``census``), not Megatron's formula
    clocked: bool = False  # the pipeline ran its schedule on the virtual clock, not the bubble's closed form
    # bytes one device's data-parallel collectives move a step, by kind, as the closed forms count them
    dp_bytes: dict = field(default_factory=dict, repr=False)

    @property
    def memory_per_device(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_per_device <= self.cluster.memory

    def summary(self) -> dict:
        return {"plan": str(self.cfg), "step_seconds": self.step_seconds, "tflops_per_device": self.tflops_per_device,
                "model_tflops_per_device": self.model_tflops_per_device, "mfu": self.mfu,
                "memory_per_device_bytes": int(self.memory_per_device), "fits": self.fits,
                "breakdown_seconds": self.breakdown, "memory_bytes": {k: int(v) for k, v in self.memory.items()},
                "tp_collectives": "traced" if self.traced else "megatron",
                "pipeline": "clock" if self.clocked else "closed form" if self.cfg.pp > 1 else "none"}

    def explain(self) -> str:
        c = self.cfg
        lines = [f"plan {c} on {self.cluster.devices} x {self.cluster.name}, batch {self.batch} x {self.seq}",
                 f"  step {self.step_seconds:.3f} s; {self.tflops_per_device:.1f} TFLOP/s per device (Megatron-LM's "
                 f"count), model FLOPs {self.model_tflops_per_device:.1f} TFLOP/s, MFU {100 * self.mfu:.1f}%",
                 "  as shoal code:",
                 f"    mesh = shoal.Mesh(torch.arange({self.cluster.devices}).reshape{c.mesh_shape()}.tolist(), "
                 f"axes={c.axes()})",
                 f"    plan, options = auto.Parallel.parse({str(c)!r}).to_plan(mesh, batch={self.batch}"
                 + (", model=model)" if c.virtual_stages > 1 else ")"),
                 "  time per step:"]
        total = sum(self.breakdown.values())
        for k, v in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<22} {v:9.4f} s  {100 * v / total:5.1f}%")
        if c.tp > 1:
            lines.append("  tensor-parallel collectives: " + (
                "those of shoal's traced step (a tp group of meta devices, 1- and 2-layer twins: auto.census)"
                if self.traced else "Megatron-LM's pattern (two all-reduces per layer each way, closed form)"))
        if c.pp > 1:
            m = self.batch // (c.dp * c.micro_batch)
            lines.append("  pipeline: " + (
                f"the {c.schedule} orders on the virtual clock ({c.pp} devices x {c.virtual_stages} stage(s), {m} "
                f"micro-batches; the first stage runs the embedding too, the last the head)" if self.clocked
                else "the bubble's closed form (equal stages, each as slow as the slowest)"))
        lines.append(f"  memory on the fullest device ({byte_size(self.memory_per_device)} of "
                     f"{byte_size(self.cluster.memory)}: {'fits' if self.fits else 'DOES NOT FIT'}):")
        for k, v in sorted(self.memory.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<22} {byte_size(v):>12}")
        if self.layouts is not None:
            lines += _layouts_lines(*self.layouts, c.tp, c.sequence_parallel)
        if self.runner_up is not None:
            lines.append(f"  runner-up {self.runner_up.cfg}: {self.runner_up.step_seconds:.3f} s "
                         f"({self.runner_up.tflops_per_device:.1f} TFLOP/s); it lost by " + _why(self, self.runner_up))
        return "\n".join(lines)


def _layouts_lines(best, megatron, tp: int, sp: bool) -> list[str]:
    """What the integer program's per-op layouts for a tp group would change (``search``; priced without
    sequence parallelism, whose pins ``to_plan`` keeps, laying out the parameters alone)."""
    differ = [n for n in best.params if best.params[n] != megatron.params[n]]
    kinds = sorted({n.split(".", 2)[-1] if n.startswith("blocks.") else n for n in differ})
    pins = sorted(best.plan().outputs)  # a ModuleList's items by pattern
    ahead = best.run_seconds < megatron.run_seconds
    return [f"  per-op layouts of a tp group of {tp} (integer program, a micro-batch through a twin of at most 3 "
            f"layers, solved in {best.solve_seconds:.1f} s): {best.seconds * 1e3:.3f} ms against Megatron's pattern "
            f"{megatron.seconds * 1e3:.3f} ms by the program's prices; as dispatch runs the two plans "
            f"{best.run_seconds * 1e3:.3f} ms against {megatron.run_seconds * 1e3:.3f} ms "
            f"({100 * (1 - best.run_seconds / megatron.run_seconds):+.1f}%)",
            f"    {len(differ)} of {len(best.params)} parameters laid out otherwise"
            + (f" ({', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''})" if kinds else "")
            + f", outputs pinned at {', '.join(pins) if pins else 'none'}; "
            + ("to_plan(..., layouts=est.layouts[0]) lays them out" + (" (the parameters: sp keeps its own pins)"
                                                                       if sp else "") if ahead else
               "Megatron's pattern (to_plan without layouts) runs faster")]


def _why(best: Estimate, other: Estimate) -> str:
    diffs = {k: other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in {*best.breakdown, *other.breakdown}}
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:2]
    return ", ".join(f"{k} +{v:.4f} s" for k, v in worst if v > 0) or "nothing (a tie)"


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of a step as Narayanan et al. (SC'21) count them, with full recomputation:
    96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, w: float = 0.0) -> float:
    """Idle time of a pipeline step over ``m`` micro-batches of equal stages, as a fraction of the
    step: (p-1)/v stage slots against m (gpipe, 1f1b, interleaved); ZB-H1 fills ``w`` (the weight-
    gradient share of a stage's forward + backward) of each bubble slot twice over."""
    if p == 1:
        return 0.0
    idle = (p - 1) * (1 - 2 * w if schedule == "zb" else 1) / (v if schedule == "interleaved" else 1)
    return idle / (m + idle)


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The most micro-batches whose activations the first device holds, in units of one stage's
    (a chunk is 1/v of it): GPipe all m, 1F1B and ZB-H1 p, interleaved 1F1B its warm-up + 1 chunks."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v
    return min(p, m)


@dataclass(frozen=True, slots=True)
class _Layer:
    forward: float
    backward: float
    weight_grad: float
    core: float = 0.0  # of ``forward``: attention's core (what selective recomputation runs again)

    def again(self, recompute: str) -> float:
        """Seconds of the forward that backward runs again under ``recompute``."""
        return self.forward if recompute == "full" else self.core if recompute == "selective" else 0.0


def _op_seconds(op: OpCost, cluster: Cluster, peak: float, tp: int, sp: bool, tokens: int,
                prev: OpCost | None = None) -> float:
    """Seconds of the profiled op ``op`` on one of ``tp`` devices (split ops cut by tp: its FLOPs and
    bytes, a GEMM's dims as Megatron-LM cuts them)."""
    div = tp if op.split or (sp and op.where == "block") else 1
    if op.gemm is not None and div > 1:
        b, m, n, k = op.gemm
        if b > 1:
            b = math.ceil(b / div)  # heads split: fewer batched products
        else:  # a linear layer's weight split: the largest dim other than the tokens is cut
            dims = [m, n, k]
            i = max((j for j in range(3) if dims[j] != tokens), key=lambda j: dims[j], default=2)
            dims[i] = math.ceil(dims[i] / div)
            m, n, k = dims
        op = replace(op, gemm=(b, m, n, k))
    return _kernel_seconds(op, cluster, peak, prev, div)


def _kernel_seconds(op: OpCost, cluster: Cluster, peak: float, prev: OpCost | None = None, div: int = 1) -> float:
    """Seconds of ``op`` (its FLOPs and bytes over ``div``) on one device. A memory-bound op right after
    another of the same output size fuses with it when the cluster fuses (``Cluster.fuse``): the
    intermediate is neither written nor read back, and the fused kernel launches once."""
    if op.view:
        return cluster.view_overhead
    if op.gemm is None:
        nbytes, overhead = op.nbytes, cluster.op_overhead
        if cluster.fuse and prev is not None and prev.gemm is None and prev.phase == op.phase \
                and prev.out_bytes == op.out_bytes:
            nbytes, overhead = max(op.nbytes - 2 * prev.out_bytes, op.out_bytes), 0.0
        return nbytes / div / cluster.hbm + op.flops / div / peak + overhead
    b, m, n, k = op.gemm
    eff = cluster.gemm_efficiency  # output tiles quantize m and n; k is looped over (its cost: the bytes)
    for d in (m, n):
        eff *= d / (d + cluster.gemm_half)
    return 2 * b * m * n * k / (peak * eff) + op.nbytes / div / cluster.hbm + cluster.op_overhead


def _program_seconds(ops, cluster: Cluster, peak: float) -> float:
    """Seconds of one device's kernels ``ops`` (a traced step's, ``census.kernels``), in order."""
    total, prev = 0.0, None
    for op in ops:
        total += _kernel_seconds(op, cluster, peak, prev)
        if not op.view:
            prev = op
    return total


def _phase_seconds(prof: Profile, where: str, cluster: Cluster, peak: float, tp: int, sp: bool) -> _Layer:
    t = {"F": 0.0, "B": 0.0, "W": 0.0, "core": 0.0}
    prev = None
    for op in prof.ops:
        if op.where == where:
            s = _op_seconds(op, cluster, peak, tp, sp, prof.tokens, prev)
            prev = op
            t[op.phase] += s
            if op.core and op.phase == "F":
                t["core"] += s
            if op.phase == "B" and op.gemm is not None and op.gemm[0] == 1:
                t["W"] += s / 2  # a linear's backward: input gradient and weight gradient, equal GEMMs
    for phase, w, k in prof.views:
        if w == where:
            t[phase] += k * cluster.view_overhead
    return _Layer(t["F"], t["B"], t["W"], t["core"])


def _traced(layer: _Layer, embed: _Layer, head: _Layer, mcfg, cluster: Cluster, c: Parallel, seq: int,
            peak: float) -> tuple[_Layer, _Layer, _Layer]:
    """The profiled phases scaled to the kernels one device runs in shoal's traced step (``census``,
    a tp group of meta devices): a layer's, and the embedding's and head's together. The traced ops
    carry no forward / backward mark, so the profile's split stands; the totals are the trace's,
    dispatch's copies and slices and the shards' real shapes included."""
    counted = census(mcfg, c.tp, c.micro_batch, seq, c.recompute, c.precision, c.sequence_parallel)
    t_layer, t_ends = counted.compute(lambda ops: _program_seconds(ops, cluster, peak))
    s = t_layer / (layer.forward + layer.backward + layer.again(c.recompute))  # the traced step recomputes
    e = t_ends / (embed.forward + embed.backward + head.forward + head.backward)

    def scaled(x: _Layer, f: float) -> _Layer:
        return _Layer(x.forward * f, x.backward * f, x.weight_grad * f, x.core * f)

    return scaled(layer, s), scaled(embed, e), scaled(head, e)


def simulate(model: nn.Module, cluster: Cluster, cfg: Parallel, *, batch: int, seq: int | None = None) -> Estimate:
    """Predict a training step of ``model`` (a bundled GPT, on the meta device) under ``cfg`` on
    ``cluster`` for a global ``batch`` of sequences of ``seq`` tokens (default the model's block size)."""
    mcfg = gpt_config(model)
    seq = seq or mcfg.block_size
    c = cfg.resolved(cluster.devices)
    check(c, mcfg, batch)
    m = batch // (c.dp * c.micro_batch)
    prof = profile(model, c.micro_batch, seq, DTYPES[c.precision])
    return estimate(prof, mcfg, cluster, c, batch, seq, m, clock=True)


_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def estimate(prof: Profile, mcfg, cluster: Cluster, c: Parallel, batch: int, seq: int, m: int,
             clock: bool = False) -> Estimate:
    """The step of ``m`` micro-batches (profiled in ``prof``) per data-parallel rank under resolved ``c``.
    ``clock``: a pipeline runs its schedule on the virtual clock (``_clocked``), else the closed form
    of its bubble (``bubble_fraction``, equal stages: the search's first pass)."""
    peak = cluster.peak(c.precision)
    sp = c.sequence_parallel and c.tp > 1
    layer = _phase_seconds(prof, "block", cluster, peak, c.tp, sp)
    embed = _phase_seconds(prof, "embed", cluster, peak, c.tp, sp)
    head = _phase_seconds(prof, "head", cluster, peak, c.tp, sp)
    if cluster.traced_kernels:  # the kernels of the step shoal compiles for the plan
        layer, embed, head = _traced(layer, embed, head, mcfg, cluster, c, seq, peak)
    act = prof.tokens * mcfg.n_embd * _DTYPE_BYTES[c.precision]  # one layer's output, a micro-batch
    again = layer.again(c.recompute)
    layers = mcfg.n_layer // c.pp
    tp_comm, traced = _tp_seconds(prof, mcfg, cluster, c, seq, act, layers)  # a micro-batch through a stage
    fwd = layers * layer.forward
    bwd = layers * (layer.backward + again)
    stage_compute = fwd + bwd + max(embed.forward + embed.backward, head.forward + head.backward)
    p2p = 0.0
    if c.pp > 1:  # each micro-batch crosses v stage boundaries per device each way, 1/tp per device (split
        # on the sequence with sp; else scattered to cross, all-gathered on arrival: boxing._scattered)
        across = c.tp * c.dp >= (cluster.links[0].size or cluster.devices)
        gather = cluster.all_gather(act, c.tp) if c.tp > 1 and not sp else 0.0
        p2p = 2 * c.virtual_stages * (cluster.send_recv(act / c.tp, across) + gather)
    stage = stage_compute + tp_comm + p2p  # one micro-batch through the slowest stage
    if clock and c.pp > 1:  # the schedule's orders on the virtual clock, the stages as they differ
        pipeline, stage_compute, stage = _clocked(c, m, layers, layer, embed, head, tp_comm, p2p, again)
    else:  # the closed form: equal stages, each as slow as the slowest
        w_share = layers * layer.weight_grad / stage if stage else 0.0
        frac = bubble_fraction(c.schedule, c.pp, m, c.virtual_stages, w_share)
        pipeline = m * stage / (1 - frac)

    w_bytes, g_bytes, o_bytes = _STATES[c.precision]
    ends = prof.embed_params + prof.head_params if c.pp == 1 else max(prof.embed_params, prof.head_params)
    params = (layers * prof.block_params + ends) / c.tp  # the fullest stage's (one stage: all of them)
    tensors = layers * prof.block_tensors + prof.other_tensors  # the last stage's (the embedding, tied, too)
    dp_time, dp_bytes = 0.0, {}
    if c.dp > 1:
        if c.zero >= 2:  # as shoal runs ZeRO-2/3: each gradient reduce-scattered on its own
            calls = tensors
            reduce = tensors * cluster.reduce_scatter(params * g_bytes / tensors, c.dp, c.tp)
            dp_bytes["reduce_scatter"] = params * g_bytes
        else:  # all-reduced in buckets, as shoal buckets them
            calls = max(1, math.ceil(params * g_bytes / cluster.bucket_bytes))
            reduce = calls * cluster.all_reduce(params * g_bytes / calls, c.dp, c.tp)
            dp_bytes["all_reduce"] = params * g_bytes
        overlap = layers * (layer.backward + again)  # the last micro-batch's
        # in one process a collective's latency is the devices' threads handing over under one lock:
        # host time that no device's computation hides; only its sums and copies overlap
        link = cluster.links[0]
        exposed = calls * link.alpha if link.in_process else 0.0
        dp_time = max(reduce - exposed - overlap, 0.0) + exposed
        if c.zero in (1, 2):  # each updated parameter gathered on its own, after its update: not hidden
            dp_time += tensors * cluster.all_gather(params * w_bytes / tensors, c.dp, c.tp)
            dp_bytes["all_gather"] = params * w_bytes
        if c.zero == 3:  # each unit's weights (a block's, the rest's) gathered for every forward (and
            # full recomputation) and backward, per micro-batch (attention's core holds no weights)
            units = layers + 1
            gathers = 3 if c.recompute == "full" else 2
            dp_time += m * gathers * units * cluster.all_gather(params * w_bytes / units, c.dp, c.tp)
            dp_bytes["all_gather"] = m * gathers * params * w_bytes
    update = params / (c.dp if c.zero >= 1 else 1) * _UPDATE[c.precision] / cluster.hbm \
        + _ADAM_KERNELS * cluster.op_overhead
    step = pipeline + dp_time + update
    breakdown = {"compute": m * stage_compute, "tensor-parallel comm": m * tp_comm,
                 "pipeline send/recv": m * p2p, "pipeline bubble": pipeline - m * stage,
                 "data-parallel comm": dp_time, "optimizer": update}

    memory = _memory(prof, c, params, layers, m, sp, act, cluster.bucket_bytes, mcfg)
    mega = megatron_flops(batch, seq, mcfg.n_layer, mcfg.n_embd, mcfg.vocab_size)
    own = sum(o.flops for o in prof.ops if o.where != "block") + mcfg.n_layer * sum(
        o.flops for o in prof.ops if o.where == "block")
    own *= batch // c.micro_batch
    per_device = 1e12 * step * cluster.devices
    return Estimate(c, cluster, batch, seq, step, mega / per_device, own / per_device,
                    own / (step * cluster.devices * peak), memory, breakdown, traced=traced,
                    clocked=clock and c.pp > 1, dp_bytes=dp_bytes)


@functools.cache
def _orders(name: str, p: int, m: int, v: int) -> schedules.Orders:
    return schedules.schedule(name, p, m, v)


def _clocked(c: Parallel, m: int, layers: int, layer: _Layer, embed: _Layer, head: _Layer, tp_comm: float,
             p2p: float, again: float) -> tuple[float, float, float]:
    """(makespan, compute, busy) of ``m`` micro-batches through the pipeline of resolved ``c`` on the
    virtual clock (``runtime.schedules``: the orders the runtime fires), compute and busy being the
    busiest device's per micro-batch. Each of the ``pp x v`` model stages runs its ``layers / v``
    layers, the first the embedding too, the last the head and loss; each takes 1/v of a device's
    tp collectives (split between forward and backward as its compute is) and sends its activations
    forward and their gradient back (``p2p`` is a device's per micro-batch); backward runs ``again``
    seconds of a layer's forward again (recomputation)."""
    v, chunks = c.virtual_stages, c.pp * c.virtual_stages
    per = layers / v
    tp_f = layer.forward / (layer.forward + layer.backward + again)
    send = p2p / (2 * v)

    def compute(kind: str, stage: int) -> float:
        first, last = stage == 0, stage == chunks - 1
        if kind == "F":
            return per * layer.forward + first * embed.forward + last * head.forward
        if kind == "W":
            return per * layer.weight_grad
        return (per * (layer.backward - layer.weight_grad + again)
                + first * embed.backward + last * head.backward)

    def seconds(kind: str, stage: int) -> float:
        comm = 0.0 if kind == "W" else send + tp_comm / v * (tp_f if kind == "F" else 1 - tp_f)
        return compute(kind, stage) + comm

    timeline = schedules.simulate(_orders(c.schedule, c.pp, m, v), c.pp, v, seconds)
    makespan = max(f.end for f in timeline) - min(f.start for f in timeline)
    split = any(f.item.kind == "W" for f in timeline)  # else each B item holds the weight gradient too
    busy, work = [0.0] * c.pp, [0.0] * c.pp
    for f in timeline:
        stage = f.item.chunk * c.pp + f.device
        busy[f.device] += f.end - f.start
        work[f.device] += compute(f.item.kind, stage) + (compute("W", stage) if f.item.kind == "B" and not split
                                                         else 0.0)
    d = max(range(c.pp), key=busy.__getitem__)
    return makespan, work[d] / m, busy[d] / m


def _tp_seconds(prof: Profile, mcfg, cluster: Cluster, c: Parallel, seq: int, act: float,
                layers: int) -> tuple[float, bool]:
    """Seconds of a micro-batch's tensor-parallel collectives through a stage of ``layers`` layers, and
    whether they were traced: the ones shoal's step runs (``census``) where the cluster says so, else
    Megatron-LM's: an
    all-reduce of a layer's output per row-parallel layer in forward (again in recomputation), one
    per column-parallel region's input in backward (with sequence parallelism a reduce-scatter and
    an all-gather: the same time)."""
    if c.tp == 1:
        return 0.0, False
    if cluster.census:
        counted = census(mcfg, c.tp, c.micro_batch, seq, c.recompute, c.precision, c.sequence_parallel)
        return counted.seconds(lambda k: cluster.collective(k.kind, k.nbytes, k.n), layers), True
    recompute = c.recompute == "full"
    return layers * cluster.all_reduce(act, c.tp) * (prof.allreduces_forward * (2 if recompute else 1)
                                                      + prof.allreduces_backward), False


def _memory(prof: Profile, c: Parallel, params: float, layers: int, m: int, sp: bool, act: float,
            bucket: float, mcfg) -> dict[str, float]:
    """Bytes on the fullest device by kind. Communication buffers, as shoal's step holds them during
    backward: data-parallel gradients flattened into buckets (one filling, one reducing), or under
    ZeRO-2/3 the largest gradient whole before its reduce-scatter; under ZeRO-3 two units' weights
    gathered whole (the one running and the next); under pipelines a received activation and
    gradient per register (the runtime's two), 1/tp of a micro-batch's layer output each."""
    w, g, o = _STATES[c.precision]
    dp = c.dp
    out = {"weights": params * w / (dp if c.zero >= 3 else 1),
           "gradients": params * g / (dp if c.zero >= 2 else 1),
           "optimizer state": params * o / (dp if c.zero >= 1 else 1)}
    replicated = prof.saved_other / (c.tp if sp else 1)
    per_layer = prof.saved_split / c.tp + replicated
    held = in_flight(c.schedule, c.pp, m, c.virtual_stages)
    if c.recompute == "full":  # each layer keeps its input; one layer's whole activations live in its backward
        kept = act / (c.tp if sp else 1)
        out["activations"] = held * layers * kept + per_layer
    elif c.recompute == "selective":  # attention's core keeps its inputs q, k, v in place of what it saves
        kept = per_layer - (prof.saved_core - prof.core_inputs) / c.tp
        out["activations"] = held * layers * kept + (per_layer - kept)
    else:
        out["activations"] = held * layers * per_layer
    out["logits (last stage)"] = prof.head_saved / c.tp
    largest = max(mcfg.vocab_size, 4 * mcfg.n_embd) * mcfg.n_embd / c.tp  # the vocabulary's or the MLP's matrix
    buffers = 0.0
    if dp > 1:
        buffers += largest * g if c.zero >= 2 else 2 * min(bucket, params * g)
    if dp > 1 and c.zero >= 3:
        buffers += 2 * (prof.block_params / c.tp) * w
    if c.pp > 1:
        buffers += 2 * 2 * act / c.tp
    out["communication buffers"] = buffers
    return out
