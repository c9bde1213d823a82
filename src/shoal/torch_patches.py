"""Every change shoal makes to torch, made once, when shoal is imported; each says why.

The functions installed live beside what they serve (``ops.host``, ``ops.foreach``, ``parallel``);
only this module changes torch.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _foreach_supported_types as _OPTIM_FOREACH_TYPES
from torch.utils._foreach_utils import _foreach_supported_types as _UTIL_FOREACH_TYPES

from .ops import foreach, host
from .parallel import onto_param_mesh
from .tensor import GlobalTensor

__all__: list[str] = []

# kept alive: a Library unregisters its kernels when collected
_ATEN = torch.library.Library("aten", "IMPL")

# ATen reads some tensor arguments' memory above __torch_dispatch__ (tensor_split's indices), which a
# GlobalTensor has not: a PythonTLSSnapshot kernel, which only subclasses reach, gives it the global value
for _name, _kernel in host.KERNELS.items():
    _ATEN.impl(_name, _kernel, "PythonTLSSnapshot")

# torch (2.13) has no Meta kernel for the fused optimizers' tensor-lr overloads: dispatch decides layouts
# on meta tensors and graph mode traces on them
for _name, _kernel in foreach.META_KERNELS.items():
    _ATEN.impl(_name, _kernel, "Meta")

# optimizers and clip_grad_norm_ take the multi-tensor (foreach) path only for these types (DTensor
# adds itself too)
for _types in (_UTIL_FOREACH_TYPES, _OPTIM_FOREACH_TYPES):
    if GlobalTensor not in _types:
        _types.append(GlobalTensor)

_POLICY = torch.optim.Optimizer._process_value_according_to_param_policy


def _process_value(param, value, *args, **kwargs):
    return onto_param_mesh(param, _POLICY(param, value, *args, **kwargs))


# Optimizer.load_state_dict casts a loaded state tensor to its parameter's dtype and device only: one
# saved under another plan must also move onto its parameter's mesh
torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(_process_value)
