"""The notebook's current session and the plain functions the magics call."""

from __future__ import annotations

import time

from .errors import NotStartedError
from .session import Session, SessionStatus

_CURRENT: Session | None = None


def set_current_session(session: Session | None) -> None:
    global _CURRENT
    _CURRENT = session


def current_session(required: bool = True) -> Session | None:
    """The session started by ``%mlxdist start`` (or :func:`start`)."""
    if _CURRENT is None and required:
        raise NotStartedError("no session: run %mlxdist start -n N first")
    return _CURRENT


def start(n: int | None = None, **kwargs: object) -> Session:
    """Start a session and make it the current one (what ``%mlxdist start`` does)."""
    s = Session(n, **kwargs).start()  # type: ignore[arg-type]
    set_current_session(s)
    return s


def stop() -> None:
    """Stop the current session, if any."""
    if _CURRENT is not None:
        _CURRENT.stop()


def format_status(st: SessionStatus) -> str:
    """The text of ``%mlxdist status``."""
    lines = [
        f"session {st.session_id or '-'}: {st.state}, {st.n} ranks, "
        f"backend={st.backend}, launcher={st.launcher}, up {st.uptime:.0f} s"
    ]
    if st.broken_reason:
        lines.append(f"  broken: {st.broken_reason} -> run %mlxdist restart")
    now = time.time()
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
