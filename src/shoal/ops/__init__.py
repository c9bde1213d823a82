"""Op rules, one module per family, all in the one registry of ``registry``."""

from . import (
    attention,
    convolution,
    embedding,
    factory,
    foreach,
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
    convolution,
    factory,
    foreach,
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
