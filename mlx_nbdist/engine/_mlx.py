"""The one adapter over MLX's private API, and why each use is needed.

A ``FullyShardedModule`` (``mlx.nn.layers.distributed.fully_shard``) gathers its
shards with a function it keeps in ``_gather_fn``: its forward is the all_gather, its
vjp the backward's sum_scatter. Two things swap it, for which MLX has no public hook:
:mod:`mlx_nbdist.engine.sharding` guards it so that a gradient fails at once, with a
clear message, on a backend without ``sum_scatter`` (instead of a terse error at
evaluation), and :mod:`mlx_nbdist.engine.gradsync` replaces it for the "before"
gradient (a backward that slices instead of reducing).

Checked against mlx 0.32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def gather_fn(module: Any) -> Callable[..., Any]:
    """The function a ``FullyShardedModule`` gathers its shards with."""
    return module._gather_fn


def set_gather_fn(module: Any, fn: Callable[..., Any]) -> None:
    """Make ``module`` (a ``FullyShardedModule``) gather its shards with ``fn``."""
    module._gather_fn = fn
