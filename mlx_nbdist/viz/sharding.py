"""Pictures and text of how one tensor is laid out across the ranks of a group.

Everything here consumes :class:`~mlx_nbdist.results.TensorSlice` lists (one per
rank) and :class:`~mlx_nbdist.results.PlanRow` lists; nothing imports MLX.

Every tensor is drawn in a 2-D *view*: a 0-D tensor as ``1 x 1``, a 1-D tensor as a
``1 x n`` strip and an n-D tensor with its leading dimensions flattened into rows,
``(d0, ..., dk, c)`` shown as ``(d0 * ... * dk, c)``. Rectangles are in view
coordinates: x is the column, y is the row, row 0 at the top.

Figures are built with the object API (:class:`matplotlib.figure.Figure`), never
through pyplot, so nothing is kept alive by a global figure manager.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib import colors as mcolors
from matplotlib import patheffects
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from mlx_nbdist.errors import rank_span
from mlx_nbdist.results import PlanRow, TensorSlice

#: Largest heatmap side in pixels; bigger tensors are block-averaged down to it.
MAX_PIXELS = 256

#: (row0, row1, col0, col1) in view coordinates, half-open.
Rect = tuple[int, int, int, int]

_WARN = "#b00020"
_PT_PER_INCH = 72.0
_CHAR_EM = 0.62  # average glyph width of DejaVu Sans, in em
_LINE_EM = 1.25
_LABEL_SIZES = (8.5, 7.0)
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_BOTTOM, _PANEL_GAP = 0.85, 0.35, 0.6, 0.85
_CBAR_GAP, _CBAR_WIDTH, _CBAR_ROOM = 0.12, 0.14, 0.65
_LEGEND_ROW = 0.3
_TITLE_CHAR_INCH = 0.085  # average width of a 10 pt heading character
_LEGEND_COLUMNS = 10
_MAX_GRID_ROWS, _MAX_GRID_COLS = 12, 64


class NotebookFigure(Figure):
    """A :class:`~matplotlib.figure.Figure` that shows itself as a PNG in Jupyter.

    Figures here are made without pyplot (so no global figure manager keeps them
    alive); IPython then has no inline formatter for them unless a matplotlib
    backend was activated, so they render themselves.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()


# --------------------------------------------------------------------------- colours


def rank_color(rank: int) -> tuple[float, float, float]:
    """The colour used for ``rank`` in every figure of this package.

    Ranks 0-9 get the ``tab10`` colours, ranks 10-19 their lighter ``tab20``
    partners, and higher ranks a golden-ratio walk around the hue circle, so a rank
    keeps its colour whatever the group size.

    Args:
        rank: the rank.

    Returns:
        An RGB triple in ``[0, 1]``.
    """
    tab20 = matplotlib.colormaps["tab20"].colors
    if 0 <= rank < 10:
        return tuple(float(v) for v in tab20[2 * rank])
    if 10 <= rank < 20:
        return tuple(float(v) for v in tab20[2 * (rank - 10) + 1])
    hue = (rank * 0.618033988749895) % 1.0
    return tuple(float(v) for v in mcolors.hsv_to_rgb((hue, 0.6, 0.85)))


def _text_color(background: tuple[float, ...]) -> str:
    r, g, b = background[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


def human_bytes(n: float) -> str:
    """Format a byte count, e.g. ``2.0 MiB``.

    Args:
        n: number of bytes.

    Returns:
        The count with a binary unit.
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


def _text_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = ""
) -> list[str]:
    """Align ``rows`` under ``headers``; ``align`` holds ``l``/``r`` per column."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    align = align.ljust(len(headers), "l")

    def fmt(cells: Sequence[str]) -> str:
        out = [
            str(c).rjust(w) if a == "r" else str(c).ljust(w)
            for c, w, a in zip(cells, widths, align, strict=False)
        ]
        return "  ".join(out).rstrip()

    return [fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Block:
    """One contiguous range one rank holds, and where it falls in the 2-D view."""

    rank: int
    segment: int
    segments: int
    start: int
    stop: int
    rects: tuple[Rect, ...]


@dataclass
class _Layout:
    """Who holds what of one tensor, in view coordinates."""

    name: str
    full_shape: tuple[int, ...]
    dtype: str
    axis: int | None
    slices: list[TensorSlice]
    blocks: list[_Block]

    @property
    def view(self) -> tuple[int, int]:
        return _view_shape(self.full_shape)

    @property
    def replicated(self) -> bool:
        return self.axis is None

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.slices]

    @property
    def segments(self) -> int:
        return max((len(s.ranges) for s in self.slices), default=1)

    def slice_of(self, rank: int) -> TensorSlice:
        return next(s for s in self.slices if s.rank == rank)


def _view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view; an empty dimension still gets one row/column."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, max(int(shape[0]), 1))
    return (max(int(np.prod(shape[:-1])), 1), max(int(shape[-1]), 1))


def _rects(shape: Sequence[int], axis: int, start: int, stop: int) -> tuple[Rect, ...]:
    """Rectangles in the view covered by ``full[..., start:stop, ...]`` along ``axis``."""
    rows, cols = _view_shape(shape)
    if len(shape) == 1:
        return ((0, 1, start, stop),)
    if axis == len(shape) - 1:
        return ((0, rows, start, stop),)
    outer = int(np.prod(shape[:axis]))
    inner = int(np.prod(shape[axis + 1 : -1]))
    span = int(shape[axis]) * inner
    return tuple((o * span + start * inner, o * span + stop * inner, 0, cols) for o in range(outer))


def _layout(slices: Sequence[TensorSlice]) -> _Layout:
    """Check that ``slices`` describe one tensor and work out its blocks."""
    if not slices:
        raise ValueError("no slices to show")
    ordered = sorted(slices, key=lambda s: s.rank)
    first = ordered[0]
    full = tuple(int(d) for d in first.full_shape)
    for s in ordered:
        if tuple(s.full_shape) != full:
            raise ValueError(
                f"{s.name or 'the tensor'}: full_shape {full} on rank {first.rank} but "
                f"{tuple(s.full_shape)} on rank {s.rank}: the slices do not describe one tensor"
            )
        if s.axis != first.axis:
            raise ValueError(
                f"{s.name or 'the tensor'} is sharded on axis {first.axis} on rank "
                f"{first.rank} but on axis {s.axis} on rank {s.rank} (None: replicated)"
            )
    if first.axis is not None and not 0 <= first.axis < len(full):
        raise ValueError(f"{first.name}: axis {first.axis} out of range for shape {full}")
    blocks = [] if first.axis is None else [b for s in ordered for b in _slice_blocks(s, full)]
    return _Layout(first.name, full, first.dtype, first.axis, ordered, blocks)


def _slice_blocks(s: TensorSlice, full: tuple[int, ...]) -> list[_Block]:
    n = len(s.ranges)
    return [
        _Block(s.rank, i, n, int(a), int(b), _rects(full, s.axis, int(a), int(b)))
        for i, (a, b) in enumerate(s.ranges)
        if b > a
    ]


def _coverage(layout: _Layout) -> tuple[int, int]:
    """(indices held by no rank, indices held by several) along the sharded axis."""
    if layout.replicated:
        return (0, 0)
    count = np.zeros(layout.full_shape[layout.axis], dtype=np.int32)
    for block in layout.blocks:
        count[block.start : block.stop] += 1
    return int((count == 0).sum()), int((count > 1).sum())


def _range_text(shape: Sequence[int], axis: int, start: int, stop: int) -> str:
    if len(shape) == 1:
        return f"[{start}:{stop}]"
    if len(shape) == 2:
        return f"{('rows', 'cols')[axis]} {start}:{stop}"
    return "[" + ", ".join(f"{start}:{stop}" if d == axis else ":" for d in range(len(shape))) + "]"


def _ranges_text(layout: _Layout, s: TensorSlice) -> str:
    if layout.replicated:
        return "all"
    parts = [_range_text(layout.full_shape, layout.axis, a, b) for a, b in s.ranges]
    if len(layout.full_shape) == 2 and len(parts) > 1:
        word = parts[0].split(" ")[0]
        return word + " " + ", ".join(p.split(" ")[1] for p in parts)
    return ", ".join(parts)


# --------------------------------------------------------------------------- values


@dataclass
class _Heat:
    """The reassembled tensor, as a (downsampled) 2-D image."""

    image: np.ndarray
    factor: tuple[int, int]
    sampled: bool


def _is_sampled(s: TensorSlice) -> bool:
    return s.sampled or tuple(np.shape(s.data)) != tuple(s.shape)


def _reassemble(layout: _Layout) -> np.ndarray | None:
    """The full tensor from the ranks' data, ``None`` when some rank sent none.

    Sharded slices are put back in place (indices no rank holds are NaN). When a
    slice is a strided sample, the samples are concatenated along the sharded axis
    instead, giving a strided picture of the full tensor.
    """
    if any(s.data is None for s in layout.slices):
        return None
    if layout.replicated:
        return np.asarray(layout.slices[0].data)
    if any(_is_sampled(s) for s in layout.slices):
        return _reassemble_sampled(layout)
    return _reassemble_exact(layout)


def _reassemble_exact(layout: _Layout) -> np.ndarray:
    datas = [np.asarray(s.data) for s in layout.slices]
    dtype = np.result_type(*(d.dtype for d in datas), np.float16)
    full = np.full(layout.full_shape, np.nan, dtype=dtype)
    axis = layout.axis
    for s, data in zip(layout.slices, datas, strict=True):
        cuts = np.cumsum([b - a for a, b in s.ranges])[:-1]
        for (a, b), chunk in zip(s.ranges, np.split(data, cuts, axis=axis), strict=True):
            index = [slice(None)] * full.ndim
            index[axis] = slice(a, b)
            full[tuple(index)] = chunk
    return full


def _reassemble_sampled(layout: _Layout) -> np.ndarray:
    axis = layout.axis
    pieces: list[tuple[int, np.ndarray]] = []
    for s in layout.slices:
        data = np.asarray(s.data)
        taken = max(data.shape[axis], 1)
        stride = max(1, math.ceil(s.shape[axis] / taken))
        bounds = np.cumsum([b - a for a, b in s.ranges])[:-1]
        cuts = [min(data.shape[axis], math.ceil(c / stride)) for c in bounds]
        pieces += [
            (a, chunk)
            for (a, _), chunk in zip(s.ranges, np.split(data, cuts, axis=axis), strict=True)
        ]
    pieces.sort(key=lambda p: p[0])
    ndim = pieces[0][1].ndim
    common = [min(p.shape[d] for _, p in pieces) for d in range(ndim)]
    crop = tuple(slice(None) if d == axis else slice(0, common[d]) for d in range(ndim))
    return np.concatenate([p[crop] for _, p in pieces], axis=axis)


def _sample_stride(layout: _Layout) -> int:
    """The largest stride of the sampled slices (along their first axis)."""
    strides = [
        math.ceil(s.shape[0] / max(np.shape(s.data)[0], 1))
        for s in layout.slices
        if s.data is not None and np.ndim(s.data) and len(s.shape)
    ]
    return max(strides, default=1)


def _replica_diff(layout: _Layout) -> float | None:
    """max |x_r - x_first| over the replicas, ``None`` when it cannot be told."""
    if not layout.replicated:
        return None
    datas = [np.asarray(s.data) for s in layout.slices if s.data is not None]
    if len(datas) < 2 or any(d.shape != datas[0].shape for d in datas):
        return None
    ref = datas[0]
    diff = 0.0
    for d in datas[1:]:
        if np.array_equal(d, ref, equal_nan=np.issubdtype(d.dtype, np.inexact)):
            continue
        delta = np.abs(d.astype(np.float64) - ref.astype(np.float64))
        diff = max(diff, float(np.nanmax(delta)) if delta.size else 0.0)
    return diff


def _as_view(array: np.ndarray) -> np.ndarray:
    a = np.asarray(array)
    if np.iscomplexobj(a):
        a = np.abs(a)
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    return a.reshape(-1, a.shape[-1])


def downsample(
    image: np.ndarray, max_pixels: int = MAX_PIXELS
) -> tuple[np.ndarray, tuple[int, int]]:
    """Block-average a 2-D array so that neither side exceeds ``max_pixels``.

    Args:
        image: a 2-D array.
        max_pixels: the largest side of the result.

    Returns:
        ``(means, (row_factor, col_factor))``: bin ``(i, j)`` is the mean of
        ``image[i*fr:(i+1)*fr, j*fc:(j+1)*fc]`` (the last bins may be smaller), as
        float64.
    """
    rows, cols = image.shape
    fr = max(1, math.ceil(rows / max_pixels))
    fc = max(1, math.ceil(cols / max_pixels))
    if fr == fc == 1:
        return np.asarray(image, dtype=np.float64), (1, 1)
    ri, ci = np.arange(0, rows, fr), np.arange(0, cols, fc)
    sums = np.add.reduceat(np.add.reduceat(image, ri, axis=0, dtype=np.float64), ci, axis=1)
    counts = np.outer(np.diff(np.append(ri, rows)), np.diff(np.append(ci, cols)))
    return sums / counts, (fr, fc)


def _heat(layout: _Layout) -> _Heat | None:
    full = _reassemble(layout)
    if full is None or full.size == 0:
        return None
    image, factor = downsample(_as_view(full))
    return _Heat(image, factor, any(_is_sampled(s) for s in layout.slices))


def _color_scale(image: np.ndarray) -> tuple[str, float, float]:
    finite = image[np.isfinite(image)]
    if finite.size == 0:
        return "viridis", 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if lo < 0 < hi:
        m = max(-lo, hi)
        return "RdBu_r", -m, m
    if lo == hi:
        return "viridis", lo - 0.5, hi + 0.5
    return "viridis", lo, hi


def _stats(s: TensorSlice) -> dict[str, float]:
    """min/max/norm of a slice: its summary (computed from complete data on first
    read), else, for a summary given without them, from complete data here."""
    out = {k: float(v) for k, v in s.summary.items() if k in ("min", "max", "norm")}
    if len(out) < 3 and s.data is not None and not _is_sampled(s) and np.size(s.data):
        data = np.asarray(s.data)
        if np.iscomplexobj(data):
            data = np.abs(data)
        data = data.astype(np.float64)
        out.setdefault("min", float(np.min(data)))
        out.setdefault("max", float(np.max(data)))
        out.setdefault("norm", float(np.linalg.norm(data.ravel())))
    return out


def _stats_lines(stats: dict[str, float]) -> list[str]:
    lines = []
    if "min" in stats and "max" in stats:
        lines.append(f"min {stats['min']:.3g}  max {stats['max']:.3g}")
    if "norm" in stats:
        lines.append(f"norm {stats['norm']:.4g}")
    return lines


# --------------------------------------------------------------------------- labels


@dataclass(frozen=True)
class _Label:
    """A label placed at the centre of a block."""

    rank: int | None
    x: float
    y: float
    text: str
    size: float
    rotation: int
    short: bool


def _fitting_lines(lines: Sequence[str], width: float, height: float, size: float) -> int:
    """How many leading ``lines`` fit in a ``width x height`` points box at ``size``."""
    max_lines = int((height - 4) // (size * _LINE_EM))
    max_chars = (width - 6) / (size * _CHAR_EM)
    n = 0
    for line in lines[: max(max_lines, 0)]:
        if len(line) > max_chars:
            break
        n += 1
    return n


def _fit(
    lines: Sequence[str], box: tuple[float, float], short: str
) -> tuple[str, float, int, bool] | None:
    """Pick text, font size and rotation for a label in a box (points).

    Returns:
        ``(text, size, rotation, is_short)`` or ``None`` when even ``short`` does not fit.
    """
    width, height = box
    for size in _LABEL_SIZES:
        options = [
            (_fitting_lines(lines, w, h, size), rot) for rot, (w, h) in ((0, box), (90, box[::-1]))
        ]
        n, rotation = max(options, key=lambda option: option[0])  # ties keep horizontal
        if n >= min(len(lines), 3) or (size == _LABEL_SIZES[-1] and n > 0):
            return "\n".join(lines[:n]), size, rotation, False
    size = _LABEL_SIZES[-1]
    if _fitting_lines([short], width, height, size):
        return short, size, 0, True
    return None


def _block_lines(layout: _Layout, block: _Block, first: bool) -> list[str]:
    s = layout.slice_of(block.rank)
    head = f"rank {block.rank}"
    if block.segments > 1:
        head += f"  seg {block.segment + 1}/{block.segments}"
    lines = [head]
    if first:
        lines.append(f"local {tuple(s.shape)}" if block.segments > 1 else str(tuple(s.shape)))
    lines.append(_range_text(layout.full_shape, layout.axis, block.start, block.stop))
    if first and s.data is None:
        lines += _stats_lines(_stats(s))
    return lines


def _replicated_lines(layout: _Layout) -> list[str]:
    shape = f"{layout.full_shape} each" if layout.full_shape else "scalar"
    lines = ["replicated", f"on ranks {rank_span(layout.ranks)}", shape]
    s = layout.slices[0]
    if s.data is None:
        lines += _stats_lines(_stats(s))
    return lines


def _layout_labels(layout: _Layout, panel_pt: tuple[float, float]) -> list[_Label | None]:
    """One label per block (``None`` where nothing fits), for a panel of that size."""
    rows, cols = layout.view
    sx, sy = panel_pt[0] / cols, panel_pt[1] / rows
    if layout.replicated:
        fit = _fit(_replicated_lines(layout), panel_pt, "repl.")
        return [_Label(None, cols / 2, rows / 2, *fit) if fit else None]
    labels: list[_Label | None] = []
    seen: set[int] = set()
    for block in layout.blocks:
        r0, r1, c0, c1 = block.rects[0]
        lines = _block_lines(layout, block, first=block.rank not in seen)
        seen.add(block.rank)
        fit = _fit(lines, ((c1 - c0) * sx, (r1 - r0) * sy), str(block.rank))
        labels.append(_Label(block.rank, (c0 + c1) / 2, (r0 + r1) / 2, *fit) if fit else None)
    return labels


def _repeat_labels(layout: _Layout, panel_pt: tuple[float, float]) -> list[_Label]:
    """Rank-only labels for the 2nd, 3rd... rectangle of blocks that span several bands."""
    rows, cols = layout.view
    sx, sy = panel_pt[0] / cols, panel_pt[1] / rows
    labels = []
    for block in layout.blocks:
        for r0, r1, c0, c1 in block.rects[1:]:
            fit = _fit([f"rank {block.rank}"], ((c1 - c0) * sx, (r1 - r0) * sy), str(block.rank))
            if fit:
                labels.append(_Label(block.rank, (c0 + c1) / 2, (r0 + r1) / 2, *fit))
    return labels


def _needs_legend(layout: _Layout, labels: Sequence[_Label | None]) -> bool:
    if len(layout.ranks) < 2:
        return False
    return layout.replicated or any(lab is None or lab.short for lab in labels)


# --------------------------------------------------------------------------- figures


def _panel_size(view: tuple[int, int], base: float = 5.0) -> tuple[float, float]:
    """Inches for one panel: true aspect within limits, strips kept readable."""
    rows, cols = view
    base = min(base, max(1.6, 0.4 * max(rows, cols)))  # a tiny tensor gets a small panel
    ratio = rows / max(cols, 1)
    if rows == 1 and cols > 1:
        return base, 0.9
    if ratio <= 1:
        return base, max(base * ratio, 1.2)
    height = base + 0.5
    return max(height / ratio, 2.4), height


def _figure(
    panels: Sequence[tuple[float, float]],
    colorbars: Sequence[bool],
    title: Sequence[str],
    legend_rows: int = 0,
    panel_title_lines: int = 1,
) -> tuple[Figure, list[Axes], list[Axes | None]]:
    """A figure with panels side by side at exact sizes (inches), optional colorbars.

    The figure is widened (panels centred) when the heading lines need more room.
    """
    top = 0.3 + 0.2 * (len(title) + panel_title_lines)
    bottom = _MARGIN_BOTTOM + _LEGEND_ROW * legend_rows
    extra = _CBAR_GAP + _CBAR_WIDTH + _CBAR_ROOM
    width = _MARGIN_LEFT + _MARGIN_RIGHT + _PANEL_GAP * (len(panels) - 1)
    width += sum(w + (extra if cb else 0.0) for (w, _), cb in zip(panels, colorbars, strict=True))
    needed = 0.4 + _TITLE_CHAR_INCH * max((len(line) for line in title), default=0)
    x = _MARGIN_LEFT + max(needed - width, 0.0) / 2
    width = max(width, needed)
    tallest = max(h for _, h in panels)
    height = bottom + tallest + top
    fig = NotebookFigure(figsize=(width, height))
    axes: list[Axes] = []
    caxes: list[Axes | None] = []
    for (w, h), cb in zip(panels, colorbars, strict=True):
        y = bottom + (tallest - h) / 2
        axes.append(fig.add_axes((x / width, y / height, w / width, h / height)))
        x += w
        cax = None
        if cb:
            rect = ((x + _CBAR_GAP) / width, y / height, _CBAR_WIDTH / width, h / height)
            cax = fig.add_axes(rect)
            x += extra
        caxes.append(cax)
        x += _PANEL_GAP
    return fig, axes, caxes


def _axes_pt(ax: Axes) -> tuple[float, float]:
    fig_w, fig_h = _root_figure(ax).get_size_inches()
    pos = ax.get_position()
    return pos.width * fig_w * _PT_PER_INCH, pos.height * fig_h * _PT_PER_INCH


def _root_figure(ax: Axes) -> Figure:
    fig = ax.figure
    while not isinstance(fig, Figure):
        fig = fig.figure
    return fig


def _axis_labels(shape: Sequence[int]) -> tuple[str, str]:
    n = len(shape)
    if n == 0:
        return "", ""
    if n == 1:
        return "axis 0", ""
    if n == 2:
        return "axis 1 (cols)", "axis 0 (rows)"
    return f"axis {n - 1}", f"axes 0-{n - 2} flattened"


def _ticks(bounds: set[int], extent: int, room_pt: float) -> list[int]:
    ticks = sorted({0, extent} | {b for b in bounds if 0 <= b <= extent})
    if len(ticks) > max(2, int(room_pt // 30)):
        return [0, extent]
    return ticks


def _setup_axes(ax: Axes, layout: _Layout) -> None:
    rows, cols = layout.view
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    w_pt, h_pt = _axes_pt(ax)
    rects = [r for b in layout.blocks for r in b.rects]
    ax.set_xticks(_ticks({c for r in rects for c in r[2:]}, cols, w_pt))
    if len(layout.full_shape) <= 1:
        ax.set_yticks([])
    else:
        ax.set_yticks(_ticks({c for r in rects for c in r[:2]}, rows, h_pt * 2.5))
    ax.tick_params(labelsize=7, length=2, pad=1.5)
    xlabel, ylabel = _axis_labels(layout.full_shape)
    ax.set_xlabel(xlabel, fontsize=8, labelpad=2)
    ax.set_ylabel(ylabel, fontsize=8, labelpad=2)


def _add_rect(ax: Axes, rect: Rect, gid: str, **style: object) -> Rectangle:
    r0, r1, c0, c1 = rect
    patch = Rectangle((c0, r0), c1 - c0, r1 - r0, **style)
    patch.set_gid(gid)
    ax.add_patch(patch)
    return patch


def _draw_layout(ax: Axes, layout: _Layout, labels: Sequence[_Label | None]) -> None:
    """Blocks coloured by owning rank, with labels."""
    _setup_axes(ax, layout)
    if layout.replicated:
        _draw_replicated(ax, layout)
    for block in layout.blocks:
        for rect in block.rects:
            style = {"facecolor": rank_color(block.rank), "edgecolor": "black", "linewidth": 0.8}
            _add_rect(ax, rect, f"block-r{block.rank}", **style)
    for label in [*labels, *_repeat_labels(layout, _axes_pt(ax))]:
        if label is not None:
            _draw_label(ax, label)


def _draw_replicated(ax: Axes, layout: _Layout) -> None:
    """One block over the whole tensor, striped diagonally in every holder's colour."""
    rows, cols = layout.view
    style = {"facecolor": "white", "edgecolor": "black", "linewidth": 1.0}
    _add_rect(ax, (0, rows, 0, cols), "block-replicated", **style)
    w_pt, h_pt = _axes_pt(ax)
    stripe = 14.0 / max(w_pt, 1.0)
    shift = h_pt / max(w_pt, 1.0)
    ranks = layout.ranks
    for i in range(math.ceil((1 + shift) / stripe) + 1):
        x = -shift + i * stripe
        corners = [(x, 0), (x + stripe, 0), (x + stripe + shift, 1), (x + shift, 1)]
        rank = ranks[i % len(ranks)]
        poly = Polygon(
            corners,
            closed=True,
            transform=ax.transAxes,
            facecolor=rank_color(rank),
            edgecolor="none",
            alpha=0.5,
        )
        poly.set_gid(f"stripe-r{rank}")
        ax.add_patch(poly)


def _draw_label(ax: Axes, label: _Label) -> None:
    if label.rank is None:
        color, box = (
            "black",
            {"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.3", "alpha": 0.9},
        )
    else:
        color, box = _text_color(rank_color(label.rank)), None
    ax.text(
        label.x,
        label.y,
        label.text,
        ha="center",
        va="center",
        fontsize=label.size,
        rotation=label.rotation,
        color=color,
        bbox=box,
        linespacing=1.1,
        clip_on=True,
    )


def _draw_values(ax: Axes, cax: Axes | None, layout: _Layout, heat: _Heat) -> None:
    """The reassembled tensor as a heatmap, rank blocks outlined on top."""
    rows, cols = layout.view
    cmap, vmin, vmax = _color_scale(heat.image)
    image = ax.imshow(
        heat.image,
        extent=(0, cols, rows, 0),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
    )
    image.set_gid("values")
    _setup_axes(ax, layout)
    _draw_outlines(ax, layout)
    fig = _root_figure(ax)
    if cax is not None:
        bar = fig.colorbar(image, cax=cax)
    else:
        bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.ax.tick_params(labelsize=7)


def _draw_outlines(ax: Axes, layout: _Layout) -> None:
    rows, cols = layout.view
    halo = [patheffects.Stroke(linewidth=3.2, foreground="black"), patheffects.Normal()]
    if layout.replicated:
        _add_rect(
            ax,
            (0, rows, 0, cols),
            "outline-replicated",
            fill=False,
            edgecolor="black",
            linewidth=1.5,
        )
        _draw_tag(ax, (0, rows, 0, cols), f"replicated {rank_span(layout.ranks)}", None)
        return
    for block in layout.blocks:
        color = rank_color(block.rank)
        for i, rect in enumerate(block.rects):
            patch = _add_rect(
                ax, rect, f"outline-r{block.rank}", fill=False, edgecolor=color, linewidth=1.6
            )
            patch.set_path_effects(halo)
            if i == 0:
                _draw_tag(ax, rect, f"r{block.rank}", color)


def _draw_tag(ax: Axes, rect: Rect, text: str, color: tuple[float, ...] | None) -> None:
    """A small rank tag in the top-left corner of a block, if the block has room."""
    rows, cols = (ax.get_ylim()[0], ax.get_xlim()[1])
    w_pt, h_pt = _axes_pt(ax)
    r0, r1, c0, c1 = rect
    if (c1 - c0) / cols * w_pt < len(text) * 5 + 12 or (r1 - r0) / rows * h_pt < 13:
        return
    fc = color if color is not None else (1.0, 1.0, 1.0)
    ax.annotate(
        text,
        xy=(c0, r0),
        xytext=(2.5, -2.5),
        textcoords="offset points",
        ha="left",
        va="top",
        fontsize=7,
        color=_text_color(fc),
        bbox={"boxstyle": "round,pad=0.15", "fc": fc, "ec": "none", "alpha": 0.9},
    )


def _add_legend(fig: Figure, ranks: Sequence[int]) -> None:
    handles = [Patch(facecolor=rank_color(r), edgecolor="black", label=f"rank {r}") for r in ranks]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=min(len(ranks), _LEGEND_COLUMNS),
        fontsize=7,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
        handlelength=1.2,
    )


def _title_lines(layout: _Layout, heat: _Heat | None, title: str | None) -> tuple[list[str], bool]:
    """Heading lines for a tensor figure and whether something is wrong."""
    lines = [title or f"{layout.name}  {layout.full_shape} {layout.dtype}"]
    if layout.replicated:
        lines.append(
            f"replicated on ranks {rank_span(layout.ranks)} (each holds the whole tensor)"
        )
    else:
        mode = f"sharded on axis {layout.axis} over {len(layout.ranks)} ranks"
        if layout.segments > 1:
            mode += f", {layout.segments} segments per rank"
        lines.append(mode)
    notes, warnings = _notes(layout, heat)
    if notes:
        lines.append("; ".join(notes))
    lines += warnings
    return lines, bool(warnings)


def _notes(layout: _Layout, heat: _Heat | None) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    warnings: list[str] = []
    if len(layout.full_shape) > 2:
        notes.append(f"{layout.full_shape} shown as {layout.view}")
    if any(s.data is None for s in layout.slices):
        notes.append("summary only (values not pulled)")
    elif heat is not None and any(_is_sampled(s) for s in layout.slices):
        notes.append(f"values sampled (stride {_sample_stride(layout)} on every axis)")
    if heat is not None and heat.factor != (1, 1):
        notes.append(f"heatmap block-mean {heat.factor[0]}x{heat.factor[1]}")
    gaps, overlaps = _coverage(layout)
    if gaps:
        warnings.append(f"{gaps} indices of axis {layout.axis} held by no rank")
    if overlaps:
        warnings.append(f"{overlaps} indices of axis {layout.axis} held by several ranks")
    diff = _replica_diff(layout)
    if diff:
        warnings.append(f"replicas DIFFER across ranks: max |diff| = {diff:.3g}")
    elif diff == 0.0:
        notes.append("replicas identical")
    return notes, warnings


# --------------------------------------------------------------------------- public: figures


def show_tensor(
    slices: list[TensorSlice],
    *,
    values: bool = True,
    ax: Axes | Sequence[Axes] | None = None,
    title: str | None = None,
) -> Figure:
    """Draw how a tensor is split across ranks, and its reassembled values.

    The left panel shows the full tensor with one block per range a rank holds,
    coloured by rank and labelled with the rank, its local shape and the range.
    When ``values`` is true and every rank sent data, a second panel shows the
    reassembled tensor as a heatmap (block-averaged down to :data:`MAX_PIXELS` per
    side) with the rank blocks outlined. Tensors of more than two dimensions are
    drawn with their leading dimensions flattened into rows.

    Args:
        slices: one :class:`TensorSlice` per rank, all of the same tensor.
        values: draw the values heatmap when data is available.
        ax: draw into these axes instead of a new figure: one Axes gets the
            heatmap when there are values to show, else the blocks; two Axes get
            blocks and heatmap.
        title: replaces the first heading line (name, shape, dtype).

    Returns:
        The figure drawn into.

    Raises:
        ValueError: the slices are empty or do not describe one tensor.
    """
    layout = _layout(slices)
    heat = _heat(layout) if values else None
    lines, warn = _title_lines(layout, heat, title)
    if ax is not None:
        return _draw_into(ax, layout, heat, lines, warn)
    size = _panel_size(layout.view)
    labels = _layout_labels(layout, (size[0] * _PT_PER_INCH, size[1] * _PT_PER_INCH))
    legend = _needs_legend(layout, labels)
    panels = [size, size] if heat is not None else [size]
    colorbars = [False, True] if heat is not None else [False]
    legend_rows = math.ceil(len(layout.ranks) / _LEGEND_COLUMNS) if legend else 0
    fig, axes, caxes = _figure(panels, colorbars, lines, legend_rows)
    _draw_layout(axes[0], layout, labels)
    axes[0].set_title("sharding", fontsize=9)
    if heat is not None:
        _draw_values(axes[1], caxes[1], layout, heat)
        axes[1].set_title("values (reassembled)", fontsize=9)
    fig.suptitle("\n".join(lines), fontsize=10, color=_WARN if warn else "black")
    if legend:
        _add_legend(fig, layout.ranks)
    return fig


def _draw_into(
    ax: Axes | Sequence[Axes], layout: _Layout, heat: _Heat | None, lines: list[str], warn: bool
) -> Figure:
    axes = [ax] if isinstance(ax, Axes) else list(ax)
    if len(axes) >= 2 or heat is None:
        _draw_layout(axes[0], layout, _layout_labels(layout, _axes_pt(axes[0])))
    if heat is not None:
        _draw_values(axes[-1], None, layout, heat)
    axes[0].set_title("\n".join(lines), fontsize=9, color=_WARN if warn else "black")
    return _root_figure(axes[0])


def show_quantized(
    weight: list[TensorSlice],
    scales: list[TensorSlice],
    biases: list[TensorSlice] | None = None,
) -> Figure:
    """Draw a quantized layer: packed weight, scales and biases side by side.

    The packed ``uint32`` weight is drawn as rank blocks only (its raw words are not
    meaningful values); scales and biases get heatmaps with rank outlines when data
    was pulled, else rank blocks with summary labels. The heading turns red when
    scales or biases are not split across the ranks in the same proportions as the
    weight.

    Args:
        weight: slices of the packed weight.
        scales: slices of the quantization scales.
        biases: slices of the quantization biases, if the mode has them.

    Returns:
        The new figure.
    """
    parts = [("weight (packed uint32 words)", weight, False), ("scales", scales, True)]
    if biases is not None:
        parts.append(("biases", biases, True))
    layouts = [_layout(p[1]) for p in parts]
    heats = [_heat(lay) if show else None for lay, (_, _, show) in zip(layouts, parts, strict=True)]
    size = _panel_size(layouts[0].view, base=4.0)
    size_pt = (size[0] * _PT_PER_INCH, size[1] * _PT_PER_INCH)
    labels = [_layout_labels(lay, size_pt) for lay in layouts]
    legend = any(_needs_legend(lay, lab) for lay, lab in zip(layouts, labels, strict=True))
    lines, warn = _quantized_title(layouts, [p[0] for p in parts])
    legend_rows = math.ceil(len(layouts[0].ranks) / _LEGEND_COLUMNS) if legend else 0
    colorbars = [h is not None for h in heats]
    fig, axes, caxes = _figure([size] * len(parts), colorbars, lines, legend_rows, 2)
    for ax, cax, lay, heat, lab, (name, _, _) in zip(
        axes, caxes, layouts, heats, labels, parts, strict=True
    ):
        if heat is not None:
            _draw_values(ax, cax, lay, heat)
        else:
            _draw_layout(ax, lay, lab)
        ax.set_title(f"{name}\n{lay.full_shape} {lay.dtype}", fontsize=9)
    fig.suptitle("\n".join(lines), fontsize=10, color=_WARN if warn else "black")
    if legend:
        _add_legend(fig, layouts[0].ranks)
    return fig


def _fractions(layout: _Layout) -> dict[int, list[tuple[float, float]]]:
    if layout.replicated:
        return {r: [(0.0, 1.0)] for r in layout.ranks}
    n = max(layout.full_shape[layout.axis], 1)
    return {s.rank: [(a / n, b / n) for a, b in s.ranges] for s in layout.slices}


def _same_split(a: _Layout, b: _Layout) -> list[int]:
    """Ranks on which ``b`` is not split in the same proportions as ``a``."""
    if a.axis != b.axis:
        return sorted(set(a.ranks) | set(b.ranks))
    fa, fb = _fractions(a), _fractions(b)
    bad = set(fa) ^ set(fb)
    for rank in set(fa) & set(fb):
        if len(fa[rank]) != len(fb[rank]) or not np.allclose(fa[rank], fb[rank]):
            bad.add(rank)
    return sorted(bad)


def _quantized_title(layouts: Sequence[_Layout], names: Sequence[str]) -> tuple[list[str], bool]:
    w = layouts[0]
    base = w.name[: -len(".weight")] if w.name.endswith(".weight") else w.name
    lines = [f"{base}  quantized"]
    if w.replicated:
        lines.append(f"replicated on ranks {rank_span(w.ranks)}")
    else:
        lines.append(f"sharded on axis {w.axis} over {len(w.ranks)} ranks")
    problems = []
    for lay, name in zip(layouts[1:], names[1:], strict=True):
        bad = _same_split(w, lay)
        if bad:
            problems.append(f"{name} NOT split like the weight on ranks {rank_span(bad)}")
    return lines + problems, bool(problems)


# --------------------------------------------------------------------------- public: text


def _grid_size(view: tuple[int, int]) -> tuple[int, int]:
    rows, cols = view
    if rows == 1:
        return 1, min(cols, _MAX_GRID_COLS)
    ncols = min(cols, _MAX_GRID_COLS, max(8, round(_MAX_GRID_ROWS * 2 * cols / rows)))
    nrows = min(rows, _MAX_GRID_ROWS, max(1, round(ncols * rows / cols / 2)))
    return nrows, ncols


def _rank_char(rank: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyz"[rank] if 0 <= rank < 36 else "#"


def _char_grid(layout: _Layout) -> list[str]:
    """The view as characters: each cell shows the rank holding its centre."""
    rows, cols = layout.view
    nrows, ncols = _grid_size(layout.view)
    fill = "*" if layout.replicated else "."
    grid = np.full((nrows, ncols), fill, dtype="<U1")
    ys = (np.arange(nrows) + 0.5) * rows / nrows
    xs = (np.arange(ncols) + 0.5) * cols / ncols
    for block in layout.blocks:
        char = _rank_char(block.rank)
        for r0, r1, c0, c1 in block.rects:
            hit_r, hit_c = (ys >= r0) & (ys < r1), (xs >= c0) & (xs < c1)
            if not hit_r.any():
                hit_r[min(int((r0 + r1) / 2 * nrows / rows), nrows - 1)] = True
            if not hit_c.any():
                hit_c[min(int((c0 + c1) / 2 * ncols / cols), ncols - 1)] = True
            grid[np.ix_(hit_r, hit_c)] = char
    top = "┌" + "─" * ncols + "┐"
    bottom = "└" + "─" * ncols + "┘"
    return [top, *("│" + "".join(row) + "│" for row in grid), bottom]


def _slice_rows(layout: _Layout) -> list[list[str]]:
    rows = []
    for s in layout.slices:
        st = _stats(s)
        rows.append(
            [
                str(s.rank),
                _ranges_text(layout, s),
                str(tuple(s.shape)),
                s.dtype,
                human_bytes(_slice_bytes(s)),
                *(f"{st[k]:.4g}" if k in st else "-" for k in ("norm", "min", "max")),
            ]
        )
    return rows


# MLX dtype names numpy does not know, and their sizes in bytes
_MLX_ITEMSIZES = {"bfloat16": 2}


def _itemsize(dtype: str) -> int:
    """Bytes per element of an MLX dtype name (``float16`` 2, ``int8`` 1, ``uint32`` 4)."""
    if dtype in _MLX_ITEMSIZES:
        return _MLX_ITEMSIZES[dtype]
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 2 if "16" in dtype else 4


def _slice_bytes(s: TensorSlice) -> int:
    """Bytes of a rank's local slice in its own dtype. (Not ``TensorSlice.nbytes``: it
    counts every dtype but bfloat16 as 4 bytes an element.)"""
    return int(np.prod(s.shape, dtype=np.int64)) * _itemsize(s.dtype)


def format_tensor(slices: list[TensorSlice]) -> str:
    """Describe how a tensor is split across ranks, for a terminal.

    Args:
        slices: one :class:`TensorSlice` per rank, all of the same tensor.

    Returns:
        Heading lines, a character grid of the full tensor (each cell shows the rank
        that holds it, ``*`` for every rank, ``.`` for none) and a table of rank,
        ranges, local shape, dtype, bytes, norm, min and max.
    """
    layout = _layout(slices)
    lines, _ = _title_lines(layout, None, None)
    grid = _char_grid(layout)
    if layout.replicated:
        grid.append(f"* = every rank ({rank_span(layout.ranks)}) holds the whole tensor")
    headers = ("rank", "ranges", "local shape", "dtype", "bytes", "norm", "min", "max")
    table = _text_table(headers, _slice_rows(layout), align="rlllrrrr")
    total = sum(_slice_bytes(s) for s in layout.slices)
    full = int(np.prod(layout.full_shape)) * _itemsize(layout.dtype)
    footer = (
        f"total {human_bytes(total)} on {len(layout.ranks)} ranks; unsharded {human_bytes(full)}"
    )
    return "\n".join([*lines, *grid, "", *table, footer])


# --------------------------------------------------------------------------- public: plans


_PLAN_HEADERS = (
    "layer",
    "path",
    "mode",
    "full shape",
    "per-rank shape",
    "dtype",
    "bytes/rank",
    "collectives/step",
    "problem",
)
_PLAN_ALIGN = "llllllrll"
_PROBLEM_STYLE = "color:#b00020;background:#fde7e9;font-weight:bold"


def _plan_cells(row: PlanRow) -> list[str]:
    return [
        row.layer,
        row.path,
        row.mode,
        str(tuple(row.full_shape)),
        str(tuple(row.local_shape)),
        row.dtype,
        human_bytes(row.bytes_per_rank),
        row.collectives_per_step or "-",
        row.problem,
    ]


def _unsharded_bytes(row: PlanRow) -> int:
    local = int(np.prod(row.local_shape))
    if local == 0:
        return 0
    return round(row.bytes_per_rank * int(np.prod(row.full_shape)) / local)


def _plan_footer(rows: Sequence[PlanRow], group_size: int) -> str:
    per_rank = sum(r.bytes_per_rank for r in rows)
    unsharded = sum(_unsharded_bytes(r) for r in rows)
    share = f" = {100 * per_rank / unsharded:.1f}% of it" if unsharded else ""
    ideal = f" (ideal {100 / group_size:.1f}% on {group_size} ranks)" if group_size > 0 else ""
    text = (
        f"total per rank {human_bytes(per_rank)} vs unsharded {human_bytes(unsharded)}"
        f"{share}{ideal}"
    )
    problems = sum(1 for r in rows if r.problem)
    if problems:
        text += f"; {problems} problem{'s' if problems > 1 else ''}"
    return text


def plan_table_html(rows: list[PlanRow], group_size: int) -> str:
    """An HTML table of a sharding plan, problems highlighted in red.

    Args:
        rows: the plan, one row per parameter.
        group_size: the number of ranks the plan is for.

    Returns:
        A ``<table>`` with layer, path, mode, full shape, per-rank shape, dtype,
        bytes per rank, collectives per step and problem columns, and a footer with
        the total bytes per rank against the unsharded total.
    """
    head = "".join(
        f'<th style="text-align:left;padding:2px 8px">{html.escape(h)}</th>' for h in _PLAN_HEADERS
    )
    body = "".join(_plan_row_html(r) for r in rows)
    foot = (
        f'<tr><td colspan="{len(_PLAN_HEADERS)}" style="padding:4px 8px;'
        f'font-weight:bold;border-top:1px solid #888">'
        f"{html.escape(_plan_footer(rows, group_size))}</td></tr>"
    )
    return (
        '<table class="mlx-nbdist-plan" style="border-collapse:collapse;'
        'font-family:monospace;font-size:12px">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"
    )


def _plan_row_html(row: PlanRow) -> str:
    cells = []
    values = _plan_cells(row)
    for i, (value, align) in enumerate(zip(values, _PLAN_ALIGN, strict=True)):
        style = f"padding:2px 8px;text-align:{'right' if align == 'r' else 'left'}"
        if i == len(values) - 1 and row.problem:
            style += ";" + _PROBLEM_STYLE
        cells.append(f'<td style="{style}">{html.escape(value)}</td>')
    return "<tr>" + "".join(cells) + "</tr>"


def format_plan(rows: list[PlanRow], group_size: int) -> str:
    """The sharding plan as an aligned text table.

    Args:
        rows: the plan, one row per parameter.
        group_size: the number of ranks the plan is for.

    Returns:
        The table (rows with a problem start with ``!!``) and the totals footer.
    """
    headers = ("", *_PLAN_HEADERS)
    body = [["!!" if r.problem else "", *_plan_cells(r)] for r in rows]
    table = _text_table(headers, body, align="l" + _PLAN_ALIGN)
    return "\n".join([*table, _plan_footer(rows, group_size)])
