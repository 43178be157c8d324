"""The one adapter over MLX's private API, and why each use is needed.

A ``FullyShardedModule`` (``mlx.nn.layers.distributed.fully_shard``) gathers its
shards with a function it keeps in ``_gather_fn``: its forward is the all_gather, its
vjp the backward's sum_scatter. Two things swap it, for which MLX has no public hook:
:mod:`mlx_nbdist.engine.sharding` guards it so that a gradient fails at once, with a
clear message, on a backend without ``sum_scatter`` (instead of a terse error at
evaluation), and :mod:`mlx_nbdist.engine.gradsync` replaces it for the "before"
gradient (a backward that slices instead of reducing).

A model's own ``shard(group)`` (mlx-lm's) slices some layers in place with
``shard_inplace``, whose layout (axis, segments) only its sharding predicate knows;
every in-place slice goes through ``mlx.nn.layers.distributed._shard``, looked up when
it is called: :func:`shard_predicates` listens there, so that
:mod:`mlx_nbdist.engine.sharding` records each slice's layout as it is made, without
reading any weight.

Checked against mlx 0.32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx


def gather_fn(module: Any) -> Callable[..., Any]:
    """The function a ``FullyShardedModule`` gathers its shards with."""
    return module._gather_fn


def set_gather_fn(module: Any, fn: Callable[..., Any]) -> None:
    """Make ``module`` (a ``FullyShardedModule``) gather its shards with ``fn``."""
    module._gather_fn = fn


@contextmanager
def shard_predicates(paths: dict[int, str]) -> Iterator[dict[str, tuple[Any, Any, tuple]]]:
    """Within: what ``shard_inplace``'s sharding predicate said of each parameter it
    sliced, ``{path: (axis, segments, full shape)}`` (``paths``: each parameter's
    ``id`` to its path in the model; others are not recorded)."""
    import mlx.nn.layers.distributed as mxd

    original = mxd._shard
    said: dict[str, tuple[Any, Any, tuple]] = {}

    def _shard(parameters: Any, sharding_predicate: Callable[..., Any], group: Any = None
               ) -> Any:
        def predicate(path: str, weight: Any) -> Any:
            s = sharding_predicate(path, weight)
            where = paths.get(id(weight))
            if where is not None and s is not None:
                axis, segments = (s, 1) if isinstance(s, int) else s
                said[where] = (axis, segments, tuple(weight.shape))
            return s

        return original(parameters, predicate, group)

    mxd._shard = _shard
    try:
        yield said
    finally:
        mxd._shard = original


@contextmanager
def no_random_draws() -> Iterator[None]:
    """Within: ``mx.random.uniform`` returns zeros and leaves the random state alone.

    MLX's sharded layer constructors (``AllToShardedLinear.__init__`` ...) draw their
    initial weights with ``mx.random.uniform``, advancing the global random key, and
    MLX gives no way to save and restore that key. A plan dry-runs a model's own
    ``shard()`` on one rank only; without this it would leave that rank's random
    state ahead of the others', so later random draws (LoRA's initial weights,
    dropout, sampling) would silently differ between ranks. The constructors'
    weights are replaced by the sliced ones right after, so zeros are harmless.
    """
    original = mx.random.uniform

    def zeros(low: Any = 0.0, high: Any = 1.0, shape: Any = (), dtype: Any = mx.float32,
              *args: Any, **kwargs: Any) -> mx.array:
        return mx.zeros(shape, dtype=dtype)

    mx.random.uniform = zeros
    try:
        yield
    finally:
        mx.random.uniform = original
