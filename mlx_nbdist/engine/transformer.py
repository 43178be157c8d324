"""Find a transformer's attention and MLP blocks, and what megatron does to each.

Tensor parallelism of a transformer (Megatron-LM) is decided by *role*, not by the
order layers are defined in: in an attention block the query, key and value
projections are all-to-sharded (each rank computes whole heads) and the output
projection sharded-to-all; in an MLP block gate and up are all-to-sharded and down
sharded-to-all; embeddings, norms and ``lm_head`` stay replicated. The attention's
head counts are divided by the number of ranks, as mlx-lm's own ``Model.shard`` does.

A block is a module with :class:`~mlx.nn.Linear` (or ``QuantizedLinear``) children
named in :data:`ROLES` (the names mlx-lm's models use). A block the rules cannot
shard correctly is refused with the reason (:attr:`Block.refusal`): a norm over all
heads' features (olmo2's ``q_norm``), a per-head parameter (``sinks``), a module the
rules do not know, a fused projection, missing head counts. This module needs MLX
only, not mlx-lm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..enums import TextEnum
from ..results import HeadRow, ShardMode, count


class BlockKind(TextEnum):
    """What a block is in a transformer."""

    ATTENTION = "attention"
    MLP = "mlp"


#: child name -> (block kind, the mode megatron gives it); ``None`` kind: either kind
ROLES: dict[str, tuple[BlockKind | None, ShardMode]] = {
    "q_proj": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "k_proj": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "v_proj": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "wq": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "wk": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "wv": (BlockKind.ATTENTION, ShardMode.ALL_TO_SHARDED),
    "o_proj": (BlockKind.ATTENTION, ShardMode.SHARDED_TO_ALL),
    "out_proj": (BlockKind.ATTENTION, ShardMode.SHARDED_TO_ALL),
    "wo": (BlockKind.ATTENTION, ShardMode.SHARDED_TO_ALL),
    "gate_proj": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "up_proj": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "down_proj": (BlockKind.MLP, ShardMode.SHARDED_TO_ALL),
    "w1": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "w3": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "w2": (BlockKind.MLP, ShardMode.SHARDED_TO_ALL),
    "fc1": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "fc2": (BlockKind.MLP, ShardMode.SHARDED_TO_ALL),
    "c_fc": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "c_proj": (None, ShardMode.SHARDED_TO_ALL),
    "up": (BlockKind.MLP, ShardMode.ALL_TO_SHARDED),
    "down": (BlockKind.MLP, ShardMode.SHARDED_TO_ALL),
}
#: fused projections: their rows hold several projections side by side, which one
#: even split per rank does not respect (q, k and v rows differ in size with GQA)
FUSED = ("qkv_proj", "gate_up_proj", "c_attn", "Wqkv", "query_key_value", "in_proj")
#: the attribute names a block keeps its head counts under, query heads first
HEAD_ATTRS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
#: block kinds told apart by their input projections
_KIND_OF_INPUTS = {
    name: kind for name, (kind, mode) in ROLES.items()
    if kind is not None and mode == ShardMode.ALL_TO_SHARDED
}


@dataclass
class Block:
    """One attention or MLP block and what megatron makes of it.

    Attributes:
        path: the block's path in the model (``model.layers.0.self_attn``).
        kind: attention or MLP.
        modes: ``{linear layer path: mode}`` for its projections.
        heads: ``(attribute, count)`` of query heads (attention only).
        kv_heads: ``(attribute, count)`` of key/value heads (attention only).
        head_dim: features per head (from ``head_dim`` or the query rows / heads).
        refusal: why the rules cannot shard it correctly (empty when they can).
    """

    path: str
    kind: BlockKind
    modes: dict[str, ShardMode] = field(default_factory=dict)
    heads: tuple[str, int] | None = None
    kv_heads: tuple[str, int] | None = None
    head_dim: int | None = None
    refusal: str = ""

    @property
    def name(self) -> str:
        """The block's path, as a message names it (the model's own, at its root)."""
        return self.path or f"the model's own {self.kind} block"

    def head_row(self, n_ranks: int) -> HeadRow:
        """The plan's line for this attention block over ``n_ranks`` ranks."""
        heads = self.heads[1] if self.heads else 0
        kv = self.kv_heads[1] if self.kv_heads else heads
        problem = ""
        counts = {"head": heads, "kv head": kv}
        bad = {what: k for what, k in counts.items() if k % n_ranks}
        if bad:
            text = " and ".join(count(k, what) for what, k in bad.items())
            verb = "does" if list(bad.values()) == [1] else "do"
            rest = "".join(f"; its {count(k, what)} do" for what, k in counts.items()
                           if what not in bad)
            problem = (f"{self.path}: {text} {verb} not divide by {n_ranks} ranks (each rank "
                       f"must hold whole heads{rest})")
        attrs = tuple(dict.fromkeys(a[0] for a in (self.heads, self.kv_heads) if a))
        return HeadRow(path=self.path, heads=heads, kv_heads=kv, head_dim=self.head_dim or 0,
                       group_size=n_ranks, problem=problem, attrs=attrs)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _is_linear(module: Any) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def _first_attr(module: nn.Module, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _out_features(layer: nn.Module) -> int:
    return int(layer.weight.shape[0])


def find_blocks(modules: list[tuple[str, nn.Module]], *, sharded: Any = None
                ) -> list[Block]:
    """The attention and MLP blocks among ``modules`` (``(path, module)`` in model order).

    Args:
        modules: every module of the model with its path.
        sharded: ``sharded(layer) -> bool``, whether a child is already a
            tensor-parallel layer (it still counts as a projection of its block).
    """
    blocks = []
    for path, module in modules:
        children = {k: v for k, v in module.items() if isinstance(v, nn.Module)}
        projections = {k: v for k, v in children.items()
                       if k in ROLES and (_is_linear(v) or (sharded and sharded(v)))}
        kinds = {_KIND_OF_INPUTS[k] for k in projections if k in _KIND_OF_INPUTS}
        fused = [k for k in children if k in FUSED]
        if not kinds and not fused:
            continue
        kind = BlockKind.ATTENTION if BlockKind.ATTENTION in kinds or any(
            k in ("qkv_proj", "c_attn", "Wqkv", "query_key_value") for k in fused
        ) else BlockKind.MLP
        block = Block(path=path, kind=kind,
                      modes={_join(path, k): ROLES[k][1] for k in projections})
        if kind == BlockKind.ATTENTION:
            _read_heads(block, module, projections)
        block.refusal = _refusal(block, module, children, projections, fused)
        blocks.append(block)
    return blocks


def _read_heads(block: Block, module: nn.Module, projections: dict[str, nn.Module]) -> None:
    block.heads = _first_attr(module, HEAD_ATTRS)
    block.kv_heads = _first_attr(module, KV_HEAD_ATTRS) or block.heads
    head_dim = getattr(module, "head_dim", None)
    query = next((projections[k] for k in ("q_proj", "wq") if k in projections), None)
    scale = getattr(module, "scale", None)
    if not isinstance(head_dim, int) and isinstance(scale, float) and scale > 0:
        head_dim = round(scale ** -2)  # mlx-lm's attention keeps scale = head_dim ** -0.5
    if not isinstance(head_dim, int) and block.heads and query is not None and _is_linear(query):
        # an unsharded query only: a sharded one's local rows over a stale head count
        # would hide exactly the mistake head_problems looks for
        head_dim = _out_features(query) // max(block.heads[1], 1)
    block.head_dim = head_dim if isinstance(head_dim, int) else None


def _refusal(block: Block, module: nn.Module, children: dict[str, nn.Module],
             projections: dict[str, nn.Module], fused: list[str]) -> str:
    """Why megatron's role rules would give wrong outputs for this block, or ``""``."""
    if fused:
        return (f"{_join(block.path, fused[0])} is a fused projection (several projections' "
                "rows side by side), which an even split per rank does not respect")
    if block.kind == BlockKind.ATTENTION:
        if block.heads is None:
            return (f"{block.name} has {', '.join(sorted(projections))} but no head count "
                    f"attribute ({' / '.join(HEAD_ATTRS)}), so its heads cannot be divided")
        missing = [r for r in (("q_proj", "wq"), ("o_proj", "out_proj", "wo", "c_proj"))
                   if not any(k in projections for k in r)]
        if missing:
            return (f"{block.name} has no {' / '.join(missing[0])} projection: the rules "
                    "need the query and output projections of an attention block")
    for key, value in sorted(module.items()):
        if key in projections or not tree_flatten(_params_of(value)):
            continue
        where = _join(block.path, key)
        if isinstance(value, nn.Module):
            size = _last_dim(value)
            if block.kind == BlockKind.ATTENTION and size is not None and size == block.head_dim:
                continue  # a norm over one head's features (qwen3's q_norm): replicated
            what = f"{type(value).__name__} over {size} features" if size else type(
                value).__name__
            if block.kind == BlockKind.ATTENTION and size and block.head_dim and size > (
                    block.head_dim):
                return (f"{where} ({what} = several heads x {block.head_dim}) mixes the "
                        "features of all heads, so splitting the heads across ranks would "
                        "change its output")
            return (f"{where} ({what}) is neither a projection megatron knows nor a "
                    f"per-head norm, so the rules cannot say how to split it")
        return (f"{where} is a parameter of the {block.kind} block itself (shape "
                f"{tuple(getattr(value, 'shape', ()))}), e.g. one value per head, which the "
                "rules do not split")
    return ""


def _params_of(value: Any) -> Any:
    return value.parameters() if isinstance(value, nn.Module) else value


def _last_dim(module: nn.Module) -> int | None:
    weight = module.get("weight") if isinstance(module, nn.Module) else None
    shape = getattr(weight, "shape", None)
    return int(shape[-1]) if shape else None


def head_problems(block: Block, layers: dict[str, nn.Module]) -> str:
    """Whether an already-sharded attention block's head counts match its layers.

    After ``shard_linear`` a query projection holds ``heads / N`` heads' rows; the
    block's own head count must say so (mlx-lm's ``shard`` and ours divide it), or the
    reshape in its forward mixes heads.
    """
    query = next((layers[p] for p in block.modes if p.rsplit(".", 1)[-1] in ("q_proj", "wq")),
                 None)
    if query is None or block.heads is None or not block.head_dim:
        return ""
    local_heads = _out_features(query) // block.head_dim
    if local_heads != block.heads[1]:
        return (f"{block.path}.{block.heads[0]} is {block.heads[1]} but its query projection "
                f"holds {local_heads} heads' rows on this rank: divide the head counts by "
                "the number of ranks after sharding (mlx_nbdist.shard does)")
    return ""


def divide_heads(module: nn.Module, attrs: tuple[str, ...], n_ranks: int) -> None:
    """Divide a block's head counts (``attrs``) by ``n_ranks``, once its projections
    are sharded: each rank now computes ``heads / n_ranks`` whole heads."""
    for attr in attrs:
        setattr(module, attr, getattr(module, attr) // n_ranks)
