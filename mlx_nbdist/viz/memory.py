"""Memory over time, per rank: MLX's active and peak memory and the process's RSS,
kept from the ranks' published records, drawn as a small chart, and a warning for a
rank whose machine is running out of memory (before the kernel's OOM killer ends it).

Only consumes the records (:meth:`Session.rank_record`); the dashboard feeds it at
each poll.
"""

from __future__ import annotations

import html
from collections import deque
from dataclasses import dataclass
from typing import Any

from .common import WARN_COLOR, human_bytes, rank_hex

#: points kept per rank (at the dashboard's 0.5 s: the last two minutes)
HISTORY = 240
#: a machine with less than this share of its memory available is flagged
LOW_SHARE = 0.10
#: ... or with less than this many bytes available, whichever is larger
LOW_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryPoint:
    """One published sample of one rank."""

    t: float
    active: int
    peak: int
    rss: int
    host_total: int
    host_available: int


def low_memory(p: MemoryPoint) -> str:
    """Why this sample's machine is nearly out of memory (``""``: it is not)."""
    if p.host_total <= 0:
        return ""
    floor = max(LOW_SHARE * p.host_total, LOW_BYTES)
    if p.host_available >= floor:
        return ""
    return (
        f"its machine has {human_bytes(p.host_available)} free of "
        f"{human_bytes(p.host_total)}; the rank uses {human_bytes(p.rss)} (RSS): "
        "it may be killed by the system"
    )


class MemoryHistory:
    """The last :data:`HISTORY` samples of each rank's memory."""

    def __init__(self, history: int = HISTORY):
        self.history = history
        self.points: dict[int, deque[MemoryPoint]] = {}

    def update(self, records: dict[int, dict[str, Any]]) -> None:
        """Add each rank's newest record (a record seen before is not added again)."""
        for r, rec in records.items():
            t = rec.get("updated")
            if not t or "rss" not in rec:
                continue
            q = self.points.setdefault(r, deque(maxlen=self.history))
            if q and q[-1].t >= t:
                continue
            q.append(
                MemoryPoint(
                    t=float(t),
                    active=int(rec.get("active_memory", 0)),
                    peak=int(rec.get("peak_memory", 0)),
                    rss=int(rec.get("rss", 0)),
                    host_total=int(rec.get("host_memory", 0)),
                    host_available=int(rec.get("host_available", 0)),
                )
            )

    def flags(self) -> dict[int, str]:
        """Ranks whose machine is nearly out of memory now, and why."""
        out = {}
        for r, q in sorted(self.points.items()):
            why = low_memory(q[-1]) if q else ""
            if why:
                out[r] = why
        return out

    def values(self) -> dict[int, dict[str, Any]]:
        """Per rank: samples kept, last and highest RSS and MLX peak, the flag."""
        flags = self.flags()
        return {
            r: {
                "samples": len(q),
                "rss": q[-1].rss,
                "max_rss": max(p.rss for p in q),
                "peak": max(p.peak for p in q),
                "active": q[-1].active,
                "low": flags.get(r, ""),
            }
            for r, q in sorted(self.points.items())
            if q
        }

    def html(self, width: int = 520, height: int = 90) -> str:
        """An SVG chart (RSS solid, MLX active dashed, one colour per rank) and the
        warnings; ``""`` before any sample."""
        series = {r: list(q) for r, q in sorted(self.points.items()) if q}
        if not series:
            return ""
        t0 = min(q[0].t for q in series.values())
        t1 = max(q[-1].t for q in series.values())
        top = max(max(p.rss, p.active) for q in series.values() for p in q) or 1
        span = max(t1 - t0, 1e-9)

        def line(points: list[MemoryPoint], key: str) -> str:
            return " ".join(
                f"{(p.t - t0) / span * (width - 2) + 1:.1f},"
                f"{height - 1 - getattr(p, key) / top * (height - 2):.1f}"
                for p in points
            )

        paths = []
        for r, q in series.items():
            color = rank_hex(r)
            paths.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                         f'points="{line(q, "rss")}"/>')  # fmt: skip
            paths.append(f'<polyline fill="none" stroke="{color}" stroke-width="1" '
                         f'stroke-dasharray="3,2" points="{line(q, "active")}"/>')  # fmt: skip
        legend = " · ".join(
            f'<span style="color:{rank_hex(r)}">rank {r}</span> '
            f"{human_bytes(q[-1].rss)} RSS, {human_bytes(q[-1].active)} MLX"
            for r, q in series.items()
        )
        warn = "".join(
            f'<div style="color:{WARN_COLOR}"><b>rank {r}</b>: {html.escape(why)}</div>'
            for r, why in self.flags().items()
        )
        return (
            f"<div><b>memory</b> (last {t1 - t0:.0f} s; solid: RSS, dashed: MLX active; "
            f"top {human_bytes(top)})</div>"
            f'<svg width="{width}" height="{height}" style="border:1px solid #ddd">'
            + "".join(paths)
            + f"</svg><div><small>{legend}</small></div>{warn}"
        )
