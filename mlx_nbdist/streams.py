"""Each rank's output of a running cell, as it arrives, in the order it was written.

The session hands every iopub message of a cell's request (see :mod:`._ipp`) to a
:class:`CellStreams`, from ipyparallel's IO thread. It keeps one :class:`RankStream`
per rank: an ordered list of output items (text of stdout and stderr, displays,
the last expression) that behaves like a notebook output area: ``\\r`` rewrites the
current line, a display with a ``display_id`` is updated in place, and
``clear_output`` (``wait=True`` too) clears the area. The notebook's live view and
API callbacks read it from the main thread (:meth:`CellStreams.take_events`).

Plain data: nothing here displays anything (that is :mod:`mlx_nbdist.viz.live`).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from .enums import TextEnum


class Kind(TextEnum):
    """What an :class:`OutputEvent` carries."""

    STDOUT = "stdout"
    STDERR = "stderr"
    DISPLAY = "display"
    UPDATE = "update_display"
    CLEAR = "clear_output"
    RESULT = "execute_result"


@dataclass
class OutputEvent:
    """One piece of a rank's output, as the rank produced it.

    Attributes:
        rank: the session's rank.
        kind: stdout/stderr text, a display (or an update of one), a clear, the
            cell's last expression.
        text: the text of a stream event.
        data: the MIME bundle of a display or result.
        metadata: its metadata.
        display_id: the display's id, when the rank gave one.
        wait: for a clear: wait for the next output before clearing.
    """

    rank: int
    kind: Kind
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    display_id: str | None = None
    wait: bool = False


@dataclass
class Item:
    """One entry of a rank's output area."""

    kind: Kind
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    display_id: str | None = None

    def shown(self) -> str:
        """The text as a terminal shows it (``\r`` rewrites its line)."""
        return apply_carriage_returns(self.text)


_LINE_REWRITE = re.compile(r"[^\n]*\r(?!\n)")


def apply_carriage_returns(text: str) -> str:
    """What a terminal shows: ``\\r`` (not before ``\\n``) returns to the line's start."""
    if "\r" not in text:
        return text
    text = text.replace("\r\n", "\n")
    return _LINE_REWRITE.sub("", text)


class RankStream:
    """The output area of one rank for one cell."""

    def __init__(self, rank: int):
        self.rank = rank
        self.items: list[Item] = []
        self._clear_pending = False
        #: bumped on every change: the view re-renders a rank whose version moved
        self.version = 0

    def apply(self, ev: OutputEvent) -> None:
        if ev.kind == Kind.CLEAR:
            if ev.wait:
                self._clear_pending = True
            else:
                self.items.clear()
            self.version += 1
            return
        if ev.kind == Kind.UPDATE:
            for item in self.items:
                if item.display_id == ev.display_id:
                    item.data, item.metadata = ev.data, ev.metadata
                    self.version += 1
            return  # an update of a display this area never showed is dropped, as in Jupyter
        if self._clear_pending:
            self.items.clear()
            self._clear_pending = False
        last = self.items[-1] if self.items else None
        if ev.kind in (Kind.STDOUT, Kind.STDERR):
            # kept as written: a ``\r`` line rewrite may span messages, so it is
            # applied when the text is shown (:meth:`Item.shown`)
            if last is not None and last.kind == ev.kind:
                last.text += ev.text
            else:
                self.items.append(Item(ev.kind, text=ev.text))
        else:
            self.items.append(
                Item(ev.kind, data=ev.data, metadata=ev.metadata, display_id=ev.display_id)
            )
        self.version += 1

    def text(self) -> str:
        """The area as plain text (displays by their ``text/plain`` form)."""
        out = []
        for item in self.items:
            if item.kind in (Kind.STDOUT, Kind.STDERR):
                out.append(item.shown())
            else:
                plain = item.data.get("text/plain", "")
                if item.kind == Kind.RESULT:
                    plain = f"Out[rank {self.rank}]: " + ("\n" if "\n" in plain else "") + plain
                out.append(plain + ("" if plain.endswith("\n") else "\n"))
        return "".join(out)


def event_of(rank: int, msg: dict[str, Any]) -> OutputEvent | None:
    """The output event an iopub message carries (``None`` for status, errors, ...)."""
    kind = msg.get("header", {}).get("msg_type") or msg.get("msg_type")
    content = msg.get("content", {})
    if kind == "stream":
        name = Kind.STDERR if content.get("name") == "stderr" else Kind.STDOUT
        return OutputEvent(rank, name, text=str(content.get("text", "")))
    if kind in ("display_data", "update_display_data", "execute_result"):
        transient = content.get("transient") or {}
        return OutputEvent(
            rank,
            {"display_data": Kind.DISPLAY, "update_display_data": Kind.UPDATE}.get(
                kind, Kind.RESULT
            ),
            data=dict(content.get("data") or {}),
            metadata=dict(content.get("metadata") or {}),
            display_id=transient.get("display_id"),
        )
    if kind == "clear_output":
        return OutputEvent(rank, Kind.CLEAR, wait=bool(content.get("wait")))
    return None


class CellStreams:
    """The output of every rank of one cell, fed from ipyparallel's IO thread."""

    def __init__(self, ranks: list[int]):
        self.ranks = {r: RankStream(r) for r in ranks}
        self._lock = threading.Lock()
        self._new: list[OutputEvent] = []
        #: set when output arrives: wakes whoever delivers it (the supervisor)
        self.changed = threading.Event()

    def feed(self, rank: int, msg: dict[str, Any]) -> None:
        """Called for each iopub message of ``rank``'s request (any thread)."""
        ev = event_of(rank, msg)
        if ev is None:
            return
        with self._lock:
            self.ranks[rank].apply(ev)
            self._new.append(ev)
        self.changed.set()

    def take_events(self) -> list[OutputEvent]:
        """The events since the last call (in arrival order)."""
        with self._lock:
            new, self._new = self._new, []
        return new

    def snapshot(self) -> dict[int, tuple[int, list[Item], str]]:
        """Per rank: version, a copy of its items, and its plain text."""
        with self._lock:
            return {
                r: (s.version, [Item(**vars(i)) for i in s.items], s.text())
                for r, s in self.ranks.items()
            }
