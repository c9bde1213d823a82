"""Tensor arguments that ATen reads on the host, before shoal's dispatch sees the op.

A few CompositeImplicitAutograd kernels read an argument's memory directly (``tensor_split`` with
a tensor of indices or sections reads it with ``const_data_ptr``). They run above
``__torch_dispatch__``, so on a GlobalTensor, which has no memory of its own, ATen stopped with
"data is not allocated yet". A kernel at the PythonTLSSnapshot key, which only tensor subclasses
(and Python modes) carry, takes such an argument's global value first (gathered, as ``tolist()``
does) and runs torch's own kernel on it; plain tensors never reach it. Graph mode cannot read a
value while tracing and says so.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
# while torch's own kernel runs, this key is passed over (nested ops then reach the Python key directly)
_SNAPSHOT = torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot)


def _host(t, what: str):
    from ..tensor import GlobalTensor

    return t._host_value(what) if isinstance(t, GlobalTensor) else t


def _tensor_split(self, indices_or_sections, dim=0):
    ios = _host(indices_or_sections, "torch.tensor_split(x, tensor)")
    with torch._C._ExcludeDispatchKeyGuard(_SNAPSHOT):
        return aten.tensor_split.tensor_indices_or_sections(self, ios, dim)


# op overload name -> kernel with the op's signature, for the PythonTLSSnapshot key (``shoal.torch_patches``
# registers them)
KERNELS = {"tensor_split.tensor_indices_or_sections": _tensor_split}
