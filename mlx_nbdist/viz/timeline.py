"""A picture and text of profiled cells: one lane per rank, coloured by what it did.

Consumes :class:`~mlx_nbdist.timelines.CellTimeline` (plain data built from what the
ranks of a ``%%mlxdist --profile`` cell recorded): computing, waiting in a collective
for the last rank to arrive, moving data, sending/receiving, idle between cells. The
rank the others waited for and the slowest rank are marked on their lanes. Times are
those of the profiled run, in which every collective is evaluated where it is issued.
"""

from __future__ import annotations

import textwrap

from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from mlx_nbdist.timelines import CellTimeline, SegmentKind, format_seconds
from mlx_nbdist.viz.common import WARN_COLOR, NotebookFigure, rank_color

#: the colour of each kind of segment (a rank's colour marks its lane's label)
KIND_COLORS: dict[SegmentKind, str] = {
    SegmentKind.COMPUTE: "#7fa7d9",
    SegmentKind.WAIT: "#f2a541",
    SegmentKind.COLLECTIVE: "#c0392b",
    SegmentKind.SEND: "#8e44ad",
    SegmentKind.RECV: "#27ae60",
    SegmentKind.IDLE: "#e6e6e6",
    SegmentKind.UNTIMED: "#000000",
}
_LABELS = {
    SegmentKind.COMPUTE: "computing",
    SegmentKind.WAIT: "waiting in a collective",
    SegmentKind.COLLECTIVE: "collective (moving data)",
    SegmentKind.SEND: "send",
    SegmentKind.RECV: "recv",
    SegmentKind.IDLE: "idle (between cells)",
    SegmentKind.UNTIMED: "issued in mx.compile/vmap (not timed)",
}
_HEIGHT = 0.6


def timeline_figure(tl: CellTimeline, width: float = 10.0) -> NotebookFigure:
    """One lane per rank (rank 0 on top), time in milliseconds from the first cell.

    Args:
        tl: the timeline (``Session.timeline(k)``).
        width: the figure's width in inches.

    Returns:
        The figure; its segment bars have gids ``"<kind>:r<rank>"`` and the marks
        ``"waited-for:r<rank>"`` / ``"slowest:r<rank>"``; with several cells, each
        cell's label (its name, ``In [7]``, else ``cell N``) has gid ``"cell:<N>"``.
    """
    fig = NotebookFigure(figsize=(width, 1.6 + 0.55 * len(tl.ranks)), layout="constrained")
    ax = fig.add_subplot()
    _draw_lanes(ax, tl)
    _draw_cells(ax, tl)
    _mark(ax, tl)
    ax.set_title("\n".join(textwrap.wrap(tl.summary(), 110)), fontsize=8, loc="left")
    _legend(ax, tl)
    return fig


def _draw_lanes(ax: Axes, tl: CellTimeline) -> None:
    ms = 1e3
    for r in tl.ranks:
        y = _y(tl, r)
        for kind in SegmentKind:
            segs = [s for s in tl.lanes[r] if s.kind == kind]
            if not segs:
                continue
            if kind == SegmentKind.UNTIMED:
                (line,) = ax.plot([s.start * ms for s in segs], [y] * len(segs), "x",
                                  color=KIND_COLORS[kind], markersize=6)
                line.set_gid(f"{kind}:r{r}")
                continue
            bars = ax.broken_barh(
                [(s.start * ms, s.duration * ms) for s in segs],
                (y - _HEIGHT / 2, _HEIGHT),
                facecolors=KIND_COLORS[kind],
                edgecolor="white" if kind == SegmentKind.COMPUTE else "none",
                linewidth=0.3,
                hatch="///" if kind == SegmentKind.WAIT else None,
            )
            bars.set_gid(f"{kind}:r{r}")
    ax.set_yticks([_y(tl, r) for r in tl.ranks], [_lane_name(tl, r) for r in tl.ranks],
                  fontsize=8)
    for tick, r in zip(ax.get_yticklabels(), tl.ranks, strict=True):
        tick.set_color(WARN_COLOR if r in (tl.waited_for, tl.slowest) else rank_color(r))
        if r == tl.waited_for:
            tick.set_fontweight("bold")
    ax.set_ylim(-0.7, len(tl.ranks) - 0.3)
    ax.set_xlim(0, max(tl.duration * ms, 1e-3))
    ax.set_xlabel("ms since the first profiled cell started (clocks aligned)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.spines[["top", "right"]].set_visible(False)


def _draw_cells(ax: Axes, tl: CellTimeline) -> None:
    """A dashed line at each cell's start (earliest over the ranks), labelled with the
    cell's name (``In [7]``, else ``cell N``)."""
    if len(tl.cells) < 2:
        return
    starts: dict[int, float] = {}
    for spans in tl.spans.values():
        for number, start, _ in spans:
            starts[number] = min(start, starts.get(number, start))
    every = max(1, len(starts) // 12)
    for i, (number, start) in enumerate(sorted(starts.items(), key=lambda kv: kv[1])):
        ax.axvline(start * 1e3, color="0.55", linestyle="--", linewidth=0.6, zorder=0)
        if i % every == 0:
            label = ax.text(start * 1e3, len(tl.ranks) - 0.35, f" {tl.label(number)}",
                            fontsize=6, color="0.35", va="bottom")
            label.set_gid(f"cell:{number}")


def _mark(ax: Axes, tl: CellTimeline) -> None:
    """A star where the waited-for rank arrived at its biggest hold-up, and a
    triangle at the start of the slowest rank's lane."""
    if tl.waited_for is not None:
        worst = max(
            (c for c in tl.collectives if c.waited_for == tl.waited_for),
            key=lambda c: sum(c.waits.values()),
        )
        (star,) = ax.plot([worst.last_arrival * 1e3], [_y(tl, tl.waited_for)], marker="*",
                          markersize=13, color=WARN_COLOR, markeredgecolor="black",
                          linestyle="none", zorder=5)
        star.set_gid(f"waited-for:r{tl.waited_for}")
    if tl.slowest is not None:
        (dot,) = ax.plot([0], [_y(tl, tl.slowest)], marker=">", markersize=8,
                         color=WARN_COLOR, linestyle="none", zorder=5, clip_on=False)
        dot.set_gid(f"slowest:r{tl.slowest}")


def _legend(ax: Axes, tl: CellTimeline) -> None:
    present = {s.kind for lane in tl.lanes.values() for s in lane}
    handles: list[Patch | Line2D] = [
        Patch(facecolor=KIND_COLORS[k], hatch="///" if k == SegmentKind.WAIT else None,
              label=_LABELS[k])
        for k in SegmentKind
        if k in present and k != SegmentKind.UNTIMED
    ]
    if SegmentKind.UNTIMED in present:
        handles.append(Line2D([], [], marker="x", linestyle="none", color="black",
                              label=_LABELS[SegmentKind.UNTIMED]))
    if tl.waited_for is not None:
        handles.append(Line2D([], [], marker="*", linestyle="none", color=WARN_COLOR,
                              markeredgecolor="black", markersize=10,
                              label=f"rank {tl.waited_for} arrived last (everyone waited)"))
    if tl.slowest is not None:
        handles.append(Line2D([], [], marker=">", linestyle="none", color=WARN_COLOR,
                              label=f"rank {tl.slowest}: most compute"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)


def _y(tl: CellTimeline, rank: int) -> float:
    return float(len(tl.ranks) - 1 - tl.ranks.index(rank))


def _lane_name(tl: CellTimeline, rank: int) -> str:
    notes = []
    if rank == tl.waited_for:
        notes.append("waited for")
    if rank == tl.slowest:
        notes.append("slowest")
    return f"rank {rank}" + (f"\n({', '.join(notes)})" if notes else "")


def format_timeline(tl: CellTimeline) -> str:
    """The summary line, each rank's split of its time, and the per-op statistics."""
    lines = [tl.summary(), ""]
    for r in tl.ranks:
        busy = sum(e - s for _, s, e in tl.spans[r])
        lines.append(
            f"rank {r}: {format_seconds(busy)} in cells: compute "
            f"{format_seconds(tl.compute[r])}, collectives {format_seconds(tl.comm[r])} "
            f"(waiting {format_seconds(tl.wait[r])})"
        )
    if tl.untimed:
        lines.append(f"{tl.untimed} collective(s) issued inside mx.compile/vmap: not timed")
    if tl.dropped:
        lines.append(f"{tl.dropped} collective(s) past the recorder's limit were not kept")
    return "\n".join([*lines, "", tl.stats.table()])
