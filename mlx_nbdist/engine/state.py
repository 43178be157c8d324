"""What this rank is, once the bootstrap has run: its group, rank, tracker and monitor.

The bootstrap sets it (:func:`install`); everything else on the rank reads it
(:func:`current`, :func:`monitor`). This module imports none of theirs (nor MLX), so
the modules that need the state never import each other for it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .monitor import Monitor
    from .tracker import Tracker


@dataclass
class EngineState:
    """What the bootstrap installed on this engine."""

    world: Any
    rank: int
    size: int
    session_id: str
    tracker: Tracker
    monitor: Monitor


_STATE: EngineState | None = None


def install(state: EngineState) -> None:
    """Make ``state`` this rank's (once: a rank joins one group in its life)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError(f"rank {_STATE.rank} is already bootstrapped")
    _STATE = state


def started() -> bool:
    """Whether this process is a started rank."""
    return _STATE is not None


def current() -> EngineState:
    """The rank's state; raises when called outside a started rank."""
    if _STATE is None:
        raise RuntimeError(
            "this code must run inside a %%mlxdist cell on a started rank "
            "(mlx_nbdist's bootstrap has not run in this process)"
        )
    return _STATE


def own_collectives() -> AbstractContextManager[None]:
    """A context whose collectives are mlx_nbdist's own, left out of the rank's totals
    (:meth:`.tracker.Tracker.internal`); nothing outside a started rank."""
    return nullcontext() if _STATE is None else _STATE.tracker.internal()


def monitor() -> Monitor | None:
    """The rank's monitor, or ``None`` outside a started rank (plain Python, the notebook)."""
    return None if _STATE is None else _STATE.monitor
