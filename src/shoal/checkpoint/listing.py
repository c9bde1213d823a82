"""A checkpoint for other tools and for people: ``export`` writes its model as one plain safetensors
state dict; ``describe`` lists its tensors, layouts, files and values."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from .index import TMP
from .reading import Source
from .writing import write_safetensors

__all__ = ["export", "describe"]


def export(path: str | os.PathLike, out: str | os.PathLike, prefix: str | None = None, *,
           verify: bool = True) -> Path:
    """Write the module ``prefix`` (default: the checkpoint's one module) of checkpoint ``path`` as
    one plain safetensors state dict under the module's own names (tied weights under each name)."""
    out = Path(out)
    with Source(path, verify) as src:
        prefix = src.module_prefix("export") if prefix is None else prefix
        if prefix and src.kinds.get(prefix) != "module":
            raise ValueError(f"checkpoint.export: {src.path} has no module {prefix!r}; its modules are "
                             f"{src.modules()}")
        cut = len(prefix) + 1 if prefix else 0
        tensors = {n[cut:]: src.read(n, None, src.entry(n).dtype) for n in src.under(prefix)}
    tmp = out.with_name(f"{out.name}{TMP}{secrets.token_hex(4)}")
    try:
        write_safetensors(tmp, tensors, {"format": "pt"})  # "pt": what transformers' loaders look for
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _size(n: float) -> str:
    unit = 0
    while n >= 1024 and unit < 3:
        n, unit = n / 1024, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {('KiB', 'MiB', 'GiB')[unit - 1]}"


def describe(path: str | os.PathLike, *, verify: bool = False) -> str:
    """A readable listing of checkpoint ``path``: each tensor's global shape, dtype, saved layout and
    size, the files and the saved values."""
    with Source(path, verify) as src:
        rows = [("name", "shape", "dtype", "saved layout", "size")]
        for n in sorted(src.names()):
            if n in src.ties:
                rows.append((n, "", "", f"= {src.ties[n]} (tied)", ""))
            else:
                e = src.entry(n)
                rows.append((n, str(list(e.shape)), str(e.dtype).removeprefix("torch."), e.layout or "-",
                             _size(e.nbytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        total = sum(e.nbytes for e in src.entries.values())
        lines = [f"{src.path}: {len(src.entries)} tensors, {_size(total)}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        for f, meta in sorted(src.files.items()):
            lines.append(f"file {f}: {_size(meta['bytes'])}, sha256 {meta['sha256'][:16]}...")
        for k, v in src.values.items():
            if src.kinds.get(k) == "optimizer":
                groups = v["param_groups"]
                hyper = ", ".join(f"{h} {x}" for h, x in groups[0].items() if h != "params") if groups else ""
                lines.append(f"optimizer {k}: {len(groups)} parameter group(s) of "
                             f"{sum(len(g['params']) for g in groups)} parameters; {hyper}")
            else:
                lines.append(f"value {k}: {json.dumps(v)[:200]}")
    return "\n".join(lines)
