"""Running a decision: one runner per kind. ``run_rule`` boxes the inputs, runs the op (or the
rule's local function) on every local shard and wraps the outputs; ``run_replicated`` runs it on
whole Broadcast values; ``run_random`` draws as one device would; ``run_decomposed`` re-dispatches
the op's parts. Writes go back into the written tensors' own shards (``aliasing``)."""

from __future__ import annotations

import contextlib

import torch

from .. import aliasing, boxing, comm, debug, seam
from ..errors import untraceable
from ..mesh import Mesh
from ..ops.registry import Shard, lookup
from ..sbp import Broadcast
from ..spec import TensorSpec
from ..tensor import GlobalTensor, _full_value, _scatter_full
from ..world import world
from .coverage import _FALLBACK_WARNED, _warn_fallback
from .decide import _DECOMPOSING, Decision, _decomposition
from .key import _fill, _fill_args

__all__ = ["run_rule", "run_replicated", "run_random", "run_decomposed"]

_B = Broadcast()
_GT = GlobalTensor

# Inside __torch_dispatch__ torch excludes the dispatch keys above Python, the Conjugate and Negative
# keys among them: a kernel that makes a conjugated or negated view of a shard internally (pinv's
# ``mH``) would have the bit ignored by the ops it feeds. Shard kernels of the fallback run with
# them (and ZeroTensor, for autograd's zero tensors) back, as one device runs them.
_MATH_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative, torch._C.DispatchKey.ZeroTensor)


@contextlib.contextmanager
def _math_bits():
    was = [k for k in _MATH_KEYS if torch._C._dispatch_tls_is_dispatch_key_excluded(k)]
    for k in was:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        yield
    finally:
        for k in was:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, True)


def run_decomposed(func, args: tuple, kwargs: dict):
    """The op in parts (the rule's decomposition, else torch's), each part dispatched."""
    rule = lookup(func)
    fn = rule.decomposition if rule is not None and rule.decomposition is not None else _decomposition(func)
    _DECOMPOSING.add(func)
    try:
        return fn(*args, **kwargs)
    finally:
        _DECOMPOSING.discard(func)


def run_random(func, dec: Decision, targs, tkwargs, tensors):
    with _math_bits():
        return _random(func, dec, targs, tkwargs, tensors)


def run_replicated(func, dec: Decision, targs, tkwargs, tensors, refused):
    """A value op or the fallback: the op once on Broadcast inputs. ``refused()``: whether torch's
    meta kernel itself refuses the call (a user's error, raised as it is while tracing)."""
    kind = dec.kind
    with _math_bits():  # a fallback's kernel may be any of torch's, e.g. one viewing its operands conjugated
        try:
            out = run_rule(func, dec, targs, tkwargs, tensors)
        except Exception as e:
            # a traced step runs the fallback on meta shards: an op without a meta kernel, or whose
            # result needs its inputs' values (nonzero's shape, allclose's bool), stops the trace clearly
            if kind == "fallback" and seam.current().tracing and not refused():
                why = f"torch cannot run it on meta tensors, without values ({_first_line(e)})"
                raise untraceable(func, why) from e
            raise
    if kind == "fallback" and func not in _FALLBACK_WARNED:  # after the run: a user error is not news
        _warn_fallback(func, tensors)
    return out


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_rule(func, dec: Decision, targs, tkwargs, tensors):
    """Box the inputs, run on every local shard, wrap the outputs. ``tkwargs`` None: ``targs`` are
    the call's own args and tensors are swapped in at ``dec.tensor_args``."""
    mesh = dec.mesh
    positions = dec.positions
    shards_in = []
    for t, spec in zip(tensors, dec.in_specs):
        if type(t) is _GT or isinstance(t, _GT):
            src = t._spec
            shards_in.append(t._shards if src is spec or src.sbp == spec.sbp else t._shards_as(spec))
        else:
            shards = comm.place(t, mesh)  # a plain tensor meeting a GlobalTensor is taken as Broadcast
            rep = spec.with_sbp((_B,) * mesh.ndim)
            shards_in.append(shards if spec == rep else boxing.box(shards, rep, spec))
    if dec.replicated:  # the op sees each whole value with the strides torch would give it (view checks them)
        shards_in = [_with_strides(s, t.stride()) if type(t) is _GT else s for s, t in zip(shards_in, tensors)]
    once = dec.run_once and all(_same_everywhere(s, positions) for s in shards_in)
    fn = dec.local or func._op  # the C++ op itself: skips OpOverload.__call__
    results: list = [None] * mesh.size
    run_at = positions[:1] if once else positions
    same_as: dict = {}
    if dec.mutated and not once and len(positions) > 1:
        run_at, same_as = _plan_writes(dec.mutated, shards_in, positions)
    simple = tkwargs is None
    for p in run_at:
        if simple:
            a = list(targs)
            for i, j in enumerate(dec.tensor_args):
                a[j] = shards_in[i][p]
            kw = {}
        else:
            vals = [s[p] for s in shards_in]
            a = [_fill(x, vals) for x in targs]
            kw = {k: _fill(v, vals) for k, v in tkwargs.items()} if tkwargs else {}
        if dec.size_arg is not None:
            a[dec.size_arg] = list(dec.out_specs[0].local_shape(p))
        if dec.local_ctx:
            results[p] = fn(Shard(p, dec.in_specs, dec.out_specs), *a, **kw)
        else:
            results[p] = fn(*a, **kw)
    if once:
        r0 = results[positions[0]]
        for p in positions[1:]:
            results[p] = r0
    for q, p in same_as.items():
        results[q] = results[p]
    # a written tensor keeps its layout and memory (its views alias it): a result computed in another
    # layout, or on a copy, is written back into its own shards; then its group is told
    for i in dec.mutated:
        t = tensors[i]
        if isinstance(t, _GT):
            aliasing.write_shards(t, shards_in[i], dec.in_specs[i])
            aliasing.wrote(t)
    if dec.replicated:
        return _wrap_replicated(results, positions, mesh, tensors, dec, shards_in)
    if dec.single_out:  # one tensor out, not an input written in place
        return _GT._make(dec.out_specs[0], tuple(results), dec.out_strides[0], device=dec.device)
    if not positions:  # another process's devices: the outputs are known from the decision alone
        return _fill(dec.out_template, [
            tensors[dec.returns_input[k]] if dec.returns_input[k] is not None
            else _GT._make(spec, (None,) * mesh.size, dec.out_strides[k], device=dec.device)
            for k, spec in enumerate(dec.out_specs)
        ])
    first = results[positions[0]]
    outs_local = []
    _collect(first, outs_local)
    per_out = [[None] * mesh.size for _ in outs_local]
    for p in positions:
        flat: list = []
        _collect(results[p], flat)
        for k, v in enumerate(flat):
            per_out[k][p] = v
    wrapped = []
    for k, spec in enumerate(dec.out_specs):
        alias = dec.returns_input[k]
        if alias is not None and isinstance(tensors[alias], _GT):
            wrapped.append(tensors[alias])
        else:
            wrapped.append(_GT._make(spec, tuple(per_out[k]), dec.out_strides[k]))
    return _fill(dec.out_template, wrapped)


def _with_strides(shards: tuple, stride: tuple) -> tuple:
    """Whole-value shards laid out under ``stride`` (a GlobalTensor's own) where they are not and
    those strides address each element once."""
    out, made = [], {}
    for s in shards:
        if s is None or s.stride() == stride or s.numel() <= 1:
            out.append(s)
            continue
        if id(s) not in made:
            dims = sorted((st, n) for n, st in zip(s.shape, stride) if n > 1)
            reach = 0  # the furthest element the smaller strides reach: each stride must pass it
            for st, n in dims:
                if st <= reach:
                    return shards
                reach += (n - 1) * st
            buf = s.new_empty((reach + 1,))
            made[id(s)] = buf.as_strided(tuple(s.shape), stride).copy_(s)
        out.append(made[id(s)])
    return tuple(out)


def _random(func, dec: Decision, targs, tkwargs, tensors):
    """Draw the global value exactly as one device would (same op, same RNG calls, global shape),
    then keep each shard's part: with the same seed, results equal single-device torch."""
    if dec.replicated:
        return _random_replicated(func, dec, targs, tkwargs, tensors)
    w = world()
    dev = w.torch_device(w.local_devices[0])
    full_in = [torch.empty(t.shape, dtype=t.dtype, device=dev) if isinstance(t, GlobalTensor) else t for t in tensors]
    out = func(*_fill_args(targs, full_in), **{k: _fill(v, full_in) for k, v in tkwargs.items()})
    if debug.ENABLED and w.processes > 1:  # every process must draw the same numbers: seed alike
        for d in [full_in[i] for i in dec.mutated] or [out]:
            debug.check_same_value(str(func), d)
    for i in dec.mutated:
        t = tensors[i]
        drawn = _scatter_full(full_in[i], t._spec)
        aliasing.write_shards(t, drawn._shards, t._spec)
        aliasing.wrote(t)
    if dec.mutated:
        return tensors[dec.mutated[0]]
    return _scatter_full(out, dec.out_specs[0])


def _random_replicated(func, dec: Decision, targs, tkwargs, tensors):
    """A random op without a rule: run once, on its inputs' whole values (every process gathers
    them and draws the same numbers), and lay the results out Broadcast. Running it per device
    would draw once per device, and a decomposition may draw other numbers than the op does."""
    if seam.current().tracing:
        raise untraceable(func, "it is a random op without a rule, drawn once on its inputs' gathered values")
    rep = (_B,) * dec.mesh.ndim
    full_in = [_full_value(t) if isinstance(t, GlobalTensor) else t for t in tensors]
    out = func(*_fill_args(targs, full_in), **{k: _fill(v, full_in) for k, v in tkwargs.items()})
    for i in dec.mutated:
        t = tensors[i]
        if isinstance(t, GlobalTensor):
            aliasing.write_shards(t, _scatter_full(full_in[i], t._spec)._shards, t._spec)
            aliasing.wrote(t)

    def wrap(o):
        if isinstance(o, torch.Tensor):
            for i in dec.mutated:  # an in-place result: the written input itself
                if o is full_in[i]:
                    return tensors[i]
            return _scatter_full(o, TensorSpec(tuple(o.shape), o.dtype, dec.mesh, rep))
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(e) for e in o)
        return o

    res = wrap(out)
    if func not in _FALLBACK_WARNED:
        _warn_fallback(func, tensors)
    return res


def _collect(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for e in obj:
            _collect(e, out)


def _same_everywhere(shards, positions) -> bool:
    if not positions:
        return False
    first = shards[positions[0]]
    return all(shards[p] is first for p in positions)


def _region(t) -> tuple:
    """The memory a shard covers: equal regions are the same piece of memory (by storage, so that
    meta shards, which all have address 0, are told apart when a step is traced)."""
    if isinstance(t, torch.Tensor):
        return (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride())
    return (id(t),)


def _plan_writes(mutated, shards_in: list, positions) -> tuple[list, dict]:
    """Shards of several devices may be one piece of memory (Broadcast shares it on CPU).

    A position that reads exactly what an earlier one reads shares its result (the write happens
    once). Otherwise every written piece another position already writes is copied first, so each
    device writes its own. Returns (positions to run at, {skipped position: the one it shares}).
    """
    run_at, same_as = [], {}
    seen_reads: dict = {}
    written: list[set] = [set() for _ in mutated]
    for p in positions:
        reads = tuple(_region(s[p]) for s in shards_in)
        if reads in seen_reads:
            same_as[p] = seen_reads[reads]
            continue
        seen_reads[reads] = p
        for k, i in enumerate(mutated):
            region = _region(shards_in[i][p])
            if region in written[k]:
                new = list(shards_in[i])
                new[p] = new[p].clone()
                shards_in[i] = tuple(new)
                region = _region(new[p])
            written[k].add(region)
        run_at.append(p)
    return run_at, same_as


def _wrap_replicated(results, positions, mesh, tensors, dec, shards_in):
    """Outputs of a replicated run: tensors become Broadcast GlobalTensors."""
    first = results[positions[0]] if positions else None
    w = world()
    if w.processes > 1 and not _covers_all_processes(mesh):
        # processes without a device here learn the result (a value, or tensor shapes) from its owner
        first = _from_owner(first, w.process_of(mesh.devices[0]))
    rep = (_B,) * mesh.ndim

    def wrap(obj, path):
        if isinstance(obj, torch.Tensor):
            for i in dec.mutated:  # in-place result: the mutated input itself
                t = tensors[i]
                if isinstance(t, GlobalTensor) and shards_in[i][positions[0]] is obj:
                    return t
            shards = [None] * mesh.size
            for p in positions:
                shards[p] = _pick(results[p], path)
            spec = TensorSpec(tuple(obj.shape), obj.dtype, mesh, rep)
            return GlobalTensor._make(spec, tuple(shards), obj.stride())
        if isinstance(obj, (list, tuple)):
            return type(obj)(wrap(e, (*path, k)) for k, e in enumerate(obj))
        return obj

    return wrap(first, ())


def _covers_all_processes(mesh: Mesh) -> bool:
    w = world()
    return len({w.process_of(d) for d in mesh.devices}) == w.processes


def _from_owner(obj, src: int):
    """``obj`` as process ``src`` has it, on every process; tensors travel as meta tensors (shapes only)."""
    import torch.distributed as dist

    def meta(o):
        if isinstance(o, torch.Tensor):
            return torch.empty_strided(tuple(o.shape), o.stride(), dtype=o.dtype, device="meta")
        if isinstance(o, (list, tuple)):
            return type(o)(meta(e) for e in o)
        return o

    box = [meta(obj) if world().rank == src else None]
    dist.broadcast_object_list(box, src)
    return obj if world().rank == src else box[0]


def _pick(obj, path):
    for k in path:
        obj = obj[k]
    return obj
