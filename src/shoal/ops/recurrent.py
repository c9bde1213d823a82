"""Recurrent layers: the oneDNN LSTM layer torch runs on CPU (``mkldnn_rnn_layer``) and its backward.

Every sequence runs on its own, so a batch split is local (weights Broadcast, their gradients
Partial sums). The forward's last output is a workspace of oneDNN's own layout, sized by the
batch it ran on: a shard's workspace is no piece of the global one. So the forward returns an
empty workspace (what torch's meta kernel gives too) and the backward first reruns its shard's
forward to rebuild it: an LSTM's backward costs one more forward, and the layer runs on shards.
Packed sequences (``batch_sizes``) have no split rule.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .common import named_args, sig_of
from .empty import pad_empty
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")
# input and output are (time, batch, features) whatever batch_first says (torch's LSTM has
# transposed them already); the states are (batch, hidden)
_SEQ, _ROW = Split(1), Split(0)

# mkldnn_rnn_layer(input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, batch_sizes, mode,
#                  hidden_size, num_layers, has_biases, bidirectional, batch_first, train)
#   -> (output, hy, cy, workspace)
# mkldnn_rnn_layer_backward(input, weight1..weight4, hx_, cx_tmp, output, hy_, cy_, grad_output,
#                  grad_hy, grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train,
#                  bidirectional, batch_sizes, batch_first, workspace)
#   -> (grad_input, grad_weight1..grad_weight4, grad_hx, grad_cx)


def _forward(call: Call) -> list[Sig]:
    if call.arg(8, "batch_sizes"):  # packed
        return []
    return [Sig((_SEQ, _B, _B, _B, _B, _ROW, _ROW), (_SEQ, _ROW, _ROW, _B))]


def _backward(call: Call) -> list[Sig]:
    if call.arg(20, "batch_sizes"):
        return []
    ins = sig_of(named_args(call, 13), (_SEQ, _B, _B, _B, _B, _ROW, _ROW, _SEQ, _ROW, _ROW, _SEQ, _ROW, _ROW)) + (_B,)
    return [Sig(ins, (_SEQ, _P, _P, _P, _P, _ROW, _ROW))]


def _dense(*ts):
    """oneDNN reads its tensors as contiguous memory: a shard of a split dim is a strided view."""
    return [t if t is None else aten.contiguous.default(t) for t in ts]


def _empty_workspace(x):
    return x.new_empty((0,), dtype=torch.uint8)


def _forward_local(call: Call, ins, outs):
    """The shard's forward, its workspace dropped (the backward rebuilds it); an empty shard runs padded."""
    func = call.func

    def run(x, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, biases, bidir, batch_first,
            train):
        x, hx, cx = _dense(x, hx, cx)
        out, hy, cy, _ = func(x, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, biases,
                              bidir, batch_first, train)
        return out, hy, cy, _empty_workspace(x)

    return pad_empty(run)


def _backward_local(call: Call, ins, outs):
    """Reruns the shard's forward for oneDNN's workspace, then its backward; an empty shard runs padded
    (zero gradients in, zero gradients out)."""
    func = call.func

    def run(x, w0, w1, w2, w3, hx, cx, out, hy, cy, g_out, g_hy, g_cy, reverse, mode, hidden, layers, biases,
            train, bidir, batch_sizes, batch_first, workspace):
        x, hx, cx, out, hy, cy, g_out, g_hy, g_cy = _dense(x, hx, cx, out, hy, cy, g_out, g_hy, g_cy)
        with torch.enable_grad():  # the kernel makes no workspace with grad mode off, as in a backward
            workspace = aten.mkldnn_rnn_layer.default(x, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode,
                                                      hidden, layers, biases, bidir, batch_first, True)[3]
        return func(x, w0, w1, w2, w3, hx, cx, out, hy, cy, g_out, g_hy, g_cy, reverse, mode, hidden, layers,
                    biases, train, bidir, batch_sizes, batch_first, workspace)

    return pad_empty(run)


register(aten.mkldnn_rnn_layer.default, Rule(_forward, local=_forward_local, local_ctx=True, name="lstm_layer"))
register(aten.mkldnn_rnn_layer_backward.default,
         Rule(_backward, local=_backward_local, local_ctx=True, name="lstm_layer_backward"))
