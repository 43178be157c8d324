"""Show what gradient synchronisation does to each parameter for one step.

Runs inside a rank; every rank of the group must call :func:`grad_sync` together with
the same model structure. The model is not updated.

What "before" and "after" mean depends on how the model is parallelised:

``dp`` (a plain model, each rank on its own data)
    before: the gradient of this rank's loss; after:
    ``mlx.nn.average_gradients(grads, group=group)`` (one ``all_sum`` per bucket,
    divided by the group size).
``tp`` (layers from ``shard_linear``: ``AllToShardedLinear`` … on the same data)
    MLX synchronises tensor-parallel gradients *inside* the backward: each
    all-to-sharded layer passes its input through ``sum_gradients(group)``, an
    identity whose backward ``all_sum``\\ s the input gradient over the ranks. The
    forward ``all_sum`` of sharded-to-all layers has an identity backward. So:
    before: the gradient computed with ``mlx.nn.layers.distributed.sum_gradients``
    temporarily replaced by a plain identity (the size-1 path MLX itself uses for a
    group of one), i.e. every rank back-propagates only its own shard's contribution;
    after: the real gradient. Parameters that no all-to-sharded layer's input
    depends on get identical before/after (a single Megatron pair fed the data
    directly: every gradient is local); parameters upstream of one (replicated, and
    sharded ones too, e.g. the first pair's weights in a two-pair Megatron stack)
    are the ones the backward ``all_sum`` fixes.
``fsdp`` (a ``FullyShardedModule`` from ``fully_shard``)
    before: this rank's own rows of the full gradient it computed from its data
    (the wrapper's gather function is temporarily swapped for one whose backward
    slices instead of ``sum_scatter``-ing); after: the real shard gradient
    (``sum_scatter`` of every rank's full gradient, divided by the group size).

Limits: one group (no 2-D TP x DP); ``tp`` assumes every rank feeds the same batch
(``max_diff_after`` of replicated parameters shows when they do not); the TP
backward ``all_sum`` moves activation gradients shared by every upstream parameter,
so its calls and bytes per step are reported in every row (``step_calls``,
``step_nbytes``, and in words in ``collective``: ``bwd all_sum/step: K calls, N B``)
and ``nbytes`` is 0 for every ``tp`` row (a
backward where no input of an all-to-sharded layer needs a gradient, e.g. a Megatron
MLP fed the data directly, does no all_sum at all: K = 0); the ``fsdp``
before-gradient ignores ``compute_dtype``, and ``fsdp`` needs a backend with
``sum_scatter`` (MLX 0.32's ring and mpi CPU backends lack it: a clear
``RuntimeError`` is raised there, on every rank). Two forward/backward passes are
run (before and after).

The real step (``dp``: the gradient and its ``average_gradients``; ``tp``/``fsdp``:
the pass with the real synchronisation) runs inside ``timing()``: the notebook's
``gradsync`` passes a :func:`~.profile.recording` of it, so its collectives are
counted and timed (the "before" pass and the rank-0 comparison are not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers import distributed as mxd
from mlx.utils import tree_flatten, tree_unflatten

from ..results import GradSample, ShardMode
from . import _mlx, state
from .sharding import NO_SUM_SCATTER, ParamSpec, has_sum_scatter, param_specs

__all__ = ["grad_sync"]

MODES = ("auto", "dp", "tp", "fsdp")

#: a context manager factory the real step runs in (see the module's docstring)
Timing = Callable[[], AbstractContextManager[Any]]


def grad_sync(
    model: nn.Module,
    loss_fn: Callable[..., mx.array],
    *args: Any,
    group: mx.distributed.Group | None = None,
    mode: str = "auto",
    timing: Timing = nullcontext,
) -> list[GradSample]:
    """Each trainable parameter's gradient on this rank before and after sync.

    Args:
        model: the model (plain, tensor-parallel or ``FullyShardedModule``).
        loss_fn: called as ``loss_fn(model, *args)``, returns a scalar loss (the
            usual ``nn.value_and_grad`` convention).
        *args: the batch (e.g. ``x, y``); in ``dp``/``fsdp`` each rank's own shard
            of the data, in ``tp`` the same batch on every rank.
        group: the group; ``mx.distributed.init()`` when ``None``.
        mode: ``dp``, ``tp``, ``fsdp`` or ``auto`` (``fsdp`` when the model contains
            a ``FullyShardedModule``, ``tp`` when it has sharded layers, else ``dp``).
        timing: the real step (the synchronised pass) runs in ``with timing():``,
            e.g. a :func:`~.profile.recording` that times its collectives.

    Returns:
        One :class:`~mlx_nbdist.results.GradSample` per trainable parameter, in
        model order. ``max_diff_after`` is ``max |after_this_rank - after_rank0|``
        for replicated parameters (0 expected), 0 for sharded ones.

    Raises:
        ValueError: for an unknown ``mode``.
        RuntimeError: ``fsdp`` on a backend without ``sum_scatter``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    group = group or mx.distributed.init()
    specs = param_specs(model, group_size=group.size(), rank=group.rank())
    if mode == "auto":
        mode = _auto_mode(specs)
    step = {"dp": _dp_step, "tp": _tp_step, "fsdp": _fsdp_step}[mode]
    saved = model.parameters()
    try:
        before, after, sync, per_step = step(model, loss_fn, args, group, specs, timing)
        mx.eval(before, after)
    finally:
        model.update(saved)  # a failed pass must not leave unevaluable arrays behind
    replicated = [p for p in after if specs[p].axis is None]
    diffs = _diff_to_rank0({p: after[p] for p in replicated}, group)
    step_calls, step_nbytes = per_step or (None, None)
    return [
        GradSample(
            name=path, rank=group.rank(), replicated=specs[path].axis is None,
            norm_before=_norm(before[path]), norm_after=_norm(after[path]),
            max_diff_after=diffs.get(path, 0.0), shape=tuple(after[path].shape),
            collective=sync[path][0], nbytes=sync[path][1],
            step_calls=step_calls, step_nbytes=step_nbytes,
        )
        for path in after
    ]


def _auto_mode(specs: dict[str, ParamSpec]) -> str:
    modes = {s.mode for s in specs.values()}
    if ShardMode.FSDP in modes:
        return "fsdp"
    return "tp" if modes - {ShardMode.REPLICATED} else "dp"


#: (gradients before sync, after sync, per parameter the collective's text and bytes,
#: the (calls, bytes) of the step's own collective or None: GradSample.step_calls…)
_Step = tuple[
    dict[str, mx.array], dict[str, mx.array], dict[str, tuple[str, int]], tuple[int, int] | None
]


def _grads(model: nn.Module, loss_fn: Callable[..., mx.array], args: tuple) -> dict[str, mx.array]:
    _, grads = nn.value_and_grad(model, loss_fn)(model, *args)
    return dict(tree_flatten(grads))


def _dp_step(
    model: nn.Module, loss_fn: Callable[..., mx.array], args: tuple,
    group: mx.distributed.Group, specs: dict[str, ParamSpec], timing: Timing,
) -> _Step:
    with timing():  # the step as training runs it: this rank's gradient, then the average
        grads = _grads(model, loss_fn, args)
        mx.eval(grads)
        averaged = dict(tree_flatten(nn.average_gradients(
            tree_unflatten(list(grads.items())), group=group)))
        mx.eval(averaged)
    n = group.size()
    sync = {
        p: (f"all_sum / {n} (average_gradients)", g.nbytes) if n > 1 else ("none (1 rank)", 0)
        for p, g in grads.items()
    }
    return grads, averaged, sync, None


def _tp_step(
    model: nn.Module, loss_fn: Callable[..., mx.array], args: tuple,
    group: mx.distributed.Group, specs: dict[str, ParamSpec], timing: Timing,
) -> _Step:
    with _sum_gradients(lambda original: lambda g: _identity):
        before = _grads(model, loss_fn, args)
        mx.eval(before)
    recorded: list[int] = []
    with _sum_gradients(lambda original: _recording(original, recorded)), timing():
        after = _grads(model, loss_fn, args)
        mx.eval(after)
    step = step_collective_text(len(recorded), sum(recorded))
    sync: dict[str, tuple[str, int]] = {}
    for path, g in after.items():
        if not bool(mx.array_equal(before[path], g)):
            # the backward all_sum of an all-to-sharded layer's input gradient changed it
            sync[path] = (f"all_sum of input grads in bwd (sum_gradients; {step})", 0)
        elif specs[path].axis is not None:
            sync[path] = (f"none (local shard gradient; {step})", 0)
        else:
            sync[path] = (f"none (replicated, not synchronised; {step})", 0)
    return before, after, sync, (len(recorded), sum(recorded))


def step_collective_text(calls: int, nbytes: int) -> str:
    """How the tensor-parallel backward synchronised this step, in each row's
    ``collective`` text (for people: the numbers travel as
    ``GradSample.step_calls`` / ``step_nbytes``)."""
    return f"bwd all_sum/step: {calls} call{'' if calls == 1 else 's'}, {nbytes:,} B"


def _identity(x: mx.array) -> mx.array:
    return x


@contextmanager
def _sum_gradients(factory: Callable[[Callable], Callable]) -> Iterator[None]:
    """Temporarily replace ``mlx.nn.layers.distributed.sum_gradients``.

    The distributed layers look the function up in their module at call time, so
    the replacement is seen by every ``AllToShardedLinear`` forward in the block.
    """
    original = mxd.sum_gradients
    mxd.sum_gradients = factory(original)
    try:
        yield
    finally:
        mxd.sum_gradients = original


def _recording(original: Callable, sink: list[int]) -> Callable:
    """``sum_gradients`` that records the bytes of each backward ``all_sum`` it does."""

    @mx.custom_function
    def record(x: mx.array) -> mx.array:
        return x

    @record.vjp
    def record_vjp(x: mx.array, dx: mx.array, _: mx.array) -> mx.array:
        sink.append(dx.nbytes)
        return dx

    def make(group: mx.distributed.Group) -> Callable:
        real = original(group)
        if group.size() == 1:
            return real
        # backward: the cotangent goes through real's all_sum, then through record
        return lambda x: real(record(x))

    return make


def _fsdp_step(
    model: nn.Module, loss_fn: Callable[..., mx.array], args: tuple,
    group: mx.distributed.Group, specs: dict[str, ParamSpec], timing: Timing,
) -> _Step:
    if not has_sum_scatter(group):
        raise RuntimeError(f"grad_sync(mode='fsdp'): {NO_SUM_SCATTER}")
    wrappers = [m for _, m in model.named_modules()
                if isinstance(m, mxd.FullyShardedModule)]
    saved = [_mlx.gather_fn(w) for w in wrappers]
    try:
        for w in wrappers:
            _mlx.set_gather_fn(w, _local_gather(group))
        before = _grads(model, loss_fn, args)
        mx.eval(before)
    finally:
        for w, fn in zip(wrappers, saved, strict=True):
            _mlx.set_gather_fn(w, fn)
    with timing():
        after = _grads(model, loss_fn, args)
        mx.eval(after)
    n = group.size()
    sync = {}
    for path, g in after.items():
        if specs[path].mode == ShardMode.FSDP:
            sync[path] = (f"sum_scatter / {n} (fsdp bwd)", g.nbytes * n)
        else:
            sync[path] = ("none", 0)
    return before, after, sync, None


def _local_gather(group: mx.distributed.Group) -> Callable:
    """FSDP gather whose backward keeps this rank's rows instead of reducing them."""
    rank = group.rank()

    @mx.custom_function
    def gather(shards: list[mx.array]) -> list[mx.array]:
        return [mx.distributed.all_gather(s, group=group) for s in shards]

    @gather.vjp
    def gather_vjp(
        shards: list[mx.array], cotangents: list[mx.array], _: list[mx.array]
    ) -> list[mx.array]:
        return [c[rank * s.shape[0]:(rank + 1) * s.shape[0]].astype(s.dtype)
                for s, c in zip(shards, cotangents, strict=True)]

    return gather


def _norm(g: mx.array) -> float:
    values = np.asarray(g.astype(mx.float32)).astype(np.float64)
    return float(np.linalg.norm(values.ravel()))


def _diff_to_rank0(grads: dict[str, mx.array], group: mx.distributed.Group) -> dict[str, float]:
    """max |g - g_rank0| per parameter, with one ``all_sum`` of rank 0's values."""
    if group.size() == 1 or not grads:
        return dict.fromkeys(grads, 0.0)
    flat = mx.concatenate([g.astype(mx.float32).reshape(-1) for g in grads.values()])
    mine = flat if group.rank() == 0 else mx.zeros_like(flat)
    with state.own_collectives():  # a check of ours, not the step's: not in the totals
        rank0 = mx.distributed.all_sum(mine, group=group)
    diff = np.abs(np.asarray(flat) - np.asarray(rank0))
    out, start = {}, 0
    for path, g in grads.items():
        part = diff[start:start + g.size]
        out[path] = float(part.max()) if part.size else 0.0
        start += g.size
    return out
