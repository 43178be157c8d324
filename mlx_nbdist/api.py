"""The notebook's current session and the plain functions the magics call.

Also the session the distributed kernel starts in the background at launch
(:func:`start_in_background`): the first command that needs it waits for it
(:func:`wait_for_background_start`).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import NotStartedError, StartError
from .results import RankStack
from .session import Session, SessionStatus
from .timelines import CellTimeline, CommStats

_CURRENT: Session | None = None


def set_current_session(session: Session | None) -> None:
    global _CURRENT
    _CURRENT = session


def current_session(required: bool = True) -> Session | None:
    """The session started by ``%mlxdist start`` (or :func:`start`)."""
    if _CURRENT is None and required:
        from .engine import state  # imports neither MLX nor the engine's modules

        if state.started():  # called in a %%mlxdist cell, on a rank
            raise NotStartedError(
                f"this runs in the notebook, not on a rank (this is rank {state.current().rank}"
                "): it drives every rank from there. In a %%mlxdist cell use the rank's own "
                "functions: mlx_nbdist.script.load_checkpoint(model, directory) and "
                "save_checkpoint(...), mlx_nbdist.shard(model, ...), mx.distributed's "
                "collectives")
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


def timeline(k: int = 1) -> CellTimeline:
    """The current session's last ``k`` profiled cells (``%mlxdist timeline``)."""
    return current_session().timeline(k)  # type: ignore[union-attr]


def trace(path: str | os.PathLike[str], k: int = 1) -> Path:
    """Write the current session's last ``k`` profiled cells as Chrome trace JSON."""
    return current_session().trace(path, k)  # type: ignore[union-attr]


def comm_stats(k: int = 1) -> CommStats:
    """Per-op, per-rank collective statistics of the last ``k`` profiled cells."""
    return current_session().comm_stats(k)  # type: ignore[union-attr]


def export(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write the current session's cells as one standalone script (``%mlxdist export``;
    see :meth:`Session.export`)."""
    return current_session().export(path, overwrite=overwrite)  # type: ignore[union-attr]


def where() -> dict[int, RankStack]:
    """Every rank's current stack in the current session (``%mlxdist where``)."""
    return current_session().where()  # type: ignore[union-attr]


def format_status(st: SessionStatus) -> str:
    """The text of ``%mlxdist status``."""
    from .viz.status import format_status as render  # viz loads matplotlib: only here

    return render(st)


@dataclass
class _BackgroundStart:
    session: Session
    thread: threading.Thread | None = None
    messages: list[str] = field(default_factory=list)
    error: BaseException | None = None


_STARTING: _BackgroundStart | None = None


def start_in_background(session: Session) -> threading.Thread:
    """Start ``session`` in a thread (the distributed kernel does this at launch).

    The first command that needs the session waits for it
    (:func:`wait_for_background_start`); a start that failed raises there.
    """
    global _STARTING
    job = _BackgroundStart(session)

    def run() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                session.start(job.messages.append)
            set_current_session(session)
        except BaseException as e:  # noqa: BLE001 - reported to the first cell
            job.error = e

    job.thread = threading.Thread(target=run, name="mlx_nbdist-start", daemon=True)
    _STARTING = job
    job.thread.start()
    return job.thread


def background_start() -> threading.Thread | None:
    """The thread of a start begun by :func:`start_in_background`, while it is known."""
    return _STARTING.thread if _STARTING is not None else None


def wait_for_background_start(progress: Callable[[str], None] | None = None) -> None:
    """Wait for a background start, passing its messages to ``progress``.

    Raises:
        StartError: the start failed (once; the next call returns at once).
    """
    global _STARTING
    job = _STARTING
    if job is None or job.thread is None:
        return
    say = progress or (lambda msg: None)
    seen = 0
    while job.thread.is_alive():
        if len(job.messages) > seen:
            seen = len(job.messages)
            say(job.messages[-1])
        job.thread.join(0.1)
    if seen:
        say("MLX group ready" if job.error is None else "start failed")
    _STARTING = None
    if job.error is not None:
        raise StartError(
            f"the MLX session did not start: {job.error}\n"
            "start it by hand with %mlxdist start -n N (or restart the kernel)"
        )
