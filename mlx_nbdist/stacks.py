"""A rank's stacks as plain data: parse what :mod:`faulthandler` wrote, keep the
frames that are the user's, and name the cell and line a rank is in.

Pure functions, no I/O: :mod:`mlx_nbdist.session.stacks` asks the ranks for their
stacks (:mod:`mlx_nbdist.engine.stacks` writes them) and hands the text here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePath

from .results import Frame, RankStack

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')

#: top-level packages whose frames are the machinery around a cell, not its code
INFRASTRUCTURE = frozenset(
    {
        "IPython", "ipykernel", "ipyparallel", "tornado", "zmq", "asyncio", "traitlets",
        "threading", "concurrent", "runpy", "selectors", "contextlib", "jupyter_client",
        "mlx_nbdist", "<frozen>",
    }
)  # fmt: skip


def parse_dump(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """Every thread of one faulthandler dump: ``{thread id: [(file, line, func)]}``,
    outermost frame first."""
    threads: dict[int, list[tuple[str, int, str]]] = {}
    current: list[tuple[str, int, str]] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            current = threads.setdefault(int(head.group(2), 16), [])
            continue
        m = _FRAME.match(line)
        if m and current is not None:
            current.insert(0, (m.group(1), int(m.group(2)), m.group(3)))
    return threads


def _package(file: str) -> str:
    """The top-level package a file belongs to, from its path (``""``: not known)."""
    if file.startswith("<frozen"):
        return "<frozen>"  # runpy, importlib: how the engine process was started
    parts = PurePath(file).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1 :]
            return PurePath(rest[0]).stem if rest else ""
    if "mlx_nbdist" in parts:
        return "mlx_nbdist"
    if len(parts) >= 2 and re.match(r"python3\.\d+$", parts[-2]):
        return PurePath(parts[-1]).stem  # the standard library: threading.py, runpy.py
    if len(parts) >= 3 and re.match(r"python3\.\d+$", parts[-3]):
        return parts[-2]  # a standard-library package: asyncio/, concurrent/
    return ""


def user_frames(
    frames: list[tuple[str, int, str]], cells: Mapping[str, tuple[str, str]] | None = None
) -> list[Frame]:
    """The frames from the outermost cell (or user) frame inwards, the machinery's
    frames left out (those of :data:`INFRASTRUCTURE`; mlx_nbdist's own only at the
    innermost end, where it tracks a collective).

    ``cells`` maps a cell's file name (the last part of its path) to its name
    (``In [7]``) and source.
    """
    cells = cells or {}
    out: list[Frame] = []
    for file, line, func in frames:
        known = cells.get(PurePath(file).name)
        if known is not None:
            lines = known[1].splitlines()
            text = lines[line - 1] if 0 < line <= len(lines) else ""
            out.append(Frame(file, line, func, cell=known[0], text=text))
        elif _package(file) not in INFRASTRUCTURE or (out and _package(file) == "mlx_nbdist"):
            out.append(Frame(file, line, func))
    starts = [i for i, f in enumerate(out) if f.cell is not None]
    starts = starts or [i for i, f in enumerate(out) if _is_cellish(f)] or [0]
    out = out[starts[0] :]
    while out and _package(out[-1].file) == "mlx_nbdist":
        out.pop()  # the tracker around a collective: the user's frame above says which
    return out


def _is_cellish(f: Frame) -> bool:
    """A frame of code typed into a kernel whose source is not known here."""
    return PurePath(f.file).parent.name.startswith("ipykernel_") or (
        f.file.startswith("<") and not f.file.startswith("<frozen")
    )


def rank_stack(
    rank: int,
    dump: str,
    main_thread: int | None,
    cells: Mapping[str, tuple[str, str]] | None = None,
) -> RankStack:
    """Rank ``rank``'s main-thread stack from one dump (``main_thread``: its id; when
    unknown, the thread that ran the signal handler, written last)."""
    threads = parse_dump(dump)
    if not threads:
        return RankStack(rank, note="the rank wrote no stack")
    frames = threads.get(main_thread) if main_thread is not None else None
    if frames is None:
        frames = list(threads.values())[-1]
    kept = user_frames(frames, cells)
    if not kept:
        return RankStack(rank, note="idle: no cell code is running")
    return RankStack(rank, kept)
