"""Sharded checkpoints: each process writes the slices its devices own as safetensors, plus one
``index.json`` (global shapes, dtypes, saved layouts, which file holds which slice, a sha256 per
file); loading reads only the slices each local shard needs, into any mesh, plan or device count.

``save(path, {"model": m, "optim": opt, "step": 100})`` (``background=True``: returns a ``Saving``
to ``wait()`` on), ``load(path, {"model": m, "optim": opt})``, ``latest(dir)``, ``export(path, out)``,
``describe(path)``. No pickle: loading never runs code.

Modules: ``index`` (the format, finding checkpoints), ``collect`` (what a state mapping holds),
``writing`` (save), ``reading`` (a checkpoint's slices), ``loading`` (load), ``listing`` (export, describe).
"""

from .index import latest
from .listing import describe, export
from .loading import LoadResult, load
from .writing import Saving, save

__all__ = ["save", "load", "latest", "export", "describe", "LoadResult", "Saving"]
