"""Progress bars and streamed scalars from inside a ``%%mlxdist`` cell.

::

    %%mlxdist
    for step in mlx_nbdist.progress(range(100), desc="train"):
        loss = train_step()
        mlx_nbdist.log_scalars(loss=loss)      # an mx.array scalar or a number

On a rank, :func:`progress` and :func:`log_scalars` only write into the rank's
monitor state (:class:`~mlx_nbdist.engine.monitor.Monitor`), which the rank's monitor
thread publishes every 0.25 s; the notebook draws one bar per rank and a live plot
of the scalars from those files, even while the cell runs. Nothing is printed on
the rank, so the cell's output stays clean.

Anywhere else (plain Python, a terminal, the notebook's own process) the bar is a
text bar on stderr, and the scalars show after it (``loss=0.123``). Where that stream
is no terminal (a pipe, a log file, ``mlx.launch`` running an exported script) the bar
is written as whole lines, at most one every :data:`LINE_INTERVAL` seconds and its
last, with ``[rank r]`` in front in a group of several ranks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from . import state

#: seconds between two writes of a bar (rank state or text line); the end is always written
MIN_INTERVAL = 0.05
_TEXT_INTERVAL = 0.1
#: seconds between two lines of a bar written to something that is not a terminal
LINE_INTERVAL = 2.0
_PER_CELL: dict[int, int] = {}  # bars made so far in each cell: keys agree across ranks
_ACTIVE: list[Progress] = []


def _number(value: Any) -> float:
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)


class Progress:
    """An iterable progress bar (like ``tqdm``) that a rank publishes to the notebook.

    Args:
        iterable: what to iterate; ``None`` to drive the bar with :meth:`update`.
        desc: a label.
        total: number of steps (default ``len(iterable)`` when it has one).
        unit: what one step is called.
        file: where the text bar goes outside a rank (default ``sys.stderr``).
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        desc: str = "",
        total: int | None = None,
        unit: str = "it",
        file: IO[str] | None = None,
    ):
        self.iterable = iterable
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.postfix: dict[str, float] = {}
        self.started = time.time()
        self._t0 = time.monotonic()
        self._written = 0.0
        self.closed = False
        self.monitor = state.monitor()
        self.file = file
        cell = int(self.monitor.state.get("cell", 0)) if self.monitor is not None else 0
        index = _PER_CELL.get(cell, 0)
        _PER_CELL.clear()  # only the current cell's count matters
        _PER_CELL[cell] = index + 1
        self.key = f"c{cell}-{index}"
        self.cell = cell
        self._text_len = 0
        self._lines = 0
        _ACTIVE.append(self)
        self._write(force=True)

    # -- iteration ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this progress bar has no iterable: call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no total")
        return self.total

    # -- updates --------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps."""
        self.n += n
        self._write()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._write(force=True)

    def log(self, step: int | None = None, **scalars: Any) -> None:
        """Stream scalars (e.g. ``loss=...``); see :func:`log_scalars`."""
        log_scalars(step=step, **scalars)

    def close(self) -> None:
        """Mark the bar finished and write it a last time."""
        if self.closed:
            return
        self.closed = True
        self._write(force=True)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    @property
    def rate(self) -> float | None:
        el = self.elapsed
        return self.n / el if el > 0 and self.n else None

    def record(self) -> dict[str, Any]:
        """The bar as the rank publishes it."""
        return {
            "desc": self.desc,
            "n": self.n,
            "total": self.total,
            "unit": self.unit,
            "rate": self.rate,
            "elapsed": self.elapsed,
            "started": self.started,
            "updated": time.time(),
            "done": self.closed,
            "cell": self.cell,
            "postfix": dict(self.postfix),
        }

    # -- output ----------------------------------------------------------------------
    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        interval = MIN_INTERVAL if self.monitor is not None else _TEXT_INTERVAL
        if not force and now - self._written < interval:
            return
        self._written = now
        if self.monitor is not None:
            self.monitor.set_progress(self.key, self.record())
            return
        out = self.file or sys.stderr
        if not _is_terminal(out):
            self._write_line(out, now)
            return
        line = format_bar(self.record())
        pad = max(0, self._text_len - len(line))
        self._text_len = len(line)
        out.write("\r" + line + " " * pad + ("\n" if self.closed else ""))
        out.flush()


    def _write_line(self, out: IO[str], now: float) -> None:
        """One whole line: the first, the last, and one per :data:`LINE_INTERVAL`."""
        if self._lines and not self.closed and now - self._written < LINE_INTERVAL:
            return
        self._written = now
        self._lines += 1
        out.write(_rank_prefix() + format_bar(self.record()) + "\n")
        out.flush()


def _is_terminal(out: IO[str]) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _rank_prefix() -> str:
    """``[rank r] `` in a group of several ranks (a script under mlx.launch), else ``""``."""
    if not state.started():
        return ""
    st = state.current()
    return f"[rank {st.rank}] " if st.size > 1 else ""


def progress(
    iterable: Iterable[Any] | None = None,
    desc: str = "",
    total: int | None = None,
    unit: str = "it",
    file: IO[str] | None = None,
) -> Progress:
    """A progress bar over ``iterable``: one bar per rank in the notebook.

    Used inside a ``%%mlxdist`` cell it publishes through the rank's monitor and the
    notebook shows a bar per rank under the cell (and on the dashboard); anywhere
    else it is a text bar on ``file`` (default stderr).

    Args:
        iterable: what to iterate (``None``: call ``.update(n)`` yourself).
        desc: a label, e.g. ``"train"``.
        total: number of steps, when ``len(iterable)`` does not say.
        unit: what one step is called.
        file: the text bar's stream outside a rank.

    Returns:
        A :class:`Progress`, to iterate or use as a context manager.
    """
    return Progress(iterable, desc=desc, total=total, unit=unit, file=file)


def log_scalars(step: int | None = None, **scalars: Any) -> None:
    """Stream named scalars (``loss=...``) to the notebook's live plot, per rank.

    Values may be numbers or MLX/numpy scalars (``.item()`` is called, which
    evaluates an MLX array). ``step`` defaults to one more than the last point of
    each name. Outside a rank, the values are shown after the active text bar.
    """
    values = {k: _number(v) for k, v in scalars.items()}
    mon = state.monitor()
    if mon is not None:
        mon.add_scalars(values, step)
    if _ACTIVE:
        bar = _ACTIVE[-1]
        bar.postfix.update(values)
        bar._write(force=mon is None)


def bar_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """The parts of a published bar's text: ``frac`` (or None), ``counts``, ``timing``, ``post``."""
    n, total = int(rec.get("n") or 0), rec.get("total")
    unit = rec.get("unit") or "it"
    rate = rec.get("rate")
    timing = f"{_duration(rec.get('elapsed') or 0.0)}"
    if rate:
        timing += f", {rate:.3g} {unit}/s"
        if total and n < total:
            timing += f", {_duration((total - n) / rate)} left"
    post = " ".join(f"{k}={v:.4g}" for k, v in (rec.get("postfix") or {}).items())
    return {
        "desc": rec.get("desc") or "",
        "frac": min(1.0, n / total) if total else None,
        "counts": f"{n}/{total}" if total else f"{n} {unit}",
        "timing": timing,
        "post": post,
    }


def format_bar(rec: dict[str, Any], width: int = 24) -> str:
    """One line of text for a published bar, e.g. ``train: 45%|███  | 45/100 [...]``."""
    f = bar_fields(rec)
    desc = f"{f['desc']}: " if f["desc"] else ""
    if f["frac"] is not None:
        fill = int(round(f["frac"] * width))
        bar = "█" * fill + " " * (width - fill)
        text = f"{desc}{f['frac'] * 100:3.0f}%|{bar}| {f['counts']} [{f['timing']}]"
    else:
        text = f"{desc}{f['counts']} [{f['timing']}]"
    return f"{text} {f['post']}".rstrip()


def _duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    if m < 60:
        return f"{m}:{s:02d}"
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"
