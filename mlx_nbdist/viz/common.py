"""What every figure and table of :mod:`mlx_nbdist.viz` shares.

The one source of rank colours (:func:`rank_color` for matplotlib, :func:`rank_hex`
for HTML and SVG), byte counts in words, aligned text tables, and a matplotlib figure
that shows itself in Jupyter without pyplot. Only matplotlib's colour tables are used
here: importing this module loads no pyplot and no backend.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib
from matplotlib import colors as mcolors
from matplotlib.figure import Figure

#: Red of headings, labels and table cells that report a problem.
WARN_COLOR = "#b00020"


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


def rank_hex(rank: int) -> str:
    """:func:`rank_color` as ``#rrggbb``, for HTML and SVG (progress bars, rank areas)."""
    return "#{:02x}{:02x}{:02x}".format(*(int(round(c * 255)) for c in rank_color(rank)))


def text_color(background: tuple[float, ...]) -> str:
    """``white`` or ``black``, whichever reads better on an RGB ``background``."""
    r, g, b = background[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


# --------------------------------------------------------------------------- text


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


def text_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = ""
) -> list[str]:
    """Rows aligned under their headers, for terminals.

    Args:
        headers: the column titles.
        rows: the cells, one sequence per row.
        align: ``l`` or ``r`` per column (missing columns: ``l``).

    Returns:
        The header line, a line of dashes, then one line per row (trailing blanks
        stripped).
    """
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    align = align.ljust(len(headers), "l")

    def fmt(cells: Sequence[str]) -> str:
        out = [
            str(c).rjust(w) if a == "r" else str(c).ljust(w)
            for c, w, a in zip(cells, widths, align, strict=False)
        ]
        return "  ".join(out).rstrip()

    return [fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]
