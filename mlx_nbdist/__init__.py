"""mlx_nbdist: interactive distributed MLX from a Jupyter notebook.

``%load_ext mlx_nbdist``, then ``%mlxdist start -n 2`` and ``%%mlxdist`` cells run on
every rank of one MLX distributed group.
"""

from __future__ import annotations

from typing import Any

from .api import comm_stats, current_session, export, start, stop, timeline, trace, where
from .client.checkpoint import consolidate, read_index, save
from .client.checkpoint import load as load_checkpoint
from .client.models import check, gradsync, plan, shard, show, slices
from .engine.progress import log_scalars, progress
from .errors import (
    CellError,
    CellInterrupted,
    CheckpointError,
    CollectiveTimeout,
    MLXDistError,
    NotStartedError,
    SessionBrokenError,
    SetupError,
    ShardingError,
    StartError,
)
from .history import ExportError
from .results import CellResult, RankOutput
from .session import Session

__version__ = "0.1.0"

__all__ = [
    "CellError",
    "CellInterrupted",
    "CellResult",
    "CheckpointError",
    "CollectiveTimeout",
    "ExportError",
    "MLXDistError",
    "NotStartedError",
    "RankOutput",
    "Session",
    "SessionBrokenError",
    "SetupError",
    "ShardingError",
    "StartError",
    "check",
    "comm_stats",
    "consolidate",
    "current_session",
    "dashboard",
    "export",
    "generate",
    "load",
    "load_checkpoint",
    "log_scalars",
    "lora",
    "progress",
    "gradsync",
    "read_index",
    "save",
    "plan",
    "shard",
    "show",
    "slices",
    "start",
    "stop",
    "timeline",
    "trace",
    "where",
]


#: run inside a rank (they load mlx.core and, when called, mlx-lm): imported on use
_ON_RANKS = {"generate", "load", "lora"}


def __getattr__(name: str) -> Any:
    # lazy: `import mlx_nbdist` (also on the ranks) must not load ipywidgets or mlx.core
    if name == "dashboard":
        from .viz.dashboard import dashboard

        return dashboard
    if name in _ON_RANKS:
        from .engine import lm

        return getattr(lm, name)
    raise AttributeError(f"module 'mlx_nbdist' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext mlx_nbdist``: register the magics and make them configurable."""
    from .magics import MLXDist

    magics = MLXDist(shell=ipython)
    ipython.register_magics(magics)
    if magics not in ipython.configurables:
        ipython.configurables.append(magics)


def unload_ipython_extension(ipython: Any) -> None:
    stop()
