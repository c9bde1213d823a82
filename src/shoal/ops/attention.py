"""Attention: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (what
``F.scaled_dot_product_attention`` runs on CPU).

q, k, v are (batch, heads, length, head_dim). Batch and heads are independent: q, k, v (and the mask,
where it is not broadcast along that dim) split alike, and so do out, logsumexp and the gradients.
Queries are independent too when the mask is not causal: q split on its length gives out and
logsumexp split the same way (keys and values whole), and in backward Partial grad_key/grad_value.
out is linear in v, and all gradients are linear in grad_out. Dropout draws random numbers: with
dropout only the replicated signature is offered. The math path (dropout, forced backends) is built
from ops ruled elsewhere (bmm, softmax, pointwise).
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .empty import pad_empty_local
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_sbp(mask: torch.Tensor, d: int, size: int):
    """The mask's SBP when dim ``d`` of the (B, H, L, S) scores is split; it broadcasts from the right."""
    md = d - (4 - mask.ndim)
    if md < 0 or (mask.shape[md] == 1 and size != 1):
        return _B
    return Split(md)


def _splits(q, k, v, mask, causal: bool) -> list[tuple[int, tuple, tuple]]:
    """(dim, SBPs of q, k, v[, mask]) for every dim of the scores that may be split."""
    out = []
    for d in (0, 1):
        if d == 1 and not (q.shape[1] == k.shape[1] == v.shape[1]):
            continue  # grouped-query heads do not line up
        m = () if mask is None else (_mask_sbp(mask, d, q.shape[d]),)
        out.append((d, (Split(d),) * 3, m))
    if not causal:  # a causal mask counts query positions from the start of the shard, not of the sequence
        m = () if mask is None else (_mask_sbp(mask, 2, q.shape[2]),)
        out.append((2, (Split(2), _B, _B), m))
    return out


def _flash(call: Call) -> list[Sig]:
    if call.arg(3, "dropout_p", 0.0):
        return []
    q, k, v = call.ins[:3]
    mask = call.ins[3] if len(call.ins) > 3 else None
    causal = bool(call.arg(4, "is_causal", False))
    sigs = [Sig((*qkv, *m), (Split(d), Split(d))) for d, qkv, m in _splits(q, k, v, mask, causal)]
    sigs.append(Sig((_B, _B, _P) + (() if mask is None else (_B,)), (_P, _B)))  # out is linear in v
    return sigs


def _flash_backward(call: Call) -> list[Sig]:
    if call.arg(6, "dropout_p", 0.0):
        return []
    go, q, k, v = call.ins[:4]
    mask = call.ins[6] if len(call.ins) > 6 else None
    causal = bool(call.arg(7, "is_causal", False))
    sigs = []
    for d, (sq, sk, sv), m in _splits(q, k, v, mask, causal):
        s = Split(d)
        if d < 2:
            sigs.append(Sig((s, sq, sk, sv, s, s, *m), (s, s, s)))
        else:  # keys and values see every query: their gradients are sums over query shards
            sigs.append(Sig((s, sq, sk, sv, s, s, *m), (s, _P, _P)))
    rest = (_B,) * (len(call.ins) - 1)
    sigs.append(Sig((_P, *rest), (_P, _P, _P)))  # every gradient is linear in grad_out
    return sigs


register(_FLASH, Rule(_flash, local=pad_empty_local, local_ctx=True, name="flash_attention"))
register(_FLASH_BACKWARD, Rule(_flash_backward, local=pad_empty_local, local_ctx=True, name="flash_attention_backward"))
