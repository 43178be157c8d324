"""Per-rank timelines of profiled cells, their statistics and Chrome trace export.

Pure functions over the plain data that profiled cells publish (one record per rank
and cell, see :mod:`mlx_nbdist.engine.profile`): no MLX, no session.

What is measured (and what is not): in a profiled cell each collective is evaluated
where it is issued. Per collective a rank records ``t_ready`` (its inputs were
computed: it could take part) and ``t_done`` (the collective finished here). A
collective runs only when every rank has arrived, so for the k-th collective of a
cell the rank with the latest ``t_ready`` is *the rank everyone waited for*, and
each rank's wait is that last arrival minus its own ``t_ready``; the rest,
``t_done - last arrival``, is the transfer, and ``bytes / transfer`` the effective
bandwidth. Everything between collectives is *compute* (including Python and
anything the cell evaluated itself); between two cells a rank is *idle*. A collective
issued inside ``mx.compile`` / ``mx.vmap`` is *untimed*: only its issue is known and
it is never drawn as a duration. Profiling serialises compute and communication, so
these are the profiled run's times, not those of the same cell unprofiled.

Cells are named as the user sees them: a record's ``name`` (the session puts the
cell's name there, ``In [7]`` from the magic) labels its lanes, summary, table and
trace events; without one a cell is ``cell N`` (the session's count of cells).

Clocks: ranks on this machine share its clock (offset 0); for others the notebook
estimates each rank's offset from clock round trips (:func:`estimate_offset`, the
sample with the smallest round trip, as NTP does), and waits shorter than that
uncertainty are not attributed to anyone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .enums import TextEnum
from .errors import NoProfileError

#: ops that pair two ranks rather than the whole group
P2P = ("send", "recv", "recv_like")
#: waits shorter than this (seconds) are noise: nobody is "waited for"
WAIT_NOISE = 1e-4


class SegmentKind(TextEnum):
    """What a rank was doing during one segment of its lane."""

    COMPUTE = "compute"
    #: in a collective, waiting for the last rank to arrive (``waited_for``), or in one
    #: the other ranks did not match in the cell (``waited_for`` ``None``: no transfer)
    WAIT = "wait"
    #: in a group collective after every rank arrived: moving data
    COLLECTIVE = "collective"
    SEND = "send"
    RECV = "recv"
    #: between two profiled cells
    IDLE = "idle"
    #: a collective issued inside mx.compile / mx.vmap: an instant, never a duration
    UNTIMED = "untimed"


@dataclass(frozen=True)
class ClockOffset:
    """A rank's clock minus the notebook's, and how sure we are (both seconds)."""

    offset: float = 0.0
    uncertainty: float = 0.0


def estimate_offset(samples: Iterable[tuple[int, int, int]]) -> ClockOffset:
    """NTP-style offset from ``(t_send, t_rank, t_reply)`` samples (nanoseconds: the
    notebook's clock before asking, the rank's answer, the notebook's clock after).

    The sample with the smallest round trip wins: the rank read its clock somewhere in
    that round trip, so the offset is ``t_rank - midpoint`` within half of it.
    """
    rows = [(int(a), int(b), int(c)) for a, b, c in samples]
    if not rows:
        raise ValueError("estimate_offset needs at least one (t_send, t_rank, t_reply) sample")
    bad = [r for r in rows if r[2] < r[0]]
    if bad:
        raise ValueError(f"a clock sample replied before it was sent: {bad[0]}")
    t0, tr, t1 = min(rows, key=lambda r: r[2] - r[0])
    return ClockOffset((tr - (t0 + t1) / 2) / 1e9, (t1 - t0) / 2e9)


@dataclass
class Segment:
    """One stretch of one rank's lane (times in seconds from the timeline's origin)."""

    rank: int
    kind: SegmentKind
    start: float
    end: float
    cell: int
    op: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    nbytes: int = 0
    peer: int | None = None
    #: 1-based number of the collective among those the rank issued in the cell
    index: int = 0
    #: the rank that arrived last at this collective (``None``: nobody waited)
    waited_for: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    def label(self) -> str:
        """``all_sum (64, 1024) float32, 256.0 KiB`` or the kind's name."""
        if not self.op:
            return str(self.kind)
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return f"{self.op}{peer} {tuple(self.shape)} {self.dtype}, {_bytes(self.nbytes)}"


@dataclass
class Collective:
    """The k-th group collective of a cell (or one send/recv pair), across ranks."""

    cell: int
    op: str
    shape: tuple[int, ...]
    nbytes: int
    #: each rank's ``t_ready`` and ``t_done`` (seconds from the origin)
    ready: dict[int, float]
    done: dict[int, float]
    #: the rank that arrived last, when it kept another waiting longer than the noise
    waited_for: int | None
    #: each rank's wait for the last arrival (seconds)
    waits: dict[int, float]

    @property
    def last_arrival(self) -> float:
        return max(self.ready.values())


@dataclass
class OpStats:
    """One op's collectives on one rank (``rank`` ``None``: the group's: ``count`` and
    ``nbytes`` of any rank for a group collective, of all ranks for messages; times
    and shares are per-rank means)."""

    op: str
    rank: int | None
    count: int
    nbytes: int
    #: seconds in the collective (``t_done - t_ready``), of which ``wait`` waiting
    time: float
    wait: float
    #: seconds moving data (``t_done - last arrival``)
    transfer: float
    #: share of the cell's time (of this rank; ``rank`` ``None``: mean over ranks)
    share: float
    #: ``nbytes / transfer`` in GB/s (``None`` when nothing was timed)
    gbps: float | None
    #: ``gbps`` over the backend's probed bandwidth (``None`` without a probe)
    ratio: float | None


@dataclass
class CommStats:
    """Per-op and per-rank statistics of the collectives of one or more cells."""

    cells: list[int]
    backend: str
    probe_gbps: float | None
    rows: list[OpStats] = field(default_factory=list)
    #: each cell's name as the user saw it (``In [7]``), where it has one
    names: dict[int, str] = field(default_factory=dict)
    #: collectives issued inside ``mx.compile`` / ``mx.vmap`` (once for the group, as
    #: the rows count group collectives): counted nowhere else
    untimed: int = 0

    def of(self, op: str, rank: int | None = None) -> OpStats | None:
        """The row of ``op`` on ``rank`` (``None``: over all ranks)."""
        return next((r for r in self.rows if r.op == op and r.rank == rank), None)

    def line(self, rank: int | None = None, *, each: bool = False) -> str:
        """One line of ``rank``'s collectives (``None``: the all-ranks rows), e.g.
        ``2 all_sum, 1.0 MiB, 0.4 ms, 2.5 GB/s (0.8x probe)``, ops joined by semicolons.
        ``each``: the all-ranks rows as one rank's, where every rank did the same
        (messages are then the group's count and bytes over the ranks)."""
        parts = []
        for r in self.rows:
            if r.rank != rank:
                continue
            count, nbytes = r.count, r.nbytes
            if each and rank is None and r.op in P2P:
                k = sum(1 for x in self.rows if x.op == r.op and x.rank is not None) or 1
                count, nbytes = count // k, nbytes // k
            text = f"{count} {r.op}, {_bytes(nbytes)}, {format_seconds(r.time)}"
            if r.gbps is not None:
                text += f", {r.gbps:.3g} GB/s"
                if r.ratio is not None:
                    text += f" ({r.ratio:.2g}x probe)"
            parts.append(text)
        if self.untimed:
            parts.append(f"{self.untimed} issued inside mx.compile/vmap (not timed)")
        return "; ".join(parts) or "no collective"

    def table(self) -> str:
        """An aligned text table, the all-ranks row of each op first."""
        head = ["op", "rank", "count", "bytes", "time", "waiting", "share", "GB/s", "vs probe"]
        body = [
            [
                r.op,
                "all" if r.rank is None else str(r.rank),
                str(r.count),
                _bytes(r.nbytes),
                format_seconds(r.time),
                format_seconds(r.wait),
                f"{r.share:.0%}",
                "-" if r.gbps is None else f"{r.gbps:.3g}",
                "-" if r.ratio is None else f"{r.ratio:.0%}",
            ]
            for r in self.rows
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in [head, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        probe = "no probe" if self.probe_gbps is None else f"probe {self.probe_gbps:.3g} GB/s"
        where = cells_label(self.cells, self.names)
        return f"collectives of {where} on {self.backend} ({probe})\n" + (
            "\n".join(lines) if self.rows else "(no timed collective)"
        )

    __str__ = table


@dataclass
class CellTimeline:
    """One lane per rank over one or more profiled cells, clock-aligned.

    Times are seconds from ``origin_ns`` (the earliest cell start, on the notebook's
    clock, nanoseconds since the epoch).
    """

    cells: list[int]
    ranks: list[int]
    backend: str
    origin_ns: int
    lanes: dict[int, list[Segment]]
    collectives: list[Collective]
    #: each rank's [start, end] of each cell
    spans: dict[int, list[tuple[int, float, float]]]
    #: seconds per rank: computing, in collectives (waits included), waiting
    compute: dict[int, float]
    comm: dict[int, float]
    wait: dict[int, float]
    #: the rank that kept the others waiting longest (``None``: nobody waited)
    waited_for: int | None
    #: the rank that computed longest (``None``: a single rank)
    slowest: int | None
    stats: CommStats
    clock_uncertainty: float = 0.0
    untimed: int = 0
    dropped: int = 0
    #: each cell's name as the user saw it (``In [7]``), where it has one
    names: dict[int, str] = field(default_factory=dict)
    #: per cell, the ranks that ran it but sent no record (their cell failed or was
    #: ended before it finished): they have no lane
    absent: dict[int, list[int]] = field(default_factory=dict)

    def label(self, cell: int) -> str:
        """How the user knows ``cell``: its name (``In [7]``), else ``cell N``."""
        return self.names.get(cell) or f"cell {cell}"

    @property
    def duration(self) -> float:
        """Seconds from the first cell's start to the last one's end, over all ranks."""
        return max((e for s in self.spans.values() for _, _, e in s), default=0.0)

    def caused(self) -> dict[int, float]:
        """Seconds the other ranks spent waiting for each rank, summed."""
        out = dict.fromkeys(self.ranks, 0.0)
        for c in self.collectives:
            if c.waited_for is not None:
                out[c.waited_for] += sum(c.waits.values())
        return out

    def summary(self) -> str:
        """One line: where the time went (e.g. ``In [7]: 40 % all_sum at 0.6 GB/s on
        ring (probe: 0.8 GB/s), 30 % waiting for rank 1; slowest rank 1 ...``)."""
        head = cells_label(self.cells, self.names)
        ops = [r for r in self.stats.rows if r.rank is None]
        if not ops:
            what = "no timed collective"
            if self.untimed:
                what += f" ({self.untimed} issued inside mx.compile/vmap: not timed)"
            parts = [f"{head}: {what}"]
        else:
            top = max(ops, key=lambda r: r.time)
            bw = "" if top.gbps is None else f" at {top.gbps:.3g} GB/s"
            probe = (
                "" if self.stats.probe_gbps is None
                else f" (probe: {self.stats.probe_gbps:.3g} GB/s)"
            )
            parts = [f"{head}: {top.share:.0%} {top.op}{bw} on {self.backend}{probe}"]
            others = [r for r in ops if r is not top and r.share >= 0.01]
            if others:
                parts[0] += ", " + ", ".join(f"{r.share:.0%} {r.op}" for r in others)
        total = _mean([_busy(s) for s in self.spans.values()])
        waiting = _mean(list(self.wait.values())) / total if total > 0 else 0.0
        if self.waited_for is not None and waiting >= 0.005:
            parts.append(f"{waiting:.0%} waiting, mostly for rank {self.waited_for}")
        alone = _mean([sum(s.duration for s in lane if s.kind == SegmentKind.WAIT
                           and s.waited_for is None) for lane in self.lanes.values()])
        if total > 0 and alone / total >= 0.005:
            parts.append(f"{alone / total:.0%} in collectives the other ranks did not match "
                         "in this cell (they failed, skipped them or issued others; a drain "
                         "may have released them)")
        if self.slowest is not None:
            busy = _busy(self.spans[self.slowest])
            parts.append(
                f"slowest rank {self.slowest} (compute "
                f"{format_seconds(self.compute[self.slowest])} of {format_seconds(busy)})"
            )
        if self.clock_uncertainty > WAIT_NOISE:
            parts.append(f"clocks aligned to ±{self.clock_uncertainty * 1e3:.2g} ms")
        for cell, ranks in self.absent.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            parts.append(f"no timeline from {who} in {self.label(cell)}: its cell did not "
                         "finish (it failed, or was ended or interrupted)")
        return "; ".join(parts)

    __str__ = summary

    def figure(self, **kwargs: Any) -> Any:
        """The timeline drawn (see :func:`mlx_nbdist.viz.timeline.timeline_figure`)."""
        from .viz.timeline import timeline_figure

        return timeline_figure(self, **kwargs)

    def chrome_trace(self) -> dict[str, Any]:
        """This timeline as Chrome trace-event JSON (see :func:`to_chrome_trace`)."""
        return to_chrome_trace([self])


# --------------------------------------------------------------------------- building


def build(
    cells: Sequence[Mapping[int, Mapping[str, Any]]],
    offsets: Mapping[int, ClockOffset] | None = None,
    probe_gbps: float | None = None,
    backend: str = "",
) -> CellTimeline:
    """The timeline of profiled cells, oldest first.

    Args:
        cells: per cell, each rank's published record (``Recorder.finish``'s data:
            ``cell``, ``start_ns``, ``end_ns``, ``events`` with ``t_ready``/``t_done``
            in the rank's clock; optionally ``name``, the cell's name for people).
        offsets: each rank's clock minus the notebook's (missing: 0, this machine).
        probe_gbps: the backend's probed bandwidth, for the ratio.
        backend: the backend's name, for the summary.
    """
    cells = [c for c in cells if c]
    if not cells:
        raise NoProfileError("no profiled cell to draw: run a cell with %%mlxdist --profile")
    offsets = dict(offsets or {})
    ranks = sorted({int(r) for c in cells for r in c})
    off_ns = {r: int(round(offsets.get(r, ClockOffset()).offset * 1e9)) for r in ranks}
    origin = min(int(p["start_ns"]) - off_ns[int(r)] for c in cells for r, p in c.items())

    def at(rank: int, t_ns: int) -> float:
        return (int(t_ns) - off_ns[rank] - origin) / 1e9

    noise = max([WAIT_NOISE] + [2 * o.uncertainty for o in offsets.values()])
    lanes: dict[int, list[Segment]] = {r: [] for r in ranks}
    spans: dict[int, list[tuple[int, float, float]]] = {r: [] for r in ranks}
    matched: list[Collective] = []
    untimed = dropped = 0
    numbers: list[int] = []
    names: dict[int, str] = {}
    absent: dict[int, list[int]] = {}
    for cell in cells:
        number = int(next(iter(cell.values())).get("cell", 0))
        numbers.append(number)
        missing = sorted({int(r) for p in cell.values() for r in p.get("absent", ())})
        if missing:
            absent[number] = missing
        name = next((str(p["name"]) for p in cell.values() if p.get("name")), "")
        if name:
            names[number] = name
        events = {
            int(r): [_event(int(r), e, at) for e in p.get("events", [])] for r, p in cell.items()
        }
        dropped += sum(int(p.get("dropped", 0)) for p in cell.values())
        cell_matched, last_of = _match(number, events, noise)
        matched += cell_matched
        cell_untimed = 0
        for r, p in cell.items():
            r = int(r)
            start, end = at(r, p["start_ns"]), at(r, p["end_ns"])
            prev = spans[r][-1][2] if spans[r] else None
            if prev is not None and start > prev:
                lanes[r].append(Segment(r, SegmentKind.IDLE, prev, start, number))
            spans[r].append((number, start, end))
            lane, n_untimed = _lane(r, number, start, end, events[r], last_of)
            lanes[r] += lane
            cell_untimed = max(cell_untimed, n_untimed)
        untimed += cell_untimed  # each rank issues the same ones: counted once, as the group's
    compute = {r: sum(s.duration for s in lanes[r] if s.kind == SegmentKind.COMPUTE)
               for r in ranks}
    # waiting for a rank that came late (not in a collective no other rank issued)
    wait = {r: sum(s.duration for s in lanes[r]
                   if s.kind == SegmentKind.WAIT and s.waited_for is not None) for r in ranks}
    comm = {
        r: sum(s.duration for s in lanes[r] if s.kind in _IN_COLLECTIVE) for r in ranks
    }
    stats = _stats(numbers, ranks, lanes, spans, probe_gbps, backend)
    stats.names, stats.untimed = names, untimed
    tl = CellTimeline(
        cells=numbers,
        ranks=ranks,
        backend=backend,
        origin_ns=origin,
        lanes=lanes,
        collectives=matched,
        spans=spans,
        compute=compute,
        comm=comm,
        wait=wait,
        waited_for=None,
        slowest=None,
        stats=stats,
        clock_uncertainty=max((o.uncertainty for o in offsets.values()), default=0.0),
        untimed=untimed,
        dropped=dropped,
        names=names,
        absent=absent,
    )
    caused = tl.caused()
    if caused and max(caused.values()) > noise:
        tl.waited_for = max(caused, key=lambda r: caused[r])
    if len(ranks) > 1:
        tl.slowest = max(ranks, key=lambda r: compute[r])
    return tl


_IN_COLLECTIVE = (SegmentKind.WAIT, SegmentKind.COLLECTIVE, SegmentKind.SEND, SegmentKind.RECV)


@dataclass
class _Event:
    rank: int
    index: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    peer: int | None
    world: bool
    timed: bool
    issue: float
    ready: float
    done: float


def _event(rank: int, e: Mapping[str, Any], at: Any) -> _Event:
    ready, done = at(rank, e["t_ready"]), at(rank, e["t_done"])
    if done < ready:
        raise ValueError(
            f"rank {rank}: collective #{e.get('index')} ({e.get('op')}) ends before it is "
            "ready (t_done < t_ready): the record is corrupt"
        )
    peer = e.get("peer")
    return _Event(
        rank=rank,
        index=int(e.get("index", 0)),
        op=str(e["op"]),
        shape=tuple(int(d) for d in e.get("shape", ())),
        dtype=str(e.get("dtype", "")),
        nbytes=int(e.get("nbytes", 0)),
        peer=None if peer is None else int(peer),
        world=bool(e.get("world", True)),
        timed=bool(e.get("timed", True)),
        issue=at(rank, e.get("t_issue", e["t_ready"])),
        ready=ready,
        done=done,
    )


def _match(
    cell: int, events: dict[int, list[_Event]], noise: float
) -> tuple[list[Collective], dict[tuple[int, int], tuple[float, int | None]]]:
    """Pair each rank's k-th group collective with the others' (and each send with its
    recv). Returns the pairings and, per ``(rank, index)``, the last arrival and who
    it was (``None`` when nobody waited longer than ``noise``)."""
    out: list[Collective] = []
    last_of: dict[tuple[int, int], tuple[float, int | None]] = {}

    def add(op: str, group: dict[int, _Event]) -> None:
        if any(not e.timed for e in group.values()):
            return
        ready = {r: e.ready for r, e in group.items()}
        last = max(ready, key=lambda r: ready[r])
        lead = ready[last] - min(ready.values())
        who = last if len(group) > 1 and lead > noise else None
        waits = {r: ready[last] - t for r, t in ready.items()}
        send = next((e for e in group.values() if e.op == "send"), None)
        if send is not None and send.rank != last and send.done <= ready[last]:
            # a buffered send, over before its receiver came: nobody waited for anybody
            who, waits = None, dict.fromkeys(group, 0.0)
        any_e = next(iter(group.values()))
        out.append(Collective(cell, op, any_e.shape, any_e.nbytes, ready,
                              {r: e.done for r, e in group.items()}, who, waits))
        for r, e in group.items():
            last_of[(r, e.index)] = (ready[last], who if r != last else None)

    group_ops = {r: [e for e in evs if e.world and e.op not in P2P] for r, evs in events.items()}
    if group_ops:
        n = min(len(v) for v in group_ops.values())
        for k in range(n):
            row = {r: v[k] for r, v in group_ops.items()}
            if len({e.op for e in row.values()}) > 1:
                break  # the ranks issued different collectives: no honest pairing after
            add(row[next(iter(row))].op, row)
    sends: dict[tuple[int, int], list[_Event]] = {}
    recvs: dict[tuple[int, int], list[_Event]] = {}
    for r, evs in events.items():
        for e in evs:
            if e.op == "send" and e.peer is not None:
                sends.setdefault((r, e.peer), []).append(e)
            elif e.op in ("recv", "recv_like") and e.peer is not None:
                recvs.setdefault((e.peer, r), []).append(e)
    for key, ss in sends.items():
        for s, rv in zip(ss, recvs.get(key, []), strict=False):
            add("send/recv", {s.rank: s, rv.rank: rv})
    return out, last_of


def _lane(
    rank: int,
    cell: int,
    start: float,
    end: float,
    events: list[_Event],
    last_of: dict[tuple[int, int], tuple[float, int | None]],
) -> tuple[list[Segment], int]:
    """One rank's segments in one cell: compute between collectives, and each
    collective split into its wait and its transfer."""
    out: list[Segment] = []
    cursor = start
    untimed = 0
    for e in sorted(events, key=lambda e: (e.ready, e.index)):
        common = {"op": e.op, "shape": e.shape, "dtype": e.dtype, "nbytes": e.nbytes,
                  "peer": e.peer, "index": e.index}
        if not e.timed:
            untimed += 1
            out.append(Segment(rank, SegmentKind.UNTIMED, e.issue, e.issue, cell, **common))
            continue
        if e.ready > cursor:
            out.append(Segment(rank, SegmentKind.COMPUTE, cursor, e.ready, cell))
        if e.world and (rank, e.index) not in last_of:
            # not matched by the other ranks in this cell (they failed, skipped it or
            # issued others; a drain's zeros may have released it): all of it was
            # waiting, no transfer to time
            out.append(Segment(rank, SegmentKind.WAIT, e.ready, e.done, cell, **common))
            cursor = max(cursor, e.done)
            continue
        last, who = last_of.get((rank, e.index), (e.ready, None))
        # waiting for nobody (within the clock noise, or a buffered send): all of it moves
        moving = min(max(last, e.ready), e.done) if who is not None else e.ready
        if who is not None and moving > e.ready:
            out.append(Segment(rank, SegmentKind.WAIT, e.ready, moving, cell, waited_for=who,
                               **common))
        kind = {"send": SegmentKind.SEND, "recv": SegmentKind.RECV,
                "recv_like": SegmentKind.RECV}.get(e.op, SegmentKind.COLLECTIVE)
        out.append(Segment(rank, kind, moving, e.done, cell, waited_for=who, **common))
        cursor = max(cursor, e.done)
    if end > cursor:
        out.append(Segment(rank, SegmentKind.COMPUTE, cursor, end, cell))
    return out, untimed


def _busy(spans: list[tuple[int, float, float]]) -> float:
    return sum(e - s for _, s, e in spans)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _stats(
    cells: list[int],
    ranks: list[int],
    lanes: dict[int, list[Segment]],
    spans: dict[int, list[tuple[int, float, float]]],
    probe_gbps: float | None,
    backend: str,
) -> CommStats:
    out = CommStats(cells=cells, backend=backend, probe_gbps=probe_gbps)
    per: dict[tuple[str, int], dict[str, float]] = {}
    for r in ranks:
        for s in lanes[r]:
            if s.kind not in _IN_COLLECTIVE:
                continue
            row = per.setdefault((s.op, r), dict.fromkeys(
                ("count", "nbytes", "time", "wait", "transfer"), 0.0))
            row["time"] += s.duration
            if s.kind == SegmentKind.WAIT:
                row["wait"] += s.duration
                if s.waited_for is None:  # one that met no peer: counted, nothing timed
                    row["count"] += 1
            else:  # one transfer segment per collective
                row["count"] += 1
                row["nbytes"] += s.nbytes
                row["transfer"] += s.duration

    def gbps(nbytes: float, transfer: float) -> float | None:
        return nbytes / transfer / 1e9 if transfer > 0 else None

    def ratio(g: float | None) -> float | None:
        return g / probe_gbps if g is not None and probe_gbps else None

    for op in dict.fromkeys(op for op, _ in sorted(per, key=lambda k: (k[0], k[1]))):
        rows = {r: per[(op, r)] for r in ranks if (op, r) in per}
        shares = {r: v["time"] / b if (b := _busy(spans[r])) > 0 else 0.0
                  for r, v in rows.items()}
        total = {k: sum(v[k] for v in rows.values()) for k in ("nbytes", "time", "wait",
                                                               "transfer")}
        g = gbps(total["nbytes"], total["transfer"])
        n = len(rows)
        # every rank takes part in each group collective (the group's count is any
        # rank's); each message is one rank's own (the group's is the sum)
        of_group = sum if op in P2P else max
        out.rows.append(OpStats(op, None, int(of_group(v["count"] for v in rows.values())),
                                int(of_group(v["nbytes"] for v in rows.values())),
                                total["time"] / n, total["wait"] / n, total["transfer"] / n,
                                _mean(list(shares.values())), g, ratio(g)))
        for r, v in rows.items():
            g = gbps(v["nbytes"], v["transfer"])
            out.rows.append(OpStats(op, r, int(v["count"]), int(v["nbytes"]), v["time"],
                                    v["wait"], v["transfer"], shares[r], g, ratio(g)))
    return out


# ---------------------------------------------------------------------- Chrome trace

#: phases of the trace-event format (Duration B/E, Complete X, Instant i/I, Counter C,
#: Async b/n/e and S/T/p/F, Flow s/t/f, Sample P, Object N/O/D, Metadata M, Memory
#: dump V/v, Mark R, Clock sync c, Context ( and ))
PHASES = frozenset("BEXiICbneSTpFstfPNODMVvRc()")
_TRACE_NAMES = {
    SegmentKind.COMPUTE: "compute",
    SegmentKind.IDLE: "idle",
}


def to_chrome_trace(timelines: CellTimeline | Sequence[CellTimeline]) -> dict[str, Any]:
    """Chrome trace-event JSON (the "JSON object format"), for ui.perfetto.dev and
    chrome://tracing: one process per rank (``pid`` = rank, named ``rank r``), one
    thread (``tid`` 0, ``main``), a complete event (``ph`` ``X``, ``ts``/``dur`` in
    microseconds) per cell and per segment inside it, and an instant event per
    untimed collective. Times are clock-aligned and relative to the earliest cell.
    """
    tls = [timelines] if isinstance(timelines, CellTimeline) else list(timelines)
    if not tls:
        raise NoProfileError("no timeline to export: run a cell with %%mlxdist --profile")
    origin = min(t.origin_ns for t in tls)
    ranks = sorted({r for t in tls for r in t.ranks})
    events: list[dict[str, Any]] = []
    for r in ranks:
        events += [
            {"name": "process_name", "ph": "M", "ts": 0, "pid": r, "tid": 0,
             "args": {"name": f"rank {r}"}},
            {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": r, "tid": 0,
             "args": {"sort_index": r}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": r, "tid": 0,
             "args": {"name": "main"}},
        ]
    for t in tls:
        shift = (t.origin_ns - origin) / 1e3  # microseconds

        def us(seconds: float, shift: float = shift) -> float:
            return round(shift + seconds * 1e6, 3)

        for r in t.ranks:
            for number, start, end in t.spans[r]:
                events.append({"name": t.label(number), "cat": "cell", "ph": "X",
                               "ts": us(start), "dur": round((end - start) * 1e6, 3),
                               "pid": r, "tid": 0, "args": {"cell": number}})
            for s in t.lanes[r]:
                if s.kind == SegmentKind.IDLE:
                    continue  # a gap between cells shows as idle by itself
                args: dict[str, Any] = {"cell": s.cell}
                if s.op:
                    args.update(op=s.op, shape=list(s.shape), dtype=s.dtype, bytes=s.nbytes,
                                index=s.index)
                    if s.peer is not None:
                        args["peer"] = s.peer
                if s.waited_for is not None:
                    args["waited_for"] = s.waited_for
                if s.kind == SegmentKind.UNTIMED:
                    events.append({"name": f"{s.op} (untimed)", "cat": str(s.kind), "ph": "i",
                                   "s": "t", "ts": us(s.start), "pid": r, "tid": 0,
                                   "args": {**args, "note": "issued inside mx.compile/vmap: "
                                            "its execution was not timed"}})
                    continue
                if s.kind in (SegmentKind.COLLECTIVE, SegmentKind.SEND, SegmentKind.RECV) \
                        and s.duration > 0:
                    args["gbps"] = round(s.nbytes / s.duration / 1e9, 4)
                name = _TRACE_NAMES.get(s.kind) or (
                    (f"wait {s.op} for rank {s.waited_for}" if s.waited_for is not None
                     else f"wait {s.op}: not matched by the other ranks in this cell")
                    if s.kind == SegmentKind.WAIT else s.op
                )
                events.append({"name": name, "cat": str(s.kind), "ph": "X", "ts": us(s.start),
                               "dur": round(s.duration * 1e6, 3), "pid": r, "tid": 0,
                               "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": "mlx_nbdist",
            "origin_unix_ns": origin,
            "cells": [c for t in tls for c in t.cells],
            "cell_names": {str(c): t.label(c) for t in tls for c in t.cells},
            "backend": tls[-1].backend,
            "probe_gbps": tls[-1].stats.probe_gbps,
            "clock_uncertainty_us": round(max(t.clock_uncertainty for t in tls) * 1e6, 3),
            "measured": "profile mode: each collective evaluated where it was issued "
            "(compute and communication serialised)",
        },
    }


def write_trace(
    timelines: CellTimeline | Sequence[CellTimeline], path: str | os.PathLike[str]
) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (JSON); returns the path."""
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(f"trace path {str(out)!r} is a folder: give a file name, "
                                "e.g. run.json")
    if not out.parent.exists():
        raise FileNotFoundError(f"trace path {str(out)!r}: folder {str(out.parent)!r} does "
                                "not exist")
    out.write_text(json.dumps(to_chrome_trace(timelines)))
    return out


# --------------------------------------------------------------------------- text


def _bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def format_seconds(seconds: float) -> str:
    """``0.8 ms``, ``312 ms``, ``1.52 s``: three significant digits, no exponent."""
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s" if abs(seconds) < 1000 else f"{seconds:.0f} s"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if abs(ms) >= 100 else f"{ms:.3g} ms"


def cells_label(cells: Sequence[int], names: Mapping[int, str] | None = None) -> str:
    """Cells as the user knows them: ``In [7]``, ``In [7], In [8]``, ``In [3] ... In [9]
    (5 cells)``; cells without a name by number (``cell 7``, ``cells 3-9``)."""
    names = names or {}
    cells = list(cells)
    if not any(names.get(c) for c in cells):
        if len(cells) > 2 and cells == list(range(cells[0], cells[-1] + 1)):
            return f"cells {cells[0]}-{cells[-1]}"
        return f"cell{'s' if len(cells) > 1 else ''} {', '.join(map(str, cells))}"
    labels = [names.get(c) or f"cell {c}" for c in cells]
    if len(labels) > 3:
        return f"{labels[0]} ... {labels[-1]} ({len(labels)} cells)"
    return ", ".join(labels)
