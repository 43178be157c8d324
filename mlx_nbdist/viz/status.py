"""A session's status, written for people: the one place that renders it.

``%mlxdist status`` prints :func:`format_status`; ``%mlxdist start`` / ``restart``
print :func:`format_group`; the dashboard shows :func:`header_values` (as
:func:`header_html`) and one :func:`rank_values` row per rank. They read a
:class:`~mlx_nbdist.session.Session` or its ``SessionStatus`` snapshot through
:class:`SessionFacts` (the attributes both have), never the session's internals.
"""

from __future__ import annotations

import html
import time
from typing import Protocol

from mlx_nbdist import config
from mlx_nbdist.results import RankInfo, RankState, count
from mlx_nbdist.viz.common import human_bytes

#: Badge colour of each rank or session state in the dashboard.
STATE_COLORS = {
    "idle": "#2ca02c",
    "busy": "#1f77b4",
    "starting": "#7f7f7f",
    "stopped": "#7f7f7f",
    "error": "#d62728",
    "dead": "#000000",
    "broken": "#8c564b",
    "hung": "#ff7f0e",
}


class SessionFacts(Protocol):
    """What a ``Session`` and a ``SessionStatus`` both tell about a session."""

    @property
    def session_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def n(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def launcher(self) -> str: ...
    @property
    def uptime(self) -> float: ...
    @property
    def broken_reason(self) -> str: ...
    @property
    def ranks(self) -> dict[int, RankInfo]: ...


class StatusFacts(SessionFacts, Protocol):
    """A ``SessionStatus``: the session, and each rank's liveness and live state."""

    @property
    def alive(self) -> dict[int, bool]: ...
    @property
    def live(self) -> dict[int, RankState]: ...
    @property
    def spare(self) -> str: ...


# --------------------------------------------------------------------------- text


def format_group(s: SessionFacts, ranks: bool = False) -> str:
    """The line ``%mlxdist start`` prints once the group is ready.

    Args:
        s: the session.
        ranks: add one line per rank (device, host, pid, engine).
    """
    head = (
        f"MLX group ready: {count(s.n, 'rank')}, backend={s.backend}, launcher={s.launcher}, "
        f"session {s.session_id}"
    )
    if not ranks:
        return head
    lines = [head]
    for r, info in s.ranks.items():
        lines.append(
            f"  rank {r}: {info.device} on {info.host}, pid {info.pid}, engine {info.engine_id}"
        )
    return "\n".join(lines)


def format_status(st: StatusFacts, now: float | None = None) -> str:
    """The text of ``%mlxdist status``: the session, then one line per rank.

    Args:
        st: the session's status (``Session.status()``).
        now: the time busy ranks' running time is counted to (default: now).
    """
    lines = [
        f"session {st.session_id or '-'}: {st.state}, {count(st.n, 'rank')}, "
        f"backend={st.backend}, launcher={st.launcher}, up {st.uptime:.0f} s"
    ]
    if st.broken_reason:
        lines.append(f"  broken: {st.broken_reason} -> run %mlxdist restart")
    if st.spare:
        done = {
            "ready": "ready: a restart only forms the group",
            "failed": "failed: a restart starts new engines",
            "off": "off (spare=False): a restart starts new engines",
            "none": "none (kept for local engines only): a restart starts new engines",
        }.get(st.spare, st.spare)
        lines.append(f"  spare engines for the next restart: {done}")
    now = time.time() if now is None else now
    for r, info in st.ranks.items():
        live = st.live.get(r)
        state = live.state if live else "?"
        if not st.alive.get(r, False):
            state = "dead"
        busy = ""
        if live and live.state == "busy" and live.cell_started:
            busy = f" cell {live.cell} for {now - live.cell_started:.1f} s"
        coll = f", {live.collectives} collectives" if live else ""
        lines.append(
            f"  rank {r}: {state}{busy}, pid {info.pid} on {info.host}, {info.device}, "
            f"engine {info.engine_id}{coll}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- dashboard


def header_values(session: SessionFacts | None) -> dict[str, str]:
    """The session header of the dashboard: id, backend, launcher, N, uptime, state."""
    if session is None:
        return {"session": "-", "state": "no session", "backend": "-", "launcher": "-",
                "n": "0", "uptime": "-", "broken": ""}  # fmt: skip
    return {
        "session": session.session_id or "-",
        "state": session.state,
        "backend": session.backend,
        "launcher": session.launcher,
        "n": str(session.n),
        "uptime": _uptime(session.uptime) if session.uptime else "-",
        "broken": session.broken_reason if session.state == "broken" else "",
    }


def header_html(h: dict[str, str]) -> str:
    """:func:`header_values` as the dashboard's header line (state in its colour)."""
    color = STATE_COLORS.get({"ready": "idle"}.get(h["state"], h["state"]), "#333")
    broken = (
        f' · <span style="color:#d62728">broken: {html.escape(h["broken"])} '
        "(restart to continue)</span>"
        if h.get("broken")
        else ""
    )
    return (
        f'<div class="mlxdist-session" data-state="{html.escape(h["state"])}">'
        f"<b>MLX session</b> {html.escape(h['session'])} · "
        f'<b style="color:{color}">{html.escape(h["state"])}</b> · '
        f"backend {html.escape(h['backend'])} · launcher {html.escape(h['launcher'])} · "
        f"{html.escape(h['n'])} ranks · up {html.escape(h['uptime'])}{broken}</div>"
    )


def rank_values(
    st: RankState,
    *,
    now: float | None = None,
    stale_after: float = config.STALE_AFTER,
    session_state: str = "",
) -> dict[str, str]:
    """What a rank's dashboard row shows, as text per column.

    Args:
        st: the rank's live state.
        now: the time the row is for (default: now).
        stale_after: a rank whose state is older than this shows ``hung``.
        session_state: ``stopped`` or ``starting`` overrides the rank's own state.

    Returns:
        ``rank``, ``state``, ``cell`` (running cell and for how long), ``last`` (last
        cell's duration and outcome), ``device``, ``memory`` (MLX active / peak),
        ``process`` (RSS · CPU) and ``collectives`` (count · bytes moved).
    """
    now = time.time() if now is None else now
    state = st.state
    if session_state in ("stopped", "starting"):
        state = session_state
    elif state in ("idle", "busy", "error") and st.updated and now - st.updated > stale_after:
        state = "hung"
    cell = "-"
    if st.state == "busy" and st.cell_started and state not in ("stopped", "starting"):
        cell = f"cell {st.cell} · {_secs(now - st.cell_started)}"
    last = "-"
    if st.last_status:
        dur = f"{_secs(st.last_duration)} · " if st.last_duration is not None else ""
        last = f"{dur}{st.last_status}"
    cpu = f"{st.cpu_percent:.0f}%"
    return {
        "rank": str(st.rank),
        "state": state,
        "cell": cell,
        "last": last,
        "device": st.device or "-",
        "memory": f"{human_bytes(st.active_memory)} / {human_bytes(st.peak_memory)}",
        "process": f"{human_bytes(st.rss)} · {cpu}",
        "collectives": f"{st.collectives} · {human_bytes(st.bytes_moved)}",
    }


def dashboard_text(header: dict[str, str], ranks: dict[int, dict[str, str]]) -> str:
    """The dashboard as plain text (front ends without widgets, logs).

    Args:
        header: :func:`header_values`.
        ranks: :func:`rank_values` per rank.
    """
    h = header
    lines = [
        f"session {h.get('session')}: {h.get('state')}, {h.get('n')} ranks, "
        f"backend={h.get('backend')}, launcher={h.get('launcher')}, up {h.get('uptime')}"
    ]
    for r, row in sorted(ranks.items()):
        lines.append(
            f"  rank {r}: {row['state']:<8} {row['cell']:<18} last {row['last']:<22} "
            f"{row['device']}  mem {row['memory']}  {row['process']}  "
            f"coll {row['collectives']}"
        )
    return "\n".join(lines)


def _secs(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:.2f} s" if t < 10 else f"{t:.0f} s" if t < 120 else _uptime(t)


def _uptime(t: float) -> str:
    t = int(max(0, t))
    h, rem = divmod(t, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"
