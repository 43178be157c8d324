"""One output area per rank under a ``%%mlxdist`` cell, updated as the ranks write.

Each rank's area is one display (a ``display_id`` per rank) that is updated in place
with everything the rank produced so far: stdout and stderr in the order written,
its figures and other displays (updated in place when the rank updates them, cleared
by ``clear_output``), and finally its last expression. Rank 0's lines therefore never
interleave with rank 1's, and a notebook saved after the cell holds exactly what
streamed. Areas appear in rank order, when a rank first writes something.

The areas are ``text/html`` with a ``text/plain`` twin (what a terminal, a log or
``nbconvert --to markdown`` shows).
"""

from __future__ import annotations

import html
import time
from typing import Any

from ..results import OK, CellResult
from ..streams import Item, Kind, OutputEvent, RankStream
from .common import rank_hex

#: at most this many re-renders of one rank's area per second while a cell runs
MAX_UPDATES_PER_SECOND = 50
#: and at most this many for all the cell's areas together: with many ranks each
#: area updates less often (2 ranks: every 0.02 s each, 8 ranks: every 0.08 s)
MAX_TOTAL_UPDATES_PER_SECOND = 100
#: a large area is re-sent whole on each update: at most this many bytes per second
#: per rank (a 1 MiB area then updates about every 0.5 s), so the browser keeps up
MAX_BYTES_PER_SECOND = 2_000_000


class LiveOutput:
    """The per-rank areas of one cell; feed it :class:`OutputEvent` s (main thread)."""

    def __init__(self, ranks: list[int], *, headers: bool = True, quiet: bool = False):
        self.streams = {r: RankStream(r) for r in ranks}
        self.headers = headers
        self.quiet = quiet
        self.status: dict[int, str] = dict.fromkeys(ranks, OK)
        self._finished = False
        self._handles: dict[int, Any] = {}
        self._shown: dict[int, int] = {}
        self._at: dict[int, float] = {}
        self._size: dict[int, int] = {}  # characters last sent, per rank

    def __call__(self, ev: OutputEvent) -> None:
        self.streams[ev.rank].apply(ev)
        self._render(ev.rank)

    def flush(self) -> None:
        """Show what a throttled update held back (called every tick)."""
        for r in self.streams:
            self._render(r)

    def finish(self, result: CellResult | None) -> None:
        """The final state of every area: statuses, and under ``quiet`` only the
        ranks that failed (the others' areas, streamed while the cell ran, are
        emptied)."""
        if result is not None:
            for r, out in result.ranks.items():
                if r in self.streams:
                    self.status[r] = out.status
        self._finished = True
        for r in self.streams:
            self._render(r, force=True)

    # -- rendering ---------------------------------------------------------------------
    def _visible(self, rank: int) -> bool:
        """Shown: what the rank wrote, while the cell runs; once it ended, under
        ``quiet``, only where the rank did not finish normally. An area made to keep
        the ranks in order that stayed empty shows its header if its rank failed."""
        if not self.streams[rank].items:
            return self._finished and self.status[rank] != OK and rank in self._handles
        return not (self.quiet and self._finished and self.status[rank] == OK)

    def _render(self, rank: int, force: bool = False) -> None:
        stream = self.streams[rank]
        key = hash((stream.version, self.status[rank], self._visible(rank)))
        if self._shown.get(rank) == key:
            return
        now = time.monotonic()
        # an update at once when the area was not rendered within its interval, else
        # held back: flush() (every poll; the supervisor polls finely while output
        # flows) shows it when the interval ends
        if not force and now - self._at.get(rank, 0.0) < self._interval(rank):
            return
        if rank not in self._handles and not self._visible(rank):
            return
        self._ensure_handles(rank)
        bundle = self._bundle(rank) if self._visible(rank) else {"text/plain": ""}
        self._handles[rank].update(bundle, raw=True)
        self._size[rank] = sum(len(v) for v in bundle.values())
        self._shown[rank] = key
        self._at[rank] = now

    def _interval(self, rank: int) -> float:
        """Seconds between two renders of ``rank``'s area: by the per-area and the
        total rate, longer for a large area (it is re-sent whole)."""
        shown = max(1, len(self._handles))
        return max(
            1.0 / MAX_UPDATES_PER_SECOND,
            shown / MAX_TOTAL_UPDATES_PER_SECOND,
            self._size.get(rank, 0) / MAX_BYTES_PER_SECOND,
        )

    def _ensure_handles(self, upto: int) -> None:
        """Areas in rank order: showing rank k first makes (empty) areas for the ranks
        before it that have none, so a later rank 0 still appears above rank 1."""
        from IPython.display import display

        for r in sorted(self.streams):
            if r > upto:
                break
            if r not in self._handles:
                self._handles[r] = display({"text/plain": ""}, raw=True, display_id=True)

    def _header(self, rank: int) -> str:
        status = self.status[rank]
        return f"[rank {rank}]" + ("" if status == OK else f" ({status})")

    def _bundle(self, rank: int) -> dict[str, str]:
        stream = self.streams[rank]
        plain = stream.text()
        parts = [_html_item(rank, item) for item in stream.items]
        if self.headers:
            plain = self._header(rank) + "\n" + plain
            style = f"font-weight:bold;font-family:monospace;padding:1px 4px;color:{rank_hex(rank)}"
            parts.insert(0, f'<div style="{style}">{html.escape(self._header(rank))}</div>')
        return {
            "text/plain": plain.rstrip("\n"),
            "text/html": f'<div class="mlx-nbdist-rank" data-rank="{rank}">{"".join(parts)}</div>',
        }


_PRE = "margin:0;padding:1px 4px;white-space:pre-wrap;word-break:break-all;"


def _html_item(rank: int, item: Item) -> str:
    if item.kind == Kind.STDOUT:
        return f'<pre style="{_PRE}">{html.escape(item.shown())}</pre>'
    if item.kind == Kind.STDERR:
        return f'<pre style="{_PRE}background:#fdd">{html.escape(item.shown())}</pre>'
    data = item.data
    prefix = ""
    if item.kind == Kind.RESULT:
        prefix = f'<span style="color:#d84315">Out[rank {rank}]:</span> '
    if "image/png" in data:
        png = str(data["image/png"]).replace("\n", "")
        return f'<div>{prefix}<img src="data:image/png;base64,{png}"/></div>'
    if "image/svg+xml" in data:
        return f"<div>{prefix}{data['image/svg+xml']}</div>"
    if "text/html" in data:
        return f"<div>{prefix}{data['text/html']}</div>"
    text = data.get("text/plain", "")
    return f'<pre style="{_PRE}">{prefix}{html.escape(str(text))}</pre>'
