"""Where every thread of this rank is, on request, even while its main thread is
blocked inside MLX's C++ (a collective waiting for a peer).

:func:`install` registers Python's :mod:`faulthandler` for :data:`SIGNAL`: on that
signal the interpreter writes every thread's stack to the rank's stack file
(``rank<r>.stack`` beside its status file) from the signal handler itself, so it
needs neither the GIL nor a free main thread. The notebook sends the signal and
reads what was appended (:mod:`mlx_nbdist.session.stacks`). Nothing runs in the
background: no thread, no timer. Standard library only.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
from pathlib import Path
from typing import IO

#: the signal that asks a rank for its stacks (``None`` where there is none)
SIGNAL: int | None = getattr(signal, "SIGUSR2", None)

_FILE: list[IO[str]] = []  # the open stack file (faulthandler writes to its descriptor)


def stack_file(status_dir: str | Path, rank: int) -> Path:
    """The file rank ``rank`` writes its stacks to."""
    return Path(status_dir) / f"rank{rank}.stack"


def install(status_dir: str | Path, rank: int) -> int | None:
    """Write this process's stacks to its stack file on :data:`SIGNAL`.

    Returns:
        The main thread's identifier (the ``Thread 0x...`` of a dump), or ``None``
        where the platform has no such signal.
    """
    if SIGNAL is None or _FILE:
        return threading.main_thread().ident if _FILE else None
    f = open(stack_file(status_dir, rank), "a", encoding="utf-8")  # noqa: SIM115 - kept open
    _FILE.append(f)
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    return threading.main_thread().ident


def uninstall() -> None:
    """Stop answering :data:`SIGNAL` and close the file (the rank is stopping)."""
    if SIGNAL is not None and _FILE:
        faulthandler.unregister(SIGNAL)
        _FILE.pop().close()
