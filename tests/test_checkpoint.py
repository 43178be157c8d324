"""Sharded checkpoints: the index and its resharding arithmetic (pure), then save, load
on another number of ranks, consolidate and resume on real sessions (real engines, a
real MLX ring group).

The pure tests check the arithmetic against numpy's own ``split``/``concatenate`` (an
independent statement of MLX's sharding: each fused segment split in N, a rank's
pieces concatenated). The session tests compare every loaded tensor with the full
model built in this test process from the same seed.
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_nbdist.checkpoint_index import (
    FORMAT_VERSION,
    CheckpointError,
    FileEntry,
    Index,
    Layout,
    SafetensorsFile,
    Shard,
    TensorEntry,
    covering_runs,
    pieces,
)
from mlx_nbdist.errors import CellError
from mlx_nbdist.results import ShardMode

# ------------------------------------------------------------------ pure arithmetic


def local_of(full: np.ndarray, axis: int | None, segments: int, n: int, r: int) -> np.ndarray:
    """Rank ``r``'s slice, straight from numpy (not from :class:`Layout`)."""
    if axis is None:
        return full
    return np.concatenate([np.split(seg, n, axis=axis)[r]
                           for seg in np.split(full, segments, axis=axis)], axis=axis)


def saved_entry(full: np.ndarray, axis: int | None, segments: int, n: int
                ) -> tuple[TensorEntry, dict[tuple[str, str], np.ndarray]]:
    """An index entry and the "files" of ``full`` saved on ``n`` ranks."""
    files = {}
    shards = []
    ranks = range(n) if axis is not None else range(1)
    for r in ranks:
        local = local_of(full, axis, segments, n, r)
        name = f"rank-{r:05d}.safetensors"
        files[(name, "w")] = local
        shards.append(Shard(r, r, name, "w", tuple(local.shape)))
    entry = TensorEntry(shape=tuple(full.shape), dtype="float32",
                        mode=ShardMode.REPLICATED if axis is None else ShardMode.ALL_TO_SHARDED,
                        axis=axis, segments=segments, group_size=n if axis is not None else 1,
                        holders=list(range(n)), shards=shards)
    return entry, files


def assemble(entry: TensorEntry, files: dict[tuple[str, str], np.ndarray], target: Layout,
             index: int) -> np.ndarray:
    out = np.full(target.local_shape(), np.nan, dtype=np.float32)
    for p in pieces("w", entry, target, index):
        src = files[(p.file, p.key)][tuple(slice(a, b) for a, b in p.src)]
        out[tuple(slice(a, b) for a, b in p.dst)] = src
    return out


LAYOUTS = [(None, 1), (0, 1), (1, 1), (0, 3), (1, 3)]


@pytest.mark.parametrize("saved_n,load_n", list(itertools.product([1, 2, 4], repeat=2)))
def test_reshard_every_layout_onto_every_other(saved_n, load_n):
    full = np.arange(24 * 36, dtype=np.float32).reshape(24, 36)
    for (s_axis, s_seg), (t_axis, t_seg) in itertools.product(LAYOUTS, repeat=2):
        entry, files = saved_entry(full, s_axis, s_seg, saved_n)
        target = Layout(full.shape, t_axis, t_seg, load_n if t_axis is not None else 1)
        for r in range(load_n if t_axis is not None else 1):
            got = assemble(entry, files, target, r)
            want = local_of(full, t_axis, t_seg, load_n, r)
            np.testing.assert_array_equal(got, want, err_msg=(
                f"saved axis {s_axis} seg {s_seg} on {saved_n}, loaded axis {t_axis} seg "
                f"{t_seg} on {load_n}, rank {r}"))


def test_reshard_1d_and_scalars():
    bias = np.arange(12, dtype=np.float32)
    entry, files = saved_entry(bias, 0, 1, 4)
    np.testing.assert_array_equal(assemble(entry, files, Layout((12,), 0, 1, 2), 1), bias[6:])
    step = np.array(7.0, dtype=np.float32)
    entry, files = saved_entry(step, None, 1, 1)
    assert assemble(entry, files, Layout(()), 0) == 7.0


def test_same_layout_reads_one_whole_piece_from_its_own_file():
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    entry, _ = saved_entry(full, 0, 1, 2)
    got = pieces("w", entry, Layout((8, 6), 0, 1, 2), 1)
    assert [(p.file, p.src, p.dst) for p in got] == [
        ("rank-00001.safetensors", ((0, 4), (0, 6)), ((0, 4), (0, 6)))]


def test_a_pipeline_stage_tensor_comes_from_the_rank_that_held_it():
    full = np.ones((4, 4), dtype=np.float32)
    entry = TensorEntry(shape=(4, 4), dtype="float32", holders=[1],
                        shards=[Shard(1, 0, "rank-00001.safetensors", "w", (4, 4))])
    got = pieces("model.layers.3.w", entry, Layout((4, 4)), 0)
    assert [p.file for p in got] == ["rank-00001.safetensors"]
    assert assemble(entry, {("rank-00001.safetensors", "w"): full}, Layout((4, 4)), 0).sum() == 16


def test_uneven_split_is_refused_naming_parameter_dimension_and_ranks():
    entry, _ = saved_entry(np.zeros((30, 8), np.float32), 0, 1, 2)
    with pytest.raises(CheckpointError, match=r"layers.0.weight: dimension 0 \(size 30\) does "
                                              r"not divide across 4 ranks"):
        pieces("layers.0.weight", entry, Layout((30, 8), 0, 1, 4), 0)
    assert "3 segments" in Layout((24, 8), 0, 3, 16).problem("qkv")
    assert Layout((24, 8), 0, 3, 4).problem("qkv") == ""
    with pytest.raises(CheckpointError, match=r"shape \(30, 8\).*\(32, 8\)"):
        pieces("w", entry, Layout((32, 8), 0, 1, 2), 0)


def test_a_slice_missing_from_the_index_is_named():
    entry, _ = saved_entry(np.zeros((8, 8), np.float32), 0, 1, 4)
    entry.shards.pop(2)
    with pytest.raises(CheckpointError, match=r"slices \[0, 1, 3\] of 4"):
        pieces("w", entry, Layout((8, 8)), 0)


def test_copies_sums_agree_to_a_tolerance_and_exactly_where_not_finite():
    from mlx_nbdist.checkpoint_index import _same_sums

    assert _same_sums([1.0, 2.0, 3.0], [1.0 + 1e-7, 2.0, 3.0])
    assert not _same_sums([1.0, 2.0, 3.0], [1.1, 2.0, 3.0])
    inf, nan = float("inf"), float("nan")
    assert _same_sums([inf, nan, 1.0], [inf, nan, 1.0])
    assert not _same_sums([1.0, 2.0, 3.0], [inf, 2.0, 3.0])  # inf > inf was False
    assert not _same_sums([nan, 2.0, 3.0], [1.0, 2.0, 3.0])


def test_covering_runs_are_the_box_in_c_order():
    shape = (3, 4, 5)
    flat = np.arange(60)
    for box in [((0, 3), (0, 4), (0, 5)), ((1, 2), (0, 4), (0, 5)), ((0, 3), (1, 3), (0, 5)),
                ((0, 3), (0, 4), (2, 4)), ((1, 3), (2, 4), (1, 5))]:
        starts, length = covering_runs(shape, box)
        got = np.concatenate([flat[s:s + length] for s in starts])
        want = flat.reshape(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
        np.testing.assert_array_equal(got, want)
    assert covering_runs((6, 4), ((2, 4), (0, 4))) == ([8], 8)  # a row block: one read


def test_reader_reads_only_the_bytes_of_the_box(tmp_path):
    import mlx.core as mx

    w = mx.random.normal((256, 64))
    b16 = mx.random.normal((8, 4)).astype(mx.bfloat16)
    path = str(tmp_path / "f.safetensors")
    mx.save_safetensors(path, {"w": w, "b16": b16, "step": mx.array(3)})
    with SafetensorsFile(path) as f:
        got = f.read("w", ((64, 128), (0, 64)))
        np.testing.assert_array_equal(got, np.array(w)[64:128])
        assert f.bytes_read == 64 * 64 * 4  # a quarter of the tensor, not all of it
        cols = f.read("w", ((0, 256), (16, 32)))
        np.testing.assert_array_equal(cols, np.array(w)[:, 16:32])
        assert f.bytes_read == 64 * 64 * 4 + 256 * 16 * 4
        raw = f.read("b16")
        back = mx.array(raw).view(mx.bfloat16).astype(mx.float32)
        np.testing.assert_array_equal(np.array(back), np.array(b16.astype(mx.float32)))
        assert int(f.read("step")) == 3
        with pytest.raises(CheckpointError, match="has no tensor 'nope'"):
            f.read("nope")


def small_index(**over: Any) -> Index:
    entry, _ = saved_entry(np.zeros((4, 2), np.float32), 0, 1, 2)
    return Index(model="m", model_class="Sequential", n_ranks=2, backend="ring",
                 shards_dir="shards-x", params={"layers.0.weight": entry},
                 files={"rank-00000.safetensors": FileEntry("rank-00000.safetensors", 0,
                                                            "ab", 10)}, **over)


def test_index_round_trips_and_refuses_newer_or_broken_files():
    index = small_index(optimizer_class="Adam", lm={"config": {"model_type": "llama"}})
    again = Index.from_json(index.to_json())
    assert again == index
    newer = json.loads(index.to_json())
    newer["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION + 1}, newer"):
        Index.from_json(json.dumps(newer))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Index.from_json("{")
    with pytest.raises(CheckpointError, match="not an mlx_nbdist checkpoint"):
        Index.from_json("{}")
    broken = json.loads(index.to_json())
    del broken["params"]
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        Index.from_json(json.dumps(broken))


# ------------------------------------------------------------------ real sessions

COMMON = """
import errno
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
import mlx_nbdist
import mlx_nbdist.engine.checkpoint as ck

world = mx.distributed.init()


def build(seed=0, d_h=48):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(16, d_h), nn.ReLU(), nn.Linear(d_h, 8))


def loss_fn(m, x, y):
    return mx.mean((m(x) - y) ** 2)


def adam_step(m, opt, x, y, average=False):
    loss, grads = nn.value_and_grad(m, loss_fn)(m, x, y)
    if average:
        grads = nn.average_gradients(grads, group=world)
        loss = mx.distributed.all_sum(loss, group=world) / world.size()
    opt.update(m, grads)
    mx.eval(m.parameters(), opt.state)
    return float(loss)


def params_np(m):
    return {k: np.array(v) for k, v in tree_flatten(m.parameters())}


def batch(step):
    x = mx.random.normal((8, 16), key=mx.random.key(100 + step))
    y = mx.random.normal((8, 8), key=mx.random.key(200 + step))
    return x, y


def dp_batch(step):
    x, y = batch(step)
    r, n = world.rank(), world.size()
    return x[r * 8 // n:(r + 1) * 8 // n], y[r * 8 // n:(r + 1) * 8 // n]


def train(m, opt, steps, start=0, dp=False):
    return [adam_step(m, opt, *(dp_batch if dp else batch)(s), average=dp)
            for s in range(start, start + steps)]
"""


def full_params(seed: int = 0) -> dict[str, np.ndarray]:
    """The unsharded model, built in this process."""
    ns: dict[str, Any] = {}
    exec(COMMON, ns)  # noqa: S102 - our own code, the same the ranks run
    return ns["params_np"](ns["build"](seed))


def local_slice(full: np.ndarray, path: str, rank: int, n: int) -> np.ndarray:
    """Megatron on the MLP: layers.0 all-to-sharded (rows, bias), layers.2
    sharded-to-all (weight columns; bias whole)."""
    if path.startswith("layers.0"):
        return np.split(full, n, axis=0)[rank]
    if path == "layers.2.weight":
        return np.split(full, n, axis=1)[rank]
    return full


@pytest.fixture(scope="module")
def s2(session2: Any) -> Any:
    session2.run(COMMON)
    return session2


def _session(n: int) -> Iterator[Any]:
    from mlx_nbdist import Session
    from mlx_nbdist.session import OversubscribedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversubscribedWarning)
        s = Session(n, timeout=120).start()
    try:
        s.run(COMMON)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def saved_tp(s2: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlx_nbdist.client.checkpoint import save

    d = tmp_path_factory.mktemp("ckpt") / "tp"
    s2.run('tp = mlx_nbdist.shard(build(), "megatron")')
    saved = save("tp", d, session=s2)
    assert "2 file(s)" in str(saved)
    return d


def test_tp_save_writes_one_file_per_rank_and_an_index(saved_tp: Path):
    from mlx_nbdist.client.checkpoint import read_index

    index = read_index(saved_tp)
    assert index.n_ranks == 2 and index.backend == "ring" and index.mlx_version
    assert sorted(index.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    w0, b2 = index.params["layers.0.weight"], index.params["layers.2.bias"]
    assert (w0.mode, w0.axis, w0.shape, len(w0.shards)) == (ShardMode.ALL_TO_SHARDED, 0,
                                                            (48, 16), 2)
    assert (b2.mode, b2.axis, [s.rank for s in b2.shards]) == (ShardMode.SHARDED_TO_ALL, None,
                                                               [0])  # whole: written once
    assert [p.name for p in saved_tp.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("n", [1, 4])
def test_saved_on_2_loads_on_1_and_4(saved_tp: Path, n: int):
    from mlx_nbdist.client.checkpoint import load

    want = full_params()
    for s in _session(n):
        s.run('m = mlx_nbdist.shard(build(seed=5), "megatron")')
        loaded = load("m", saved_tp, session=s)
        assert loaded.resharded
        s.run("got = params_np(m)")
        for rank, got in s.pull("got").items():
            for path, full in want.items():
                np.testing.assert_array_equal(got[path], local_slice(full, path, rank, n),
                                              err_msg=f"{path} rank {rank} of {n}")
        if n == 4:
            # each rank read a quarter of each split tensor, not the files
            total = sum(f.bytes for f in loaded.index.files.values())
            assert all(b < 0.5 * total for b in loaded.bytes_read.values()), loaded


def test_consolidate_loads_with_plain_load_weights(saved_tp: Path, tmp_path: Path):
    from mlx_nbdist.client.checkpoint import consolidate

    out = consolidate(saved_tp, tmp_path / "whole")
    ns: dict[str, Any] = {}
    exec(COMMON, ns)  # noqa: S102
    m = ns["build"](seed=9)
    m.load_weights(str(out / "model.safetensors"))
    got = ns["params_np"](m)
    for path, full in full_params().items():
        np.testing.assert_array_equal(got[path], full)


@pytest.mark.parametrize("how", ["tp", "dp"])
def test_resume_in_a_new_session_continues_the_loss_curve(s2: Any, tmp_path: Path, how: str):
    from mlx_nbdist.client.checkpoint import load, save

    make = ('mlx_nbdist.shard(build({seed}), "megatron")' if how == "tp"
            else "build({seed})")
    dp = how == "dp"
    s2.run(f"u = {make.format(seed=0)}\nu_opt = optim.Adam(learning_rate=0.01)\n"
           f"u_losses = train(u, u_opt, 6, dp={dp})\n"
           f"a = {make.format(seed=0)}\na_opt = optim.Adam(learning_rate=0.01)\n"
           f"a_losses = train(a, a_opt, 3, dp={dp})")
    save("a", tmp_path / how, optimizer="a_opt", session=s2)
    uninterrupted = s2.pull("u_losses")[0]
    assert s2.pull("a_losses")[0] == uninterrupted[:3]
    for s in _session(2):
        s.run(f"b = {make.format(seed=7)}\nb_opt = optim.Adam(learning_rate=0.01)")
        load("b", tmp_path / how, optimizer="b_opt", session=s)
        s.run("b_step = int(b_opt.step)\n"
              f"b_losses = train(b, b_opt, 3, start=3, dp={dp})")
        assert set(s.pull("b_step").values()) == {3}
        for rank, losses in s.pull("b_losses").items():
            np.testing.assert_allclose(losses, uninterrupted[3:], rtol=1e-6,
                                       err_msg=f"{how} rank {rank}")


def test_a_model_missing_on_a_rank_is_refused_naming_it(s2: Any, tmp_path: Path):
    from mlx_nbdist.client.checkpoint import save

    s2.run("only0 = build()", ranks=[0])
    with pytest.raises(CheckpointError, match=r"rank 1: not defined"):
        save("only0", tmp_path / "x", session=s2)
    assert not (tmp_path / "x").exists()


def test_replicated_copies_that_differ_are_not_saved_as_one(s2: Any, tmp_path: Path):
    """A checkpoint keeps one copy of a whole tensor (rank 0's): the user trial saved a
    model whose rank 1 had its own bias, without a word, and rank 1's was lost."""
    from mlx_nbdist.client.checkpoint import save

    s2.run('dv = mlx_nbdist.shard(build(), "megatron")\n'
           "if rank == 1:\n    dv.layers[2].bias = dv.layers[2].bias + 1")
    with pytest.raises(CheckpointError) as info:
        save("dv", tmp_path / "x", session=s2)
    text = str(info.value)
    assert ("1 replicated parameter differs across ranks, and a checkpoint keeps one copy of "
            "each (the lowest rank's)") in text, text
    assert "layers.2.bias: rank 1 differs from rank 0" in text, text
    assert not (tmp_path / "x").exists()
    # the same on the ranks' own save (a script's), on every rank
    with pytest.raises(CellError) as cell:
        s2.run(f"import mlx_nbdist.script\nmlx_nbdist.script.save_checkpoint(dv, "
               f"{str(tmp_path / 'y')!r})")
    assert "layers.2.bias: rank 1 differs from rank 0" in str(cell.value), str(cell.value)
    s2.run("dv.layers[2].bias = mx.distributed.all_sum(dv.layers[2].bias, group=world) / 2")
    save("dv", tmp_path / "x", session=s2)  # once equal, saved
    # a copy in another order has the same sum and sum of squares: told apart too
    s2.run("if rank == 1:\n    dv.layers[2].bias = dv.layers[2].bias[::-1]")
    with pytest.raises(CheckpointError, match=r"layers.2.bias: rank 1 differs from rank 0"):
        save("dv", tmp_path / "x", session=s2)


def test_frozen_state_that_differs_by_rank_by_design_is_saved(s2: Any, tmp_path: Path):
    """BatchNorm's running statistics follow each rank's own batches in data-parallel
    training: not a copy gone astray (a reviewer's case against the check above)."""
    from mlx_nbdist.client.checkpoint import read_index, save

    s2.run("bn = nn.BatchNorm(4)\nmx.eval(bn(mx.random.normal((8, 4)) + rank))\n"
           "bn_mean = bn.running_mean.tolist()")
    means = s2.pull("bn_mean")
    assert means[0] != means[1]
    save("bn", tmp_path / "bn", session=s2)
    assert "running_mean" in read_index(tmp_path / "bn").params


def test_a_tokenizer_folder_that_is_not_one_is_refused(s2: Any, tmp_path: Path):
    from mlx_nbdist.client.checkpoint import save

    s2.run('tk = mlx_nbdist.shard(build(), "megatron")')
    with pytest.raises(CheckpointError, match=r"tokenizer_from \(--tokenizer-from\) "
                       r"\S*nowhere: no such folder"):
        save("tk", tmp_path / "x", tokenizer_from=tmp_path / "nowhere", session=s2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty holds none of a tokenizer's files"):
        save("tk", tmp_path / "x", tokenizer_from=tmp_path / "empty", session=s2)
    with pytest.raises(CellError, match=r"empty holds none of a tokenizer's files"):
        s2.run(f"import mlx_nbdist.script\nmlx_nbdist.script.save_checkpoint(tk, "
               f"{str(tmp_path / 'x')!r}, tokenizer_from={str(tmp_path / 'empty')!r})")
    assert not (tmp_path / "x").exists()


def test_the_notebooks_loader_called_in_a_cell_says_where_it_runs(s2: Any, tmp_path: Path):
    """mlx_nbdist.load_checkpoint drives the ranks from the notebook; on a rank it says
    so and names the rank-side function, not 'no session: run %mlxdist start'."""
    with pytest.raises(CellError) as info:
        s2.run(f"mlx_nbdist.load_checkpoint('net', {str(tmp_path)!r})")
    text = str(info.value)
    assert "this runs in the notebook, not on a rank (this is rank 0)" in text, text
    assert "mlx_nbdist.script.load_checkpoint(model, directory)" in text
    assert "%mlxdist start" not in text


def test_another_models_folder_is_refused_unless_overwrite(s2: Any, saved_tp: Path,
                                                           tmp_path: Path):
    import shutil

    from mlx_nbdist.client.checkpoint import read_index, save

    d = tmp_path / "taken"
    shutil.copytree(saved_tp, d)
    s2.run("other = build(d_h=32)")
    with pytest.raises(CheckpointError, match=r"another model: model 'tp' \(Sequential, 4 "
                                              r"parameters\) saved on 2 rank"):
        save("other", d, session=s2)
    assert read_index(d).model == "tp"
    save("other", d, overwrite=True, session=s2)
    assert read_index(d).model == "other"
    assert len([p for p in d.iterdir() if p.name.startswith("shards-")]) == 1


def test_a_rank_whose_disk_fills_leaves_the_previous_checkpoint(s2: Any, saved_tp: Path,
                                                               tmp_path: Path):
    import shutil

    from mlx_nbdist.client.checkpoint import load, read_index, save

    d = tmp_path / "full"
    shutil.copytree(saved_tp, d)
    before = read_index(d)
    s2.run("def _no_space(path, arrays):\n"
           "    open(path, 'wb').write(b'half a file')\n"
           "    raise OSError(errno.ENOSPC, 'No space left on device', path)\n"
           "_write = ck.write_tensors\n"
           "ck.write_tensors = _no_space", ranks=[1])
    s2.run("tp.layers[0].weight = tp.layers[0].weight * 0 + 3")
    try:
        with pytest.raises(CheckpointError, match=r"rank 1: OSError: .*No space left on device"
                                                  r".*previous checkpoint in .* is intact"):
            save("tp", d, session=s2)
    finally:
        s2.run("ck.write_tensors = _write", ranks=[1])
    assert read_index(d) == before
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in saved_tp.iterdir())
    s2.run('back = mlx_nbdist.shard(build(seed=3), "megatron")')
    load("back", d, session=s2)
    s2.run("same = bool(mx.array_equal(back.layers[0].weight, "
           "build().layers[0].weight[world.rank() * 24:(world.rank() + 1) * 24]))")
    assert set(s2.pull("same").values()) == {True}
    s2.run('tp = mlx_nbdist.shard(build(), "megatron")')


def test_damaged_checkpoints_are_named(s2: Any, saved_tp: Path, tmp_path: Path):
    import shutil

    from mlx_nbdist.client.checkpoint import load, read_index, save

    d = tmp_path / "damaged"
    shutil.copytree(saved_tp, d)
    shards = d / read_index(d).shards_dir
    s2.run('dm = mlx_nbdist.shard(build(seed=3), "megatron")')
    data = bytearray((shards / "rank-00001.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (shards / "rank-00001.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors \(written by rank 1\) "
                                              "is corrupt"):
        load("dm", d, session=s2)
    (shards / "rank-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000.safetensors \(written by rank 0\) "
                                              "is missing"):
        load("dm", d, session=s2)
    index = json.loads((d / "index.json").read_text())
    index["format_version"] = FORMAT_VERSION + 1
    (d / "index.json").write_text(json.dumps(index))
    for call in (lambda: load("dm", d, session=s2), lambda: save("dm", d, session=s2)):
        with pytest.raises(CheckpointError, match="newer than this mlx_nbdist"):
            call()
    assert json.loads((d / "index.json").read_text()) == index  # nothing was changed


def test_a_different_model_is_refused_naming_parameters(s2: Any, saved_tp: Path):
    from mlx_nbdist.client.checkpoint import load

    s2.run("wide = build(d_h=32)\n"
           "extra = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 8), "
           "nn.Linear(8, 8))")
    with pytest.raises(CheckpointError) as info:
        load("wide", saved_tp, session=s2)
    # said once, with the ranks that found it (a user trial read each line once a rank)
    said = "layers.0.weight: the checkpoint holds shape (48, 16), the model has (32, 16)"
    assert str(info.value).count(said) == 1 and f"{said} (every rank)" in str(info.value)
    with pytest.raises(CheckpointError, match=r"no parameter layers.3.bias, layers.3.weight"):
        load("extra", saved_tp, session=s2)


def test_an_mlx_lm_model_consolidates_to_a_folder_mlx_lm_loads(s2: Any, lm: dict[str, Any],
                                                               tmp_path: Path):
    pytest.importorskip("mlx_lm")
    import mlx_lm
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mlx_nbdist.client.checkpoint import consolidate, save

    from .lm_models import LM_COMMON

    src = tmp_path / "src"
    src.mkdir()
    vocab = {f"t{i}": i for i in range(255)} | {"[UNK]": 255}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    s2.run(LM_COMMON + '\nllm = mlx_nbdist.shard(build_lm("llama"), "megatron")')
    save("llm", tmp_path / "ckpt", tokenizer_from=src, session=s2)
    out = consolidate(tmp_path / "ckpt", tmp_path / "hf")
    model, tokenizer = mlx_lm.load(str(out))
    assert tokenizer.encode("t1 t5") == [1, 5]
    want = lm["logits_np"](lm["build_lm"]("llama"), lm["tokens"])
    got = lm["logits_np"](model, lm["tokens"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_experts_a_models_own_shard_sliced_in_place_are_split_not_replicated(
        s2: Any, lm: dict[str, Any], tmp_path: Path):
    """mlx-lm's own shard() slices a MoE's experts in place (SwitchLinear keeps its
    class). A user trial: they were described as whole on every rank, so `check` said
    they diverged, `slices` gave half their shape as the full one, and `save` refused
    the model (its advice, averaging gradients, was wrong too)."""
    pytest.importorskip("mlx_lm")
    import mlx_nbdist
    from mlx_nbdist.client.checkpoint import consolidate, save

    from .lm_models import LM_COMMON

    s2.run(LM_COMMON + '\nmoe = mlx_nbdist.shard(build_lm("qwen3_moe"), "megatron")')
    full = lm["params_np"](lm["build_lm"]("qwen3_moe"))
    for name, axis in (("gate_proj", 1), ("down_proj", 2)):
        path = f"model.layers.0.mlp.switch_mlp.{name}.weight"
        got = mlx_nbdist.slices(f"moe.{path}", session=s2)
        assert [(t.rank, t.axis, t.full_shape) for t in got] == [
            (r, axis, full[path].shape) for r in (0, 1)], got
        np.testing.assert_array_equal(np.concatenate([t.data for t in got], axis=axis),
                                      full[path])
    report = mlx_nbdist.check("moe", session=s2)
    assert report.ok, report
    save("moe", tmp_path / "ckpt", session=s2)
    out = consolidate(tmp_path / "ckpt", tmp_path / "whole")
    ns: dict[str, Any] = {}
    exec(LM_COMMON, ns)  # noqa: S102
    m = ns["build_lm"]("qwen3_moe", seed=9)
    m.load_weights(str(out / "model.safetensors"))
    got = ns["params_np"](m)
    for path, want in full.items():
        np.testing.assert_array_equal(got[path], want, err_msg=path)


def test_fsdp_saved_loads_as_tensor_parallel(s2: Any, tmp_path: Path):
    from mlx_nbdist.client.checkpoint import load, read_index, save

    s2.run('fs = mlx_nbdist.shard(build(), "fsdp")\n'
           'tpl = mlx_nbdist.shard(build(seed=4), "megatron")')
    save("fs", tmp_path / "fsdp", session=s2)
    index = read_index(tmp_path / "fsdp")
    assert "layers.0.weight" in index.params  # the wrapper's "module." left out
    assert index.params["layers.2.bias"].mode == ShardMode.FSDP
    load("tpl", tmp_path / "fsdp", session=s2)
    s2.run("got = params_np(tpl)")
    want = full_params()
    for rank, got in s2.pull("got").items():
        for path, full in want.items():
            np.testing.assert_array_equal(got[path], local_slice(full, path, rank, 2))


QBUILD = """
def qbuild(seed=0):
    mx.random.seed(seed)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    nn.quantize(m, group_size=32, bits=4)
    mx.eval(m.parameters())
    return m
"""


def test_a_quantized_model_saved_on_2_loads_on_2_and_on_1(s2: Any, tmp_path: Path):
    """weight (packed uint32), scales and biases are saved per rank and resharded."""
    from mlx_nbdist.client.checkpoint import load, read_index, save

    s2.run(QBUILD + 'qm = mlx_nbdist.shard(qbuild(), "megatron")\n'
           "q_layers = [type(layer).__name__ for layer in qm.layers]")
    assert s2.pull("q_layers")[0][0] == "QuantizedAllToShardedLinear"
    save("qm", tmp_path / "q", session=s2)
    index = read_index(tmp_path / "q")
    assert {p: e.dtype for p, e in index.params.items() if p.startswith("layers.0.")} == {
        "layers.0.weight": "uint32", "layers.0.scales": "float32",
        "layers.0.biases": "float32", "layers.0.bias": "float32"}
    assert index.quantization["layers.0"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    assert index.params["layers.2.scales"].axis == 1  # split like the packed weight

    ns: dict[str, Any] = {}
    exec(COMMON + QBUILD, ns)  # noqa: S102 - our own code, the same the ranks run
    want = ns["params_np"](ns["qbuild"]())
    x = ns["mx"].random.normal((4, 64), key=ns["mx"].random.key(1))
    want_out = np.array(ns["qbuild"]()(x))
    s2.run('q2 = mlx_nbdist.shard(qbuild(seed=5), "megatron")')
    load("q2", tmp_path / "q", session=s2)
    s2.run("q_same = {k: bool(np.array_equal(v, params_np(qm)[k])) "
           "for k, v in params_np(q2).items()}")
    for rank, same in s2.pull("q_same").items():
        assert same and all(same.values()), (rank, same)
    for s in _session(1):
        s.run(QBUILD + "q1 = qbuild(seed=5)")
        assert load("q1", tmp_path / "q", session=s).resharded
        s.run("q1_params = params_np(q1)")
        got = s.pull("q1_params")[0]
        for path, full in want.items():
            np.testing.assert_array_equal(got[path], full, err_msg=path)
        s.push({"x_in": np.array(x)})
        s.run("q1_out = np.array(q1(mx.array(x_in)))")
        np.testing.assert_allclose(s.pull("q1_out")[0], want_out, rtol=1e-5, atol=1e-5)


def test_pipeline_and_tensor_parallel_checkpoints_load_into_each_other(
        s2: Any, lm: dict[str, Any], tmp_path: Path):
    """A pipeline stage's layers are saved whole by the rank that holds them; a tensor
    parallel model reads them sliced, and a pipeline reads a megatron save whole."""
    pytest.importorskip("mlx_lm")
    from mlx_nbdist.client.checkpoint import load, read_index, save

    from .lm_models import LM_COMMON

    s2.run(LM_COMMON + '\npp = mlx_nbdist.shard(build_lm("qwen2", num_hidden_layers=4), '
           '"pipeline")\n'
           'tpm = mlx_nbdist.shard(build_lm("qwen2", num_hidden_layers=4), "megatron")')
    save("pp", tmp_path / "pp", session=s2)
    save("tpm", tmp_path / "tpm", session=s2)
    index = read_index(tmp_path / "pp")
    q0 = index.params["model.layers.0.self_attn.q_proj.weight"]
    assert (q0.holders, q0.axis, [s.rank for s in q0.shards]) == ([1], None, [1])
    assert index.params["model.layers.3.self_attn.q_proj.weight"].holders == [0]
    want = lm["logits_np"](lm["build_lm"]("qwen2", num_hidden_layers=4), lm["tokens"])
    s2.run('tp_from_pp = mlx_nbdist.shard(build_lm("qwen2", seed=3, num_hidden_layers=4), '
           '"megatron")\n'
           'pp_from_tp = mlx_nbdist.shard(build_lm("qwen2", seed=3, num_hidden_layers=4), '
           '"pipeline")')
    load("tp_from_pp", tmp_path / "pp", session=s2)
    load("pp_from_tp", tmp_path / "tpm", session=s2)
    s2.run("out_tp = logits_np(tp_from_pp, tokens)\nout_pp = logits_np(pp_from_tp, tokens)")
    for name in ("out_tp", "out_pp"):
        for rank, out in s2.pull(name).items():
            gap = float(np.abs(out - want).max()) / max(1.0, float(np.abs(want).max()))
            assert gap < 1e-4, (name, rank, gap)
