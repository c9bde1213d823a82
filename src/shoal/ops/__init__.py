"""Op rules, one module per family, all in the one registry of ``registry``."""

from . import factory, matrix, pointwise, random, reduction, view  # noqa: F401  (each registers its rules)
from .registry import Call, Rule, Sig, lookup, register, registered_ops

__all__ = ["Call", "Rule", "Sig", "lookup", "register", "registered_ops"]
