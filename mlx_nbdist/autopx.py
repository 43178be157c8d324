"""Auto mode: every cell runs on the ranks, like ipyparallel's ``%autopx``.

``%mlxdist auto on`` (and the distributed kernel, where it is on from the start)
adds an IPython input transformer that turns each cell into a ``%%mlxdist`` cell,
except:

* a cell starting with ``%%local`` runs here, on the notebook's client, without
  that line;
* a cell starting with a line or cell magic (``%mlxdist status``, ``%%mlxdist
  --ranks 0``, ``%matplotlib``, ``%%time``...) or a shell escape (``!ls``) is left
  alone: magics are meant for the client (write ``%%mlxdist`` first to run a
  magic on the ranks);
* empty cells.

"Starting with" ignores blank lines and comment lines before the first code line.
``%mlxdist auto off`` removes the transformer.
"""

from __future__ import annotations

from typing import Any

LOCAL = "%%local"
PREFIX = "%%mlxdist\n"


def classify(lines: list[str]) -> str:
    """``ranks``, ``local`` (a ``%%local`` cell), ``client`` (a magic) or ``empty``."""
    for line in lines:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text == LOCAL or text.startswith(LOCAL + " "):
            return "local"
        if text.startswith(("%", "!")):
            return "client"
        return "ranks"
    return "empty"


def transform(lines: list[str]) -> list[str]:
    """The input transformer (IPython's ``input_transformers_cleanup`` protocol)."""
    kind = classify(lines)
    if kind == "ranks":
        return [PREFIX, *lines]
    if kind == "local":
        out = list(lines)
        for i, line in enumerate(out):
            if line.strip().startswith(LOCAL):
                del out[i]
                break
        return out
    return lines


def is_enabled(ip: Any) -> bool:
    """Whether auto mode is on in this shell."""
    return transform in ip.input_transformers_cleanup


def enable(ip: Any) -> None:
    """Turn auto mode on (idempotent)."""
    if not is_enabled(ip):
        ip.input_transformers_cleanup.append(transform)


def disable(ip: Any) -> None:
    """Turn auto mode off (idempotent)."""
    while transform in ip.input_transformers_cleanup:
        ip.input_transformers_cleanup.remove(transform)
