"""Per-rank progress bars and live scalar plots in the notebook.

The ranks publish their bars and scalars (``mlx_nbdist.progress`` /
``mlx_nbdist.log_scalars``, see :mod:`mlx_nbdist.engine.progress`) in their status
files; this module draws them:

* :class:`ProgressPanel` - ipywidgets: one ``FloatProgress`` per rank and bar, and a
  small SVG line plot per scalar with one line per rank. Its state can be read as
  plain values (:meth:`ProgressPanel.values`), which is how it is tested.
* :class:`LiveCell` - what ``%%mlxdist`` passes as ``on_tick`` to
  :meth:`~mlx_nbdist.session.Session.run`: it shows the panel under the cell the
  first time a rank publishes a bar or a scalar in this cell (nothing otherwise),
  updates it every tick, and can be asked to interrupt the cell (the dashboard's
  interrupt button does that); outside Jupyter it writes a text line instead.
"""

from __future__ import annotations

import html
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..engine.progress import bar_fields, format_bar
from .common import rank_hex

# (rank -> record) per bar key, and (rank -> [[step, value, cell], ...]) per scalar name
Bars = dict[str, dict[int, dict[str, Any]]]
Scalars = dict[str, dict[int, list[list[float]]]]


# --------------------------------------------------------------------------- data


def collect(
    records: dict[int, dict[str, Any]], cell: int | None = None
) -> tuple[Bars, Scalars]:
    """Group the ranks' published bars by key and scalars by name.

    Args:
        records: each rank's raw status record (``Session.rank_record``).
        cell: keep only bars and points of this cell (``None``: bars of each
            rank's latest cell, and every point).
    """
    bars: Bars = {}
    scalars: Scalars = {}
    for r, rec in sorted(records.items()):
        entries = rec.get("progress") or {}
        if cell is None and entries:
            latest = max(int(e.get("cell", 0)) for e in entries.values())
            wanted = latest
        else:
            wanted = cell
        for key, e in entries.items():
            if int(e.get("cell", 0)) == wanted:
                bars.setdefault(key, {})[r] = e
        for name, points in (rec.get("scalars") or {}).items():
            pts = [p for p in points if cell is None or int(p[2]) == cell]
            if pts:
                scalars.setdefault(name, {})[r] = pts
    order = sorted(bars, key=lambda k: min(e.get("started", 0) for e in bars[k].values()))
    return {k: bars[k] for k in order}, scalars


def bar_text(rec: dict[str, Any]) -> str:
    """The text beside a bar: ``45/100 [3.2s, 12 it/s, 4.6s left] loss=0.1``."""
    f = bar_fields(rec)
    return f"{f['counts']} [{f['timing']}] {f['post']}".rstrip()


# --------------------------------------------------------------------------- plot


def scalar_svg(
    name: str, series: dict[int, list[list[float]]], width: int = 360, height: int = 140
) -> str:
    """A small line plot of one scalar, one line per rank, as an SVG string."""
    pad_l, pad_r, pad_t, pad_b = 46, 8, 18, 16
    clean = {
        r: [(float(p[0]), float(p[1])) for p in pts if math.isfinite(float(p[1]))]
        for r, pts in sorted(series.items())
    }
    clean = {r: pts for r, pts in clean.items() if pts}
    title = html.escape(name)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'class="mlxdist-plot" data-name="{title}" '
        'style="font: 10px sans-serif; background: #fff">',
        f'<text x="{pad_l}" y="12" font-weight="bold">{title}</text>',
    ]
    if not clean:
        parts.append("</svg>")
        return "".join(parts)
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.05 or 0.5), y1 + (abs(y1) * 0.05 or 0.5)
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return pad_t + (1 - (y - y0) / (y1 - y0)) * h

    parts.append(
        f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>'
    )
    parts.append(f'<text x="{pad_l - 3}" y="{pad_t + 8}" text-anchor="end">{y1:.4g}</text>')
    parts.append(f'<text x="{pad_l - 3}" y="{pad_t + h}" text-anchor="end">{y0:.4g}</text>')
    parts.append(f'<text x="{pad_l}" y="{height - 3}">{x0:g}</text>')
    parts.append(f'<text x="{pad_l + w}" y="{height - 3}" text-anchor="end">{x1:g}</text>')
    lx = pad_l + 60
    for r, pts in clean.items():
        color = rank_hex(r)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5" '
            f'data-rank="{r}"/>'
        )
        if len(pts) == 1:
            cx, cy = sx(pts[0][0]), sy(pts[0][1])
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2" fill="{color}"/>')
        parts.append(
            f'<text x="{lx}" y="12" fill="{color}">rank {r}: {pts[-1][1]:.4g}</text>'
        )
        lx += 80
    parts.append("</svg>")
    return "".join(parts)


# --------------------------------------------------------------------------- widgets


class ProgressPanel:
    """One bar per rank for each published progress bar, and a plot per scalar.

    Attributes:
        widget: the ``ipywidgets.VBox`` to display (CSS class ``mlxdist-progress``).
    """

    def __init__(self) -> None:
        import ipywidgets as w

        self._w = w
        self.bars_box = w.VBox()
        self.plots = w.HTML()
        self.plots.add_class("mlxdist-plots")
        self.widget = w.VBox([self.bars_box, self.plots])
        self.widget.add_class("mlxdist-progress")
        self._rows: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._titles: dict[str, Any] = {}
        self._values: dict[str, dict[int, dict[str, Any]]] = {}
        self._scalars: dict[str, dict[int, float]] = {}
        self._lock = threading.Lock()

    @property
    def empty(self) -> bool:
        return not self._values and not self._scalars

    def update(self, bars: Bars, scalars: Scalars, states: dict[int, str] | None = None) -> None:
        """Show ``bars`` and ``scalars`` (see :func:`collect`); ``states`` colours failures."""
        w = self._w
        states = states or {}
        with self._lock:
            children = []
            for key, per_rank in bars.items():
                title = self._titles.get(key)
                desc = next((e.get("desc") for e in per_rank.values() if e.get("desc")), "")
                if title is None:
                    title = self._titles[key] = w.HTML()
                title.value = f"<b>{html.escape(desc or 'progress')}</b>"
                children.append(title)
                for r, rec in sorted(per_rank.items()):
                    children.append(self._row(key, r, rec, states.get(r, "")))
            if [id(c) for c in self.bars_box.children] != [id(c) for c in children]:
                self.bars_box.children = children
            self._values = {
                k: {r: _bar_value(e) for r, e in per.items()} for k, per in bars.items()
            }
            svg = "".join(scalar_svg(name, series) for name, series in scalars.items())
            if self.plots.value != svg:
                self.plots.value = svg
            self._scalars = {
                name: {r: float(pts[-1][1]) for r, pts in series.items()}
                for name, series in scalars.items()
            }

    def _row(self, key: str, rank: int, rec: dict[str, Any], state: str) -> Any:
        w = self._w
        if (key, rank) not in self._rows:
            label = w.HTML(
                f'<span style="color:{rank_hex(rank)}; font-weight:bold">rank {rank}</span>',
                layout=w.Layout(width="60px"),
            )
            bar = w.FloatProgress(min=0.0, max=1.0, layout=w.Layout(width="40%"))
            text = w.Label()
            row = w.HBox([label, bar, text])
            row.add_class("mlxdist-bar")
            self._rows[(key, rank)] = (row, (bar, text))
        row, (bar, text) = self._rows[(key, rank)]
        total, n = rec.get("total"), float(rec.get("n") or 0)
        bar.max = float(total) if total else max(1.0, n)
        bar.value = min(n, bar.max)
        if state in ("error", "dead", "broken", "hung"):
            bar.bar_style = "danger"
        elif rec.get("done"):
            bar.bar_style = "success"
        else:
            bar.bar_style = "info" if not total else ""
        text.value = bar_text(rec)
        return row

    def values(self) -> dict[str, Any]:
        """The panel's state as plain values: bars per key and rank, last scalar values."""
        with self._lock:
            return {"bars": dict(self._values), "scalars": dict(self._scalars)}

    def text(self) -> str:
        """A plain-text rendering (the fallback for front ends without widgets)."""
        lines = []
        for per in self._values.values():
            for r, v in sorted(per.items()):
                lines.append(f"[rank {r}] {v['text']}")
        for name, per in self._scalars.items():
            lines.append(name + ": " + ", ".join(f"rank {r} {v:.4g}" for r, v in per.items()))
        return "\n".join(lines)


def _bar_value(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "desc": rec.get("desc", ""),
        "n": int(rec.get("n") or 0),
        "total": rec.get("total"),
        "done": bool(rec.get("done")),
        "text": format_bar(rec),
    }


# --------------------------------------------------------------------------- live cell

_RUNNING: weakref.WeakValueDictionary[int, LiveCell] = weakref.WeakValueDictionary()


def running_cell(session: Any) -> LiveCell | None:
    """The :class:`LiveCell` of the ``%%mlxdist`` cell running on ``session``, if any."""
    return _RUNNING.get(id(session))


def frontend_mode() -> str:
    """``widget`` inside a Jupyter kernel, ``text`` elsewhere (a terminal, plain Python)."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:  # pragma: no cover - IPython is a dependency
        return "text"
    return "widget" if getattr(ip, "kernel", None) is not None else "text"


class LiveCell:
    """Live per-rank progress of one running ``%%mlxdist`` cell (its ``on_tick``).

    Args:
        session: the session running the cell.
        mode: ``widget``, ``text`` or ``off`` (default: :func:`frontend_mode`).
        display: how a widget is shown (default ``IPython.display.display``).
        stream: where text mode writes (default stderr).
    """

    def __init__(
        self,
        session: Any,
        mode: str | None = None,
        display: Callable[[Any], Any] | None = None,
        stream: Any = None,
    ):
        self.session = session
        self.mode = mode or frontend_mode()
        self._display = display
        self.stream = stream
        self.panel: ProgressPanel | None = None
        self.shown = False
        self.ticks = 0
        self.interrupt_requested = threading.Event()
        self.interrupt_delivered = threading.Event()
        self._after: list[Callable[[], None]] = []
        self._text_at = 0.0
        self._text_len = 0
        self.cell: int | None = None
        self._before = 0  # the session's last cell when this one was entered

    def __enter__(self) -> LiveCell:
        _RUNNING[id(self.session)] = self
        self._before = self.session.cell
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.finish()
        finally:
            if _RUNNING.get(id(self.session)) is self:
                del _RUNNING[id(self.session)]
            after, self._after = self._after, []
            for fn in after:
                fn()

    # -- control ------------------------------------------------------------------
    def request_interrupt(self) -> None:
        """Interrupt the cell at the next tick, as Jupyter's stop button does."""
        self.interrupt_requested.set()

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the cell's thread once the cell has ended (stop, restart)."""
        self._after.append(fn)

    # -- ticks --------------------------------------------------------------------
    def __call__(self) -> None:
        self.tick()

    def tick(self) -> None:
        """Called by the session every 0.25 s while the cell runs."""
        self.ticks += 1
        if self.interrupt_requested.is_set() and not self.interrupt_delivered.is_set():
            self.interrupt_delivered.set()
            # the supervisor treats this like the kernel's interrupt: SIGINT the ranks,
            # a short grace, then end the ones still running
            raise KeyboardInterrupt("interrupted from the mlx_nbdist dashboard")
        if self.mode == "off":
            return
        self._refresh()

    def finish(self) -> None:
        """A last update once the cell has ended (bars show their final counts)."""
        if self.mode == "off" or self.session.directory is None:
            return
        if self.shown:
            t_end = time.monotonic() + 1.0
            while time.monotonic() < t_end and not self._all_done():
                time.sleep(0.1)
        elif not self.session.published_in(self._cell()):
            return  # nothing shown, and no bar or scalar to show
        self._refresh(final=True)

    def _records(self) -> dict[int, dict[str, Any]]:
        s = self.session
        if s.directory is None:
            return {}
        return {r: s.rank_record(r) for r in range(s.n)}

    def _all_done(self) -> bool:
        bars, _ = collect(self._records(), self._cell())
        return all(e.get("done") for per in bars.values() for e in per.values())

    def _cell(self) -> int:
        """This cell's number; -1 (no bars) while it was not sent to the ranks (a
        cell that failed before dispatch must not show the previous cell's bars)."""
        if self.cell is None:
            if self.session.cell <= self._before:
                return -1
            self.cell = self.session.cell
        return self.cell

    def _refresh(self, final: bool = False) -> None:
        records = self._records()
        bars, scalars = collect(records, self._cell())
        if not bars and not scalars:
            return
        states = {r: rec.get("state", "") for r, rec in records.items()}
        if self.mode == "widget":
            if self.panel is None:
                self.panel = ProgressPanel()
            self.panel.update(bars, scalars, states)
            if not self.shown:
                self.shown = True
                show = self._display or _ipython_display
                show(self.panel.widget)
        elif self.mode == "text":
            self._text(bars, scalars, final)

    def _text(self, bars: Bars, scalars: Scalars, final: bool) -> None:
        now = time.monotonic()
        if not final and now - self._text_at < 0.5:
            return
        self._text_at = now
        parts = []
        for per in bars.values():
            for r, e in sorted(per.items()):
                total = f"/{e['total']}" if e.get("total") else ""
                parts.append(f"[rank {r}] {e.get('desc') or 'progress'} {e.get('n', 0)}{total}")
        for name, per in scalars.items():
            parts.append(name + " " + " ".join(f"r{r}={p[-1][1]:.4g}" for r, p in per.items()))
        line = " | ".join(parts)
        out = self.stream or sys.stderr
        pad = max(0, self._text_len - len(line))
        self._text_len = len(line)
        out.write("\r" + line + " " * pad + ("\n" if final else ""))
        out.flush()
        self.shown = True


def _ipython_display(widget: Any) -> None:
    from IPython.display import display

    display(widget)
