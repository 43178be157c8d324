"""Pictures and text of how one tensor is laid out across the ranks of a group.

:func:`show_tensor` and :func:`show_quantized` draw a
:class:`~mlx_nbdist.viz.layout.TensorLayout` (rank blocks, and the reassembled values
as a heatmap); :func:`format_tensor` writes it as a character grid and a table.
Figures are built with the object API (:class:`matplotlib.figure.Figure`), never
through pyplot, so nothing is kept alive by a global figure manager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib import patheffects
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from mlx_nbdist.errors import rank_span
from mlx_nbdist.results import TensorSlice
from mlx_nbdist.viz.common import (
    WARN_COLOR,
    NotebookFigure,
    human_bytes,
    rank_color,
    text_color,
    text_table,
)
from mlx_nbdist.viz.layout import (
    MAX_PIXELS,
    Block,
    Heat,
    Rect,
    TensorLayout,
    heat_of,
    range_text,
    ranges_text,
    slice_stats,
    tensor_layout,
    title_lines,
)

__all__ = ["MAX_PIXELS", "format_tensor", "show_quantized", "show_tensor"]

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


def _block_lines(layout: TensorLayout, block: Block, first: bool) -> list[str]:
    s = layout.slice_of(block.rank)
    head = f"rank {block.rank}"
    if block.segments > 1:
        head += f"  seg {block.segment + 1}/{block.segments}"
    lines = [head]
    if first:
        lines.append(f"local {tuple(s.shape)}" if block.segments > 1 else str(tuple(s.shape)))
    lines.append(range_text(layout.full_shape, layout.axis, block.start, block.stop))
    if first and s.data is None:
        lines += _stats_lines(slice_stats(s))
    return lines


def _replicated_lines(layout: TensorLayout) -> list[str]:
    each = " each" if len(layout.ranks) > 1 else ""
    shape = f"{layout.full_shape}{each}" if layout.full_shape else "scalar"
    lines = (["whole", f"on rank {layout.ranks[0]} only", shape] if len(layout.ranks) == 1
             else ["replicated", f"on ranks {rank_span(layout.ranks)}", shape])
    s = layout.slices[0]
    if s.data is None:
        lines += _stats_lines(slice_stats(s))
    return lines


def _layout_labels(layout: TensorLayout, panel_pt: tuple[float, float]) -> list[_Label | None]:
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


def _repeat_labels(layout: TensorLayout, panel_pt: tuple[float, float]) -> list[_Label]:
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


def _needs_legend(layout: TensorLayout, labels: Sequence[_Label | None]) -> bool:
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


def _setup_axes(ax: Axes, layout: TensorLayout) -> None:
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


def _draw_layout(ax: Axes, layout: TensorLayout, labels: Sequence[_Label | None]) -> None:
    """Blocks coloured by owning rank, with labels."""
    _setup_axes(ax, layout)
    if layout.replicated:
        _draw_replicated(ax, layout)
    for block in layout.blocks:
        for rect in block.rects:
            style = {"facecolor": rank_color(block.rank), "edgecolor": "black", "linewidth": 0.8}
            _add_rect(ax, rect, f"block-r{block.rank}", **style)
    _draw_units(ax, layout)
    for label in [*labels, *_repeat_labels(layout, _axes_pt(ax))]:
        if label is not None:
            _draw_label(ax, label)


def _draw_units(ax: Axes, layout: TensorLayout) -> None:
    """Dashed lines where the units of the sharded axis meet (an attention
    projection's heads), so a block is seen to hold whole heads."""
    along, positions = layout.unit_lines()
    rows, cols = layout.view
    for p in positions:
        if along == "rows":
            (line,) = ax.plot([0, cols], [p, p], color="0.25", linewidth=0.6, linestyle="--")
        else:
            (line,) = ax.plot([p, p], [0, rows], color="0.25", linewidth=0.6, linestyle="--")
        line.set_gid("unit-line")


def _draw_replicated(ax: Axes, layout: TensorLayout) -> None:
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
        color, box = text_color(rank_color(label.rank)), None
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


def _draw_values(ax: Axes, cax: Axes | None, layout: TensorLayout, heat: Heat) -> None:
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
    _draw_units(ax, layout)
    _draw_outlines(ax, layout)
    fig = _root_figure(ax)
    if cax is not None:
        bar = fig.colorbar(image, cax=cax)
    else:
        bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.ax.tick_params(labelsize=7)


def _draw_outlines(ax: Axes, layout: TensorLayout) -> None:
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
        tag = (f"rank {layout.ranks[0]}" if len(layout.ranks) == 1
               else f"replicated {rank_span(layout.ranks)}")
        _draw_tag(ax, (0, rows, 0, cols), tag, None)
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
        color=text_color(fc),
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
    layout = tensor_layout(slices)
    heat = heat_of(layout) if values else None
    lines, warn = title_lines(layout, heat, title)
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
    fig.suptitle("\n".join(lines), fontsize=10, color=WARN_COLOR if warn else "black")
    if legend:
        _add_legend(fig, layout.ranks)
    return fig


def _draw_into(
    ax: Axes | Sequence[Axes], layout: TensorLayout, heat: Heat | None, lines: list[str], warn: bool
) -> Figure:
    axes = [ax] if isinstance(ax, Axes) else list(ax)
    if len(axes) >= 2 or heat is None:
        _draw_layout(axes[0], layout, _layout_labels(layout, _axes_pt(axes[0])))
    if heat is not None:
        _draw_values(axes[-1], None, layout, heat)
    axes[0].set_title("\n".join(lines), fontsize=9, color=WARN_COLOR if warn else "black")
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
    layouts = [tensor_layout(p[1]) for p in parts]
    heats = [
        heat_of(lay) if show else None for lay, (_, _, show) in zip(layouts, parts, strict=True)
    ]
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
    fig.suptitle("\n".join(lines), fontsize=10, color=WARN_COLOR if warn else "black")
    if legend:
        _add_legend(fig, layouts[0].ranks)
    return fig


def _fractions(layout: TensorLayout) -> dict[int, list[tuple[float, float]]]:
    if layout.replicated:
        return {r: [(0.0, 1.0)] for r in layout.ranks}
    n = max(layout.full_shape[layout.axis], 1)
    return {s.rank: [(a / n, b / n) for a, b in s.ranges] for s in layout.slices}


def _same_split(a: TensorLayout, b: TensorLayout) -> list[int]:
    """Ranks on which ``b`` is not split in the same proportions as ``a``."""
    if a.axis != b.axis:
        return sorted(set(a.ranks) | set(b.ranks))
    fa, fb = _fractions(a), _fractions(b)
    bad = set(fa) ^ set(fb)
    for rank in set(fa) & set(fb):
        if len(fa[rank]) != len(fb[rank]) or not np.allclose(fa[rank], fb[rank]):
            bad.add(rank)
    return sorted(bad)


def _quantized_title(
    layouts: Sequence[TensorLayout], names: Sequence[str]
) -> tuple[list[str], bool]:
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


def _char_grid(layout: TensorLayout) -> list[str]:
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


def _slice_rows(layout: TensorLayout) -> list[list[str]]:
    rows = []
    for s in layout.slices:
        st = slice_stats(s)
        rows.append(
            [
                str(s.rank),
                ranges_text(layout, s),
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
    """Bytes of a rank's local slice in its own dtype (like ``TensorSlice.nbytes``, but
    an unknown dtype name counts 2 or 4 bytes an element instead of raising)."""
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
    layout = tensor_layout(slices)
    lines, _ = title_lines(layout, None, None, drawn=False)
    grid = _char_grid(layout)
    if layout.replicated:
        grid.append(f"* = every rank ({rank_span(layout.ranks)}) holds the whole tensor")
    headers = ("rank", "ranges", "local shape", "dtype", "bytes", "norm", "min", "max")
    table = text_table(headers, _slice_rows(layout), align="rlllrrrr")
    total = sum(_slice_bytes(s) for s in layout.slices)
    full = int(np.prod(layout.full_shape)) * _itemsize(layout.dtype)
    footer = (
        f"total {human_bytes(total)} on {len(layout.ranks)} ranks; unsharded {human_bytes(full)}"
    )
    return "\n".join([*lines, *grid, "", *table, footer])
