"""Ask ranks where they are: each writes every thread's stack to its stack file on a
signal (:mod:`mlx_nbdist.engine.stacks`), even while blocked inside MLX; this reads
what was appended and keeps the frames of the user's code (:mod:`mlx_nbdist.stacks`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .._ipykernel import cell_file_name
from ..engine.stacks import SIGNAL, stack_file
from ..results import RankStack
from ..stacks import rank_stack

if TYPE_CHECKING:
    from .ranks import RankGroup

#: a dump is complete when its file has not grown for this long (s)
SETTLE = 0.05


def cell_files(sources: Mapping[int, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """``{file name: (cell name, source)}`` for the cells the session ran (``sources``:
    ``{cell number: (cell name, source)}``)."""
    out: dict[str, tuple[str, str]] = {}
    for name, src in sources.values():
        file = cell_file_name(src)  # named after the raw cell ...
        if file is not None:
            out[file] = (name, _as_run(src))  # ... its line numbers are the code's as run
    return out


def _as_run(src: str) -> str:
    """The code IPython runs for a cell (leading blank lines dropped, magics turned
    into calls): frames' line numbers count its lines."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(src)
    except Exception:  # noqa: BLE001 - a cell IPython cannot transform did not run either
        return src


def request(
    group: RankGroup,
    ranks: Iterable[int],
    sources: Mapping[int, tuple[str, str]],
    timeout: float,
) -> dict[int, RankStack]:
    """Every rank's current stack (main thread, trimmed to the user's code).

    A rank that cannot be asked (no signal on this platform, its files on another
    host, not answering within ``timeout``) gets a stack with a ``note`` saying why.
    """
    ranks = sorted(ranks)
    out: dict[int, RankStack] = {}
    files: dict[int, Path] = {}
    for r in ranks:
        info, place = group.ranks.get(r), group.places.get(r)
        if SIGNAL is None or info is None or info.main_thread is None:
            out[r] = RankStack(r, note="stack dumps are not available on this platform")
        elif place is not None and not place.shared_files:
            out[r] = RankStack(r, note=f"its stack file is on {place.host}, not readable here")
        else:
            files[r] = stack_file(group.directory, r)
    before = {r: _size(p) for r, p in files.items()}
    group.kill_ranks(list(files), SIGNAL)  # type: ignore[arg-type]
    grown: dict[int, tuple[int, float]] = {}  # rank -> (size, when it last grew)
    t_end = time.monotonic() + timeout
    while len(grown) < len(files) or any(
        time.monotonic() - at < SETTLE for _, at in grown.values()
    ):
        now = time.monotonic()
        if now > t_end:
            break
        for r, p in files.items():
            size = _size(p)
            if size > before[r] and grown.get(r, (0, 0.0))[0] != size:
                grown[r] = (size, now)
        time.sleep(0.01)
    cells = cell_files(sources)
    for r, p in files.items():
        if r not in grown:
            out[r] = RankStack(r, note=f"it wrote no stack within {timeout:g} s")
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            f.seek(before[r])
            dump = f.read()
        out[r] = rank_stack(r, dump, group.ranks[r].main_thread, cells)
    return dict(sorted(out.items()))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0
