"""Plan and apply tensor-parallel or fully-sharded layouts with MLX's own API.

Two public functions run inside a rank:

* :func:`plan` describes, before anything moves, what every parameter of a model
  becomes on each rank (a :class:`ShardPlan` of :class:`~mlx_nbdist.results.PlanRow`),
  and collects every problem at once: dimensions not divisible by the group size,
  layouts whose outputs will not equal the unsharded model.
* :func:`shard` checks the plan and applies it through ``mlx.nn.layers.distributed``
  only (``shard_linear``, ``AllToShardedLinear.from_linear``,
  ``ShardedToAllLinear.from_linear``, the ``Quantized*.from_quantized_linear``
  constructors, ``fully_shard`` and ``shard_inplace``): no sharding math is
  reimplemented here.

``sharding`` is one of:

``"all-to-sharded"`` / ``"sharded-to-all"``
    every ``Linear``/``QuantizedLinear`` becomes that layer type.
``"megatron"``
    on a transformer, by role (:mod:`mlx_nbdist.engine.transformer`): q/k/v and
    gate/up all-to-sharded, o and down sharded-to-all, the attention's head counts
    divided by the number of ranks, embeddings and ``lm_head`` replicated. A model
    with its own ``shard(group)`` (24 mlx-lm architectures) is sharded by it, and
    planned by dry-running it on a copy of the module tree. A block the rules cannot
    shard correctly (a norm over all heads' features) is refused, naming it. On a
    model with no transformer block, consecutive ``Linear`` layers in definition order
    alternate all-to-sharded / sharded-to-all (right for a chain such as
    ``nn.Sequential`` whose layers inside a pair act on each value alone, as ReLU
    does: a norm or a softmax there is flagged; elsewhere the plan says what it
    assumed).
``"pipeline"``
    the model's own ``pipeline(group)`` (mlx-lm's ``model.model.pipeline``): each
    rank keeps the layers it runs, rank 0 the last ones; the plan lists the stages.
``"fsdp"``
    the whole model is wrapped with ``fully_shard`` (every parameter split on axis 0,
    all_gather in the forward, sum_scatter in the backward). On a backend without
    ``sum_scatter`` (MLX 0.32's CPU ring and mpi) :func:`shard` warns, and taking a
    gradient raises ``RuntimeError`` (:data:`FSDP_NO_GRADIENTS`) as soon as
    ``nn.value_and_grad`` is called, instead of MLX's "[ring] sum_scatter not
    supported" at evaluation.
``"inplace-all-to-sharded"`` / ``"inplace-sharded-to-all"``
    MLX's ``shard_inplace``: the parameters are sliced but the layers stay ``Linear``
    and insert no collective, so the outputs are wrong unless the forward sums itself.
a mapping ``{layer path or glob: mode}``
    mode per ``Linear``/``QuantizedLinear`` layer; modes are the two TP modes, the
    two inplace modes and ``"replicated"`` (or ``None``). Exact paths win over globs.

What each mode does (the axes it splits, the MLX layer or function that applies it,
the collectives it adds, whether it may stand for the whole model) is one row of
:data:`RULES`, as MLX's own ``shard_linear`` picks its constructor from a dict: a new
mode is a new :class:`~mlx_nbdist.results.ShardMode` member and a new row.

Sharded layers remember how they were sharded (mode, segments, full shapes) in an
attribute, so :mod:`mlx_nbdist.engine.slices` can describe any rank's slice later;
layers sharded by hand are described from their class (see :func:`param_specs`).
"""

from __future__ import annotations

import copy
import fnmatch
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers import distributed as mxd
from mlx.utils import tree_flatten

from ..errors import ShardingError
from ..results import HeadRow, PlanRow, ShardMode, StageRow, count
from . import _mlx, state, transformer
from .dtypes import dtype_name, nbytes

__all__ = [
    "FSDP_NO_GRADIENTS",
    "MEGATRON",
    "PIPELINE",
    "NO_SUM_SCATTER",
    "PIPELINE_NO_GRADIENTS",
    "RULES",
    "STRATEGIES",
    "ModeRule",
    "ParamSpec",
    "ShardMode",
    "ShardPlan",
    "verify_identical",
    "has_sum_scatter",
    "param_specs",
    "plan",
    "shard",
]

#: tensor parallelism: by role in a transformer (the model's own ``shard`` when it has
#: one), else alternating all-to-sharded and sharded-to-all layers of a chain
MEGATRON = "megatron"
#: pipeline parallelism: each rank runs some of the layers (the model's ``pipeline``)
PIPELINE = ShardMode.PIPELINE.value
#: megatron: the mode of the next plain linear layer after a layer of each mode
_MEGATRON_NEXT = {
    ShardMode.ALL_TO_SHARDED: ShardMode.SHARDED_TO_ALL,
    ShardMode.SHARDED_TO_ALL: ShardMode.ALL_TO_SHARDED,
}

_META_ATTR = "_nbdist_shard"
_QUANTIZED_CLASSES = (
    nn.QuantizedLinear,
    mxd.QuantizedAllToShardedLinear,
    mxd.QuantizedShardedToAllLinear,
)
_QUANTIZED_PARAMS = ("weight", "scales", "biases")
_INPLACE_WARNING = (
    "shard_inplace only slices the parameters: the layers stay Linear and insert no "
    "collective, so the model's outputs will NOT equal the unsharded model unless the "
    "forward sums the partial results itself (mx.distributed.all_sum). Use 'megatron' "
    "or the 'all-to-sharded'/'sharded-to-all' modes for layers that communicate."
)
FSDP_NO_GRADIENTS = (
    "mlx_nbdist: cannot compute gradients of a model sharded with 'fsdp' (fully_shard) "
    "here: its backward reduces the gradients with sum_scatter, which this MLX "
    "distributed backend does not implement (MLX 0.32's ring and mpi CPU backends do "
    "not). The fsdp forward (inference) works. To train on this backend, keep the model "
    "whole on every rank and average the gradients (data parallel: "
    "nn.average_gradients(grads, group=world)), or use tensor parallelism "
    "(mlx_nbdist.shard(model, 'megatron')); or use a backend with sum_scatter (nccl)."
)
PIPELINE_NO_GRADIENTS = (
    "mlx_nbdist: cannot compute gradients through a pipelined model: MLX's send and recv, "
    "which carry the hidden state from one stage to the next, have no gradient (vjp), so "
    "mlx-lm's pipeline(group) is for inference (forward, generation). To train, use tensor "
    "parallelism (mlx_nbdist.shard(model, 'megatron')) or data parallelism (the whole "
    "model on every rank, nn.average_gradients)."
)
NO_SUM_SCATTER = (
    "this MLX distributed backend does not implement sum_scatter (MLX 0.32's ring and mpi "
    "CPU backends do not), so the fsdp forward works but its backward, i.e. any gradient "
    "or training step, will raise; use a backend with sum_scatter (nccl) to train"
)

#: ``convert(layer or model, segments, group) -> the sharded layer or model``
Convert = Callable[[nn.Module, int, Any], nn.Module]


@dataclass(frozen=True)
class ModeRule:
    """What one :class:`~mlx_nbdist.results.ShardMode` does: one row of :data:`RULES`.

    Attributes:
        axis: ``axis(name, ndim)``: the axis a parameter of the layer (``weight``,
            ``bias``, ``scales``...) is split on, or ``None`` when every rank holds it all.
        via: the MLX function that applies the mode (shown in plans and warnings).
        convert: how :func:`shard` applies it to one layer (to the whole model when
            ``whole_model``); ``None``: the layer is left as it is.
        layers: the MLX classes a ``Linear`` and a ``QuantizedLinear`` become; a layer
            of one of them found in a model (built by hand) is read as this mode.
        output: what the layer's output is: ``"sharded"`` (split across the ranks),
            ``"whole"`` (it takes a split input and sums it), ``""`` (as its input).
        collectives: the collectives the layer adds per step, from the layer.
        warning: why the sharded model's outputs differ from the full model's (the
            plan and :func:`shard` warn); empty for a mode that computes the same.
        strategy: may be the sharding of a whole model (``shard(model, mode)``).
        whole_model: the mode wraps the whole model and cannot be given per layer.
    """

    axis: Callable[[str, int], int | None]
    via: str = ""
    convert: Convert | None = None
    layers: tuple[type, ...] = ()
    output: str = ""
    collectives: Callable[[nn.Module], str] | None = None
    warning: str = ""
    strategy: bool = True
    whole_model: bool = False


def _split_outputs(name: str, ndim: int) -> int | None:
    """all-to-sharded: a weight's output rows, a bias's last axis (MLX's
    ``_all_to_sharded``)."""
    return ndim - 1 if name.endswith("bias") else max(ndim - 2, 0)


def _split_inputs(name: str, ndim: int) -> int | None:
    """sharded-to-all: a weight's input columns; the bias stays whole."""
    return None if name.endswith("bias") else ndim - 1


def _split_first(name: str, ndim: int) -> int | None:
    return 0 if ndim else None


def _whole(name: str, ndim: int) -> int | None:
    return None


def _shard_linear(sharding: str) -> Convert:
    def convert(layer: nn.Module, segments: int, group: Any) -> nn.Module:
        return mxd.shard_linear(layer, sharding, segments=segments, group=group)

    return convert


def _shard_inplace(sharding: str) -> Convert:
    def convert(layer: nn.Module, segments: int, group: Any) -> nn.Module:
        mxd.shard_inplace(layer, sharding, segments=segments, group=group)
        return layer

    return convert


def _no_collective(layer: nn.Module) -> str:
    return "none (no collective inserted!)"


#: every mode's behaviour; :func:`plan`, :func:`shard` and :func:`param_specs` read it
RULES: dict[ShardMode, ModeRule] = {
    ShardMode.ALL_TO_SHARDED: ModeRule(
        axis=_split_outputs,
        via="shard_linear",
        convert=_shard_linear("all-to-sharded"),
        layers=(mxd.AllToShardedLinear, mxd.QuantizedAllToShardedLinear),
        output="sharded",
        collectives=lambda m: f"bwd all_sum of input grad (..., {_linear_dims(m)[0]})",
    ),
    ShardMode.SHARDED_TO_ALL: ModeRule(
        axis=_split_inputs,
        via="shard_linear",
        convert=_shard_linear("sharded-to-all"),
        layers=(mxd.ShardedToAllLinear, mxd.QuantizedShardedToAllLinear),
        output="whole",
        collectives=lambda m: f"fwd all_sum (..., {_linear_dims(m)[1]})",
    ),
    ShardMode.FSDP: ModeRule(
        axis=_split_first,
        via="fully_shard",
        convert=lambda model, segments, group: _fully_shard(model, group),
        collectives=lambda m: "fwd all_gather + bwd sum_scatter",
        whole_model=True,
    ),
    ShardMode.INPLACE_ALL_TO_SHARDED: ModeRule(
        axis=_split_outputs,
        via="shard_inplace",
        convert=_shard_inplace("all-to-sharded"),
        output="sharded",
        collectives=_no_collective,
        warning=_INPLACE_WARNING,
    ),
    ShardMode.INPLACE_SHARDED_TO_ALL: ModeRule(
        axis=_split_inputs,
        via="shard_inplace",
        convert=_shard_inplace("sharded-to-all"),
        output="whole",
        collectives=_no_collective,
        warning=_INPLACE_WARNING,
    ),
    ShardMode.PIPELINE: ModeRule(
        axis=_whole,
        via="pipeline",
        convert=lambda model, segments, group: _pipeline(model, group),
        collectives=lambda m: "fwd recv from the stage before, send to the next; all_gather",
        whole_model=True,
    ),
    ShardMode.REPLICATED: ModeRule(axis=_whole, strategy=False),
}
#: the names :func:`plan` and :func:`shard` take as the sharding of a whole model
STRATEGIES = (MEGATRON, *(m.value for m, r in RULES.items() if r.strategy))
#: the modes a ``{layer path or glob: mode}`` mapping may give
_LAYER_MODES = tuple(m for m, r in RULES.items() if not r.whole_model)
#: the mode of a layer built by hand from its class
_BY_CLASS = {cls: mode for mode, r in RULES.items() for cls in r.layers}


def _mode(value: Any) -> ShardMode | None:
    """``value`` as a :class:`ShardMode`, or ``None`` when it is none of them."""
    try:
        return ShardMode(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class _LayerShard:
    """What :func:`shard` did to one layer (kept as an attribute on the layer)."""

    mode: ShardMode
    segments: int
    #: full (unsharded) shape of each parameter, keyed by the path inside the layer.
    full_shapes: dict[str, tuple[int, ...]]
    group_size: int


@dataclass
class _Sliced:
    """Parameters a model's own ``shard`` sliced in place, the layer keeping its class
    (mlx-lm slices MoE experts so), by name: ``(axis, full shape, group size,
    segments)``, as ``shard_inplace``'s predicate said. Kept as an attribute on the
    layer, as :class:`_LayerShard`; without it they would be described as whole on
    every rank (a false "diverged", a refused save)."""

    params: dict[str, tuple[int, tuple[int, ...], int, int]]


#: the attribute a layer keeps its :class:`_Sliced` in
_SLICED_ATTR = "_nbdist_sliced"


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is laid out across the ranks.

    Attributes:
        path: parameter path in the model, e.g. ``layers.0.weight``.
        layer: class name of the module that owns the parameter.
        mode: ``all-to-sharded``, ``sharded-to-all``, ``fsdp``, ``inplace-…`` or
            ``replicated`` (the mode of the owning layer; a sharded-to-all bias has
            this layer mode but ``axis is None``).
        axis: the sharded axis (non-negative) or ``None`` when every rank holds it all.
        segments: number of fused segments the axis was split in (1 normally).
        group_size: number of ranks the parameter is split over (1 when replicated).
        full_shape: shape of the unsharded parameter.
        local_shape: shape on each rank.
        dtype: MLX dtype name.
        kind: ``sharded``, ``replicated`` or ``quantized`` (packed weight, scales, biases).
        rank: this rank's index in the sharding group, when known.
    """

    path: str
    layer: str
    mode: ShardMode
    axis: int | None
    segments: int
    group_size: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    kind: str
    rank: int | None = None

    def ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` blocks of the full tensor along ``axis`` held by ``rank``.

        Returns:
            One block per segment; empty for replicated parameters or unknown rank.
        """
        if self.axis is None or self.rank is None:
            return []
        full = self.full_shape[self.axis]
        seg = full // self.segments
        block = seg // self.group_size
        return [
            (s * seg + self.rank * block, s * seg + (self.rank + 1) * block)
            for s in range(self.segments)
        ]


@dataclass
class ShardPlan:
    """A sharding plan: one row per parameter, and what is wrong with it.

    Plain data (picklable) so it can travel from a rank to the notebook.

    Attributes:
        sharding: the requested strategy (a mapping is kept as a dict of strings).
        group_size: number of ranks planned for.
        segments: fused segments per sharded axis.
        rows: one :class:`PlanRow` per parameter, in model order.
        problems: errors that make :func:`shard` refuse the plan (see :meth:`check`).
        warnings: layouts that will run but whose outputs are probably not what the
            user expects (inplace sharding, sharded activations leaking out…).
        layer_modes: mode chosen for each layer that :func:`shard` will convert.
        heads: per attention block, the heads each rank keeps (tensor parallel).
        stages: per rank, the layers it runs (pipeline).
        own: the model's own method :func:`shard` calls (``Model.shard``), or ``""``.
    """

    sharding: str | dict[str, str | None]
    group_size: int
    segments: int
    rows: list[PlanRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    layer_modes: dict[str, ShardMode] = field(default_factory=dict)
    heads: list[HeadRow] = field(default_factory=list)
    stages: list[StageRow] = field(default_factory=list)
    own: str = ""

    @property
    def ok(self) -> bool:
        """True when :meth:`check` would not raise."""
        return not self.problems

    @property
    def bytes_per_rank(self) -> int:
        """Parameter bytes each rank holds after sharding (pipelined: the largest stage)."""
        if self.stages:
            return max(s.param_bytes for s in self.stages)
        return sum(r.bytes_per_rank for r in self.rows)

    def check(self) -> ShardPlan:
        """Raise if the plan cannot be applied.

        Returns:
            The plan itself, so ``plan(...).check()`` can be chained.

        Raises:
            ShardingError: listing every problem (every offending parameter).
        """
        if self.problems:
            head = (
                f"cannot shard with {self._strategy_text()} across "
                f"{count(self.group_size, 'rank')}: {count(len(self.problems), 'problem')}"
            )
            raise ShardingError("\n  - ".join([head, *self.problems]))
        return self

    def _strategy_text(self) -> str:
        return repr(self.sharding) if isinstance(self.sharding, dict) else f"'{self.sharding}'"

    def __str__(self) -> str:
        """A summary line, then the table the notebook shows too
        (:func:`mlx_nbdist.viz.format_plan`)."""
        from ..viz.plan import extras_of, format_plan

        lines = [
            f"ShardPlan {self._strategy_text()} over {self.group_size} ranks"
            + (f", segments={self.segments}" if self.segments != 1 else "")
            + f": {len(self.rows)} parameters, {self.bytes_per_rank:,} bytes per rank",
            format_plan(self.rows, self.group_size, **extras_of(self)),
        ]
        if any(r.layer.startswith("Quantized") for r in self.rows):
            lines.append("quantized weights are packed (uint32 holds 32/bits values); "
                         "scales/biases have input_dims/group_size columns")
        return "\n".join(lines)


# --------------------------------------------------------------------------- walking


@dataclass
class _Node:
    path: str
    module: nn.Module
    parent: Any  # the Module, dict or list that holds it (None for the root)
    key: Any  # its key or index in ``parent``


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _walk(model: nn.Module) -> list[_Node]:
    """Every module in definition order (pre-order; attributes, then list items)."""
    # an explicit stack, not a recursive closure: a closure that calls itself is a
    # reference cycle, which kept the walked modules (and through them, lazily loaded
    # weights) alive until the next garbage collection
    nodes: list[_Node] = []
    stack: list[tuple[Any, str, Any, Any]] = [(model, "", None, None)]
    while stack:
        value, path, parent, key = stack.pop()
        if isinstance(value, nn.Module):
            nodes.append(_Node(path, value, parent, key))
            items = list(value.items())
        elif isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        stack.extend((v, _join(path, k), value, k) for k, v in reversed(items)
                     if isinstance(v, (dict, list)))
    return nodes


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def _direct_params(node: _Node, nodes_by_path: dict[str, _Node]) -> list[tuple[str, mx.array]]:
    """Parameters owned by this module (not by a child module), with full paths."""
    out = []
    for key, arr in tree_flatten(node.module.parameters()):
        path = _join(node.path, key)
        if _owner_path(path, nodes_by_path) == node.path:
            out.append((path, arr))
    return out


def _owner_path(param_path: str, nodes_by_path: dict[str, _Node]) -> str:
    parts = param_path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in nodes_by_path:
            return candidate
    return ""


def _kind(module: nn.Module, name: str, axis: int | None) -> str:
    if isinstance(module, _QUANTIZED_CLASSES) and name in _QUANTIZED_PARAMS:
        return "quantized"
    return "replicated" if axis is None else "sharded"


def _fsdp_ancestor(path: str, nodes_by_path: dict[str, _Node]) -> _Node | None:
    parts = path.split(".") if path else []
    for i in range(len(parts) + 1):
        node = nodes_by_path.get(".".join(parts[:i]))
        if node is not None and isinstance(node.module, mxd.FullyShardedModule):
            return node
    return None


# --------------------------------------------------------------------------- specs


def param_specs(
    model: nn.Module, *, group_size: int | None = None, rank: int | None = None
) -> dict[str, ParamSpec]:
    """Describe how every parameter of ``model`` is laid out now.

    Layers sharded by :func:`shard` carry their exact metadata (mode, segments, full
    shapes). Otherwise the layout is inferred from the layer class:
    ``AllToShardedLinear`` shards weight on axis 0 and bias on its last axis,
    ``ShardedToAllLinear`` shards weight on its last axis and replicates the bias
    (the quantized classes do the same for weight, scales and biases), everything
    under a ``FullyShardedModule`` is split on axis 0, and all other parameters are
    replicated. Inferred layouts assume ``segments == 1``. A plain ``Linear`` that
    the user sliced with ``shard_inplace`` directly cannot be told apart from an
    unsharded one and is reported as replicated.

    Args:
        model: the (possibly sharded) model.
        group_size: ranks for parameters under a ``FullyShardedModule`` (which does
            not keep its group); tensor-parallel layers use their own ``group``.
            Defaults to the size of ``mx.distributed.init()``.
        rank: this rank's index, stored in the specs so that
            :meth:`ParamSpec.ranges` works; tensor-parallel layers use their group's.

    Returns:
        ``{parameter path: ParamSpec}`` in model order.
    """
    nodes = _walk(model)
    by_path = {n.path: n for n in nodes}
    specs: dict[str, ParamSpec] = {}
    for node in nodes:
        for path, arr in _direct_params(node, by_path):
            specs[path] = _spec_for(path, arr, node, by_path, group_size, rank)
    return specs


def _default_group_size(group_size: int | None) -> int:
    return group_size if group_size is not None else mx.distributed.init().size()


def _spec_for(
    path: str,
    arr: mx.array,
    node: _Node,
    by_path: dict[str, _Node],
    group_size: int | None,
    rank: int | None,
) -> ParamSpec:
    module = node.module
    name = path[len(node.path) + 1:] if node.path else path
    local = tuple(arr.shape)
    common = {"path": path, "layer": type(module).__name__, "local_shape": local,
              "dtype": dtype_name(arr.dtype)}

    wrapper = _fsdp_ancestor(node.path, by_path)
    if wrapper is not None:
        meta = getattr(wrapper.module, _META_ATTR, None)
        rel = path[len(wrapper.path) + 1:] if wrapper.path else path
        if meta is not None and rel in meta.full_shapes:
            n = meta.group_size
            full = meta.full_shapes[rel]
        else:
            n = _default_group_size(group_size)
            full = (local[0] * n, *local[1:])
        return ParamSpec(mode=ShardMode.FSDP, axis=0, segments=1, group_size=n,
                         full_shape=full, kind=_kind(module, name, 0), rank=rank, **common)

    meta = getattr(module, _META_ATTR, None)
    tp_mode = _BY_CLASS.get(type(module))
    if meta is not None:
        mode, segments, n = meta.mode, meta.segments, meta.group_size
        full = meta.full_shapes.get(name, local)
    elif tp_mode is not None:
        mode, segments, n = tp_mode, 1, module.group.size()
        full = None
    elif name in getattr(getattr(module, _SLICED_ATTR, None), "params", {}):
        axis, full, n, segments = getattr(module, _SLICED_ATTR).params[name]
        # its inputs split (a weight's last axis) or its outputs (a bias, experts' rows)
        mode = (ShardMode.INPLACE_SHARDED_TO_ALL if axis == len(local) - 1 > 0
                else ShardMode.INPLACE_ALL_TO_SHARDED)
        return ParamSpec(mode=mode, axis=axis, segments=segments, group_size=n,
                         full_shape=full, kind=_kind(module, name, axis), rank=rank, **common)
    else:
        return ParamSpec(mode=ShardMode.REPLICATED, axis=None, segments=1, group_size=1,
                         full_shape=local, kind=_kind(module, name, None), rank=rank,
                         **common)

    axis = RULES[mode].axis(name, len(local))
    if full is None:
        full = local if axis is None else tuple(
            d * n if i == axis else d for i, d in enumerate(local))
    layer_group = getattr(module, "group", None)
    if layer_group is not None and not isinstance(layer_group, (int, str)):
        rank = layer_group.rank()
    return ParamSpec(mode=mode, axis=axis, segments=segments,
                     group_size=n if axis is not None else 1, full_shape=full,
                     kind=_kind(module, name, axis), rank=rank, **common)


# --------------------------------------------------------------------------- planning


def plan(
    model: nn.Module,
    sharding: str | Mapping[str, str | None] = "megatron",
    *,
    group_size: int,
    segments: int = 1,
) -> ShardPlan:
    """Describe what :func:`shard` would do, without touching the model.

    Needs no distributed group: only the number of ranks.

    Args:
        model: the unsharded (or partly hand-sharded) model.
        sharding: a strategy name (see the module docstring) or a mapping
            ``{layer path or glob: mode}``.
        group_size: the number of ranks to plan for.
        segments: fused segments per sharded axis (e.g. 3 for a fused QKV weight);
            every sharded dimension must be divisible by ``group_size * segments``.

    Returns:
        The :class:`ShardPlan`; dimension problems are collected in
        ``plan.problems`` (call ``.check()`` to raise), suspicious layouts in
        ``plan.warnings``.

    Raises:
        ShardingError: for an unknown strategy or mode, a mapping that names paths
            that are not in the model or modules that are not linear layers, or
            invalid ``group_size``/``segments``.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ShardingError(f"group_size must be a positive int, got {group_size!r}")
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ShardingError(
            f"segments must be a positive int, got {segments!r} "
            "(fractional segment lists are not supported by mlx_nbdist)")
    nodes = _walk(model)
    by_path = {n.path: n for n in nodes}
    key = dict(sharding) if isinstance(sharding, Mapping) else sharding
    result = ShardPlan(sharding=key, group_size=group_size, segments=segments)

    mode = None if isinstance(sharding, Mapping) else _mode(sharding)
    if mode == ShardMode.PIPELINE:
        _plan_pipeline(model, nodes, by_path, result)
        return result
    if isinstance(model, mxd.FullyShardedModule) or (mode is not None and RULES[mode].whole_model):
        _plan_fsdp(model, nodes, by_path, result)
        return result
    blocks = transformer.find_blocks([(n.path, n.module) for n in nodes],
                                     sharded=_tensor_parallel)
    if isinstance(sharding, Mapping):
        modes = _resolve_mapping(sharding, nodes)
    elif sharding == MEGATRON and blocks:
        if _staged_prefix(model):
            raise ShardingError(f"{type(model).__name__} is already pipelined (each rank "
                                "holds other layers): shard the whole model instead")
        if _own_shard(model) and not any(_current_mode(n.module) for n in nodes):
            _plan_own_shard(model, nodes, by_path, blocks, result)
            return result
        modes = _resolve_roles(blocks, result)
    elif sharding == MEGATRON or (mode is not None and RULES[mode].strategy):
        modes = _resolve_strategy(mode or MEGATRON, nodes)
        if mode is None:
            _note_order_pairing(nodes, modes, result)
    else:
        raise ShardingError(
            f"unknown sharding {sharding!r}; use one of {', '.join(STRATEGIES)} "
            "or a mapping {layer path or glob: mode}")
    result.layer_modes = {p: m for p, m in modes.items() if RULES[m].convert is not None}
    again = _refuse_resharding(nodes, by_path, result,
                               strategy=None if isinstance(sharding, Mapping) else sharding)
    if not again:  # (a sharded block's head counts are its rank's share already)
        _plan_heads(blocks, result)
    _plan_layers(nodes, by_path, modes, result)
    _flag_flow(nodes, by_path, modes, result, blocks)
    return result


def _refuse_resharding(nodes: list[_Node], by_path: dict[str, _Node], result: ShardPlan,
                       *, strategy: str | None) -> bool:
    """A layer is sharded once: converting a layer MLX already sharded fails deep in
    MLX (or slices its slice again). A one-mode strategy applies to a model none of
    whose layers is sharded yet (on a sharded one it would convert what is left, e.g.
    only the head); megatron continues a hand-sharded start by its pairs, but not a
    model with nothing left to convert; a mapping (``strategy`` None) names its
    layers."""
    again = {p: _current_mode(by_path[p].module) for p in result.layer_modes}
    again = {p: m for p, m in again.items() if m is not None}
    if not again and strategy is not None and (strategy != MEGATRON or not result.layer_modes):
        again = {n.path: m for n in nodes if (m := _current_mode(n.module)) is not None}
    if not again:
        return False
    listed = ", ".join(f"{p or '(root)'} ({m})" for p, m in list(again.items())[:4])
    more = f" and {len(again) - 4} more" if len(again) > 4 else ""
    result.problems.append(
        f"already sharded: {listed}{more}. A model is sharded once: build it again (with "
        "the same seed on every rank) to shard it another way")
    return True


def head_size(model: nn.Module, param_path: str) -> int | None:
    """The rows (or, for an output projection, columns) of one attention head along
    ``param_path``'s sharded axis, when the parameter belongs to an attention block's
    projection; ``None`` otherwise."""
    owner = param_path.rsplit(".", 1)[0]
    nodes = _walk(model)
    blocks = transformer.find_blocks([(n.path, n.module) for n in nodes],
                                     sharded=_tensor_parallel)
    for block in blocks:
        if block.kind == transformer.BlockKind.ATTENTION and owner in block.modes:
            return block.head_dim or None
    return None


def _tensor_parallel(module: nn.Module) -> bool:
    return _current_mode(module) is not None


def tensor_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a tensor-parallel (or ``shard_inplace``-sliced) layer."""
    return _tensor_parallel(module)


def _own_shard(model: nn.Module) -> str:
    """``"Model.shard"`` when the model defines its own ``shard(group)`` (mlx-lm's do)."""
    method = getattr(type(model), "shard", None)
    return f"{type(model).__name__}.shard" if callable(method) else ""


def _own_pipeline(model: nn.Module) -> nn.Module | None:
    """The module whose ``pipeline(group)`` splits the layers (mlx-lm: ``model.model``)."""
    for candidate in (getattr(model, "model", None), model):
        if isinstance(candidate, nn.Module) and callable(
                getattr(type(candidate), "pipeline", None)):
            return candidate
    return None


def _resolve_roles(blocks: list[transformer.Block], result: ShardPlan) -> dict[str, ShardMode]:
    """megatron on a transformer: every block's projections by role, heads divided."""
    modes: dict[str, ShardMode] = {}
    for block in blocks:
        if block.refusal:
            result.problems.append(
                f"megatron cannot shard {block.name} correctly: {block.refusal}")
        else:
            modes.update(block.modes)
    return modes


def _plan_heads(blocks: list[transformer.Block], result: ShardPlan) -> None:
    """Attention blocks whose projections this plan shards by role (megatron, or a
    mapping that names them so): their heads are divided, so they must divide."""
    for block in blocks:
        if block.kind != transformer.BlockKind.ATTENTION or block.refusal or any(
                result.layer_modes.get(p) != m for p, m in block.modes.items()):
            continue
        row = block.head_row(result.group_size)
        result.heads.append(row)
        if row.problem:
            result.problems.append(row.problem)


def _note_order_pairing(nodes: list[_Node], modes: dict[str, ShardMode],
                        result: ShardPlan) -> None:
    """megatron on a model that is not a transformer pairs layers in definition order:
    provably right for a chain (``nn.Sequential``), else say what was assumed."""
    unchained = [p for p in modes if not _in_sequential(p, nodes)]
    if unchained:
        pairs = ", ".join(f"{p} {m}" for p, m in modes.items())
        result.warnings.append(
            f"megatron found no transformer block (attention with q/k/v/o projections, an MLP "
            f"with gate/up/down or fc1/fc2), so it paired the Linear layers in the order they "
            f"are defined ({pairs}): right only if the forward calls them one after the other "
            "in that order; for any other flow give a mapping {layer path: mode}")


def _in_sequential(path: str, nodes: list[_Node]) -> bool:
    parent = path.rsplit(".", 2)[0] if path.count(".") >= 2 else ""
    by_path = {n.path: n for n in nodes}
    owner = by_path.get(parent)
    return owner is not None and isinstance(owner.module, nn.Sequential) and (
        path.split(".")[-2] == "layers")


class _PlanningGroup:
    """Stands in for a group of ``size`` ranks while a model's own ``shard(group)`` or
    ``pipeline(group)`` is dry-run on a copy of its module tree: MLX's layer
    constructors and mlx-lm's methods only ask ``size()`` and ``rank()`` then (the
    sliced arrays stay lazy and are never evaluated)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _structure_copy(value: Any) -> Any:
    """A copy of a module tree whose modules, lists and dicts are new but whose arrays
    are the same (nothing is copied or evaluated)."""
    if isinstance(value, nn.Module):
        new = copy.copy(value)
        for key, child in value.items():
            if isinstance(child, (nn.Module, list, dict)):
                new[key] = _structure_copy(child)
        return new
    if isinstance(value, list):
        return [_structure_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _structure_copy(v) for k, v in value.items()}
    return value


def _plan_own_shard(model: nn.Module, nodes: list[_Node], by_path: dict[str, _Node],
                    blocks: list[transformer.Block], result: ShardPlan) -> None:
    """megatron on a model with its own ``shard(group)``: the plan is that method,
    dry-run on a copy of the module tree, so it shows exactly what :func:`shard` does."""
    n_ranks = result.group_size
    result.own = _own_shard(model)
    result.heads = [b.head_row(n_ranks) for b in blocks
                    if b.kind == transformer.BlockKind.ATTENTION]
    result.problems += [h.problem for h in result.heads if h.problem]
    if result.segments != 1:
        result.problems.append(f"{result.own}() takes no segments")
    sharded = None
    if not result.problems:
        sharded = _structure_copy(model)
        try:
            with _mlx.no_random_draws():  # a plan on one rank must not move its random key
                sharded.shard(_PlanningGroup(n_ranks))
        except Exception as e:  # noqa: BLE001 - the model's own code: report what it said
            result.problems.append(
                f"{result.own}() cannot shard this model across {n_ranks} ranks: "
                f"{type(e).__name__}: {e}")
            sharded = None
    if sharded is None:  # show what the roles would do, with the problems above
        modes = {p: m for b in blocks if not b.refusal for p, m in b.modes.items()}
        _plan_layers(nodes, by_path, modes, result)
        return
    after = _walk(sharded)
    after_by_path = {n.path: n for n in after}
    for node in nodes:
        new = after_by_path.get(node.path)
        for path, arr in _direct_params(node, by_path):
            result.rows.append(_own_row(path, arr, node, new, n_ranks))
            if new is not None and type(new.module) is not type(node.module):
                mode = _current_mode(new.module)
                if mode is not None:
                    result.layer_modes[node.path] = mode
    after_blocks = transformer.find_blocks([(n.path, n.module) for n in after],
                                           sharded=_tensor_parallel)
    layers = {n.path: n.module for n in after}
    result.warnings += _block_layouts(after_blocks, layers, {}, n_ranks)[1]


def _remember_sliced(model: nn.Module, classes: dict[str, type],
                     said: dict[str, tuple[Any, Any, tuple]], n_ranks: int) -> None:
    """Mark what the model's own ``shard`` sliced in place (see :class:`_Sliced`), in
    the layout ``shard_inplace``'s predicate gave it (``said``: see
    :func:`~mlx_nbdist.engine._mlx.shard_predicates`). Segments given as fractions or
    offsets (a list), and slices made by hand (``w[rank * k:]``), are left looking
    whole, as before: a save then refuses them, naming them."""
    nodes = _walk(model)
    by_path = {n.path: n for n in nodes}
    for node in nodes:
        if type(node.module) is not classes.get(node.path):
            continue  # a new layer (MLX's sharded Linear): its class says how it is split
        sliced = {}
        for path, arr in _direct_params(node, by_path):
            if path not in said:
                continue
            axis, segments, full = said[path]
            if not isinstance(segments, int) or not full or arr.ndim != len(full):
                continue
            axis = int(axis) % len(full)
            if tuple(arr.shape) != full:
                name = path[len(node.path) + 1:] if node.path else path
                sliced[name] = (axis, tuple(full), n_ranks, segments)
        if sliced:
            setattr(node.module, _SLICED_ATTR, _Sliced(sliced))


def _own_row(path: str, arr: mx.array, node: _Node, new: _Node | None, n_ranks: int
             ) -> PlanRow:
    """A plan row read from the module before and after the model's own ``shard``."""
    name = path[len(node.path) + 1:] if node.path else path
    full = tuple(arr.shape)
    local_arr = dict(tree_flatten(new.module.parameters())).get(name) if new else None
    local = tuple(local_arr.shape) if local_arr is not None else full
    axis = next((i for i, (a, b) in enumerate(zip(full, local, strict=True)) if a != b), None)
    module = new.module if new is not None else node.module
    mode = _current_mode(module) or ShardMode.REPLICATED
    label = type(node.module).__name__
    if type(module) is not type(node.module):
        label += f" -> {type(module).__name__}"
    elif axis is not None:
        label += " (sliced in place by the model's shard)"
    collective = ""
    if RULES[mode].layers and name == "weight":
        collective = _layer_collective(module, mode)
    return PlanRow(path=path, layer=label, mode=mode, full_shape=full, local_shape=local,
                   axis=axis, dtype=dtype_name(arr.dtype),
                   bytes_per_rank=nbytes(local, arr.dtype), collectives_per_step=collective)


def _plan_pipeline(model: nn.Module, nodes: list[_Node], by_path: dict[str, _Node],
                   result: ShardPlan) -> None:
    """pipeline: which rank runs which layers, from the model's own ``pipeline(group)``
    dry-run on a copy for every rank (mlx-lm gives rank 0 the last layers)."""
    n_ranks = result.group_size
    inner = _own_pipeline(model)
    if inner is None:
        has = [n for n in ("qwen2", "qwen3_moe", "deepseek_v3", "glm4_moe", "ministral3")]
        result.problems.append(
            f"{type(model).__module__}.{type(model).__name__} has no pipeline(group) method "
            f"(mlx-lm gives one to {', '.join(has)} and a few more, not to every "
            "architecture): use megatron (tensor parallel) for this model")
        return
    if result.segments != 1:
        result.problems.append("pipeline takes no segments")
    tp = [n.path for n in nodes if _current_mode(n.module) is not None]
    if tp:
        result.problems.append(
            f"pipeline over tensor-parallel layers is not supported (their collectives span "
            f"all ranks while each stage runs alone): {', '.join(tp[:4])}"
            + (f" and {len(tp) - 4} more" if len(tp) > 4 else ""))
        return
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or any(x is None for x in layers):
        result.problems.append(f"{type(inner).__name__}.layers is not a full list of layers "
                               "(already pipelined?)")
        return
    if len(layers) < n_ranks:
        result.problems.append(f"{len(layers)} layers cannot be split over {n_ranks} ranks "
                               "(each pipeline stage needs at least one layer)")
        return
    prefix = next(n.path for n in nodes if n.module is inner)
    spans = {}
    for r in range(n_ranks):
        probe = _structure_copy(inner)
        try:
            probe.pipeline(_PlanningGroup(n_ranks, r))
        except Exception as e:  # noqa: BLE001 - the model's own code: report what it said
            result.problems.append(f"{type(inner).__name__}.pipeline() fails for rank {r} of "
                                   f"{n_ranks}: {type(e).__name__}: {e}")
            return
        spans[r] = (int(probe.start_idx), int(probe.end_idx if probe.end_idx is not None
                                                  else len(layers)) - 1)
    holder_of = {i: r for r, (a, b) in spans.items() for i in range(a, b + 1)}
    layer_prefix = _join(prefix, "layers") + "."
    shared = 0
    per_rank = dict.fromkeys(spans, 0)
    for node in nodes:
        for path, arr in _direct_params(node, by_path):
            full = tuple(arr.shape)
            size = nbytes(full, arr.dtype)
            holder = None
            if path.startswith(layer_prefix):
                holder = holder_of[int(path[len(layer_prefix):].split(".", 1)[0])]
                per_rank[holder] += size
            else:
                shared += size
            result.rows.append(PlanRow(
                path=path, layer=type(node.module).__name__,
                mode=ShardMode.PIPELINE if holder is not None else ShardMode.REPLICATED,
                full_shape=full, local_shape=full, axis=None, dtype=dtype_name(arr.dtype),
                bytes_per_rank=size, holder=holder))
    result.stages = [StageRow(rank=r, first=a, last=b, param_bytes=per_rank[r] + shared)
                     for r, (a, b) in sorted(spans.items())]
    result.layer_modes = {prefix: ShardMode.PIPELINE}


def _resolve_strategy(sharding: str, nodes: list[_Node]) -> dict[str, ShardMode]:
    """Mode for every plain linear layer (hand-sharded layers keep theirs)."""
    if sharding != MEGATRON:
        return {n.path: ShardMode(sharding) for n in nodes if _convertible(n.module)}
    modes: dict[str, ShardMode] = {}
    expect = ShardMode.ALL_TO_SHARDED
    for n in nodes:
        current = _current_mode(n.module)
        if current in _MEGATRON_NEXT:
            expect = _MEGATRON_NEXT[current]
        elif _convertible(n.module):
            modes[n.path] = expect
            expect = _MEGATRON_NEXT[expect]
    return modes


def _convertible(module: nn.Module) -> bool:
    return _is_linear(module) and getattr(module, _META_ATTR, None) is None


def _current_mode(module: nn.Module) -> ShardMode | None:
    meta = getattr(module, _META_ATTR, None)
    if meta is not None:
        return meta.mode
    return _BY_CLASS.get(type(module))


def _resolve_mapping(mapping: Mapping[str, str | None], nodes: list[_Node]
                     ) -> dict[str, ShardMode]:
    by_path = {n.path: n for n in nodes}
    linear_paths = [n.path for n in nodes if _is_linear(n.module)]
    errors: list[str] = []
    modes: dict[str, ShardMode] = {}
    from_glob: dict[str, tuple[str, ShardMode]] = {}
    valid = ", ".join(linear_paths) or "(none)"

    for pattern, raw_mode in mapping.items():
        mode = ShardMode.REPLICATED if raw_mode is None else _mode(raw_mode)
        if mode not in _LAYER_MODES:
            errors.append(f"{pattern!r}: unknown mode {raw_mode!r}; use one of "
                          f"{', '.join(_LAYER_MODES)}")
            continue
        if not any(ch in pattern for ch in "*?["):
            node = by_path.get(pattern)
            if node is None:
                hint = ""
                owner = pattern.rsplit(".", 1)[0]
                if owner in by_path and _is_linear(by_path[owner].module):
                    hint = f" (name the layer {owner!r}, not its parameter)"
                errors.append(f"unknown path {pattern!r}{hint}; valid Linear paths: {valid}")
            elif not _is_linear(node.module):
                errors.append(f"{pattern!r} is a {type(node.module).__name__}, not a "
                              f"Linear or QuantizedLinear; valid Linear paths: {valid}")
            else:
                modes[pattern] = mode
            continue
        matched = [p for p in linear_paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            others = [f"{n.path} ({type(n.module).__name__})" for n in nodes
                      if n.path and fnmatch.fnmatchcase(n.path, pattern)]
            what = (f"matches no Linear layer, only {', '.join(others)}" if others
                    else "matches no path in the model")
            errors.append(f"{pattern!r} {what}; valid Linear paths: {valid}")
            continue
        for p in matched:
            prev = from_glob.get(p)
            if prev is not None and prev[1] != mode and p not in mapping:
                errors.append(f"{p!r} matches {prev[0]!r} ({prev[1]}) and {pattern!r} "
                              f"({mode}); name it exactly to choose")
            from_glob[p] = (pattern, mode)

    for p, (_, mode) in from_glob.items():
        modes.setdefault(p, mode)
    for p, mode in modes.items():
        current = _current_mode(by_path[p].module)
        if current is not None and mode != current:
            errors.append(f"{p!r} is already sharded ({type(by_path[p].module).__name__}, "
                          f"{current}); it cannot become {mode}")
    if errors:
        raise ShardingError("invalid sharding mapping:\n  - " + "\n  - ".join(errors))
    return {p: m for p, m in modes.items() if _convertible(by_path[p].module)}


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of a linear layer, unpacking quantized weights."""
    out_dims, in_dims = module.weight.shape[-2:]
    if isinstance(module, _QUANTIZED_CLASSES):
        in_dims = in_dims * 32 // module.bits
    return in_dims, out_dims


def _layer_label(module: nn.Module, mode: ShardMode) -> str:
    """``Linear -> AllToShardedLinear``, ``Linear (shard_inplace)``, ``RMSNorm``."""
    name = type(module).__name__
    quantized = isinstance(module, nn.QuantizedLinear)
    if quantized:
        name += f"[{module.bits}bit,g{module.group_size},{getattr(module, 'mode', 'affine')}]"
    rule = RULES[mode]
    if rule.layers:
        return f"{name} -> {rule.layers[quantized].__name__}"
    return f"{name} ({rule.via})" if rule.convert is not None else name


def _layer_collective(module: nn.Module, mode: ShardMode) -> str:
    collectives = RULES[mode].collectives
    return collectives(module) if collectives is not None else ""


def _plan_layers(
    nodes: list[_Node], by_path: dict[str, _Node], modes: dict[str, ShardMode],
    result: ShardPlan,
) -> None:
    n_ranks, k = result.group_size, result.segments
    inexact: dict[ShardMode, list[str]] = {}  # parameters whose outputs will differ
    for node in nodes:
        params = _direct_params(node, by_path)
        if not params:
            continue
        new_mode = modes.get(node.path)
        first = True
        for path, arr in params:
            if new_mode is None:
                row = _existing_row(path, arr, node, by_path, n_ranks)
            else:
                row = _new_row(path, arr, node, new_mode, n_ranks, k, result)
                if first:
                    row.collectives_per_step = _layer_collective(node.module, new_mode)
                if RULES[new_mode].warning:
                    inexact.setdefault(new_mode, []).append(path)
            first = False
            result.rows.append(row)
    for (via, warning), paths in _by_warning(inexact).items():
        result.warnings.append(
            f"{len(paths)} parameter(s) sliced with {via} "
            f"({', '.join(sorted({p.rsplit('.', 1)[0] for p in paths}))}): {warning}")


def _by_warning(paths: dict[ShardMode, list[str]]) -> dict[tuple[str, str], list[str]]:
    """Paths of modes that warn, grouped by ``(via, warning)``: one warning each."""
    out: dict[tuple[str, str], list[str]] = {}
    for mode, ps in paths.items():
        out.setdefault((RULES[mode].via, RULES[mode].warning), []).extend(ps)
    return out


def _existing_row(
    path: str, arr: mx.array, node: _Node, by_path: dict[str, _Node], n_ranks: int
) -> PlanRow:
    spec = _spec_for(path, arr, node, by_path, n_ranks, None)
    mode = spec.mode
    collective = ""
    if RULES[mode].layers and path.endswith(".weight"):  # a layer MLX made communicate
        collective = _layer_collective(node.module, mode)
    return PlanRow(path=path, layer=type(node.module).__name__, mode=mode,
                   full_shape=spec.full_shape, local_shape=spec.local_shape, axis=spec.axis,
                   dtype=spec.dtype, bytes_per_rank=nbytes(spec.local_shape, arr.dtype),
                   collectives_per_step=collective)


def _new_row(
    path: str, arr: mx.array, node: _Node, mode: ShardMode, n_ranks: int, k: int,
    result: ShardPlan,
) -> PlanRow:
    name = path[len(node.path) + 1:] if node.path else path
    full = tuple(arr.shape)
    axis = RULES[mode].axis(name, len(full))
    local = full
    problem = ""
    if axis is not None:
        local = tuple(d // n_ranks if i == axis else d for i, d in enumerate(full))
        if full[axis] % (n_ranks * k):
            problem = _divisibility_problem(path, full, axis, n_ranks, k, node.module, name)
            result.problems.append(problem)
    if RULES[mode].warning and not problem:
        problem = "WARNING: outputs will not equal the full model (no collective)"
    return PlanRow(path=path, layer=_layer_label(node.module, mode), mode=mode,
                   full_shape=full, local_shape=local, axis=axis,
                   dtype=dtype_name(arr.dtype), bytes_per_rank=nbytes(local, arr.dtype),
                   problem=problem)


def _divisibility_problem(
    path: str, shape: tuple[int, ...], axis: int, n_ranks: int, k: int,
    module: nn.Module, name: str,
) -> str:
    by = f"group size {n_ranks}" + (f" x segments {k} = {n_ranks * k}" if k > 1 else "")
    text = f"{path}: shape {shape}, axis {axis} (size {shape[axis]}) is not divisible by {by}"
    if isinstance(module, nn.QuantizedLinear) and name in _QUANTIZED_PARAMS:
        what = "packed uint32 columns" if name == "weight" else "columns = input_dims/group_size"
        if axis == len(shape) - 1:
            text += f" ({what}, quantization group_size {module.group_size})"
    return text


def _plan_fsdp(
    model: nn.Module, nodes: list[_Node], by_path: dict[str, _Node], result: ShardPlan
) -> None:
    n_ranks = result.group_size
    rule = RULES[ShardMode.FSDP]
    if isinstance(model, mxd.FullyShardedModule):
        if result.sharding != ShardMode.FSDP:
            result.problems.append(
                f"the model is already a FullyShardedModule; it cannot also be sharded "
                f"with {result._strategy_text()}")
        for node in nodes:
            for path, arr in _direct_params(node, by_path):
                result.rows.append(_existing_row(path, arr, node, by_path, n_ranks))
        return
    if result.segments != 1:
        result.problems.append("fsdp does not take segments (fully_shard splits axis 0 evenly)")
    tp = [n.path for n in nodes if _current_mode(n.module) is not None]
    if tp:
        result.problems.append(
            f"fsdp over tensor-parallel or shard_inplace layers is not supported: {', '.join(tp)}")
    packed = [n.path or "(root)" for n in nodes if "scales" in n.module]  # quantized
    if packed:
        result.problems.append(
            "fsdp over quantized layers is not supported (MLX's fully_shard gathers their "
            f"packed weights as floats, and their forward then fails): {', '.join(packed)}; "
            "quantize after training, or shard with megatron")
    for node in nodes:
        for path, arr in _direct_params(node, by_path):
            full = tuple(arr.shape)
            problem = ""
            if not full:
                problem = f"{path}: a scalar parameter cannot be split on axis 0"
            elif full[0] % n_ranks:
                problem = (f"{path}: shape {full}, axis 0 (size {full[0]}) is not divisible "
                           f"by group size {n_ranks}")
            if problem:
                result.problems.append(problem)
            local = (full[0] // n_ranks, *full[1:]) if full else full
            result.rows.append(PlanRow(
                path=path, layer=f"{type(node.module).__name__} (FullyShardedModule)",
                mode=ShardMode.FSDP, full_shape=full, local_shape=local,
                axis=rule.axis(path, len(full)), dtype=dtype_name(arr.dtype),
                bytes_per_rank=nbytes(local, arr.dtype),
                collectives_per_step=_layer_collective(node.module, ShardMode.FSDP),
                problem=problem))


def _flag_flow(
    nodes: list[_Node], by_path: dict[str, _Node], modes: dict[str, ShardMode],
    result: ShardPlan, blocks: list[transformer.Block] = (),  # type: ignore[assignment]
) -> None:
    """Warn where sharded activations meet the wrong layer.

    A transformer block (attention, MLP) is checked as the unit it is: its input
    projections run side by side on the block's input and its output projection
    takes their results, so they must be all-to-sharded and sharded-to-all together
    (or all replicated), with the attention's head counts matching its layers.
    Outside the blocks the check assumes the forward calls the layers in the order
    they are defined, which holds for ``nn.Sequential`` and most MLPs.
    """
    outputs = {p: RULES[m].output for p, m in modes.items()}
    for node in nodes:
        current = _current_mode(node.module)
        if current is not None and not outputs.get(node.path):
            outputs[node.path] = RULES[current].output
    planned = {p: m for p, m in modes.items()}
    problems, warned = _block_layouts(blocks, {n.path: n.module for n in nodes}, planned,
                                      result.group_size)
    result.problems += problems
    result.warnings += warned
    inside = tuple(b.path + "." for b in blocks)
    nodes = [n for n in nodes if not (inside and n.path.startswith(inside))]
    sharded_by: str | None = None  # the all-to-sharded layer whose output is sharded
    last_full = "the model input"
    for node in nodes:
        if not _direct_params(node, by_path):
            if sharded_by is not None and _across_features(node.module):
                result.warnings.append(
                    f"{node.path} ({type(node.module).__name__}) sits after all-to-sharded "
                    f"{sharded_by} and sees only 1/{result.group_size} of the features on "
                    "each rank: unless it acts on each value alone, as ReLU or GELU do, "
                    "the outputs will not equal the unsharded model's")
            continue
        output = outputs.get(node.path)
        where = node.path or "(root)"
        if output == "sharded":
            if sharded_by is not None:
                result.warnings.append(
                    f"{where} is all-to-sharded but its input is still sharded by "
                    f"{sharded_by} (no sharded-to-all in between)")
            sharded_by = where
        elif output == "whole":
            if sharded_by is None:
                result.warnings.append(
                    f"{where} is sharded-to-all and expects a sharded input, but it follows "
                    f"{last_full}, which is whole on every rank")
            sharded_by = None
            last_full = where
        elif sharded_by is not None:
            result.warnings.append(
                f"{where} ({type(node.module).__name__}, replicated) sits after "
                f"all-to-sharded {sharded_by}: it sees only 1/{result.group_size} of the "
                "features on each rank")
        else:
            last_full = where
    if sharded_by is not None:
        result.warnings.append(
            f"the last sharded layer {sharded_by} is all-to-sharded: the model output "
            "stays split across ranks (each rank holds a slice of the features)")


#: parameter-free layers that act on each value alone: a sharded activation may pass
#: them (any other leaf layer between a sharded pair mixes the features it cannot see)
_ELEMENTWISE = tuple(getattr(nn, name) for name in (
    "CELU", "ELU", "GELU", "SELU", "HardShrink", "Hardswish", "HardTanh", "LeakyReLU",
    "LogSigmoid", "Mish", "ReLU", "ReLU2", "ReLU6", "Sigmoid", "SiLU", "Softplus",
    "Softshrink", "Softsign", "Step", "Tanh", "Dropout", "Identity") if hasattr(nn, name))


def _across_features(module: nn.Module) -> bool:
    """Whether a layer without parameters of its own mixes the features (``Softmax``,
    ``LayerNorm(affine=False)``, a user's layer): a leaf that is not elementwise."""
    return not module.children() and not isinstance(module, _ELEMENTWISE)


def _block_layouts(blocks: list[transformer.Block], layers: dict[str, nn.Module],
                   planned: dict[str, ShardMode], n_ranks: int) -> tuple[list[str], list[str]]:
    """What is wrong with each block's layout (planned modes, else the layers' own):
    ``(problems, warnings)``. A layout this plan would make is a problem (an attention
    or MLP block whose projections are not sharded by role cannot compute its
    outputs: MLX's forward fails on a shape or gives other numbers); one found
    already in the model is a warning."""
    problems: list[str] = []
    warned: list[str] = []
    for block in blocks:
        modes = {p: planned.get(p) or _current_mode(layers[p]) or ShardMode.REPLICATED
                 for p in block.modes}
        if all(m == ShardMode.REPLICATED for m in modes.values()):
            continue
        right = all(m == block.modes[p] for p, m in modes.items())
        if not right:
            got = ", ".join(f"{p.rsplit('.', 1)[-1]} {m}" for p, m in modes.items())
            want = ", ".join(f"{p.rsplit('.', 1)[-1]} {m}" for p, m in block.modes.items())
            what = f"{block.path} ({block.kind} block)" if block.path else block.name
            text = (f"{what} has {got}: its outputs will not equal the unsharded model's; "
                    f"tensor parallelism needs {want}")
            if any(p in planned for p in block.modes):
                problems.append(text + _megatron_hint(block, n_ranks))
            else:
                warned.append(text)
            continue
        if block.kind == transformer.BlockKind.ATTENTION and not any(
                p in planned for p in block.modes):
            problem = transformer.head_problems(block, layers)
            if problem:
                warned.append(problem)
    return problems, warned


def _megatron_hint(block: transformer.Block, n_ranks: int) -> str:
    """What --sharding megatron would do with ``block`` (its heads, for attention)."""
    if block.kind != transformer.BlockKind.ATTENTION or block.refusal:
        return " (--sharding megatron shards every block so)"
    row = block.head_row(n_ranks)
    if row.problem:
        return (f"; and no layout can shard it across {n_ranks} ranks: "
                f"{row.problem.split(': ', 1)[1]}")
    return (f" (--sharding megatron shards it so, {row.heads} heads and {row.kv_heads} kv heads "
            f"divided over {n_ranks} ranks)")


# --------------------------------------------------------------------------- applying


def shard(
    model: nn.Module,
    sharding: str | Mapping[str, str | None] = "megatron",
    *,
    group: mx.distributed.Group | None = None,
    segments: int = 1,
    check_identical: bool = True,
) -> nn.Module:
    """Shard ``model`` across ``group`` with MLX's own distributed layers.

    Runs ``plan(...).check()`` first, so nothing moves when any parameter cannot be
    split. Linear layers are replaced in their parents (attributes, ``nn.Sequential``
    ``layers`` lists, dict and list children) by the layers ``shard_linear`` builds;
    inplace modes slice the parameters with ``shard_inplace`` (and warn); ``"fsdp"``
    wraps the model with ``fully_shard``. Every rank must call this together, with
    identical model parameters (seed before building): MLX slices each rank's local
    copy, so different copies give a silently wrong model. ``check_identical``
    verifies that with one small ``all_gather`` of per-parameter checksums.

    Args:
        model: the model to shard; it is modified (children replaced) in place.
        sharding: a strategy name or ``{layer path or glob: mode}`` (see module doc).
        group: the group to shard across; ``mx.distributed.init()`` when ``None``.
        segments: fused segments per sharded axis (not for ``"fsdp"``).
        check_identical: compare the not-yet-sharded parameters across ranks first.

    Returns:
        The sharded model: ``model`` itself, the new layer when ``model`` is a single
        Linear, or the ``FullyShardedModule`` wrapper for ``"fsdp"``.

    Raises:
        ShardingError: when the plan has problems (every offending parameter listed),
            or when ranks hold different values for a parameter.
    """
    group = group or mx.distributed.init()
    n_ranks = group.size()
    the_plan = plan(model, sharding, group_size=n_ranks, segments=segments).check()
    if check_identical and n_ranks > 1:
        verify_identical(model, group)

    if isinstance(model, mxd.FullyShardedModule):
        return model
    if the_plan.own:
        classes = {n.path: type(n.module) for n in _walk(model)}
        paths = {id(a): p for p, a in tree_flatten(model.parameters())}
        with _mlx.shard_predicates(paths) as said:
            model.shard(group)
        _remember_sliced(model, classes, said, n_ranks)
        return model
    mode = None if isinstance(sharding, Mapping) else _mode(sharding)
    if mode is not None and RULES[mode].whole_model:
        return RULES[mode].convert(model, segments, group)  # type: ignore[misc]

    inexact: dict[ShardMode, list[str]] = {}
    for path, m in the_plan.layer_modes.items():
        if RULES[m].warning:
            inexact.setdefault(m, []).append(path)
    for (_via, warning), paths in _by_warning(inexact).items():
        warnings.warn(f"mlx_nbdist.shard: {', '.join(sorted(paths))}: {warning}",
                      UserWarning, stacklevel=2)
    for text in the_plan.warnings:  # what the plan flagged (flow, assumed pairing)
        if not any(r.warning and r.warning in text for r in RULES.values()):
            warnings.warn(f"mlx_nbdist.shard: {text}", UserWarning, stacklevel=2)
    by_path = {n.path: n for n in _walk(model)}
    root = model
    for path, mode in the_plan.layer_modes.items():
        node = by_path[path]
        new = _shard_layer(node.module, mode, group, segments, n_ranks)
        if new is node.module:
            continue
        if node.parent is None:
            root = new
        else:
            node.parent[node.key] = new
    for row in the_plan.heads:
        transformer.divide_heads(by_path[row.path].module, row.attrs, n_ranks)
    return root


def _pipeline(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """The model's own ``pipeline(group)``: this rank keeps only the layers it runs."""
    inner = _own_pipeline(model)
    assert inner is not None  # the plan refused models without one
    inner.pipeline(group)
    if group.size() > 1:
        _block_pipeline_backward(inner)
    return model


def _block_pipeline_backward(inner: nn.Module) -> None:
    """Make a gradient through the pipelined ``inner`` fail at once on every rank.

    MLX's ``send`` has no vjp: without this, the sending stages raise "[Primitive::vjp]
    Not implemented for Send" while the last stage goes on into its collectives and
    waits for them forever. The module's class is swapped for a subclass whose output
    passes through an identity whose vjp raises :data:`PIPELINE_NO_GRADIENTS` while the
    gradient graph is built, on every rank alike, before anything is evaluated; the
    parameter paths and the forward stay as they are.
    """

    @mx.custom_function
    def guard(h: mx.array) -> mx.array:
        return h

    @guard.vjp
    def guard_vjp(primals: Any, cotangent: Any, output: Any) -> Any:
        raise RuntimeError(PIPELINE_NO_GRADIENTS)

    base = type(inner)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        return guard(base.__call__(self, *args, **kwargs))

    inner.__class__ = type(base.__name__, (base,), {
        "__call__": __call__, "__module__": base.__module__,
        "__doc__": f"{base.__name__}, pipelined by mlx_nbdist (no gradients: see "
                   "mlx_nbdist.engine.sharding.PIPELINE_NO_GRADIENTS)"})


def _fully_shard(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """``fully_shard`` the whole model; on a backend without ``sum_scatter``, warn and
    make its gradients fail at once (see :func:`_block_fsdp_backward`)."""
    full = {p: tuple(a.shape) for p, a in tree_flatten(model.parameters())}
    wrapped = mxd.fully_shard(model, group=group)
    if wrapped is not model:
        meta = _LayerShard(
            ShardMode.FSDP, 1, {f"module.{p}": s for p, s in full.items()}, group.size())
        setattr(wrapped, _META_ATTR, meta)
        if not has_sum_scatter(group):
            # stacklevel: the user's call of shard(), through the rule's convert
            warnings.warn(f"mlx_nbdist.shard: {NO_SUM_SCATTER}", UserWarning, stacklevel=4)
            _block_fsdp_backward(wrapped)
    return wrapped


def verify_identical(model: nn.Module, group: mx.distributed.Group) -> None:
    """Raise on every rank when a replicated parameter differs from rank 0's.

    Compares the parameters every rank holds whole (a pipeline stage's own layers are
    left out). A collective: every rank calls it. The ranks first compare how many
    parameters they compare and their names, so models of different shapes give a
    clear error instead of a collective of mismatched sizes.
    """
    specs = param_specs(model, group_size=group.size())
    params = dict(tree_flatten(model.parameters()))
    staged = _staged_prefix(model)
    paths = [p for p, spec in specs.items()
             if spec.axis is None and not (staged and p.startswith(staged))]
    names = zlib.crc32("\n".join(f"{p}{tuple(params[p].shape)}" for p in paths).encode())
    shape = mx.array([len(paths), names & 0xFFFF, names >> 16], dtype=mx.int32)[None]
    with state.own_collectives():  # a check of ours: not in the rank's totals
        table = np.array(mx.distributed.all_gather(shape, group=group))
    differ = [r for r in range(len(table)) if (table[r] != table[0]).any()]
    if differ:
        raise ShardingError(
            f"ranks {differ} hold other parameters than rank 0 ({int(table[differ[0]][0])} "
            f"replicated parameters vs {int(table[0][0])}, or other names or shapes): every "
            "rank must build the same model")
    if not paths:
        return
    sums = []
    for p in paths:
        a = params[p].astype(mx.float32).reshape(-1)
        sums += [mx.sum(a), mx.sum(a * a)]
    with state.own_collectives():
        gathered = mx.distributed.all_gather(mx.stack(sums)[None], group=group)
        table = np.array(gathered, dtype=np.float64)  # (ranks, 2 * len(paths))
    tol = 1e-5 * np.maximum(np.abs(table[0]), 1.0)
    bad_rows = np.abs(table - table[0]) > tol
    bad = [(p, sorted(int(r) for r in np.nonzero(bad_rows[:, 2 * i] | bad_rows[:, 2 * i + 1])[0]))
           for i, p in enumerate(paths)]
    bad = [(p, ranks) for p, ranks in bad if ranks]
    if bad:
        listed = "\n  - ".join(f"{p}: ranks {ranks} differ from rank 0" for p, ranks in bad)
        raise ShardingError(
            f"{len(bad)} parameter(s) are not identical on every rank, so sharding would "
            "mix different models; call mx.random.seed(same value) on every rank before "
            f"building the model (or load the same weights):\n  - {listed}")


def _staged_prefix(model: nn.Module) -> str:
    """``model.layers.`` when the model is pipelined (each rank holds other layers)."""
    inner = _own_pipeline(model)
    if inner is None or getattr(inner, "pipeline_size", 1) <= 1:
        return ""
    path = next(n.path for n in _walk(model) if n.module is inner)
    return _join(path, "layers") + "."


@lru_cache
def has_sum_scatter(group: mx.distributed.Group) -> bool:
    """Whether ``group``'s backend implements ``sum_scatter`` (FSDP's backward).

    A collective: every rank of ``group`` must call it together (the answer is
    cached per group). Backends without it raise the same error on every rank, which
    leaves the group usable.
    """
    if group.size() == 1:
        return True
    try:
        with state.own_collectives():  # a probe of ours: not in the rank's totals
            mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
    except RuntimeError:
        return False
    return True


def _block_fsdp_backward(wrapped: mxd.FullyShardedModule) -> None:
    """Make gradients of ``wrapped`` fail at once, with :data:`FSDP_NO_GRADIENTS`.

    Without this, ``nn.value_and_grad`` builds a graph whose ``sum_scatter`` only
    fails when evaluated, with the backend's terse "[ring] sum_scatter not supported".
    The guard is a custom function around the wrapper's gather: its forward is the
    gather itself, its vjp raises while the gradient graph is being built (on every
    rank alike, before the backward's sum_scatter is issued), so the group stays
    usable and the forward keeps working.
    """
    gather = _mlx.gather_fn(wrapped)

    @mx.custom_function
    def guarded(shards: list[mx.array]) -> list[mx.array]:
        return gather(shards)

    @guarded.vjp
    def guarded_vjp(shards: list[mx.array], cotangents: list[mx.array], _: list[mx.array]
                    ) -> list[mx.array]:
        raise RuntimeError(FSDP_NO_GRADIENTS)

    _mlx.set_gather_fn(wrapped, guarded)


def _shard_layer(
    layer: nn.Module, mode: ShardMode, group: mx.distributed.Group, segments: int,
    n_ranks: int,
) -> nn.Module:
    full = {p: tuple(a.shape) for p, a in tree_flatten(layer.parameters())}
    new = RULES[mode].convert(layer, segments, group)  # type: ignore[misc]
    setattr(new, _META_ATTR, _LayerShard(mode, segments, full, n_ranks))
    return new
