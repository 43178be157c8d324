"""Figures and text of mlx_nbdist.viz, checked through the figure objects.

The slices are built the way MLX shards: ``np.split`` of a real array along the
sharded axis, and for fused weights (``segments > 1``) a split into segments
first, then each segment into one part per rank (the layout of
``mlx.nn.layers.distributed.shard_linear(..., segments=k)`` and of
``ParamSpec.ranges``).
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib import colors as mcolors
from matplotlib.figure import Figure

from mlx_nbdist.results import GradSample, PlanRow, TensorSlice
from mlx_nbdist.viz import (
    MAX_PIXELS,
    desynced,
    format_gradsync,
    format_plan,
    format_tensor,
    gradsync_figure,
    human_bytes,
    plan_table_html,
    rank_color,
    show_quantized,
    show_tensor,
)
from mlx_nbdist.viz.gradsync import DESYNC_COLOR

# Figures are built with the object API (no pyplot), so they render with Agg whatever
# the backend; conftest also sets MPLBACKEND=Agg.

VIZ_DIR = Path(__file__).resolve().parent.parent / "mlx_nbdist" / "viz"


# --------------------------------------------------------------------------- builders


def shard(
    name: str,
    full: np.ndarray,
    n: int,
    axis: int,
    *,
    segments: int = 1,
    with_data: bool = True,
    stride: int | None = None,
    dtype: str = "float32",
    kind: str = "sharded",
) -> list[TensorSlice]:
    """Split ``full`` like MLX: segments first, then each segment into ``n`` parts."""
    seg_len = full.shape[axis] // segments
    part = seg_len // n
    per_segment = [np.split(seg, n, axis=axis) for seg in np.split(full, segments, axis=axis)]
    out = []
    for r in range(n):
        local = np.concatenate([parts[r] for parts in per_segment], axis=axis)
        ranges = [(s * seg_len + r * part, s * seg_len + (r + 1) * part) for s in range(segments)]
        data = None
        if with_data:
            data = local if stride is None else local[(slice(None, None, stride),) * local.ndim]
        summary = {
            "min": float(local.min()),
            "max": float(local.max()),
            "norm": float(np.linalg.norm(local.astype(np.float64).ravel())),
        }
        out.append(
            TensorSlice(
                name=name,
                rank=r,
                shape=local.shape,
                full_shape=full.shape,
                dtype=dtype,
                axis=axis,
                ranges=ranges,
                kind=kind,
                data=data,
                summary=summary,
                sampled=stride is not None,
            )
        )
    return out


def replicate(name: str, full: np.ndarray, n: int, *, with_data: bool = True) -> list[TensorSlice]:
    summary = {"min": float(full.min()), "max": float(full.max()), "norm": 1.0}
    return [
        TensorSlice(
            name=name,
            rank=r,
            shape=full.shape,
            full_shape=full.shape,
            dtype="float32",
            axis=None,
            ranges=[],
            kind="replicated",
            data=full.copy() if with_data else None,
            summary=summary,
        )
        for r in range(n)
    ]


def blocks(ax) -> list:
    return [p for p in ax.patches if (p.get_gid() or "").startswith("block-")]


def outlines(ax) -> list:
    return [p for p in ax.patches if (p.get_gid() or "").startswith("outline-")]


def rect_of(patch) -> tuple[float, float, float, float]:
    """(row0, row1, col0, col1) of a Rectangle drawn in view coordinates."""
    return (
        patch.get_y(),
        patch.get_y() + patch.get_height(),
        patch.get_x(),
        patch.get_x() + patch.get_width(),
    )


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def image_of(fig: Figure) -> np.ndarray:
    images = [im for ax in fig.axes for im in ax.images if im.get_gid() == "values"]
    assert len(images) == 1
    return np.asarray(images[0].get_array())


def rgba(color) -> tuple[float, ...]:
    return tuple(np.round(mcolors.to_rgba(color), 6))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- show_tensor


def test_2d_blocks_match_ranges_and_colours(rng):
    full = rng.standard_normal((512, 256)).astype(np.float32)
    fig = show_tensor(shard("layers.0.weight", full, 2, axis=0))
    layout_ax = fig.axes[0]
    got = sorted((p.get_gid(), rect_of(p)) for p in blocks(layout_ax))
    assert got == [("block-r0", (0, 256, 0, 256)), ("block-r1", (256, 512, 0, 256))]
    colours = {p.get_gid(): rgba(p.get_facecolor()) for p in blocks(layout_ax)}
    assert colours["block-r0"] == rgba(rank_color(0))
    assert colours["block-r1"] == rgba(rank_color(1))
    assert colours["block-r0"] != colours["block-r1"]
    assert layout_ax.get_xlim() == (0, 256) and layout_ax.get_ylim() == (512, 0)


def test_rank_colour_is_stable_across_group_sizes(rng):
    full = rng.standard_normal((64, 64)).astype(np.float32)
    two = show_tensor(shard("w", full, 2, axis=1), values=False)
    eight = show_tensor(shard("w", full, 8, axis=1), values=False)

    def colour_of(fig, rank):
        found = {
            rgba(p.get_facecolor()) for p in blocks(fig.axes[0]) if p.get_gid() == f"block-r{rank}"
        }
        assert len(found) == 1
        return found.pop()

    assert colour_of(two, 1) == colour_of(eight, 1)
    assert len({colour_of(eight, r) for r in range(8)}) == 8
    assert len({rank_color(r) for r in range(20)}) == 20


def test_labels_name_rank_shape_and_range(rng):
    full = rng.standard_normal((512, 256)).astype(np.float32)
    fig = show_tensor(shard("layers.0.weight", full, 2, axis=0))
    labels = texts(fig.axes[0])
    assert any(lab.splitlines() == ["rank 0", "(256, 256)", "rows 0:256"] for lab in labels)
    assert any(lab.splitlines() == ["rank 1", "(256, 256)", "rows 256:512"] for lab in labels)
    assert "layers.0.weight  (512, 256) float32" in fig.get_suptitle()
    assert "sharded on axis 0 over 2 ranks" in fig.get_suptitle()


def test_column_split_labels_use_cols(rng):
    full = rng.standard_normal((128, 256)).astype(np.float32)
    fig = show_tensor(shard("w", full, 4, axis=1), values=False)
    got = sorted(rect_of(p) for p in blocks(fig.axes[0]))
    assert got == [(0, 128, 64 * r, 64 * (r + 1)) for r in range(4)]
    joined = "\n".join(texts(fig.axes[0]))
    assert "cols 192:256" in joined and "(128, 64)" in joined


def test_heatmap_is_the_reassembled_tensor(rng):
    full = rng.standard_normal((200, 96)).astype(np.float32)
    fig = show_tensor(shard("w", full, 4, axis=1))
    np.testing.assert_array_equal(image_of(fig), full)
    values_ax = fig.axes[1]
    assert sorted(p.get_gid() for p in outlines(values_ax)) == [f"outline-r{r}" for r in range(4)]
    assert sorted(rect_of(p) for p in outlines(values_ax)) == [
        (0, 200, 24 * r, 24 * (r + 1)) for r in range(4)
    ]
    assert {rgba(p.get_edgecolor()) for p in outlines(values_ax)} == {
        rgba(rank_color(r)) for r in range(4)
    }


def test_big_tensor_is_block_averaged_quickly(rng):
    full = rng.standard_normal((4096, 1024)).astype(np.float32)
    slices = shard("lm_head.weight", full, 4, axis=0)
    start = time.perf_counter()
    fig = show_tensor(slices)
    fig.savefig(Path("/dev/null"), format="png", dpi=60)
    elapsed = time.perf_counter() - start
    image = image_of(fig)
    assert image.shape == (MAX_PIXELS, MAX_PIXELS)
    expected = full.reshape(256, 16, 256, 4).mean(axis=(1, 3), dtype=np.float64)
    np.testing.assert_allclose(image, expected, rtol=1e-6, atol=1e-6)
    assert "each heatmap cell: the mean of 16x4 values" in fig.get_suptitle()
    assert elapsed < 10, elapsed


def test_uneven_downsample_keeps_every_element(rng):
    full = rng.standard_normal((300, 10)).astype(np.float32)
    image = image_of(show_tensor(shard("w", full, 2, axis=1)))
    assert image.shape == (150, 10)
    np.testing.assert_allclose(image, full.reshape(150, 2, 10).mean(axis=1), rtol=1e-6)


def test_1d_is_a_strip(rng):
    full = np.linspace(-1, 1, 1024, dtype=np.float32)
    fig = show_tensor(shard("layers.0.bias", full, 4, axis=0))
    got = sorted(rect_of(p) for p in blocks(fig.axes[0]))
    assert got == [(0, 1, 256 * r, 256 * (r + 1)) for r in range(4)]
    assert "[768:1024]" in "\n".join(texts(fig.axes[0]))
    image = image_of(fig)
    assert image.shape == (1, 256)
    np.testing.assert_allclose(image[0], full.reshape(256, 4).mean(axis=1), rtol=1e-6)
    width, height = fig.axes[0].get_position().size * fig.get_size_inches()
    assert width > 4 * height


def test_3d_flattens_leading_dims(rng):
    full = rng.standard_normal((4, 8, 16)).astype(np.float32)
    fig = show_tensor(shard("conv.weight", full, 2, axis=0))
    assert "(4, 8, 16) shown as (32, 16)" in fig.get_suptitle()
    assert sorted(rect_of(p) for p in blocks(fig.axes[0])) == [(0, 16, 0, 16), (16, 32, 0, 16)]
    np.testing.assert_array_equal(image_of(fig), full.reshape(32, 16))
    assert "[0:2, :, :]" in "\n".join(texts(fig.axes[0]))


def test_3d_middle_axis_gives_bands_per_leading_index(rng):
    full = rng.standard_normal((4, 8, 16)).astype(np.float32)
    fig = show_tensor(shard("conv.weight", full, 2, axis=1))
    rank0 = sorted(rect_of(p) for p in blocks(fig.axes[0]) if p.get_gid() == "block-r0")
    assert rank0 == [(8 * o, 8 * o + 4, 0, 16) for o in range(4)]
    np.testing.assert_array_equal(image_of(fig), full.reshape(32, 16))


def test_segments_give_non_contiguous_blocks_per_rank(rng):
    q, k, v = (np.full((96, 64), c, np.float32) for c in (-1.0, 0.0, 1.0))
    full = np.concatenate([q, k, v]) + rng.standard_normal((288, 64)).astype(np.float32) * 0.1
    slices = shard("attn.qkv_proj.weight", full, 2, axis=0, segments=3)
    assert slices[0].ranges == [(0, 48), (96, 144), (192, 240)]
    fig = show_tensor(slices)
    by_rank = {
        r: sorted(rect_of(p) for p in blocks(fig.axes[0]) if p.get_gid() == f"block-r{r}")
        for r in range(2)
    }
    assert by_rank[0] == [(0, 48, 0, 64), (96, 144, 0, 64), (192, 240, 0, 64)]
    assert by_rank[1] == [(48, 96, 0, 64), (144, 192, 0, 64), (240, 288, 0, 64)]
    labels = texts(fig.axes[0])
    assert any(lab.startswith("rank 1  seg 3/3") and "rows 240:288" in lab for lab in labels)
    assert "3 segments per rank" in fig.get_suptitle()
    # the heatmap puts every segment back in place (144 rows, block-mean 2x1)
    np.testing.assert_allclose(image_of(fig), full.reshape(144, 2, 64).mean(axis=1), rtol=1e-6)


def test_replicated_is_one_block(rng):
    full = rng.standard_normal((64, 64)).astype(np.float32)
    fig = show_tensor(replicate("norm.weight", full, 4))
    ax = fig.axes[0]
    assert [p.get_gid() for p in blocks(ax)] == ["block-replicated"]
    assert rect_of(blocks(ax)[0]) == (0, 64, 0, 64)
    stripes = {p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("stripe-")}
    assert stripes == {f"stripe-r{r}" for r in range(4)}
    assert any("replicated" in t and "on ranks 0-3" in t for t in texts(ax))
    assert "replicas identical" in fig.get_suptitle()
    np.testing.assert_array_equal(image_of(fig), full)


def test_replicas_that_differ_are_flagged(rng):
    full = rng.standard_normal((8, 8)).astype(np.float32)
    slices = replicate("norm.weight", full, 3)
    slices[2].data[3, 3] += 0.5
    fig = show_tensor(slices)
    assert "replicas DIFFER" in fig.get_suptitle()
    assert "0.5" in fig.get_suptitle()
    assert rgba(fig._suptitle.get_color()) != rgba("black")


def test_summary_only_has_no_heatmap_and_shows_stats(rng):
    full = rng.standard_normal((64, 32)).astype(np.float32)
    slices = shard("w", full, 2, axis=0, with_data=False)
    fig = show_tensor(slices)
    assert all(not ax.images for ax in fig.axes)
    assert len([ax for ax in fig.axes if blocks(ax)]) == 1
    joined = "\n".join(texts(fig.axes[0]))
    assert f"norm {slices[1].summary['norm']:.4g}" in joined
    assert f"max {slices[0].summary['max']:.3g}" in joined
    assert "summary only" in fig.get_suptitle()


def test_values_false_draws_one_panel(rng):
    full = rng.standard_normal((16, 16)).astype(np.float32)
    fig = show_tensor(shard("w", full, 2, axis=0), values=False)
    assert len(fig.axes) == 1 and not fig.axes[0].images


def test_sampled_values_are_noted_and_placed(rng):
    full = rng.standard_normal((64, 40)).astype(np.float32)
    fig = show_tensor(shard("w", full, 2, axis=0, stride=4))
    assert "sampled (stride 4" in fig.get_suptitle()
    np.testing.assert_array_equal(image_of(fig), full[::4, ::4])
    images = [im for ax in fig.axes for im in ax.images]
    assert images[0].get_extent() == [0, 40, 64, 0]


def test_gaps_are_warned(rng):
    full = rng.standard_normal((10, 6)).astype(np.float32)
    slices = [
        TensorSlice("gap", 0, (4, 6), (10, 6), "float32", 0, [(0, 4)], data=full[:4]),
        TensorSlice("gap", 1, (4, 6), (10, 6), "float32", 0, [(6, 10)], data=full[6:]),
    ]
    fig = show_tensor(slices)
    assert "2 indices of axis 0 held by no rank" in fig.get_suptitle()
    image = image_of(fig)
    assert np.isnan(image[4:6]).all()
    np.testing.assert_array_equal(image[6:], full[6:])


def test_mismatched_slices_raise():
    a = TensorSlice("w", 0, (2, 2), (4, 2), "float32", 0, [(0, 2)])
    b = TensorSlice("w", 1, (2, 2), (4, 3), "float32", 0, [(2, 4)])
    with pytest.raises(ValueError, match="full_shape"):
        show_tensor([a, b])
    with pytest.raises(ValueError, match="no slices"):
        show_tensor([])


def test_draws_into_given_axes(rng):
    full = rng.standard_normal((32, 32)).astype(np.float32)
    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert show_tensor(shard("w", full, 2, axis=1), ax=(left, right)) is fig
    assert len(blocks(left)) == 2 and right.images
    np.testing.assert_array_equal(right.images[0].get_array(), full)


def test_quantized_three_panels(rng):
    packed = rng.integers(0, 2**32, size=(256, 64), dtype=np.uint32)
    scales = rng.random((256, 8)).astype(np.float32)
    biases = -rng.random((256, 8)).astype(np.float32)
    fig = show_quantized(
        shard("q.weight", packed, 4, axis=0, dtype="uint32", kind="quantized"),
        shard("q.scales", scales, 4, axis=0, kind="quantized"),
        shard("q.biases", biases, 4, axis=0, kind="quantized"),
    )
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().splitlines()[0] for ax in panels] == [
        "weight (packed uint32 words)",
        "scales",
        "biases",
    ]
    assert "(256, 64) uint32" in panels[0].get_title()
    assert len(blocks(panels[0])) == 4 and not panels[0].images
    np.testing.assert_array_equal(panels[1].images[0].get_array(), scales)
    np.testing.assert_array_equal(panels[2].images[0].get_array(), biases)
    assert "NOT split" not in fig.get_suptitle()


def test_quantized_flags_scales_split_unlike_weight(rng):
    packed = rng.integers(0, 2**32, size=(64, 16), dtype=np.uint32)
    scales = rng.random((64, 4)).astype(np.float32)
    fig = show_quantized(
        shard("q.weight", packed, 2, axis=0, dtype="uint32"), shard("q.scales", scales, 2, axis=1)
    )
    assert "scales NOT split like the weight on ranks 0-1" in fig.get_suptitle()


# --------------------------------------------------------------------------- format_tensor


def test_format_tensor_grid_and_table(rng):
    full = rng.standard_normal((512, 256)).astype(np.float32)
    text = format_tensor(shard("layers.0.weight", full, 2, axis=0))
    lines = text.splitlines()
    grid = [ln for ln in lines if ln.startswith("│")]
    assert grid and set("".join(g.strip("│") for g in grid[: len(grid) // 2])) == {"0"}
    assert set("".join(g.strip("│") for g in grid[len(grid) // 2 :])) == {"1"}
    row0 = next(ln for ln in lines if ln.split()[:3] == ["0", "rows", "0:256"])
    assert "(256, 256)" in row0 and "256.0 KiB" in row0
    assert f"{np.linalg.norm(full[:256].astype(np.float64)):.4g}" in row0
    assert "total 512.0 KiB on 2 ranks; unsharded 512.0 KiB" in lines


def test_format_tensor_segments_and_replicated(rng):
    full = rng.standard_normal((288, 64)).astype(np.float32)
    text = format_tensor(shard("qkv", full, 2, axis=0, segments=3))
    assert "rows 48:96, 144:192, 240:288" in text
    grid = [ln.strip("│") for ln in text.splitlines() if ln.startswith("│")]
    assert [row[0] for row in grid] == ["0", "0", "1", "1"] * 3
    rep = format_tensor(replicate("norm", full, 4, with_data=False))
    assert "* = every rank (0-3) holds the whole tensor" in rep
    assert all(set(ln.strip("│")) == {"*"} for ln in rep.splitlines() if ln.startswith("│"))


def test_format_tensor_1d():
    full = np.arange(1024, dtype=np.float32)
    text = format_tensor(shard("b", full, 4, axis=0))
    grid = [ln.strip("│") for ln in text.splitlines() if ln.startswith("│")]
    assert grid == ["0" * 16 + "1" * 16 + "2" * 16 + "3" * 16]


@pytest.mark.parametrize(
    "dtype, numpy_dtype, itemsize",
    [("float16", np.float16, 2), ("int8", np.int8, 1), ("int32", np.int32, 4),
     ("bfloat16", np.float32, 2), ("float32", np.float32, 4), ("uint32", np.uint32, 4),
     ("bool", np.bool_, 1), ("complex64", np.complex64, 8)],
)
@pytest.mark.filterwarnings("ignore:Casting complex values")  # the builder's summary
def test_format_tensor_bytes_follow_the_dtype(dtype, numpy_dtype, itemsize):
    # bfloat16 arrives as float32 values (numpy has no bfloat16) but is counted as 2 bytes
    full = np.ones((64, 128), dtype=numpy_dtype)
    text = format_tensor(shard("w", full, 2, axis=0, dtype=dtype))
    rows = [ln.split() for ln in text.splitlines() if ln.split()[:2] in (["0", "rows"],
                                                                        ["1", "rows"])]
    assert len(rows) == 2
    local = human_bytes(32 * 128 * itemsize)
    assert all(r[5] == dtype and " ".join(r[6:8]) == local for r in rows), (local, rows)
    whole = human_bytes(64 * 128 * itemsize)
    assert f"total {whole} on 2 ranks; unsharded {whole}" in text.splitlines()


# --------------------------------------------------------------------------- gradsync


PARAMS = [
    ("embed.weight", (100, 16), True),
    ("layers.0.weight", (16, 16), True),
    ("layers.0.bias", (16,), True),
    ("layers.1.weight", (32, 16), False),
]


def grad_samples(diff_on: str | None = "layers.0.bias", diff: float = 3.2e-3) -> list[GradSample]:
    out = []
    for rank in range(4):
        for name, shape, replicated in PARAMS:
            numel = int(np.prod(shape))
            out.append(
                GradSample(
                    name=name,
                    rank=rank,
                    replicated=replicated,
                    norm_before=1.0 + 0.25 * rank,
                    norm_after=2.0 if replicated else 1.0 + 0.25 * rank,
                    max_diff_after=diff if (name == diff_on and rank == 2) else 0.0,
                    shape=shape,
                    collective="all_sum / 4 (average_gradients)" if replicated else "none",
                    nbytes=numel * 4 if replicated else 0,
                )
            )
    return out


def test_desynced_names_the_parameter():
    assert desynced(grad_samples()) == ["layers.0.bias"]
    assert desynced(grad_samples(diff_on=None)) == []
    # below tolerance: 1e-9 against an RMS element of 2/sqrt(16) = 0.5
    assert desynced(grad_samples(diff=1e-9)) == []
    assert desynced(grad_samples(diff=1e-9), tol=1e-10) == ["layers.0.bias"]
    # sharded parameters are never flagged
    assert desynced(grad_samples(diff_on="layers.1.weight", diff=5.0)) == []
    assert desynced(grad_samples(diff=float("nan"))) == ["layers.0.bias"]


def test_gradsync_figure_flags_desync_in_red():
    fig = gradsync_figure(grad_samples())
    norms_ax, diff_ax, bytes_ax = fig.axes[:3]
    diff_bars = {p.get_gid(): p for p in diff_ax.patches if p.get_gid()}
    assert set(diff_bars) == {f"maxdiff:{n}" for n, _, _ in PARAMS}
    assert rgba(diff_bars["maxdiff:layers.0.bias"].get_facecolor()) == rgba(DESYNC_COLOR)
    assert diff_bars["maxdiff:layers.0.bias"].get_height() == pytest.approx(3.2e-3)
    for name in ("embed.weight", "layers.0.weight", "layers.1.weight"):
        assert rgba(diff_bars[f"maxdiff:{name}"].get_facecolor()) != rgba(DESYNC_COLOR)
    label = next(t for t in diff_ax.texts if t.get_gid() == "difftext:layers.0.bias")
    assert "DESYNC" in label.get_text() and "0.0032" in label.get_text()
    assert rgba(label.get_color()) == rgba(DESYNC_COLOR)
    ticks = {t.get_text(): t for t in bytes_ax.get_xticklabels()}
    assert "layers.0.bias [DESYNC]" in ticks
    assert rgba(ticks["layers.0.bias [DESYNC]"].get_color()) == rgba(DESYNC_COLOR)
    assert rgba(ticks["embed.weight"].get_color()) != rgba(DESYNC_COLOR)
    assert "DESYNC in 1: layers.0.bias" in fig.get_suptitle()


def test_gradsync_figure_norm_and_byte_bars():
    samples = grad_samples(diff_on=None)
    fig = gradsync_figure(samples)
    norms_ax, _, bytes_ax = fig.axes[:3]
    bars = {p.get_gid(): p for p in norms_ax.patches if p.get_gid()}
    for s in samples:
        before, after = bars[f"before:{s.name}:r{s.rank}"], bars[f"after:{s.name}:r{s.rank}"]
        assert before.get_height() == pytest.approx(s.norm_before)
        assert after.get_height() == pytest.approx(s.norm_after)
        assert rgba(after.get_facecolor()) == rgba(rank_color(s.rank))
        assert before.get_hatch() and not after.get_hatch()
        assert before.get_x() < after.get_x()
    byte_bars = {p.get_gid(): p for p in bytes_ax.patches if p.get_gid()}
    assert byte_bars["bytes:embed.weight:r3"].get_height() == 100 * 16 * 4
    assert rgba(byte_bars["bytes:embed.weight:r3"].get_facecolor()) == rgba(rank_color(3))
    ops = {t.get_gid(): t.get_text() for t in bytes_ax.texts}
    assert ops["collective:embed.weight"] == "all_sum"
    assert ops["collective:layers.1.weight"] == "none"
    assert "agree across ranks" in fig.get_suptitle()
    diff_ax = fig.axes[1]
    notes = [t.get_text() for t in diff_ax.texts if t.get_gid() == "diff-note"]
    assert notes == ["all 3 replicated gradients are identical on every rank after sync"]
    assert len(diff_ax.get_yticks()) == 0
    assert not [t for t in gradsync_figure(grad_samples()).axes[1].texts
                if t.get_gid() == "diff-note"]


def test_format_gradsync_lines():
    text = format_gradsync(grad_samples())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["parameter", "kind", "rank"]
    bad = [ln for ln in lines if ln.startswith("layers.0.bias")]
    assert len(bad) == 4 and all(ln.endswith("DESYNC") for ln in bad)
    assert re.search(r"^layers\.0\.bias\s+replicated\s+2\s+1\.5\s+2\s+0\.0032\b", text, re.M)
    assert lines[-1] == "DESYNC (tol 1e-06 relative): layers.0.bias (max diff 0.0032)"
    ok = format_gradsync(grad_samples(diff_on=None)).splitlines()[-1]
    assert ok == "OK: all 3 replicated parameters agree across ranks (tol 1e-06)"


def tp_samples(calls: int, nbytes: int, per_rank: dict[int, tuple[int, int]] | None = None
               ) -> list[GradSample]:
    """Tensor-parallel rows as engine.gradsync reports them: every nbytes is 0."""
    out = []
    for rank in range(2):
        c, b = (per_rank or {}).get(rank, (calls, nbytes))
        step = f"bwd all_sum/step: {c} call{'' if c == 1 else 's'}, {b:,} B"
        for name, shape, replicated in PARAMS:
            what = "none (local shard gradient" if not replicated else (
                "all_sum of input grads in bwd (sum_gradients" if c else
                "none (replicated, not synchronised")
            out.append(GradSample(name, rank, replicated, 1.0, 1.0, 0.0, shape,
                                  f"{what}; {step})", 0, step_calls=c, step_nbytes=b))
    return out


def _note(fig) -> str:
    notes = [t for t in fig.axes[2].texts if t.get_gid() == "bytes-note"]
    assert len(notes) == 1
    return " ".join(notes[0].get_text().split())


def test_gradsync_bytes_panel_explains_a_step_without_per_parameter_bytes():
    fig = gradsync_figure(tp_samples(3, 12_288))
    bytes_ax = fig.axes[2]
    assert _note(fig) == (
        "no per-parameter gradient collective; the backward all_sum of activation gradients "
        "moved 12.0 KiB per step on each rank (3 calls), shared by the parameters upstream of it")
    assert not [p for p in bytes_ax.patches if (p.get_gid() or "").startswith("bytes:")]
    assert len(bytes_ax.get_yticks()) == 0  # no axis of '0 B' ticks
    ops = {t.get_gid(): t.get_text() for t in bytes_ax.texts if t.get_gid() != "bytes-note"}
    assert ops["collective:embed.weight"] == "all_sum"
    assert ops["collective:layers.1.weight"] == "none"
    fig.canvas.draw()  # renders


def test_gradsync_bytes_note_when_nothing_was_synchronised():
    assert "no gradient collective in this step" in _note(gradsync_figure(tp_samples(0, 0)))
    odd = _note(gradsync_figure(tp_samples(1, 1024, {1: (2, 2048)})))
    assert "rank 0 1.0 KiB (1 call), rank 1 2.0 KiB (2 calls)" in odd
    one_rank = [GradSample("w", 0, True, 1.0, 1.0, 0.0, (4,), "none (1 rank)", 0)]
    assert _note(gradsync_figure(one_rank)) == (
        "no collective moved gradient bytes in this step (collective: none)")
    text = format_gradsync(tp_samples(1, 1024))
    assert text.splitlines()[-2].startswith("no per-parameter gradient collective; the "
                                            "backward all_sum of activation gradients moved "
                                            "1.0 KiB per step on each rank (1 call)")
    assert "no per-parameter" not in format_gradsync(grad_samples())


def test_gradsync_step_numbers_are_fields_not_text():
    # the note reads step_calls / step_nbytes; the collective text is only for people
    fields_only = [GradSample("w", r, True, 1.0, 1.0, 0.0, (4,), "all_sum (bwd)", 0,
                              step_calls=2, step_nbytes=2048) for r in range(2)]
    assert "moved 2.0 KiB per step on each rank (2 calls)" in _note(gradsync_figure(fields_only))
    text_only = [GradSample("w", r, True, 1.0, 1.0, 0.0, (4,),
                            "all_sum (bwd all_sum/step: 2 calls, 2,048 B)", 0) for r in range(2)]
    assert _note(gradsync_figure(text_only)).startswith("no collective moved gradient bytes")


# --------------------------------------------------------------------------- plan


PLAN = [
    PlanRow(
        "layers.0.weight",
        "AllToShardedLinear",
        "all-to-sharded",
        (4096, 1024),
        (1024, 1024),
        0,
        "float32",
        1024 * 1024 * 4,
        "bwd all_sum",
    ),
    PlanRow("norm.weight", "RMSNorm", "replicated", (1024,), (1024,), None, "float32", 4096),
    PlanRow(
        "odd.weight",
        "Linear",
        "all-to-sharded",
        (1001, 64),
        (250, 64),
        0,
        "float32",
        250 * 64 * 4,
        "",
        "odd.weight: axis 0 (size 1001) is not divisible by group size 4",
    ),
]


def test_plan_table_html_highlights_problems():
    table = plan_table_html(PLAN, 4)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    header, body = rows[0], rows[1:4]
    for col in (
        "layer",
        "path",
        "mode",
        "full shape",
        "per-rank shape",
        "bytes/rank",
        "collectives/step",
        "problem",
    ):
        assert f">{col}</th>" in header
    cells = [re.findall(r"<td style=\"([^\"]*)\">(.*?)</td>", row) for row in body]
    assert cells[0][1][1] == "layers.0.weight" and cells[0][4][1] == "(1024, 1024)"
    assert cells[0][6][1] == "4.0 MiB"
    problem_style, problem_text = cells[2][-1]
    assert "not divisible" in problem_text and "#b00020" in problem_style
    assert "#b00020" not in cells[0][-1][0]
    assert all("#b00020" not in style for style, _ in cells[2][:-1])
    unsharded = 4096 * 1024 * 4 + 4096 + 1001 * 64 * 4
    per_rank = 1024 * 1024 * 4 + 4096 + 250 * 64 * 4
    foot = re.search(r"<tfoot>(.*)</tfoot>", table, re.S).group(1)
    assert f"total per rank {human_bytes(per_rank)} vs unsharded {human_bytes(unsharded)}" in foot
    assert "1 problem" in foot


def test_plan_html_escapes():
    row = PlanRow("a<b>", "L&M", "replicated", (2,), (2,), None, "float32", 8)
    table = plan_table_html([row], 2)
    assert "a&lt;b&gt;" in table and "L&amp;M" in table and "<b>" not in table


def test_format_plan_text():
    text = format_plan(PLAN, 4)
    lines = text.splitlines()
    assert "per-rank shape" in lines[0]
    problem = next(ln for ln in lines if "odd.weight" in ln)
    assert problem.startswith("!!") and problem.rstrip().endswith("group size 4")
    fine = next(ln for ln in lines if "layers.0.weight" in ln)
    assert not fine.startswith("!!") and "(1024, 1024)" in fine and "bwd all_sum" in fine
    assert lines[-1].startswith("total per rank 4.1 MiB vs unsharded 16.2 MiB")
    assert "ideal 25.0% on 4 ranks" in lines[-1]


def test_plan_problems_and_warnings_follow_the_table():
    text = format_plan(PLAN, 4, problems=["odd <axis>"], warnings=["inplace"])
    assert text.splitlines()[-3].startswith("total per rank")
    assert text.splitlines()[-2:] == ["problem: odd <axis>", "warning: inplace"]
    table = plan_table_html(PLAN, 4, problems=["odd <axis>"], warnings=["inplace"])
    assert table.startswith(plan_table_html(PLAN, 4))
    assert table.endswith("<ul><li style='color:#b00'>odd &lt;axis&gt;</li>"
                          "<li style='color:#a60'>inplace</li></ul>")
    assert "<ul>" not in plan_table_html(PLAN, 4)


# --------------------------------------------------------------------------- status


def test_status_text_of_a_session():
    from types import SimpleNamespace

    from mlx_nbdist.results import RankInfo, RankState
    from mlx_nbdist.viz.status import dashboard_text, format_group, format_status, rank_values

    ranks = {r: RankInfo(r, 10 + r, 100 + r, "h", "Device(cpu, 0)", 2, "ring") for r in (0, 1)}
    live = {0: RankState(rank=0, state="busy", cell=3, cell_started=90.0, collectives=5)}
    st = SimpleNamespace(session_id="s1", state="ready", n=2, backend="ring", launcher="local",
                         uptime=61.6, broken_reason="", ranks=ranks, alive={0: True}, live=live,
                         spare="")
    assert format_status(st, now=92.5).splitlines() == [
        "session s1: ready, 2 ranks, backend=ring, launcher=local, up 62 s",
        "  rank 0: busy cell 3 for 2.5 s, pid 100 on h, Device(cpu, 0), engine 10, 5 collectives",
        "  rank 1: dead, pid 101 on h, Device(cpu, 0), engine 11",
    ]
    st.spare = "ready"
    assert format_status(st, now=92.5).splitlines()[1] == (
        "  spare engines for the next restart: ready: a restart only forms the group")
    st.spare = "off"
    assert format_status(st, now=92.5).splitlines()[1] == (
        "  spare engines for the next restart: off (spare=False): a restart starts new engines")
    assert format_group(st) == "MLX group ready: 2 ranks, backend=ring, launcher=local, session s1"
    assert format_group(st, ranks=True).splitlines()[2] == (
        "  rank 1: Device(cpu, 0) on h, pid 101, engine 11")
    header = {"session": "s1", "state": "ready", "n": "2", "backend": "ring",
              "launcher": "local", "uptime": "1m 02s"}
    row = rank_values(live[0], now=92.5)
    assert dashboard_text(header, {0: row}).splitlines() == [
        "session s1: ready, 2 ranks, backend=ring, launcher=local, up 1m 02s",
        "  rank 0: busy     cell 3 · 2.50 s    last -                      -  "
        "mem 0 B / 0 B  0 B · 0%  coll 5 · 0 B",
    ]


def test_one_rank_colour_for_figures_and_html():
    from mlx_nbdist.viz.common import rank_hex

    assert [rank_hex(r) for r in range(3)] == ["#1f77b4", "#ff7f0e", "#2ca02c"]
    for r in range(40):
        assert mcolors.to_hex(rank_color(r)) == rank_hex(r)


# --------------------------------------------------------------------------- hygiene


def test_viz_imports_neither_mlx_nor_session():
    for path in VIZ_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                assert not re.match(r"^mlx(\.|$)", name), (path.name, name)
                assert "session" not in name, (path.name, name)


def test_viz_modules_import_no_private_names():
    for path in VIZ_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or "mlx_nbdist" in node.module):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, node.module, private)


def test_figures_render_to_png(tmp_path, rng):
    full = rng.standard_normal((48, 32)).astype(np.float32)
    figures = [
        show_tensor(shard("w", full, 4, axis=0, segments=2)),
        show_tensor(replicate("r", full[0], 2)),
        gradsync_figure(grad_samples()),
    ]
    for i, fig in enumerate(figures):
        out = tmp_path / f"{i}.png"
        fig.savefig(out, dpi=50)
        assert out.stat().st_size > 1000


def test_figures_display_as_png_in_ipython_without_pyplot(rng):
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    shell = interactiveshell.InteractiveShell.instance()
    full = rng.standard_normal((8, 8)).astype(np.float32)
    for fig in (show_tensor(shard("w", full, 2, axis=0)), gradsync_figure(grad_samples())):
        data, _ = shell.display_formatter.format(fig)
        assert data["image/png"][:8] == b"\x89PNG\r\n\x1a\n"
