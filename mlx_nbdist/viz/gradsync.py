"""Pictures and text of gradient synchronisation across the ranks of a group.

Consumes :class:`~mlx_nbdist.results.GradSample` lists: one sample per parameter
and rank, with the gradient norm before and after synchronisation, how far the
synchronised gradient of a replicated parameter differs from rank 0's, and which
collective moved how many bytes; and, when given, the step's timed collectives
(:class:`~mlx_nbdist.timelines.CommStats`: count, bytes, time, GB/s, ratio to the probe).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colors as mcolors
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from mlx_nbdist.results import GradSample
from mlx_nbdist.viz.common import NotebookFigure, human_bytes, rank_color, text_table

if TYPE_CHECKING:
    from mlx_nbdist.timelines import CommStats

#: Default tolerance of :func:`desynced`, relative to the gradient's RMS element.
DEFAULT_TOL = 1e-6

DESYNC_COLOR = "#e00000"
_OK_COLOR = "#4c9a2a"
_SHARDED_COLOR = "#c8c8c8"
_LOG_SPAN = 1e3


@dataclass(frozen=True)
class _Check:
    """The synchronisation verdict for one parameter."""

    name: str
    replicated: bool
    max_diff: float
    threshold: float
    flagged: bool


def _params(samples: Sequence[GradSample]) -> list[str]:
    return list(dict.fromkeys(s.name for s in samples))


def _ranks(samples: Sequence[GradSample]) -> list[int]:
    return sorted({s.rank for s in samples})


def _index(samples: Sequence[GradSample]) -> dict[tuple[str, int], GradSample]:
    return {(s.name, s.rank): s for s in samples}


def _check(name: str, group: Sequence[GradSample], tol: float) -> _Check:
    replicated = any(s.replicated for s in group)
    diffs = [float(s.max_diff_after) for s in group]
    diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    norm = max(float(s.norm_after) for s in group)
    numel = next((int(np.prod(s.shape)) for s in group if s.shape), 0)
    scale = norm / math.sqrt(numel) if numel else norm
    threshold = tol * scale if math.isfinite(scale) and scale > 0 else 0.0
    flagged = replicated and (math.isnan(diff) or diff > threshold)
    return _Check(name, replicated, diff, threshold, flagged)


def _checks(samples: Sequence[GradSample], tol: float) -> list[_Check]:
    return [_check(n, [s for s in samples if s.name == n], tol) for n in _params(samples)]


def desynced(samples: list[GradSample], tol: float = DEFAULT_TOL) -> list[str]:
    """Names of replicated parameters whose synchronised gradients differ across ranks.

    A replicated parameter is flagged when the largest ``max_diff_after`` over the
    ranks exceeds ``tol`` times the root-mean-square element of the synchronised
    gradient (``norm_after / sqrt(numel)``, or ``norm_after`` when the shape is
    unknown); when that gradient is all zero any difference is flagged, and so is NaN.

    Args:
        samples: one sample per parameter and rank.
        tol: relative tolerance.

    Returns:
        The flagged names, in the order they first appear in ``samples``.
    """
    return [c.name for c in _checks(samples, tol) if c.flagged]


# --------------------------------------------------------------------------- figure


def _lighten(color: tuple[float, ...], amount: float = 0.6) -> tuple[float, float, float]:
    r, g, b = mcolors.to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _slots(i: int, j: int, nranks: int) -> tuple[float, float]:
    """(left edge, width) of rank ``j``'s slot in the group of parameter ``i``."""
    width = 0.8 / nranks
    return i - 0.4 + j * width, width


def _draw_norms(
    ax: Axes, samples: Sequence[GradSample], params: list[str], ranks: list[int]
) -> None:
    """Grouped bars: per rank, the norm before (light, hatched) and after (solid)."""
    index = _index(samples)
    for j, rank in enumerate(ranks):
        color = rank_color(rank)
        for i, name in enumerate(params):
            s = index.get((name, rank))
            if s is None:
                continue
            left, width = _slots(i, j, len(ranks))
            before = ax.bar(
                left + width * 0.27,
                s.norm_before,
                width * 0.46,
                color=_lighten(color),
                edgecolor=color,
                hatch="////",
                linewidth=0.8,
            )
            after = ax.bar(
                left + width * 0.73,
                s.norm_after,
                width * 0.46,
                color=color,
                edgecolor="black",
                linewidth=0.5,
            )
            before.patches[0].set_gid(f"before:{name}:r{rank}")
            after.patches[0].set_gid(f"after:{name}:r{rank}")
    positive = [v for s in samples for v in (s.norm_before, s.norm_after) if v > 0]
    if positive and max(positive) / min(positive) > _LOG_SPAN:
        ax.set_yscale("log")
    ax.set_ylabel("gradient norm", fontsize=8)
    ax.set_title("per-rank gradient norm: before sync (hatched) vs after (solid)", fontsize=9)
    handles = [Patch(facecolor=rank_color(r), edgecolor="black", label=f"rank {r}") for r in ranks]
    handles += [
        Patch(facecolor="white", edgecolor="0.3", hatch="////", label="before sync"),
        Patch(facecolor="0.3", edgecolor="black", label="after sync"),
    ]
    ax.legend(
        handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False
    )


def _draw_diffs(ax: Axes, checks: Sequence[_Check], tol: float) -> None:
    """Max element difference between ranks after sync, desynced parameters in red."""
    top = max((c.max_diff for c in checks if math.isfinite(c.max_diff)), default=0.0)
    top = top if top > 0 else 1.0
    for i, c in enumerate(checks):
        height = c.max_diff if math.isfinite(c.max_diff) else top
        color = DESYNC_COLOR if c.flagged else (_OK_COLOR if c.replicated else _SHARDED_COLOR)
        bar = ax.bar(
            i, height if c.replicated else 0.0, 0.6, color=color, edgecolor="black", linewidth=0.5
        )
        bar.patches[0].set_gid(f"maxdiff:{c.name}")
        ax.text(
            i,
            height if c.replicated else 0.0,
            _diff_text(c),
            ha="center",
            va="bottom",
            fontsize=8 if c.flagged else 7,
            color=DESYNC_COLOR if c.flagged else "0.35",
            fontweight="bold" if c.flagged else "normal",
            gid=f"difftext:{c.name}",
        )
    ax.set_ylim(0, top * 1.45)
    if all(c.max_diff == 0 for c in checks):  # nothing to scale: say it instead
        ax.set_yticks([])
        replicated = sum(1 for c in checks if c.replicated)
        if replicated == 1:
            note = "the replicated gradient is identical on every rank after sync"
        elif replicated:
            note = f"all {replicated} replicated gradients are identical on every rank after sync"
        else:
            note = "no replicated parameter: every gradient is a local shard"
        ax.text(0.5, 0.55, note, ha="center", va="center", fontsize=8.5, color="0.15",
                transform=ax.transAxes, gid="diff-note")
    ax.set_ylabel("max |g_r - g_0|\nafter sync", fontsize=8)
    ax.set_title(f"replicas after sync (flagged above {tol:g} x RMS of the gradient)", fontsize=9)


def _diff_text(c: _Check) -> str:
    if not c.replicated:
        return "sharded"
    if c.flagged:
        return f"DESYNC\n{c.max_diff:.3g}"
    return "0" if c.max_diff == 0 else f"{c.max_diff:.2g}"


def _short_op(collective: str) -> str:
    """``all_sum / 4 (average_gradients)`` -> ``all_sum``."""
    words = re.split(r"[\s(;]", collective.strip(), maxsplit=1)
    return words[0] or "none"


def _draw_bytes(
    ax: Axes, samples: Sequence[GradSample], params: list[str], ranks: list[int]
) -> None:
    """Per parameter and rank, the bytes the synchronising collective moved.

    When no row moved bytes of its own (tensor parallelism synchronises activation
    gradients once per step, not per parameter; one rank has nothing to sync) the
    panel says so in words instead of drawing an empty axis.
    """
    index = _index(samples)
    group_pt = ax.get_figure().get_size_inches()[0] * 72 * 0.8 / max(len(params), 1)
    if all(s.nbytes == 0 for s in samples):
        _draw_no_bytes(ax, samples, params, ranks, group_pt)
        return
    for i, name in enumerate(params):
        group = [index[(name, r)] for r in ranks if (name, r) in index]
        for s in group:
            left, width = _slots(i, ranks.index(s.rank), len(ranks))
            bar = ax.bar(
                left + width / 2,
                s.nbytes,
                width * 0.85,
                color=rank_color(s.rank),
                edgecolor="black",
                linewidth=0.5,
            )
            bar.patches[0].set_gid(f"bytes:{name}:r{s.rank}")
        ops = sorted({_short_op(s.collective) for s in group})
        text = "/".join(ops)
        ax.text(
            i,
            max((s.nbytes for s in group), default=0),
            text,
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=90 if len(text) * 4.5 > group_pt else 0,
            color=DESYNC_COLOR if len(ops) > 1 else "0.2",
            gid=f"collective:{name}",
        )
    positive = [s.nbytes for s in samples if s.nbytes > 0]
    if positive and max(positive) / min(positive) > _LOG_SPAN / 10:
        ax.set_yscale("log", base=4)
        ax.set_ylim(min(positive) / 2, max(positive) * 8)
    else:
        ax.margins(y=0.25)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: human_bytes(v)))
    ax.set_ylabel("bytes moved", fontsize=8)
    ax.set_title("collective and bytes per parameter and rank", fontsize=9)
    _collective_legend(ax, samples)


def no_bytes_note(samples: Sequence[GradSample]) -> str:
    """Why no parameter reports bytes, for the bytes panel when every ``nbytes`` is 0.

    Args:
        samples: one sample per parameter and rank, all with ``nbytes == 0``.

    Returns:
        One sentence: the per-step backward all_sum of activation gradients (its bytes
        per rank and calls: ``step_calls`` and ``step_nbytes``), or that nothing was
        synchronised in the backward.
    """
    per_rank = {
        s.rank: (s.step_calls, s.step_nbytes or 0) for s in samples if s.step_calls is not None
    }
    if not per_rank:
        ops = sorted({_short_op(s.collective) for s in samples if s.collective})
        how = f" (collective: {', '.join(ops)})" if ops else ""
        return f"no collective moved gradient bytes in this step{how}"
    distinct = set(per_rank.values())
    calls, nbytes = max(distinct)
    if calls == 0 and len(distinct) == 1:
        return ("no gradient collective in this step: every rank computes its gradients "
                "locally (no all-to-sharded layer's input needs a gradient, so the backward "
                "does no all_sum)")
    if len(distinct) == 1:
        moved = f"{human_bytes(nbytes)} per step on each rank ({_calls(calls)})"
    else:
        moved = "per step: " + ", ".join(
            f"rank {r} {human_bytes(b)} ({_calls(c)})" for r, (c, b) in sorted(per_rank.items()))
    return ("no per-parameter gradient collective; the backward all_sum of activation "
            f"gradients moved {moved}, shared by the parameters upstream of it")


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def _draw_no_bytes(
    ax: Axes, samples: Sequence[GradSample], params: list[str], ranks: list[int],
    group_pt: float,
) -> None:
    index = _index(samples)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    for i, name in enumerate(params):
        group = [index[(name, r)] for r in ranks if (name, r) in index]
        ops = sorted({_short_op(s.collective) for s in group})
        text = "/".join(ops)
        ax.text(i, 0.03, text, ha="center", va="bottom", fontsize=7,
                rotation=90 if len(text) * 4.5 > group_pt else 0,
                color=DESYNC_COLOR if len(ops) > 1 else "0.2", gid=f"collective:{name}")
    width_chars = max(30, int(ax.get_figure().get_size_inches()[0] * 72 * 0.75 / 5.5))
    ax.text(0.5, 0.62, textwrap.fill(no_bytes_note(samples), width_chars), ha="center",
            va="center", fontsize=8.5, color="0.15", transform=ax.transAxes,
            bbox={"boxstyle": "round,pad=0.5", "facecolor": "#f4f4f4", "edgecolor": "0.6"},
            gid="bytes-note")
    ax.set_ylabel("bytes moved", fontsize=8)
    ax.set_title("collective and bytes per parameter and rank", fontsize=9)
    _collective_legend(ax, samples)


def _collective_legend(ax: Axes, samples: Sequence[GradSample]) -> None:
    """List the full description of each collective beside the panel."""
    described = sorted({s.collective for s in samples if s.collective})
    if not described:
        return
    handles = [Patch(visible=False, label=textwrap.fill(d, 42)) for d in described]
    ax.legend(
        handles=handles,
        fontsize=6.5,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
        handlelength=0,
        handletextpad=0,
        title="collectives",
        title_fontsize=7,
        alignment="left",
    )


def _label_params(ax: Axes, checks: Sequence[_Check]) -> None:
    ax.set_xticks(range(len(checks)))
    ax.set_xticklabels(
        [f"{c.name} [DESYNC]" if c.flagged else c.name for c in checks],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    for label, c in zip(ax.get_xticklabels(), checks, strict=True):
        if c.flagged:
            label.set_color(DESYNC_COLOR)
            label.set_fontweight("bold")
    ax.set_xlim(-0.6, len(checks) - 0.4)


def _heading(checks: Sequence[_Check], nranks: int, tol: float) -> tuple[str, bool]:
    bad = [c.name for c in checks if c.flagged]
    head = f"gradient sync: {len(checks)} parameters on {nranks} ranks"
    if bad:
        return f"{head}\nDESYNC in {len(bad)}: {', '.join(bad)}", True
    replicated = sum(1 for c in checks if c.replicated)
    return f"{head}\nall {replicated} replicated gradients agree across ranks (tol {tol:g})", False


def step_lines(comm: CommStats | None, ranks: Sequence[int]) -> list[str]:
    """The step's collectives in words: ``this step (each rank): 1 all_sum, 16.0 KiB,
    0.4 ms, 2.5 GB/s (0.8x probe)`` when every rank did the same count and bytes (times
    are the mean over ranks), else one ``this step on rank r: ...`` line per rank; no
    line without ``comm``."""
    if comm is None:
        return []
    if _same_on_every_rank(comm, ranks):
        return [f"this step (each rank): {comm.line(None, each=True)}"]
    return [f"this step on rank {r}: {comm.line(r)}" for r in ranks]


def _same_on_every_rank(comm: CommStats, ranks: Sequence[int]) -> bool:
    """Every rank issued each op as often, with as many bytes."""
    for op in {row.op for row in comm.rows}:
        rows = [comm.of(op, r) for r in ranks]
        if any(row is None for row in rows):
            return False
        if len({(row.count, row.nbytes) for row in rows if row is not None}) > 1:
            return False
    return True


def gradsync_figure(samples: list[GradSample], *, tol: float = DEFAULT_TOL,
                    comm: CommStats | None = None) -> Figure:
    """Draw how gradients were synchronised across ranks.

    Three panels share the parameter axis: per-rank gradient norms before and after
    synchronisation; the largest element difference between ranks after
    synchronisation (replicated parameters that differ beyond ``tol`` are drawn red,
    with the value and ``DESYNC``); and the bytes each rank's collective moved.

    Args:
        samples: one sample per parameter and rank.
        tol: relative tolerance, see :func:`desynced`.
        comm: the step's timed collectives, added to the title (:func:`step_lines`).

    Returns:
        The new figure.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("no gradient samples to show")
    params, ranks = _params(samples), _ranks(samples)
    checks = _checks(samples, tol)
    width = min(28.0, max(8.0, 2.5 + len(params) * (0.35 + 0.2 * len(ranks))))
    fig = NotebookFigure(figsize=(width, 8.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    _draw_norms(axes[0], samples, params, ranks)
    _draw_diffs(axes[1], checks, tol)
    _draw_bytes(axes[2], samples, params, ranks)
    _label_params(axes[2], checks)
    for ax in axes:
        ax.tick_params(labelsize=7)
    heading, bad = _heading(checks, len(ranks), tol)
    heading = "\n".join([heading, *step_lines(comm, ranks)])
    fig.suptitle(heading, fontsize=10, color=DESYNC_COLOR if bad else "black")
    return fig


# --------------------------------------------------------------------------- text


def format_gradsync(samples: list[GradSample], *, tol: float = DEFAULT_TOL,
                    comm: CommStats | None = None) -> str:
    """Gradient synchronisation as a text table, for terminals.

    Args:
        samples: one sample per parameter and rank.
        tol: relative tolerance, see :func:`desynced`.
        comm: the step's timed collectives (:func:`step_lines`, before the verdict).

    Returns:
        One row per parameter and rank (kind, norms before and after, max diff,
        collective, bytes, check), :func:`no_bytes_note` when no row moved bytes,
        the step's collectives, and a verdict line naming desynced parameters.
    """
    checks = {c.name: c for c in _checks(samples, tol)}
    order = {n: i for i, n in enumerate(checks)}
    rows = []
    for s in sorted(samples, key=lambda s: (order[s.name], s.rank)):
        c = checks[s.name]
        verdict = "DESYNC" if c.flagged else ("ok" if c.replicated else "-")
        rows.append(
            [
                s.name,
                "replicated" if s.replicated else "sharded",
                str(s.rank),
                f"{s.norm_before:.6g}",
                f"{s.norm_after:.6g}",
                f"{s.max_diff_after:.3g}",
                s.collective or "-",
                human_bytes(s.nbytes),
                verdict,
            ]
        )
    headers = (
        "parameter",
        "kind",
        "rank",
        "norm before",
        "norm after",
        "max diff",
        "collective",
        "bytes",
        "check",
    )
    lines = text_table(headers, rows, align="llrrrrlrl")
    if samples and all(s.nbytes == 0 for s in samples):
        lines.append(no_bytes_note(samples))
    lines += step_lines(comm, _ranks(samples))
    bad = [c for c in checks.values() if c.flagged]
    if bad:
        names = ", ".join(f"{c.name} (max diff {c.max_diff:.3g})" for c in bad)
        lines.append(f"DESYNC (tol {tol:g} relative): {names}")
    else:
        n = sum(1 for c in checks.values() if c.replicated)
        lines.append(f"OK: all {n} replicated parameters agree across ranks (tol {tol:g})")
    return "\n".join(lines)
