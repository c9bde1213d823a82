"""Op rules, one module per family, all in the one registry of ``registry``."""

from . import (
    attention,
    conjugate,
    convolution,
    embedding,
    factory,
    foreach,
    host,
    indexing,
    loss,
    matrix,
    normalization,
    pointwise,
    random,
    recurrent,
    reduction,
    softmax,
    view,
)
from .registry import Call, Rule, Sig, lookup, register, registered_ops

# each family module registers its rules on import; validator samples may live beside them
FAMILIES = (
    attention,
    conjugate,
    convolution,
    factory,
    foreach,
    host,  # kernels for tensor arguments ATen reads above dispatch (no rules)
    matrix,
    pointwise,
    random,
    reduction,
    view,
    normalization,
    softmax,
    loss,
    embedding,
    indexing,
    recurrent,
)

__all__ = ["Call", "Rule", "Sig", "lookup", "register", "registered_ops", "FAMILIES"]
