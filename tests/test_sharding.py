"""Sharding is correct on real sessions: real engines, a real MLX ring group.

Every rank builds the same small MLP from the same seed (32 -> 128 -> 32, batch 8,
dimensions divisible by 4). The references are computed in this test process with
the same code (``COMMON`` runs on the ranks and here), so the ranks are compared
with an independent single-process MLX, never with themselves.

One 2-rank session (conftest's ``session2``) and one 4-rank session (four ranks on
two cores: slow collectives, so only the core checks run there, marked ``4ranks``).
"""

from __future__ import annotations

import math
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

import mlx_nbdist
from mlx_nbdist import CellError, Session, ShardingError, platform
from mlx_nbdist.engine.sharding import FSDP_NO_GRADIENTS
from mlx_nbdist.results import TensorSlice
from mlx_nbdist.session import OversubscribedWarning
from mlx_nbdist.viz import human_bytes, rank_color

COMMON = """
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

D_IN, D_H, D_OUT, BATCH, LR = 32, 128, 32, 8, 0.5


def build(seed=0):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))


def build_two_pairs(seed=0):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT), nn.ReLU(),
                         nn.Linear(D_OUT, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))


def build_quantized(seed=0):
    m = build(seed)
    nn.quantize(m, group_size=32, bits=4)
    return m


def loss_fn(m, x, y):
    return mx.mean((m(x) - y) ** 2)


def grads_np(m, x, y):
    _, g = nn.value_and_grad(m, loss_fn)(m, x, y)
    return {k: np.array(v) for k, v in tree_flatten(g)}


def sgd_step(m, x, y, average=None):
    opt = optim.SGD(learning_rate=LR)
    loss, grads = nn.value_and_grad(m, loss_fn)(m, x, y)
    if average is not None:
        grads = nn.average_gradients(grads, group=average)
    opt.update(m, grads)
    mx.eval(m.parameters(), opt.state)
    return float(loss)


def params_np(m):
    return {k: np.array(v) for k, v in tree_flatten(m.parameters())}


def layer_kinds(m):
    return [type(layer).__name__ for layer in m.layers]


x = mx.random.normal((BATCH, D_IN), key=mx.random.key(1))
y = mx.random.normal((BATCH, D_OUT), key=mx.random.key(2))
"""

TP_KINDS = ["AllToShardedLinear", "ReLU", "ShardedToAllLinear"]
#: the tests of the Linux slice routes (tests/test_portable.py covers the others)
LINUX_ROUTES = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.portable(),
    reason="asserts Linux's slice routes (a pool of /dev/shm files, process_vm_readv), "
    "which macOS and portable mode (MLX_NBDIST_PORTABLE) do not take",
)
PARAMS = ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    """``COMMON`` run in this process: the single-process reference."""
    ns: dict[str, Any] = {}
    exec(COMMON, ns)  # noqa: S102 - our own code, the same the ranks run
    return ns


@pytest.fixture(scope="module")
def s2(session2: Session) -> Session:
    session2.run(COMMON + "\nimport mlx_nbdist\n")
    return session2


@pytest.fixture(scope="module")
def s4() -> Iterator[Session]:
    with warnings.catch_warnings():  # 4 ranks on a 2-core machine: expected here
        warnings.simplefilter("ignore", OversubscribedWarning)
        s = Session(4, timeout=120).start()
    try:
        s.run(COMMON + "\nimport mlx_nbdist\n")
        yield s
    finally:
        s.stop()


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def sess(request: pytest.FixtureRequest) -> Session:
    return request.getfixturevalue("s2" if request.param == 2 else "s4")


# --------------------------------------------------------------------------- helpers


def part_of(full: np.ndarray, sl: TensorSlice) -> np.ndarray:
    """The blocks of ``full`` that ``sl`` says its rank holds, concatenated."""
    if sl.axis is None:
        return full
    idx = [slice(None)] * full.ndim
    parts = []
    for start, stop in sl.ranges:
        idx[sl.axis] = slice(start, stop)
        parts.append(full[tuple(idx)])
    return np.concatenate(parts, axis=sl.axis)


def reassemble(slices: list[TensorSlice]) -> np.ndarray:
    """The full tensor rebuilt from the slices' data and ranges; every element once."""
    first = slices[0]
    if first.axis is None:
        for sl in slices[1:]:
            np.testing.assert_array_equal(sl.data, first.data)
        return first.data
    full = np.zeros(first.full_shape, dtype=first.data.dtype)
    seen = np.zeros(first.full_shape[first.axis], dtype=int)
    for sl in slices:
        idx_full = [slice(None)] * full.ndim
        idx_local = [slice(None)] * full.ndim
        offset = 0
        for start, stop in sl.ranges:
            idx_full[sl.axis] = slice(start, stop)
            idx_local[sl.axis] = slice(offset, offset + stop - start)
            full[tuple(idx_full)] = sl.data[tuple(idx_local)]
            seen[start:stop] += 1
            offset += stop - start
        assert offset == sl.shape[sl.axis], (sl.name, sl.rank, sl.ranges, sl.shape)
    assert (seen == 1).all(), f"{first.name}: ranges do not tile axis {first.axis} once"
    return full


def buffer_owner(arr: np.ndarray) -> Any:
    """The object at the end of ``arr``'s ``.base`` chain (what holds the bytes)."""
    obj: Any = arr
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    return obj


def blocks(ax: Any) -> list:
    return [p for p in ax.patches if (p.get_gid() or "").startswith("block-")]


def rect_of(patch: Any) -> tuple[float, float, float, float]:
    """(row0, row1, col0, col1) of a block rectangle."""
    return (patch.get_y(), patch.get_y() + patch.get_height(),
            patch.get_x(), patch.get_x() + patch.get_width())


def rgba(color: Any) -> tuple[float, ...]:
    from matplotlib import colors as mcolors

    return tuple(np.round(mcolors.to_rgba(color), 6))


def check_tp_step(s: Session, ref: dict[str, Any], name: str) -> None:
    """``name`` (a Megatron-sharded ``build()``) forward and one SGD step vs unsharded."""
    r = s.run(f"{name}_kinds = layer_kinds({name})\n{name}_out = np.array({name}(x))\n"
              f"{name}_loss = sgd_step({name}, x, y)")
    assert r.ok
    full = ref["build"]()
    want_out = np.array(full(ref["x"]))
    before = ref["params_np"](full)
    want_loss = ref["sgd_step"](full, ref["x"], ref["y"])
    after = ref["params_np"](full)
    kinds, outs, losses = (s.pull(f"{name}_{k}") for k in ("kinds", "out", "loss"))
    for rank in range(s.n):
        assert kinds[rank] == TP_KINDS
        diff = float(np.abs(outs[rank] - want_out).max())
        assert diff < 1e-5, f"rank {rank}: forward differs from the unsharded model by {diff}"
        assert losses[rank] == pytest.approx(want_loss, rel=1e-6)
    for path in PARAMS:
        assert np.abs(after[path] - before[path]).max() > 1e-3, f"the step left {path} alone"
        got = mlx_nbdist.slices(f"{name}.{path}", session=s)
        assert [sl.rank for sl in got] == list(range(s.n))
        for sl in got:
            np.testing.assert_allclose(sl.data, part_of(after[path], sl), rtol=0, atol=1e-6,
                                       err_msg=f"{path} on rank {sl.rank}")


# --------------------------------------------------------------------------- tensor parallel


def test_megatron_in_a_cell_matches_unsharded_forward_and_step(sess, ref):
    sess.run('tp = mlx_nbdist.shard(build(), "megatron")')
    check_tp_step(sess, ref, "tp")


def test_megatron_from_the_notebook_matches_unsharded_forward_and_step(sess, ref):
    sess.run("tpn = build()")
    table = mlx_nbdist.shard("tpn", "megatron", session=sess)
    assert not table.problems and not table.warnings
    n = sess.n
    assert [(r.path, r.mode, r.local_shape, r.axis) for r in table.rows] == [
        ("layers.0.weight", "all-to-sharded", (128 // n, 32), 0),
        ("layers.0.bias", "all-to-sharded", (128 // n,), 0),
        ("layers.2.weight", "sharded-to-all", (32, 128 // n), 1),
        ("layers.2.bias", "sharded-to-all", (32,), None),
    ]
    check_tp_step(sess, ref, "tpn")


def test_data_parallel_step_equals_full_batch_step(sess, ref):
    sess.run("dp = build()\nshard_n = BATCH // size\n"
             "dp_loss = sgd_step(dp, x[rank * shard_n:(rank + 1) * shard_n], "
             "y[rank * shard_n:(rank + 1) * shard_n], average=world)\n"
             "dp_params = params_np(dp)")
    n, batch, x, y = sess.n, ref["BATCH"], ref["x"], ref["y"]
    full = ref["build"]()
    ref["sgd_step"](full, x, y)
    want = ref["params_np"](full)
    k = batch // n
    alone = ref["build"]()  # control: rank 0's shard without averaging is another step
    ref["sgd_step"](alone, x[:k], y[:k])
    assert max(np.abs(ref["params_np"](alone)[p] - want[p]).max() for p in PARAMS) > 1e-3
    got = sess.pull("dp_params")
    losses = sess.pull("dp_loss")
    assert len({round(v, 6) for v in losses.values()}) == n  # each rank had its own data
    for rank in range(n):
        for p in PARAMS:
            np.testing.assert_allclose(got[rank][p], want[p], rtol=0, atol=1e-6,
                                       err_msg=f"{p} on rank {rank}")
            np.testing.assert_array_equal(got[rank][p], got[0][p])


def test_fsdp_forward_equals_unsharded_and_training_fails_clearly(sess, ref):
    n = sess.n
    r = sess.run('fs = mlx_nbdist.shard(build(), "fsdp")\n'
                 "fs_local = {k: tuple(v.shape) for k, v in tree_flatten(fs.parameters())}\n"
                 "fs_out = np.array(fs(x))")
    assert all("sum_scatter" in r.ranks[k].stderr for k in range(n))  # the shard warning
    want = np.array(ref["build"]()(ref["x"]))
    for rank, out in sess.pull("fs_out").items():
        assert float(np.abs(out - want).max()) < 1e-5, rank
    assert sess.pull("fs_local")[0] == {
        "module.layers.0.weight": (128 // n, 32), "module.layers.0.bias": (128 // n,),
        "module.layers.2.weight": (32 // n, 128), "module.layers.2.bias": (32 // n,)}
    full = ref["params_np"](ref["build"]())
    for path in PARAMS:  # every parameter split on axis 0, rank r holding block r
        got = mlx_nbdist.slices(f"fs.module.{path}", session=sess)
        size = full[path].shape[0] // n
        assert [(sl.axis, sl.ranges) for sl in got] == [
            (0, [(r * size, (r + 1) * size)]) for r in range(n)]
        np.testing.assert_array_equal(reassemble(got), full[path])
    with pytest.raises(CellError) as info:
        sess.run("loss, grads = nn.value_and_grad(fs, loss_fn)(fs, x, y)\nmx.eval(grads)")
    failures = info.value.failures
    assert sorted(f.rank for f in failures) == list(range(n))
    for f in failures:
        assert (f.ename, f.evalue) == ("RuntimeError", FSDP_NO_GRADIENTS)
    for words in ("fsdp", "sum_scatter", "forward (inference) works", "average_gradients",
                  "megatron"):
        assert words in FSDP_NO_GRADIENTS
    # raised while the gradient graph was built, on every rank alike: the group still works
    res = sess.run("float(mx.distributed.all_sum(mx.ones(1), group=world)[0])")
    assert {o.result_text for o in res.ranks.values()} == {f"{float(n)}"}
    sess.run("fs_out = np.array(fs(x))")  # and the model still runs forward
    assert all(float(np.abs(o - want).max()) < 1e-5 for o in sess.pull("fs_out").values())


def test_quantized_megatron_forward_within_quantization_tolerance(sess, ref):
    sess.run('qm = mlx_nbdist.shard(build_quantized(), "megatron")\n'
             "q_kinds = layer_kinds(qm)\nq_out = np.array(qm(x))")
    x = ref["x"]
    qfull = ref["build_quantized"]()
    want = np.array(qfull(x))
    quant_err = float(np.abs(want - np.array(ref["build"]()(x))).max())
    assert quant_err > 1e-3  # 4-bit weights: the tolerance below is far tighter than this
    for rank in range(sess.n):
        assert sess.pull("q_kinds")[rank] == [
            "QuantizedAllToShardedLinear", "ReLU", "QuantizedShardedToAllLinear"]
        diff = float(np.abs(sess.pull("q_out")[rank] - want).max())
        assert diff < 1e-4, f"rank {rank}: {diff} (quantization error itself {quant_err:.3g})"
    # the packed weights, scales and biases on the ranks are the unsharded ones, split
    want_params = ref["params_np"](qfull)
    for layer, axis in (("layers.0", 0), ("layers.2", 1)):
        for part in ("weight", "scales", "biases"):
            got = mlx_nbdist.slices(f"qm.{layer}.{part}", session=sess)
            assert {(sl.axis, sl.kind) for sl in got} == {(axis, "quantized")}
            np.testing.assert_array_equal(reassemble(got), want_params[f"{layer}.{part}"])


# --------------------------------------------------------------------------- the inplace trap


def test_inplace_modes_warn_and_give_wrong_outputs(s2, ref):
    mapping = {"layers.0": "inplace-all-to-sharded", "layers.2": "inplace-sharded-to-all"}
    s2.run("inp = build()")
    planned = mlx_nbdist.plan("inp", mapping, session=s2)
    assert any("shard_inplace" in w and "NOT equal the unsharded model" in w
               for w in planned.warnings)
    assert all("will not equal" in r.problem for r in planned.rows if r.axis is not None)
    table = mlx_nbdist.shard("inp", mapping, session=s2)
    assert any("shard_inplace only slices" in w for w in table.warnings)
    s2.run("inp_kinds = layer_kinds(inp)\ninp_shape = tuple(inp.layers[0].weight.shape)\n"
           "inp_out = np.array(inp(x))")
    want = np.array(ref["build"]()(ref["x"]))
    for rank in range(2):
        assert s2.pull("inp_kinds")[rank] == ["Linear", "ReLU", "Linear"]  # no collective
        assert s2.pull("inp_shape")[rank] == (64, 32)  # but the weights were sliced
        diff = float(np.abs(s2.pull("inp_out")[rank] - want).max())
        assert diff > 0.1 * float(np.abs(want).max()), f"rank {rank}: only {diff} off"


# --------------------------------------------------------------------------- plan checks


def test_indivisible_dims_are_refused_before_any_rank_moves(s2):
    s2.run("bad = nn.Sequential(nn.Linear(32, 99), nn.ReLU(), nn.Linear(99, 32))")
    with pytest.raises(ShardingError) as info:
        mlx_nbdist.shard("bad", session=s2)
    msg = str(info.value)
    assert "cannot shard 'bad' across 2 ranks" in msg
    for path, shape, axis in (("layers.0.weight", (99, 32), 0), ("layers.0.bias", (99,), 0),
                              ("layers.2.weight", (32, 99), 1)):
        assert f"{path}: shape {shape}, axis {axis} (size 99) is not divisible by group size 2" \
            in msg
    assert "layers.2.bias" not in msg  # replicated: nothing to divide
    # inside a cell the same refusal happens on every rank, before MLX touches the model
    with pytest.raises(CellError) as cell:
        s2.run('mlx_nbdist.shard(bad, "megatron")')
    assert {(f.rank, f.ename) for f in cell.value.failures} == {(0, "ShardingError"),
                                                                (1, "ShardingError")}
    s2.run("bad_state = [(type(m).__name__, tuple(m.weight.shape)) for m in bad.layers "
           "if hasattr(m, 'weight')]")
    assert s2.pull("bad_state") == {r: [("Linear", (99, 32)), ("Linear", (32, 99))]
                                    for r in (0, 1)}


def test_bad_mappings_give_clear_errors_and_change_nothing(s2):
    s2.run("mp = build()")
    cases = [
        ({"nope": "all-to-sharded"},
         "unknown path 'nope'; valid Linear paths: layers.0, layers.2"),
        ({"layers.1": "all-to-sharded"},
         "'layers.1' is a ReLU, not a Linear or QuantizedLinear; valid Linear paths: "
         "layers.0, layers.2"),
        ({"layers.0.weight": "all-to-sharded"},
         "unknown path 'layers.0.weight' (name the layer 'layers.0', not its parameter)"),
        ({"layers.0": "diagonal"}, "'layers.0': unknown mode 'diagonal'"),
    ]
    for mapping, expected in cases:
        with pytest.raises(ShardingError) as info:
            mlx_nbdist.shard("mp", mapping, session=s2)
        assert expected in str(info.value), str(info.value)
    assert s2.run("layer_kinds(mp)").ranks[1].result_text == "['Linear', 'ReLU', 'Linear']"


# --------------------------------------------------------------------------- slices


def test_slices_metadata_and_reassembly(sess, ref):
    n = sess.n
    sess.run('meta = mlx_nbdist.shard(build(), "megatron")')
    full = ref["params_np"](ref["build"]())
    expect = {  # path: (axis, local shape, kind)
        "layers.0.weight": (0, (128 // n, 32), "sharded"),
        "layers.0.bias": (0, (128 // n,), "sharded"),
        "layers.2.weight": (1, (32, 128 // n), "sharded"),
        "layers.2.bias": (None, (32,), "replicated"),
    }
    for path, (axis, local, kind) in expect.items():
        got = mlx_nbdist.slices(f"meta.{path}", session=sess)
        for r, sl in enumerate(got):
            assert (sl.name, sl.rank, sl.axis, sl.shape, sl.full_shape, sl.kind, sl.dtype) == (
                path, r, axis, local, full[path].shape, kind, "float32")
            assert sl.data.shape == local and not sl.sampled
            size = 128 // n
            assert sl.ranges == ([] if axis is None else [(r * size, (r + 1) * size)])
            assert sl.summary["norm"] == pytest.approx(np.linalg.norm(sl.data), rel=1e-5)
        np.testing.assert_array_equal(reassemble(got), full[path])


def test_slices_with_segments(s2, ref):
    s2.run("seg = build()")
    mlx_nbdist.shard("seg", "megatron", segments=2, session=s2)
    full = ref["params_np"](ref["build"]())
    for path, axis in (("layers.0.weight", 0), ("layers.0.bias", 0), ("layers.2.weight", 1)):
        got = mlx_nbdist.slices(f"seg.{path}", session=s2)
        # 128 rows in 2 segments of 64, each split over 2 ranks: blocks of 32
        assert [sl.ranges for sl in got] == [[(0, 32), (64, 96)], [(32, 64), (96, 128)]]
        assert {sl.axis for sl in got} == {axis}
        np.testing.assert_array_equal(reassemble(got), full[path])
    s2.run("seg_out = np.array(seg(x))")
    want = np.array(ref["build"]()(ref["x"]))
    assert all(float(np.abs(o - want).max()) < 1e-5 for o in s2.pull("seg_out").values())


@LINUX_ROUTES
def test_slices_sample_and_zero_copy(s2):
    s2.run('zc = mlx_nbdist.shard(build(), "megatron")')
    whole = mlx_nbdist.slices("zc.layers.0.weight", session=s2)
    sampled = mlx_nbdist.slices("zc.layers.0.weight", max_elements=100, session=s2)
    for w, sm in zip(whole, sampled, strict=True):
        assert sm.sampled and sm.data.size <= 100 and sm.shape == w.shape == (64, 32)
        stride = math.ceil(w.shape[0] / sm.data.shape[0])
        np.testing.assert_array_equal(sm.data, w.data[::stride, ::stride])
        assert sm.summary == pytest.approx(w.summary)  # the stats cover the whole slice
    from mlx_nbdist.client import transfer
    from mlx_nbdist.engine import rpc

    # each rank holds what it lent until the notebook's next request says it is no
    # longer used: here the sampled pull released the whole one, and only the
    # sample is still held
    assert {r: v["pinned"] for r, v in s2.apply(rpc.pool_state).items()} == {0: 1, 1: 1}
    # ranks on the notebook's host (Linux), slices under POOL_MIN: the notebook
    # copies each slice straight out of the rank's memory; no file, no pickle
    assert transfer.vm_available() and s2.receiver.routes == ["pool", "vm"]
    host = socket.gethostname()
    for _, (_m, info, values) in s2.apply(
        rpc.slice_of, "zc.layers.0.weight", None, s2.shm_prefix, host, ("pool", "vm")
    ).items():
        assert values is None and info["route"] == "vm" and {"pid", "addr", "nbytes"} <= set(info)
    for sl in whole:
        assert sl.data.base is not None and sl.data.base.flags.owndata  # a uint8 copy, viewed
    assert not list(Path("/dev/shm").glob(f"mlxnb-{s2.session_id}-*"))
    with pytest.raises(OSError, match="reading rank memory"):
        transfer.vm_read(2**22 + 12345, 0x1000, np.empty(8, np.uint8))  # no such process
    # a rank on another host (no shared memory): 8 KiB arrive as their own zmq frame,
    # not inside the pickle
    for _, (_meta, _info, values) in s2.apply(rpc.slice_of, "zc.layers.0.weight", None).items():
        owner = buffer_owner(values)
        assert isinstance(owner, memoryview) and isinstance(owner.obj, zmq.Frame), type(owner)
    # control: a 128-byte bias is under ipyparallel's buffer threshold and travels
    # in-band, so the check above does tell the two apart
    for _, (_meta, _info, values) in s2.apply(rpc.slice_of, "zc.layers.2.bias", None).items():
        assert isinstance(buffer_owner(values), bytes)


@LINUX_ROUTES
def test_slices_shared_memory_pool(s2):
    """Slices of 1 MiB and more end up in shared-memory segments: the rank copies,
    the notebook's array is the segment; a segment is reused once no array uses it."""
    import gc

    from mlx_nbdist.client.transfer import Lease
    from mlx_nbdist.engine import rpc, transfer

    n = 2**19  # 2 MiB of float32 per rank
    want = [np.arange(n, dtype=np.float32) + r * n for r in range(2)]
    s2.run(f"pool = mx.arange({n}, dtype=mx.float32) + rank * {n}\nmx.eval(pool)")
    s2.run("from mlx_nbdist.engine import transfer as _t")

    def state() -> list[tuple[int, int]]:
        s2.apply(rpc.settle)  # segments being made in the background
        return [(v["busy"], v["free"]) for v in s2.apply(rpc.pool_state).values()]

    def pooled(sl: TensorSlice) -> bool:
        return isinstance(buffer_owner(sl.data), Lease)

    def files() -> list[Path]:
        return list(Path("/dev/shm").glob(f"mlxnb-{s2.session_id}-*"))

    # a first pull of a size: no segment fits, so the notebook reads rank memory
    # while each rank makes one in the background; the next pull uses it
    first = mlx_nbdist.slices("pool", session=s2)
    assert not any(map(pooled, first)) and state() == [(0, 1), (0, 1)]
    second = mlx_nbdist.slices("pool", session=s2)
    for sl, w in zip(second, want, strict=True):
        np.testing.assert_array_equal(sl.data, w)
        assert pooled(sl) and not sl.data.flags.owndata and sl.data.flags.writeable
    assert state() == [(1, 0), (1, 0)] and not files()  # mapped, and unlinked at once
    # the rank's value changes; the array the notebook still holds does not
    s2.run("pool = pool * 2\nmx.eval(pool)")
    third = mlx_nbdist.slices("pool", session=s2)  # the one segment is busy: vm again
    s2.apply(rpc.settle)  # (a pull before the new segment is made: vm once more)
    fourth = mlx_nbdist.slices("pool", session=s2)  # in a second segment
    for sl, old, w in zip(fourth, second, want, strict=True):
        np.testing.assert_array_equal(old.data, w)
        np.testing.assert_array_equal(sl.data, 2 * w)
        assert pooled(sl) and not np.shares_memory(sl.data, old.data)
    assert not any(map(pooled, third)) and state() == [(2, 0), (2, 0)]
    second[0].data[:4] = -1  # a pulled array is the user's to write into
    view = second[1].data[10:20]  # a view keeps its segment busy
    del first, second, third, fourth, sl, old
    gc.collect()
    fifth = mlx_nbdist.slices("pool", session=s2)  # reuses segments, makes none
    for sl, w in zip(fifth, want, strict=True):
        np.testing.assert_array_equal(sl.data, 2 * w)
        assert pooled(sl)
    assert float(view[0]) == 10 + n and state() == [(1, 1), (2, 0)]
    # an idle pool over POOL_IDLE is dropped, on both sides
    del fifth, sl, view
    gc.collect()
    s2.run("_t.POOL_IDLE = 0")
    try:
        assert all(map(pooled, mlx_nbdist.slices("pool", session=s2)))
        assert state() == [(1, 0), (1, 0)]
        assert s2.receiver.mapped() == 2  # one mapping per rank
    finally:
        s2.run(f"_t.POOL_IDLE = {transfer.POOL_IDLE}")
    assert not files()
    # where the notebook may not read rank memory, a first pull makes its segment now
    rx = s2.receiver
    rx.routes.remove("vm")
    try:
        s2.run("pool8 = mx.ones(2**21)")  # 8 MiB: no segment fits
        got = mlx_nbdist.slices("pool8", session=s2)
        assert all(map(pooled, got)) and got[1].data.shape == (2**21,)
    finally:
        rx.routes.append("vm")
    del got
    # a rank whose /dev/shm refuses a segment keeps to the rank-memory route
    s2.run("pool16 = mx.ones(2**22)\n_t.SHM_DIR_SAVED = _t.SHM_DIR\n"
           "_t.SHM_DIR = _t.Path('/nonexistent-dir')")
    try:
        for _ in range(2):
            got = mlx_nbdist.slices("pool16", session=s2)
            assert not any(map(pooled, got)) and float(got[1].data.sum()) == 2**22
            state()
        assert s2.apply(lambda: __import__("mlx_nbdist.engine.transfer").engine.transfer
                        ._REFUSED[0]) == {0: 16 << 20, 1: 16 << 20}
    finally:
        s2.run("_t.SHM_DIR = _t.SHM_DIR_SAVED\n_t._REFUSED[0] = 1 << 62")
    assert not files()


# --------------------------------------------------------------------------- figures


def test_show_figures_match_the_slices(s2, ref, tmp_path):
    s2.run('fig_tp = mlx_nbdist.shard(build(), "megatron")\n'
           'fig_q = mlx_nbdist.shard(build_quantized(), "megatron")')
    full = ref["params_np"](ref["build"]())
    for path, rects, what in (
        ("layers.0.weight", [(0, 64, 0, 32), (64, 128, 0, 32)], ["rows 0:64", "rows 64:128"]),
        ("layers.2.weight", [(0, 32, 0, 64), (0, 32, 64, 128)], ["cols 0:64", "cols 64:128"]),
    ):
        fig = mlx_nbdist.show(f"fig_tp.{path}", session=s2)
        layout_ax = fig.axes[0]
        got = sorted((p.get_gid(), rect_of(p)) for p in blocks(layout_ax))
        assert got == [("block-r0", rects[0]), ("block-r1", rects[1])]
        for p in blocks(layout_ax):
            assert rgba(p.get_facecolor()) == rgba(rank_color(int(p.get_gid()[-1])))
        labels = [t.get_text().splitlines() for t in layout_ax.texts]
        shape = f"({rects[0][1] - rects[0][0]}, {rects[0][3] - rects[0][2]})"
        for r in (0, 1):
            assert [f"rank {r}", shape, what[r]] in labels, labels
        image = [im for ax in fig.axes for im in ax.images if im.get_gid() == "values"]
        np.testing.assert_array_equal(np.asarray(image[0].get_array()), full[path])
        assert f"fig_tp.{path}" in fig.get_suptitle()
        fig.savefig(tmp_path / f"{path}.png")
    fig = mlx_nbdist.show("fig_q.layers.2", session=s2)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().splitlines() for ax in panels] == [
        ["weight (packed uint32 words)", "(32, 16) uint32"], ["scales", "(32, 4) float32"],
        ["biases", "(32, 4) float32"]]
    assert sorted(rect_of(p) for p in blocks(panels[0])) == [(0, 32, 0, 8), (0, 32, 8, 16)]
    qfull = ref["params_np"](ref["build_quantized"]())
    np.testing.assert_array_equal(panels[1].images[0].get_array(), qfull["layers.2.scales"])
    assert "NOT split" not in fig.get_suptitle()
    fig.savefig(tmp_path / "quantized.png")
    assert all((tmp_path / f).stat().st_size > 10_000 for f in
               ("layers.0.weight.png", "layers.2.weight.png", "quantized.png"))


# --------------------------------------------------------------------------- gradsync


def test_gradsync_data_parallel(s2, ref):
    s2.run("gdp = build()\nshard_n = BATCH // size\n"
           "xs, ys = x[rank * shard_n:(rank + 1) * shard_n], y[rank * shard_n:(rank + 1) * shard_n]")
    g = mlx_nbdist.gradsync("gdp", "loss_fn(gdp, xs, ys)", session=s2)
    x, y, grads = ref["x"], ref["y"], ref["grads_np"]
    model = ref["build"]()
    full = grads(model, x, y)
    local = [grads(model, x[:4], y[:4]), grads(model, x[4:], y[4:])]
    by = {(s.name, s.rank): s for s in g.samples}
    assert sorted(by) == sorted((p, r) for p in PARAMS for r in (0, 1))
    for p in PARAMS:
        before = [by[p, r].norm_before for r in (0, 1)]
        after = [by[p, r].norm_after for r in (0, 1)]
        assert before == pytest.approx([np.linalg.norm(local[r][p]) for r in (0, 1)], rel=1e-5)
        assert abs(before[0] - before[1]) > 1e-3 * max(before), p  # differ before sync
        assert after[0] == after[1] == pytest.approx(np.linalg.norm(full[p]), rel=1e-5)
        for r in (0, 1):
            assert by[p, r].replicated and by[p, r].max_diff_after == 0.0
            assert by[p, r].nbytes == full[p].nbytes
            assert by[p, r].collective.startswith("all_sum / 2")
    assert g.desynced() == []
    fig = g.figure()
    bytes_ax = fig.axes[2]
    heights = {p.get_gid(): p.get_height() for p in bytes_ax.patches if p.get_gid()}
    assert heights["bytes:layers.0.weight:r1"] == 128 * 32 * 4
    assert not [t for t in bytes_ax.texts if t.get_gid() == "bytes-note"]
    # the step's collectives, timed: average_gradients is one all_sum of every gradient
    # (one bucket); the rank-0 comparison gradsync does afterwards is not counted
    param_bytes = sum(full[p].nbytes for p in PARAMS)
    assert g.comm is not None and [r.op for r in g.comm.rows] == ["all_sum"] * 3
    for r in (0, 1):
        row = g.comm.of("all_sum", r)
        assert (row.count, row.nbytes) == (1, param_bytes), row
        assert row.time > 0 and row.gbps and row.gbps > 0
        assert row.ratio == pytest.approx(row.gbps / g.comm.probe_gbps)
    line = f"this step (each rank): {g.comm.line()}"
    assert line.startswith(f"this step (each rank): 1 all_sum, {human_bytes(param_bytes)}, ")
    assert "x probe)" in line
    assert line in str(g).splitlines() and line in fig.get_suptitle().splitlines()
    # its table is named after the call, not an internal cell number
    assert str(g.comm).startswith("collectives of gradsync('gdp') on ring"), str(g.comm)


def test_gradsync_tensor_parallel_and_a_desynced_replica(s2, ref, tmp_path):
    s2.run('gtp = mlx_nbdist.shard(build(), "megatron")')
    g = mlx_nbdist.gradsync("gtp", "loss_fn(gtp, x, y)  # a comment ends the step", session=s2)
    assert g.desynced() == []
    full = ref["grads_np"](ref["build"](), ref["x"], ref["y"])
    for s in g.samples:  # the local shard gradients are the full gradient's blocks
        sl = next(t for t in mlx_nbdist.slices(f"gtp.{s.name}", max_elements=1, session=s2)
                  if t.rank == s.rank)
        assert s.norm_after == pytest.approx(np.linalg.norm(part_of(full[s.name], sl)), rel=1e-5)
        assert s.nbytes == 0 and "bwd all_sum/step: 0 calls, 0 B" in s.collective
    # the step's only collective: the forward all_sum of the sharded-to-all layer
    out_bytes = ref["BATCH"] * ref["D_OUT"] * 4
    assert [(g.comm.of("all_sum", r).count, g.comm.of("all_sum", r).nbytes)
            for r in (0, 1)] == [(1, out_bytes)] * 2
    fig = g.figure()
    note = [t.get_text() for t in fig.axes[2].texts if t.get_gid() == "bytes-note"]
    assert len(note) == 1 and "no gradient collective in this step" in note[0]
    assert not fig.axes[2].get_yticks().size  # no empty '0 B' axis
    fig.savefig(tmp_path / "gradsync_tp.png")
    assert mlx_nbdist.check("gtp", session=s2).ok

    s2.run("if rank == 1:\n    gtp.layers[2].bias = gtp.layers[2].bias + 0.05")
    g = mlx_nbdist.gradsync("gtp", "loss_fn(gtp, x, y)", session=s2)
    assert g.desynced() == ["layers.2.bias"]
    assert "DESYNC in 1: layers.2.bias" in g.figure().get_suptitle()
    bias = {s.rank: s for s in g.samples if s.name == "layers.2.bias"}
    assert bias[0].max_diff_after == 0 and bias[1].max_diff_after > 1e-3
    report = mlx_nbdist.check("gtp", session=s2)
    assert not report.ok and list(report.diverged) == ["layers.2.bias"]
    assert list(report.diverged["layers.2.bias"]) == [1]
    assert report.diverged["layers.2.bias"][1] == pytest.approx(32 * 0.05, rel=1e-3)
    assert "layers.2.bias: rank 1" in str(report)


def test_a_gradsync_step_that_fails_shows_the_users_frames_only(s2):
    """The user trial: ``--step 'nosuch(net)'`` showed ipyparallel's do_apply frame and
    'Could not get source, probably due dynamically evaluated source code.'"""
    from mlx_nbdist import CellError
    from mlx_nbdist.errors import strip_ansi

    s2.run("gbad = build()")
    with pytest.raises(CellError) as info:
        mlx_nbdist.gradsync("gbad", "nosuch(gbad)", session=s2)
    shown = strip_ansi("\n".join(info.value._render_traceback_()))
    assert "NameError: name 'nosuch' is not defined" in shown, shown
    assert "ipyparallel" not in shown and "Could not get source" not in shown, shown
    assert "----> 2 nosuch(gbad)" in shown, shown  # the step's own line
    # a step that gives no loss says so, naming the step (MLX's words named neither)
    with pytest.raises(CellError) as info:
        mlx_nbdist.gradsync("gbad", '"a string"', session=s2)
    assert ("gradsync: --step '\"a string\"' gave a str, not the loss (a scalar mx.array, "
            "or a tuple that starts with one)") in str(info.value), str(info.value)


def test_gradsync_two_megatron_pairs_reports_the_backward_all_sum(s2, ref):
    s2.run('g2 = mlx_nbdist.shard(build_two_pairs(), "megatron")')
    g = mlx_nbdist.gradsync("g2", "loss_fn(g2, x, y)", session=s2)
    full = ref["grads_np"](ref["build_two_pairs"](), ref["x"], ref["y"])
    nbytes = ref["BATCH"] * ref["D_OUT"] * 4  # the input gradient of the second pair
    step = f"bwd all_sum/step: 1 call, {nbytes:,} B"
    upstream = {"layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"}
    for s in g.samples:
        assert step in s.collective, s.collective
        assert s.collective.startswith("all_sum" if s.name in upstream else "none"), s
        sl = next(t for t in mlx_nbdist.slices(f"g2.{s.name}", max_elements=1, session=s2)
                  if t.rank == s.rank)
        assert s.norm_after == pytest.approx(np.linalg.norm(part_of(full[s.name], sl)),
                                             rel=1e-5), s.name
        if s.name in upstream:
            assert abs(s.norm_before - s.norm_after) > 1e-4 * s.norm_after, s.name
    assert g.desynced() == []
    note = [t.get_text() for t in g.figure().axes[2].texts if t.get_gid() == "bytes-note"]
    assert len(note) == 1
    assert f"moved {human_bytes(nbytes)} per step on each rank (1 call)" in \
        " ".join(note[0].split())
    # timed: the two sharded-to-all layers' forward all_sum and the backward one, each
    # of a (BATCH, D_OUT) float32 activation (gradient)
    for r in (0, 1):
        row = g.comm.of("all_sum", r)
        assert (row.count, row.nbytes) == (3, 3 * nbytes), row
    assert f"this step (each rank): 3 all_sum, {human_bytes(3 * nbytes)}, " in str(g)
