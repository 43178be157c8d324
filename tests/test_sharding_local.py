"""Single-process tests of sharding plans, slices and grad_sync (no MLX group needed).

``plan`` only needs a group size; ``shard``/``local_slice``/``grad_sync`` run here on
MLX's size-1 group, where the distributed layers are built but never communicate.
The multi-rank behaviour is checked by the session tests.
"""

from __future__ import annotations

import pickle

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.nn.layers import distributed as mxd

from mlx_nbdist.engine.gradsync import grad_sync
from mlx_nbdist.engine.sharding import param_specs, plan, shard
from mlx_nbdist.engine.slices import local_slice, model_shards
from mlx_nbdist.errors import ShardingError


def _mlp(din: int = 64, dh: int = 256, dout: int = 64, seed: int = 0) -> nn.Sequential:
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(din, dh), nn.ReLU(), nn.Linear(dh, dout))


class _Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = {"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d)}

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.mlp["down"](nn.gelu(self.mlp["up"](self.norm(x))))


class _Net(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.blocks = [_Block(d), _Block(d)]
        self.head = nn.Linear(d, 16)

    def __call__(self, x: mx.array) -> mx.array:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _rows(p):
    return {r.path: r for r in p.rows}


# ------------------------------------------------------------------------ plan


def test_megatron_plan_rows():
    p = plan(_mlp(), group_size=4)
    rows = _rows(p)
    assert list(rows) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    w0, b0, w2, b2 = rows.values()
    assert (w0.mode, w0.full_shape, w0.local_shape, w0.axis) == ("all-to-sharded", (256, 64),
                                                                  (64, 64), 0)
    assert (b0.local_shape, b0.axis) == ((64,), 0)
    assert (w2.mode, w2.local_shape, w2.axis) == ("sharded-to-all", (64, 64), 1)
    assert (b2.local_shape, b2.axis) == ((64,), None)
    assert w0.bytes_per_rank == 64 * 64 * 4 and w0.dtype == "float32"
    assert "bwd all_sum" in w0.collectives_per_step
    assert w2.collectives_per_step.startswith("fwd all_sum")
    assert p.ok and not p.warnings and p.layer_modes == {"layers.0": "all-to-sharded",
                                                         "layers.2": "sharded-to-all"}
    assert p.check() is p


def test_plan_is_plain_data_and_prints():
    p = plan(_mlp(), group_size=2)
    q = pickle.loads(pickle.dumps(p))
    assert q.rows == p.rows and q.problems == p.problems
    text = str(p)
    assert "layers.0.weight" in text and "AllToShardedLinear" in text and "(256, 64)" in text


def test_bad_dims_reports_every_offending_parameter():
    m = nn.Sequential(nn.Linear(64, 6), nn.ReLU(), nn.Linear(6, 10))
    p = plan(m, group_size=4)
    assert len(p.problems) == 3
    with pytest.raises(ShardingError) as info:
        p.check()
    msg = str(info.value)
    for part in ("layers.0.weight", "(6, 64)", "layers.0.bias", "(6,)", "layers.2.weight",
                 "(10, 6)", "axis 1", "group size 4"):
        assert part in msg
    assert "layers.2.bias" not in msg  # replicated, nothing to split
    assert plan(m, group_size=2).ok


def test_segments_multiply_the_divisor():
    p = plan(_mlp(dh=12), group_size=2, segments=4)
    assert any("segments 4 = 8" in x for x in p.problems)
    assert plan(_mlp(dh=16), group_size=2, segments=4).ok
    with pytest.raises(ShardingError):
        plan(_mlp(), group_size=2, segments=0)
    with pytest.raises(ShardingError):
        plan(_mlp(), group_size=0)


def test_mapping_errors_name_paths():
    m = _mlp()
    with pytest.raises(ShardingError, match=r"unknown path 'layers\.5'.*layers\.0, layers\.2"):
        plan(m, {"layers.5": "all-to-sharded"}, group_size=2)
    with pytest.raises(ShardingError, match=r"'layers\.1' is a ReLU"):
        plan(m, {"layers.1": "all-to-sharded"}, group_size=2)
    with pytest.raises(ShardingError, match=r"name the layer 'layers\.0'"):
        plan(m, {"layers.0.weight": "sharded-to-all"}, group_size=2)
    with pytest.raises(ShardingError, match="matches no path"):
        plan(m, {"enc*": "all-to-sharded"}, group_size=2)
    with pytest.raises(ShardingError, match="unknown mode"):
        plan(m, {"layers.0": "rows"}, group_size=2)
    with pytest.raises(ShardingError) as info:  # every bad key in one error
        plan(m, {"layers.5": "all-to-sharded", "layers.1": "sharded-to-all"}, group_size=2)
    assert "layers.5" in str(info.value) and "ReLU" in str(info.value)
    with pytest.raises(ShardingError, match="unknown sharding"):
        plan(m, "rowwise", group_size=2)


def test_mapping_globs_and_exact_override():
    net = _Net()
    p = plan(net, {"blocks.*.mlp.up": "all-to-sharded", "blocks.*.mlp.down": "sharded-to-all"},
             group_size=2)
    assert p.ok and not p.warnings
    assert p.layer_modes == {"blocks.0.mlp.up": "all-to-sharded",
                             "blocks.0.mlp.down": "sharded-to-all",
                             "blocks.1.mlp.up": "all-to-sharded",
                             "blocks.1.mlp.down": "sharded-to-all"}
    assert _rows(p)["blocks.0.norm.weight"].mode == "replicated"
    p = plan(_mlp(), {"layers.*": "all-to-sharded", "layers.2": "sharded-to-all"}, group_size=2)
    assert p.layer_modes == {"layers.0": "all-to-sharded", "layers.2": "sharded-to-all"}
    with pytest.raises(ShardingError, match="matches no Linear layer"):
        plan(net, {"blocks.*.norm": "all-to-sharded"}, group_size=2)


def test_megatron_flow_warnings():
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64))
    p = plan(m, group_size=2)
    assert p.ok
    assert any("layers.1 (LayerNorm" in w for w in p.warnings)
    assert any("output stays split" in w for w in p.warnings)


@pytest.mark.parametrize("mid", [nn.LayerNorm(16, affine=False), nn.Softmax(), nn.GLU()])
def test_a_layer_without_parameters_that_mixes_features_between_a_pair_is_flagged(
        mid: nn.Module) -> None:
    """A user trial: megatron on Linear, LayerNorm(affine=False), Linear gave outputs
    0.39 away from the unsharded model's with no word (layers without parameters were
    passed over, as if elementwise)."""
    p = plan(nn.Sequential(nn.Linear(8, 16), mid, nn.Linear(16, 8)), group_size=2)
    assert any(w.startswith(f"layers.1 ({type(mid).__name__}) sits after all-to-sharded "
                            "layers.0 and sees only 1/2 of the features") for w in p.warnings)
    for ok in (nn.ReLU(), nn.GELU(), nn.Dropout(0.1), nn.Identity()):
        assert not plan(nn.Sequential(nn.Linear(8, 16), ok, nn.Linear(16, 8)),
                        group_size=2).warnings


def test_inplace_plan_is_flagged():
    p = plan(_mlp(), {"layers.0": "inplace-all-to-sharded", "layers.2": "inplace-sharded-to-all"},
             group_size=2)
    assert p.ok  # it runs ...
    assert any("NOT equal" in w for w in p.warnings)  # ... but gives the wrong answer
    assert all("WARNING" in r.problem for r in p.rows)
    assert _rows(p)["layers.0.weight"].collectives_per_step.startswith("none")


def test_fsdp_plan():
    p = plan(_mlp(), "fsdp", group_size=4)
    assert p.ok and {r.axis for r in p.rows} == {0}
    assert _rows(p)["layers.2.bias"].local_shape == (16,)
    assert "all_gather" in p.rows[0].collectives_per_step
    bad = plan(nn.Sequential(nn.Linear(6, 6)), "fsdp", group_size=4)
    assert len(bad.problems) == 2
    assert not plan(_mlp(), "fsdp", group_size=2, segments=2).ok
    # quantized layers: MLX's fully_shard gathers uint32 weights with the float scales as
    # floats, and the forward failed deep in quantized_matmul (a reviewer's case)
    q = _mlp(128, 256, 128)
    nn.quantize(q, group_size=64, bits=4)
    assert [p for p in plan(q, "fsdp", group_size=2).problems if p.startswith(
        "fsdp over quantized layers is not supported") and "layers.0, layers.2" in p]


def test_quantized_plan_packed_shapes():
    m = _mlp(128, 256, 128)
    nn.quantize(m, group_size=64, bits=4)
    rows = _rows(plan(m, group_size=2))
    assert rows["layers.0.weight"].full_shape == (256, 16)  # 128 inputs / 8 per uint32
    assert rows["layers.0.weight"].dtype == "uint32"
    assert rows["layers.0.scales"].local_shape == (128, 2)
    assert rows["layers.2.scales"].local_shape == (128, 2)  # 256 / 64 groups, split in 2
    assert "QuantizedShardedToAllLinear" in rows["layers.2.weight"].layer
    p4 = plan(m, group_size=8)  # 4 scale columns cannot be split 8 ways
    assert any("layers.2.scales" in x for x in p4.problems)


# ------------------------------------------------------------------------ size-1 group


def test_shard_single_rank_and_metadata():
    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("needs the size-1 group")
    x = mx.random.normal((4, 64), key=mx.random.key(1))
    ref, m = _mlp(), _mlp()
    m = shard(m, group=group)
    assert isinstance(m.layers[0], mxd.AllToShardedLinear)
    assert isinstance(m.layers[2], mxd.ShardedToAllLinear)
    assert float(mx.max(mx.abs(ref(x) - m(x)))) < 1e-5
    specs = param_specs(m, group_size=1, rank=0)
    assert specs["layers.0.weight"].mode == "all-to-sharded"
    ts = local_slice(m, "layers.0.weight", group=group)
    assert ts.ranges == [(0, 256)] and ts.full_shape == (256, 64) and ts.axis == 0
    assert np.array_equal(ts.data, np.asarray(ref.layers[0].weight))
    assert abs(ts.summary["norm"] - float(np.linalg.norm(ts.data))) < 1e-4
    assert [s.data for s in model_shards(m, group=group)] == [None] * 4
    with pytest.raises(KeyError, match="did you mean"):
        local_slice(m, "layers.0.wieght", group=group)


def test_shard_nested_containers_single_rank():
    group = mx.distributed.init()
    mx.random.seed(3)
    ref = _Net()
    mx.random.seed(3)
    net = shard(_Net(), {"blocks.*.mlp.up": "all-to-sharded",
                         "blocks.*.mlp.down": "sharded-to-all"}, group=group)
    assert isinstance(net.blocks[1].mlp["down"], mxd.ShardedToAllLinear)
    x = mx.random.normal((2, 32), key=mx.random.key(2))
    assert float(mx.max(mx.abs(ref(x) - net(x)))) < 1e-5


def test_local_slice_sampling_and_bfloat16():
    m = _mlp()
    m.set_dtype(mx.bfloat16)
    ts = local_slice(m, "layers.0.weight", max_elements=100)
    assert ts.sampled and ts.data.size <= 100 and ts.data.ndim == 2
    assert ts.dtype == "bfloat16" and ts.data.dtype == np.float32
    assert ts.kind == "replicated" and ts.axis is None and ts.ranges == []
    full = local_slice(m, "layers.0.weight")
    assert not full.sampled and full.data.shape == (256, 64)
    assert full.summary == ts.summary


def test_grad_sync_single_rank_dp():
    m = _mlp()
    x = mx.random.normal((4, 64), key=mx.random.key(1))
    y = mx.zeros((4, 64))
    before = [np.asarray(a) for a in (m.layers[0].weight, m.layers[2].bias)]
    samples = grad_sync(m, lambda mod, a, b: nn.losses.mse_loss(mod(a), b), x, y)
    assert [s.name for s in samples] == ["layers.0.weight", "layers.0.bias",
                                         "layers.2.weight", "layers.2.bias"]
    assert all(s.replicated and s.norm_before == s.norm_after and s.max_diff_after == 0
               for s in samples)
    assert np.array_equal(before[0], np.asarray(m.layers[0].weight))  # not updated
    with pytest.raises(ValueError):
        grad_sync(m, lambda mod: mod(x).sum(), mode="zero")


def test_slices_a_models_own_shard_made_in_place_are_remembered_in_their_layout() -> None:
    """mlx-lm's own shard() slices some layers in place (MoE experts): each slice is
    remembered as shard_inplace's predicate gave it (axis, segments), so slices, check
    and save know it split, read back from no weight (a value check read the whole of
    every expert on every rank, and took constant values for any layout)."""
    from mlx.nn.layers.distributed import shard_inplace
    from mlx.utils import tree_flatten

    from mlx_nbdist.engine.sharding import _PlanningGroup

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.gate, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.mix = nn.Linear(8, 8)

        def __call__(self, x: mx.array) -> mx.array:
            return self.down(self.up(x) * self.gate(x))

        def shard(self, group: object) -> None:
            shard_inplace(self.up, "all-to-sharded", segments=2, group=group)
            shard_inplace(self.gate, "all-to-sharded", group=group)
            shard_inplace(self.down, "sharded-to-all", group=group)
            shard_inplace(self.mix, "all-to-sharded", segments=[0.25], group=group)

    m = Own()
    full = {k: np.array(v) for k, v in tree_flatten(m.parameters())}
    shard(m, "megatron", group=_PlanningGroup(2, 1), check_identical=False)
    specs = param_specs(m, group_size=2, rank=1)
    got = {k: (v.mode, v.axis, v.segments, v.full_shape) for k, v in specs.items()}
    assert got == {
        "up.weight": ("inplace-all-to-sharded", 0, 2, (16, 8)),
        "up.bias": ("inplace-all-to-sharded", 0, 2, (16,)),
        "gate.weight": ("inplace-all-to-sharded", 0, 1, (16, 8)),
        "gate.bias": ("inplace-all-to-sharded", 0, 1, (16,)),
        "down.weight": ("inplace-sharded-to-all", 1, 1, (8, 16)),
        "down.bias": ("replicated", None, 1, (8,)),
        # fractional segments: no layout to describe it in, so it looks whole (refused)
        "mix.weight": ("replicated", None, 1, (4, 8)),
        "mix.bias": ("replicated", None, 1, (4,))}
    # rank 1's slice of up (2 segments): rows 4:8 and 12:16 of the whole
    want = np.concatenate([full["up.weight"][4:8], full["up.weight"][12:16]])
    np.testing.assert_array_equal(np.array(m.up.weight), want)
