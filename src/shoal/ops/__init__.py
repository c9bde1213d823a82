"""Op rules, one module per family, all in the one registry of ``registry``."""

from . import (
    attention,
    conjugate,
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

# each family module registers its rules on import (their validator samples are in ``samples``)
FAMILIES = (
    attention,
    conjugate,
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
