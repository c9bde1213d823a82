"""The bundled models, plain torch modules, each with its parallel plans as data beside it.

``shoal.models.gpt.plans(mesh, kind)`` (and bert's, resnet's) give a ``shoal.Plan`` for kind in ``KINDS``.
"""

from . import bert, gpt, kinds, resnet
from .bert import BERT, BERTConfig
from .gpt import GPT, GPTConfig
from .kinds import KINDS
from .resnet import ResNet, ResNetConfig

__all__ = [
    "BERT",
    "BERTConfig",
    "GPT",
    "GPTConfig",
    "KINDS",
    "ResNet",
    "ResNetConfig",
    "bert",
    "gpt",
    "kinds",
    "resnet",
]
