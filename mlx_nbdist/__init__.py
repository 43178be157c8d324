"""mlx_nbdist: interactive distributed MLX from a Jupyter notebook.

``%load_ext mlx_nbdist``, then ``%mlxdist start -n 2`` and ``%%mlxdist`` cells run on
every rank of one MLX distributed group.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are; imported on first use
    from .api import comm_stats, current_session, export, start, stop, timeline, trace, where
    from .client.checkpoint import consolidate, read_index, save
    from .client.checkpoint import load as load_checkpoint
    from .client.models import check, gradsync, plan, shard, show, slices
    from .engine.lm import generate, load, lora
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
    from .session.standby import prewarm
    from .viz.dashboard import dashboard

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
    "prewarm",
    "shard",
    "show",
    "slices",
    "start",
    "stop",
    "timeline",
    "trace",
    "where",
]


#: where each public name lives. Every name is imported on first use: ``import
#: mlx_nbdist`` (which every rank does) loads neither the notebook side (sessions,
#: ipyparallel's client, widgets) nor mlx.core, and costs a rank's start nothing
_WHERE = {
    **dict.fromkeys(
        ["comm_stats", "current_session", "export", "start", "stop", "timeline", "trace"],
        "api",
    ),
    "where": "api",
    **dict.fromkeys(["consolidate", "read_index", "save"], "client.checkpoint"),
    **dict.fromkeys(["check", "gradsync", "plan", "shard", "show", "slices"], "client.models"),
    **dict.fromkeys(["log_scalars", "progress"], "engine.progress"),
    **dict.fromkeys(["generate", "load", "lora"], "engine.lm"),
    **dict.fromkeys(
        [
            "CellError",
            "CellInterrupted",
            "CheckpointError",
            "CollectiveTimeout",
            "MLXDistError",
            "NotStartedError",
            "SessionBrokenError",
            "SetupError",
            "ShardingError",
            "StartError",
        ],
        "errors",
    ),
    "ExportError": "history",
    **dict.fromkeys(["CellResult", "RankOutput"], "results"),
    "Session": "session",
    "prewarm": "session.standby",
    "dashboard": "viz.dashboard",
}
_RENAMED = {"load_checkpoint": ("client.checkpoint", "load")}
#: submodules a user reaches as ``mlx_nbdist.NAME`` without importing them first (on a
#: rank: ``mlx_nbdist.script.load_checkpoint(model, directory)``)
_SUBMODULES = ("script",)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    if name in _WHERE:
        module, attr = _WHERE[name], name
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
    else:
        raise AttributeError(f"module 'mlx_nbdist' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), attr)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext mlx_nbdist``: register the magics and make them configurable, and
    start the engines of a plain ``%mlxdist start`` ahead, in the background (see
    :mod:`mlx_nbdist.session.standby`; off with ``c.MLXDist.prewarm = False``)."""
    import warnings

    from . import config
    from .api import current_session
    from .errors import SetupError

    magics = register_magics(ipython)
    if (
        magics.prewarm
        and magics.launcher in ("", "local")
        and getattr(current_session(required=False), "state", "stopped") == "stopped"
    ):
        from .session import standby

        try:
            standby.prewarm(int(magics.n), magics.backend or config.BACKEND)
        except SetupError:  # a bad default (backend, ranks): %mlxdist start will say so
            pass
        except Exception as e:  # noqa: BLE001 - loading the magics must not fail for it
            warnings.warn(f"mlx_nbdist: no engines started ahead ({e})", stacklevel=2)


def register_magics(ipython: Any) -> Any:
    """Register the ``%mlxdist`` magics in ``ipython``; the :class:`~.magics.MLXDist`
    instance (configurable as ``MLXDist``)."""
    from .magics import MLXDist

    magics = MLXDist(shell=ipython)
    ipython.register_magics(magics)
    if magics not in ipython.configurables:
        ipython.configurables.append(magics)
    return magics


def unload_ipython_extension(ipython: Any) -> None:
    from .api import stop
    from .session import standby

    try:
        stop()
    finally:
        standby.discard()
