"""Describe the slice of a (possibly sharded) tensor that this rank holds.

Runs inside a rank. :func:`local_slice` returns one parameter's local values as numpy
plus where they sit in the full tensor; :func:`model_shards` summarises every
parameter of a model without pulling the values. The layout comes from
:func:`mlx_nbdist.engine.sharding.param_specs` (exact for layers sharded by
:func:`mlx_nbdist.engine.sharding.shard`, inferred from the layer class otherwise), so these
functions issue no collective and each rank may call them alone.
"""

from __future__ import annotations

import math
from difflib import get_close_matches

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..results import ShardMode, TensorSlice, summarize
from .dtypes import dtype_name
from .sharding import ParamSpec, head_size, param_specs

__all__ = ["local_slice", "model_shards", "needs_host_copy"]


def local_slice(
    obj: nn.Module | mx.array,
    name: str,
    *,
    max_elements: int | None = None,
    group: mx.distributed.Group | None = None,
) -> TensorSlice:
    """This rank's slice of one parameter, with its place in the full tensor.

    Args:
        obj: a model (``name`` is a parameter path such as ``layers.0.weight``), or
            an ``mx.array`` (described as replicated, ``name`` is only a label).
        name: the parameter path.
        max_elements: when the slice holds more elements than this, ``data`` is a
            strided sample (the same stride on every axis, so a 2-D weight still
            looks like a weight) and ``sampled`` is True. ``None`` pulls everything.
        group: the group the model was sharded over, for this rank's index and for
            ``FullyShardedModule`` parameters; ``mx.distributed.init()`` when ``None``.

    Returns:
        A :class:`~mlx_nbdist.results.TensorSlice`; ``summary`` (min, max, mean,
        std, norm, in float64) covers the whole local slice even when ``data`` is a
        sample. bfloat16 values are converted through float32; quantized weights
        are shown as their packed integers.

    Raises:
        KeyError: ``name`` is not a parameter of ``obj`` (close matches suggested).
    """
    group = group or mx.distributed.init()
    if isinstance(obj, mx.array):
        spec = ParamSpec(path=name, layer="array", mode=ShardMode.REPLICATED, axis=None, segments=1,
                         group_size=1, full_shape=tuple(obj.shape),
                         local_shape=tuple(obj.shape), dtype=dtype_name(obj.dtype),
                         kind="replicated", rank=group.rank())
        return _describe(spec, obj, group.rank(), max_elements, with_data=True)
    params = dict(tree_flatten(obj.parameters()))
    if name not in params:
        close = get_close_matches(name, list(params), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else (
            f"; parameters: {', '.join(list(params)[:20])}" + (" …" if len(params) > 20 else ""))
        raise KeyError(f"{name!r} is not a parameter of {type(obj).__name__}{hint}")
    spec = param_specs(obj, group_size=group.size(), rank=group.rank())[name]
    out = _describe(spec, params[name], group.rank(), max_elements, with_data=True)
    if spec.axis is not None and spec.kind == "sharded":
        size = head_size(obj, name)
        if size and spec.full_shape[spec.axis] % size == 0:
            out.unit = (size, "head")
    return out


def model_shards(
    model: nn.Module, *, group: mx.distributed.Group | None = None
) -> list[TensorSlice]:
    """Summaries (no values) of this rank's slice of every parameter of ``model``.

    Args:
        model: the (possibly sharded) model.
        group: as in :func:`local_slice`.

    Returns:
        One :class:`~mlx_nbdist.results.TensorSlice` per parameter (trainable or
        frozen), in model order, with ``data=None``.
    """
    group = group or mx.distributed.init()
    params = dict(tree_flatten(model.parameters()))
    specs = param_specs(model, group_size=group.size(), rank=group.rank())
    return [_describe(spec, params[path], group.rank(), None, with_data=False)
            for path, spec in specs.items()]


def _describe(
    spec: ParamSpec, arr: mx.array, default_rank: int, max_elements: int | None,
    *, with_data: bool,
) -> TensorSlice:
    values = _to_numpy(arr)
    data = None
    sampled = False
    if with_data:
        data, sampled = _sample(values, max_elements)
    rank = spec.rank if spec.rank is not None else default_rank
    return TensorSlice(
        name=spec.path, rank=rank, shape=tuple(arr.shape), full_shape=tuple(spec.full_shape),
        dtype=dtype_name(arr.dtype), axis=spec.axis, ranges=spec.ranges(), kind=spec.kind,
        data=data, sampled=sampled,
        # sent whole: the notebook computes it when asked (TensorSlice.summary)
        summary={} if data is not None and not sampled else summarize(values),
    )


def needs_host_copy(device_type: str, gpu_backend: str) -> bool:
    """Whether an array must be copied into memory numpy owns before it leaves the rank.

    Args:
        device_type: MLX's default device type (``"cpu"`` or ``"gpu"``).
        gpu_backend: ``"metal"`` (Apple unified memory: the CPU's own pages),
            ``"cuda"``, or ``""`` (no GPU backend).

    A view of a CUDA array (``np.asarray``) may point into device or managed memory,
    which another process (``process_vm_readv``) must never read, so on a GPU other
    than Metal the slice is copied to the host first.
    """
    return device_type == "gpu" and gpu_backend != "metal"


def _gpu_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # mlx >= 0.29 on Linux
    return "cuda" if cuda is not None and cuda.is_available() else ""


def _to_numpy(arr: mx.array) -> np.ndarray:
    if arr.dtype == mx.bfloat16:
        arr = arr.astype(mx.float32)
    device = mx.default_device()
    if device.type == mx.gpu and needs_host_copy("gpu", _gpu_backend()):
        mx.eval(arr)
        return np.array(arr, copy=True)  # host memory this process owns
    return np.asarray(arr)


def _sample(values: np.ndarray, max_elements: int | None) -> tuple[np.ndarray, bool]:
    """A strided view with at most ``max_elements`` elements (one stride for all axes)."""
    if max_elements is None or values.size <= max_elements:
        return values, False  # the caller copies it once, into the transfer
    limit = max(int(max_elements), 1)
    stride = max(1, int(math.ceil((values.size / limit) ** (1 / max(values.ndim, 1)))))
    while math.prod(-(-d // stride) for d in values.shape) > limit:
        stride += 1
    return np.ascontiguousarray(values[(slice(None, None, stride),) * values.ndim]), True
