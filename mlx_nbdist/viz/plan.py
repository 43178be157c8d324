"""The one renderer of a sharding plan: what each parameter becomes on each rank.

:func:`plan_view` turns :class:`~mlx_nbdist.results.PlanRow` s (and the plan's
problems and warnings) into one model: the cells of every row, which rows have a
problem, the totals footer and the notes. :func:`format_plan` writes that model as
aligned text, :func:`plan_table_html` as an HTML table; a column is one entry of
:data:`COLUMNS`.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_nbdist.results import HeadRow, PlanRow, StageRow
from mlx_nbdist.viz.common import WARN_COLOR, human_bytes, rank_hex, text_table

__all__ = ["COLUMNS", "PlanColumn", "PlanView", "extras_of", "format_plan", "plan_table_html",
           "plan_view"]


@dataclass(frozen=True)
class PlanColumn:
    """One column of the plan table: its title, alignment and cell text."""

    title: str
    align: str  # "l" or "r"
    cell: Callable[[PlanRow], str]


#: The columns of the plan, in order.
COLUMNS: tuple[PlanColumn, ...] = (
    PlanColumn("layer", "l", lambda r: r.layer),
    PlanColumn("path", "l", lambda r: r.path),
    PlanColumn("mode", "l",
               lambda r: str(r.mode) + (f" (rank {r.holder})" if r.holder is not None else "")),
    PlanColumn("full shape", "l", lambda r: str(tuple(r.full_shape))),
    PlanColumn("per-rank shape", "l", lambda r: str(tuple(r.local_shape))),
    PlanColumn("dtype", "l", lambda r: r.dtype),
    PlanColumn("bytes/rank", "r", lambda r: human_bytes(r.bytes_per_rank)),
    PlanColumn("collectives/step", "l", lambda r: r.collectives_per_step or "-"),
    PlanColumn("problem", "l", lambda r: r.problem),
)

_PROBLEM_STYLE = f"color:{WARN_COLOR};background:#fde7e9;font-weight:bold"
_NOTE_COLORS = {"note": "#333", "problem": "#b00", "warning": "#a60"}


@dataclass(frozen=True)
class PlanView:
    """A sharding plan as the notebook shows it, before it is written as text or HTML.

    Attributes:
        cells: per plan row, the text of each of :data:`COLUMNS`.
        flagged: per plan row, whether it has a problem.
        footer: total bytes per rank against the unsharded total, and the problems.
        notes: ``(kind, text)`` for each of the plan's problems (``problem``), then
            each of its warnings (``warning``).
    """

    cells: list[list[str]]
    flagged: list[bool]
    footer: str
    notes: list[tuple[str, str]]
    heads: list[list[str]]
    stages: list[list[str]]
    #: layer index -> the rank that runs it (pipeline), for the layer->rank picture
    layer_ranks: list[int]


def extras_of(plan: Any) -> dict[str, Any]:
    """What a plan object (a ``ShardPlan``, the notebook's ``PlanTable``) holds besides
    its rows and group size, as :func:`plan_view`'s keyword arguments."""
    return {k: getattr(plan, k) for k in ("problems", "warnings", "heads", "stages", "own")}


def plan_view(
    rows: Sequence[PlanRow],
    group_size: int,
    problems: Sequence[str] = (),
    warnings: Sequence[str] = (),
    heads: Sequence[HeadRow] = (),
    stages: Sequence[StageRow] = (),
    own: str = "",
) -> PlanView:
    """The model of a plan that :func:`format_plan` and :func:`plan_table_html` write.

    Args:
        rows: the plan, one row per parameter.
        group_size: the number of ranks the plan is for.
        problems: what makes the plan unusable (``ShardPlan.problems``).
        warnings: layouts that run but are probably unintended (``ShardPlan.warnings``).
        heads: per attention block, the heads each rank keeps (tensor parallel).
        stages: per rank, the layers it runs (pipeline).
        own: the model's own method the plan dry-ran (``Model.shard``), if any.
    """
    notes = [("note", f"sharded by the model's own {own}(group), as mlx-lm does; this plan "
                      "is that method dry-run on a copy of the model")] if own else []
    return PlanView(
        cells=[[c.cell(r) for c in COLUMNS] for r in rows],
        flagged=[bool(r.problem) for r in rows],
        footer=_footer(rows, group_size, stages),
        notes=notes + [("problem", p) for p in problems] + [("warning", w) for w in warnings],
        heads=[[h.path, str(h.heads), str(h.kv_heads), str(h.head_dim),
                f"{h.heads_per_rank} + {h.kv_heads_per_rank} kv" if not h.problem else "-",
                h.problem] for h in heads],
        stages=[[f"rank {s.rank}", f"{s.first}-{s.last}" if s.last > s.first else str(s.first),
                 str(s.n_layers), human_bytes(s.param_bytes)] for s in stages],
        layer_ranks=[s.rank for s in sorted(stages, key=lambda s: s.first)
                     for _ in range(s.n_layers)],
    )


HEAD_TITLES = ("attention block", "heads", "kv heads", "head dim", "per rank", "problem")
STAGE_TITLES = ("stage", "layers", "count", "parameters held")


def _unsharded_bytes(row: PlanRow) -> int:
    local = int(np.prod(row.local_shape))
    if local == 0:
        return 0
    return round(row.bytes_per_rank * int(np.prod(row.full_shape)) / local)


def _footer(rows: Sequence[PlanRow], group_size: int, stages: Sequence[StageRow] = ()) -> str:
    per_rank = (max(s.param_bytes for s in stages) if stages
                else sum(r.bytes_per_rank for r in rows))
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


def format_plan(rows: list[PlanRow], group_size: int, **extras: Any) -> str:
    """The sharding plan as an aligned text table.

    Args:
        rows: the plan, one row per parameter.
        group_size: the number of ranks the plan is for.
        extras: ``problems`` (listed after the table, ``problem: …``), ``warnings``
            (after them, ``warning: …``), ``heads``, ``stages``, ``own``: as
            :func:`plan_view` takes them (:func:`extras_of` reads them off a plan).

    Returns:
        The heads table (tensor parallel) or the stages and a layer->rank line
        (pipeline), then the table (rows with a problem start with ``!!``), the
        totals footer, then the notes.
    """
    view = plan_view(rows, group_size, **extras)
    headers = ("", *(c.title for c in COLUMNS))
    body = [
        ["!!" if bad else "", *cells] for cells, bad in zip(view.cells, view.flagged, strict=True)
    ]
    table = text_table(headers, body, align="l" + "".join(c.align for c in COLUMNS))
    notes = [f"{kind}: {text}" for kind, text in view.notes]
    top: list[str] = []
    if view.heads:
        top += [*text_table(HEAD_TITLES, view.heads, align="lrrrll"), ""]
    if view.stages:
        picture = " ".join(str(r) for r in view.layer_ranks)
        top += [*text_table(STAGE_TITLES, view.stages, align="lllr"),
                f"layer -> rank: {picture}  (data flows from rank {max(view.layer_ranks)} "
                "down to rank 0)", ""]
    return "\n".join([*top, *table, view.footer, *notes])


def plan_table_html(rows: list[PlanRow], group_size: int, **extras: Any) -> str:
    """An HTML table of a sharding plan, problems highlighted in red.

    Takes the arguments of :func:`format_plan`; the plan's problems are listed in
    red under the table, its warnings in orange after them.

    Returns:
        A ``<table>`` with layer, path, mode, full shape, per-rank shape, dtype,
        bytes per rank, collectives per step and problem columns, and a footer with
        the total bytes per rank against the unsharded total; then a ``<ul>`` of the
        notes, if any.
    """
    view = plan_view(rows, group_size, **extras)
    head = "".join(
        f'<th style="text-align:left;padding:2px 8px">{html.escape(c.title)}</th>' for c in COLUMNS
    )
    body = "".join(
        _row_html(cells, bad) for cells, bad in zip(view.cells, view.flagged, strict=True)
    )
    foot = (
        f'<tr><td colspan="{len(COLUMNS)}" style="padding:4px 8px;'
        f'font-weight:bold;border-top:1px solid #888">'
        f"{html.escape(view.footer)}</td></tr>"
    )
    table = (
        '<table class="mlx-nbdist-plan" style="border-collapse:collapse;'
        'font-family:monospace;font-size:12px">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"
    )
    notes = "".join(
        f"<li style='color:{_NOTE_COLORS[kind]}'>{html.escape(text)}</li>"
        for kind, text in view.notes
    )
    return (_small_table_html(HEAD_TITLES, view.heads) + _stages_html(view) + table
            + (f"<ul>{notes}</ul>" if notes else ""))


def _small_table_html(titles: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    if not rows:
        return ""
    head = "".join(f'<th style="text-align:left;padding:2px 8px">{html.escape(t)}</th>'
                   for t in titles)
    body = "".join("<tr>" + "".join(f'<td style="padding:2px 8px">{html.escape(c)}</td>'
                                    for c in row) + "</tr>" for row in rows)
    return ('<table style="border-collapse:collapse;font-family:monospace;font-size:12px;'
            f'margin-bottom:6px"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')


def _stages_html(view: PlanView) -> str:
    """The stages table and a strip of one box per layer, coloured by its rank."""
    if not view.stages:
        return ""
    boxes = "".join(
        f'<span title="layer {i}: rank {r}" style="display:inline-block;min-width:22px;'
        f'padding:2px 4px;margin:1px;background:{rank_hex(r)};color:white;'
        f'text-align:center">{i}</span>' for i, r in enumerate(view.layer_ranks))
    return (_small_table_html(STAGE_TITLES, view.stages)
            + f'<div style="font-family:monospace;font-size:12px;margin-bottom:6px">'
            f"layers by rank: {boxes}</div>")


def _row_html(cells: Sequence[str], flagged: bool) -> str:
    out = []
    for i, (value, column) in enumerate(zip(cells, COLUMNS, strict=True)):
        style = f"padding:2px 8px;text-align:{'right' if column.align == 'r' else 'left'}"
        if i == len(cells) - 1 and flagged:
            style += ";" + _PROBLEM_STYLE
        out.append(f'<td style="{style}">{html.escape(value)}</td>')
    return "<tr>" + "".join(out) + "</tr>"
