"""The notebook's side of profiled cells: keep their records, align the clocks, probe
the backend, and answer ``timeline``, ``trace`` and ``comm_stats``.

The :class:`~mlx_nbdist.session.core.Session` facade owns one :class:`Profiles`. Before
the first profiled cell of a started session it measures, once, each rank's clock
offset (0 for ranks on this machine: they read the same clock) and the backend's
bandwidth for a small ``all_sum`` (:func:`mlx_nbdist.engine.profile.probe_bandwidth`).
After each profiled cell it takes the records the ranks published with the cell's
reply, with the cell's name (``In [7]``, from ``group.sources``) so that timelines and
traces name cells as the user sees them. The last :data:`KEEP` profiled cells are
kept; a restart forgets them. :meth:`Profiles.window` turns records of a window timed
inside a call (``gradsync``'s step) into statistics against the same probe.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import rpc
from ..engine.cells import PROFILE_KEY
from ..errors import NotStartedError
from ..timelines import (
    CellTimeline,
    ClockOffset,
    CommStats,
    NoProfileError,
    build,
    estimate_offset,
    write_trace,
)

if TYPE_CHECKING:
    from .core import Session

#: profiled cells kept per session (the last ones)
KEEP = 32
#: clock round trips per rank not on this machine (the shortest one counts)
CLOCK_SAMPLES = 8
#: seconds one clock round trip may take before the rank is called unreachable
CLOCK_TIMEOUT = 10.0

_WHY_OFF = (
    "the recorder is off by default because it evaluates every collective where it is "
    "issued (that serialises compute and communication, so a profiled cell can be slower)"
)


class Profiles:
    """The last profiled cells of one session, with its clock offsets and probe."""

    def __init__(self, session: Session, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"Profiles keep must be >= 1 profiled cell, got {keep}")
        self.session = session
        self.cells: deque[dict[int, dict[str, Any]]] = deque(maxlen=keep)
        self.offsets: dict[int, ClockOffset] = {}
        self.probe: dict[int, dict[str, Any]] = {}
        self.probe_gbps: float | None = None
        self._session_id = ""
        self._prepared = False

    # -- the session's calls -------------------------------------------------------------
    def prepare(self) -> None:
        """Measure clock offsets and the backend's bandwidth once per started session
        (call before a profiled cell is sent; later calls return at once)."""
        self._follow()
        if self._prepared:
            return
        s = self.session
        self.offsets = self.measure_offsets()
        answers = s.apply(rpc.probe_bandwidth)
        self.probe = {int(r): a for r, a in answers.items()}
        speeds = [a["gbps"] for a in self.probe.values() if a.get("gbps")]
        self.probe_gbps = statistics.median(speeds) if speeds else None
        self._prepared = True

    def measure_offsets(self) -> dict[int, ClockOffset]:
        """Each rank's clock offset: 0 on this machine, NTP-style elsewhere."""
        s = self.session
        out: dict[int, ClockOffset] = {}
        for r, place in s.places.items():
            if place.local:
                out[r] = ClockOffset()
                continue
            samples = []
            view = s.view([r])
            for _ in range(CLOCK_SAMPLES):
                t0 = time.time_ns()
                try:
                    tr = view.apply_async(rpc.profile_clock).get(timeout=CLOCK_TIMEOUT)
                except Exception as e:  # noqa: BLE001 - say which rank, whatever ipp raised
                    raise NotStartedError(
                        f"rank {r} did not answer a clock request within {CLOCK_TIMEOUT:g} s "
                        f"({type(e).__name__}: {e}); check %mlxdist status"
                    ) from e
                samples.append((t0, int(tr[0] if isinstance(tr, list) else tr), time.time_ns()))
            out[r] = estimate_offset(samples)
        return out

    def record(self, cell: int, futures: Mapping[int, Any]) -> int:
        """Keep what the ranks of ``cell`` published (from the cell's futures); returns
        how many ranks sent a record."""
        self._follow()
        got: dict[int, dict[str, Any]] = {}
        name = self._name_of(cell)
        for r, fut in futures.items():
            try:
                data = (fut.output.metadata["data"] or {}).get(PROFILE_KEY)
            except Exception:  # noqa: BLE001 - no output metadata (a dead rank): no record
                data = None
            if data and int(data.get("cell", -1)) == cell:
                got[int(r)] = {**data, "name": name} if name else data
        absent = sorted(int(r) for r in futures if int(r) not in got)
        if absent:  # said in the summary: a lane missing without a word misleads
            got = {r: {**p, "absent": absent} for r, p in got.items()}
        if got:
            self.cells.append(got)
        return len(got)

    def timeline(self, k: int = 1) -> CellTimeline:
        """The last ``k`` profiled cells as one timeline, clock-aligned."""
        return build(
            self._last(k, "timeline"), self.offsets, self.probe_gbps, str(self.session.backend)
        )

    def trace(self, path: str | os.PathLike[str], k: int = 1) -> Path:
        """Write the last ``k`` profiled cells as Chrome trace JSON to ``path``."""
        return write_trace(self.timeline(k), path)

    def stats(self, k: int = 1) -> CommStats:
        """Per-op and per-rank statistics of the collectives of the last ``k`` cells."""
        return self.timeline(k).stats

    def window(self, records: Mapping[int, Mapping[str, Any]], name: str = "") -> CellTimeline:
        """The timeline of one window the ranks timed inside a call (each rank's
        :func:`~mlx_nbdist.engine.profile.recording` record), named ``name`` (what the
        user called, e.g. ``gradsync('model')``), with the clock offsets and the probed
        bandwidth (measured first if need be: :meth:`prepare`); it is not kept among
        the profiled cells."""
        self.prepare()
        named = {r: {**p, "name": name} if name else dict(p) for r, p in records.items()}
        return build([named], self.offsets, self.probe_gbps, str(self.session.backend))

    # -- helpers -------------------------------------------------------------------------
    def _name_of(self, cell: int) -> str:
        """The cell's name as the session keeps it (``In [7]``); empty when unknown."""
        group = getattr(self.session, "group", None)
        source = getattr(group, "sources", {}).get(cell)
        return str(source[0]) if source else ""

    def _follow(self) -> None:
        """Forget everything when the session was (re)started since: new engines."""
        sid = self.session.session_id
        if sid != self._session_id:
            self.cells.clear()
            self.offsets, self.probe, self.probe_gbps = {}, {}, None
            self._prepared = False
            self._session_id = sid

    def _last(self, k: Any, what: str) -> list[dict[int, dict[str, Any]]]:
        if self.session.state == "stopped":
            raise NotStartedError(
                f"no session is running, so there is no {what} to show: start one with "
                "%mlxdist start -n N and run a cell with %%mlxdist --profile"
            )
        self._follow()
        if not self.cells:
            raise NoProfileError(
                f"no profiled cell yet: run a cell with %%mlxdist --profile (or "
                f"Session.run(code, profile=True)) first; {_WHY_OFF}"
            )
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(self.cells):
            raise ValueError(
                f"k={k!r}: there {'is' if len(self.cells) == 1 else 'are'} "
                f"{len(self.cells)} profiled cell(s) kept (the last {self.cells.maxlen}); "
                f"k must be a whole number from 1 to {len(self.cells)}"
            )
        return list(self.cells)[-k:]
