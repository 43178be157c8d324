"""Plans of real mlx-lm transformers, in this process (no session, no group).

The models are mlx-lm's own classes built from a config (``lm_models``); the plan
needs only the number of ranks. What the sharded models compute is checked on real
groups in ``test_transformers.py``.
"""

from __future__ import annotations

import mlx.nn as nn
import pytest

from mlx_nbdist import ShardingError
from mlx_nbdist.engine.sharding import plan
from mlx_nbdist.viz import format_plan, plan_table_html

pytest.importorskip("mlx_lm")


def _rows(p):
    return {r.path: r for r in p.rows}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_megatron_plan_of_a_model_with_its_own_shard(lm, arch):
    model = lm["build_lm"](arch)
    p = plan(model, "megatron", group_size=2)
    assert p.own == "Model.shard" and p.ok
    assert p.warnings == []  # the flow check is silent on mlx-lm's own layout
    assert [(h.path, h.heads, h.kv_heads, h.heads_per_rank, h.kv_heads_per_rank)
            for h in p.heads] == [
        (f"model.layers.{i}.self_attn", 4, 2, 2, 1) for i in range(2)]
    rows = _rows(p)
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    o = rows["model.layers.0.self_attn.o_proj.weight"]
    down = rows["model.layers.1.mlp.down_proj.weight"]
    head_dim = 32
    assert (q.mode, q.full_shape, q.local_shape, q.axis) == (
        "all-to-sharded", (4 * head_dim, 128), (2 * head_dim, 128), 0)
    assert (o.mode, o.local_shape, o.axis) == ("sharded-to-all", (128, 2 * head_dim), 1)
    assert (down.mode, down.local_shape) == ("sharded-to-all", (128, 128))
    assert rows["model.embed_tokens.weight"].mode == "replicated"
    assert q.layer == "Linear -> AllToShardedLinear"
    # dry-run on a copy: the model itself is untouched
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is nn.Linear and attn.n_heads == 4 and attn.n_kv_heads == 2
    text = format_plan(p.rows, 2, heads=p.heads, own=p.own, warnings=p.warnings)
    assert "model.layers.0.self_attn" in text and "2 + 1 kv" in text
    assert "Model.shard(group)" in text


def test_megatron_by_role_on_a_model_without_its_own_shard(lm):
    model = lm["build_lm"]("gemma")
    assert not hasattr(type(model), "shard")
    p = plan(model, "megatron", group_size=2)
    assert p.ok and p.own == "" and p.warnings == []
    assert p.layer_modes == {
        f"model.layers.{i}.{name}": mode
        for i in range(2)
        for name, mode in [("self_attn.q_proj", "all-to-sharded"),
                           ("self_attn.k_proj", "all-to-sharded"),
                           ("self_attn.v_proj", "all-to-sharded"),
                           ("self_attn.o_proj", "sharded-to-all"),
                           ("mlp.gate_proj", "all-to-sharded"),
                           ("mlp.down_proj", "sharded-to-all"),
                           ("mlp.up_proj", "all-to-sharded")]}
    assert [h.heads_per_rank for h in p.heads] == [2, 2]
    assert _rows(p)["model.embed_tokens.weight"].mode == "replicated"


def test_heads_that_do_not_divide_are_refused_before_anything_moves(lm):
    model = lm["build_lm"]("llama", hidden_size=96, num_attention_heads=3,
                           num_key_value_heads=1)
    p = plan(model, "megatron", group_size=2)
    want = ("model.layers.0.self_attn: 3 heads and 1 kv head do not divide by 2 ranks "
            "(each rank must hold whole heads)")
    assert want in p.problems and len(p.problems) == 2  # one per layer
    assert "3 heads" in plan_table_html(p.rows, 2, problems=p.problems, heads=p.heads)
    with pytest.raises(ShardingError, match="3 heads and 1 kv head do not divide by 2"):
        p.check()  # what shard() runs first (on a real group: test_transformers.py)


def test_grouped_query_heads_that_divide_two_ranks_but_not_four(lm):
    # GQA: 8 query heads over 2 kv heads; on 4 ranks a rank would hold half a kv head
    model = lm["build_lm"]("llama", num_attention_heads=8, num_key_value_heads=2)
    two, four = plan(model, "megatron", group_size=2), plan(model, "megatron", group_size=4)
    assert two.ok, two.problems
    assert [(h.heads_per_rank, h.kv_heads_per_rank) for h in two.heads] == [(4, 1), (4, 1)]
    want = ("model.layers.0.self_attn: 2 kv heads do not divide by 4 ranks "
            "(each rank must hold whole heads; its 8 heads do)")
    assert want in four.problems and len(four.problems) == 2, four.problems
    with pytest.raises(ShardingError, match="2 kv heads do not divide by 4"):
        four.check()


def test_a_norm_over_all_heads_is_refused_naming_the_module(lm):
    p = plan(lm["build_lm"]("olmo2"), "megatron", group_size=2)
    assert not p.ok
    assert any("model.layers.0.self_attn.k_norm" in x and "mixes the features of all heads"
               in x for x in p.problems), p.problems


def test_the_flow_check_flags_the_old_alternating_layout(lm):
    model = lm["build_lm"]("llama")
    alternating = {"model.layers.*.self_attn.q_proj": "all-to-sharded",
                   "model.layers.*.self_attn.k_proj": "sharded-to-all",
                   "model.layers.*.self_attn.v_proj": "all-to-sharded",
                   "model.layers.*.self_attn.o_proj": "sharded-to-all"}
    p = plan(model, alternating, group_size=2)
    bad = [w for w in p.problems if "self_attn (attention block)" in w]  # refused, not run
    assert len(bad) == 2 and "k_proj sharded-to-all" in bad[0]
    assert "q_proj all-to-sharded, k_proj all-to-sharded" in bad[0]  # what it needs
    assert "megatron shards it so, 4 heads and 2 kv heads divided over 2 ranks" in bad[0]
    # the right mapping by hand: silent, and its heads are divided like megatron's
    right = {**alternating, "model.layers.*.self_attn.k_proj": "all-to-sharded"}
    good = plan(model, right, group_size=2)
    assert good.warnings == [] and [h.heads_per_rank for h in good.heads] == [2, 2]


def test_a_hand_sharded_model_with_stale_head_counts_is_flagged(lm):
    model = lm["build_lm"]("llama")
    from mlx_nbdist.engine.sharding import _PlanningGroup  # noqa: PLC0415 - test only

    model.shard(_PlanningGroup(2))  # mlx-lm's own layout, as a 2-rank group makes it
    assert plan(model, {}, group_size=2).warnings == []
    model.model.layers[1].self_attn.n_heads = 4  # as if someone forgot to divide
    warns = plan(model, {}, group_size=2).warnings
    assert any("model.layers.1.self_attn.n_heads is 4 but its query projection holds 2"
               in w for w in warns), warns


def test_megatron_on_a_module_that_is_not_a_chain_says_what_it_assumed():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 8)

        def __call__(self, x):
            return self.b(self.a(x))

    p = plan(Branchy(), "megatron", group_size=2)
    assert any("paired the Linear layers in the order they are defined" in w
               for w in p.warnings), p.warnings
    chain = plan(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), "megatron",
                 group_size=2)
    assert chain.warnings == []


def test_pipeline_plan_lists_the_stages(lm):
    model = lm["build_lm"]("qwen2", num_hidden_layers=4)
    p = plan(model, "pipeline", group_size=2)
    assert p.ok
    assert [(s.rank, s.first, s.last) for s in p.stages] == [(0, 2, 3), (1, 0, 1)]
    rows = _rows(p)
    assert rows["model.layers.0.self_attn.q_proj.weight"].holder == 1
    assert rows["model.layers.3.mlp.up_proj.weight"].holder == 0
    assert rows["model.embed_tokens.weight"].holder is None
    shared = rows["model.embed_tokens.weight"].bytes_per_rank + rows[
        "model.norm.weight"].bytes_per_rank
    layer_bytes = sum(r.bytes_per_rank for r in p.rows if r.holder == 0)
    assert p.stages[0].param_bytes == layer_bytes + shared
    text = format_plan(p.rows, 2, stages=p.stages)
    assert "layer -> rank: 1 1 0 0" in text
    assert "pipeline (rank 1)" in text
    assert len(model.model.layers) == 4 and model.model.layers[0] is not None  # untouched


def test_pipeline_is_refused_for_a_model_without_pipeline(lm):
    p = plan(lm["build_lm"]("llama"), "pipeline", group_size=2)
    assert not p.ok and "has no pipeline(group) method" in p.problems[0]
    assert "llama" in p.problems[0] and "megatron" in p.problems[0]
    few = plan(lm["build_lm"]("qwen2"), "pipeline", group_size=4)
    assert few.problems == ["2 layers cannot be split over 4 ranks (each pipeline stage "
                            "needs at least one layer)"]


def test_quantized_model_is_planned_through_its_own_shard(lm):
    model = lm["build_lm"]("llama")
    nn.quantize(model, group_size=32, bits=4)
    p = plan(model, "megatron", group_size=2)
    assert p.ok and p.warnings == []
    q = _rows(p)["model.layers.0.self_attn.q_proj.weight"]
    assert q.layer == "QuantizedLinear -> QuantizedAllToShardedLinear"
    assert q.local_shape == (64, q.full_shape[1])



def test_planning_leaves_the_random_state_alone(lm):
    """MLX's sharded layers draw random initial weights; a plan runs on rank 0 only, so
    its dry-run must not move rank 0's random state (LoRA, dropout would then differ)."""
    import mlx.core as mx

    model = lm["build_lm"]("llama")
    mx.random.seed(7)
    want = mx.random.normal((4,))
    mx.random.seed(7)
    plan(model, "megatron", group_size=2)
    assert mx.array_equal(mx.random.normal((4,)), want).item()


def test_stale_head_counts_are_flagged_without_a_head_dim_attribute(lm):
    from mlx_nbdist.engine.sharding import _PlanningGroup

    model = lm["build_lm"]("qwen2")
    assert not hasattr(model.model.layers[0].self_attn, "head_dim")
    model.shard(_PlanningGroup(2))
    assert plan(model, {}, group_size=2).warnings == []
    model.model.layers[0].self_attn.n_heads = 4
    assert any("n_heads is 4 but its query projection holds 2" in w
               for w in plan(model, {}, group_size=2).warnings)


def test_pipeline_of_a_tensor_parallel_model_is_refused(lm):
    from mlx_nbdist.engine.sharding import _PlanningGroup

    model = lm["build_lm"]("qwen2", num_hidden_layers=4)
    model.shard(_PlanningGroup(2))
    p = plan(model, "pipeline", group_size=2)
    assert not p.ok and "pipeline over tensor-parallel layers" in p.problems[0]


def test_shard_in_a_cell_warns_what_the_plan_warns():
    from mlx_nbdist.engine.sharding import shard

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 8)

    with pytest.warns(UserWarning, match="paired the Linear layers in the order"):
        shard(Branchy(), "megatron")


@pytest.mark.parametrize("how", ["all-to-sharded", "sharded-to-all"])
def test_a_flat_strategy_on_a_transformer_is_refused_naming_its_heads(lm, how):
    """Every linear layer one way splits an attention's heads without dividing its head
    counts: MLX's forward would fail deep inside (rope, a reshape). Refused, each block
    named with what it needs and, where no layout can work, why."""
    p = plan(lm["build_lm"]("llama", hidden_size=96, num_attention_heads=3,
                            num_key_value_heads=3), how, group_size=2)
    attn = [x for x in p.problems if "self_attn (attention block)" in x]
    assert len(attn) == 2, p.problems
    assert "o_proj sharded-to-all" in attn[0]  # what tensor parallelism needs
    assert ("no layout can shard it across 2 ranks: 3 heads and 3 kv heads do not divide "
            "by 2 ranks") in attn[0]
    assert any("mlp (mlp block)" in x for x in p.problems)
    with pytest.raises(ShardingError, match="attention block"):
        p.check()


def test_a_sharded_model_is_not_sharded_again(lm):
    from mlx_nbdist.engine.sharding import _PlanningGroup  # noqa: PLC0415 - test only

    model = lm["build_lm"]("llama")
    model.shard(_PlanningGroup(2))  # mlx-lm's own layout
    for how in ("megatron", "all-to-sharded"):
        p = plan(model, how, group_size=2)
        assert any(x.startswith("already sharded: model.layers.0.self_attn.q_proj "
                                "(all-to-sharded)") for x in p.problems), (how, p.problems)
        with pytest.raises(ShardingError, match="A model is sharded once"):
            p.check()
        # its heads are each rank's share already: no head count is called wrong
        assert not any("do not divide" in x or "does not divide" in x for x in p.problems)


def test_a_model_that_is_itself_a_block_is_named_so():
    """The user trial's MLP at the model's root was named by an empty path:
    '   (mlp block) has up inplace-all-to-sharded, ...'."""

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

        def __call__(self, x):
            return self.down(nn.relu(self.up(x)))

    p = plan(MLP(), "inplace-all-to-sharded", group_size=2)
    assert any(x.startswith("the model's own mlp block has up inplace-all-to-sharded, down "
                            "inplace-all-to-sharded: its outputs will not equal")
               for x in p.problems), p.problems
