"""A session's folder on disk: where it lives, its name, and the files in it that
several processes read (the record the watchdog and ``%mlxdist cleanup`` use, MLX's
ring hostfile, the ipyparallel logs)."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from .watchdog import RECORD

LOOPBACK = "127.0.0.1"


def runtime_root() -> Path:
    """Directory holding one folder per session, readable by this user only."""
    base = os.environ.get("MLX_NBDIST_RUNTIME") or os.path.join(
        tempfile.gettempdir(), f"mlx_nbdist-{os.getuid()}"
    )
    root = Path(base)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def session_dir(session_id: str) -> Path:
    path = runtime_root() / session_id
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this user only, atomically (a reader
    sees the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def write_record(directory: Path, record: dict[str, Any]) -> None:
    """The session's record (:data:`RECORD`): its processes, state and remote ranks."""
    write_private(directory / RECORD, json.dumps(record))


def write_ring_hostfile(path: Path, endpoints: list[list[str]]) -> Path:
    """Write MLX's ring hostfile from each rank's ``ip:port`` endpoints."""
    return write_private(path, json.dumps(endpoints))


def log_tail(directory: Path, lines: int = 15, prefix: str = "", files: int = 3) -> str:
    """The last lines of the engines' and controller's logs, for error messages
    (``prefix``: only logs whose name starts so, e.g. ``ipengine``; ``files``: the
    most recently written this many)."""
    folder = directory / "profile" / "log"
    logs = sorted(
        (p for p in [*folder.glob("*.log"), *folder.glob("*.out")] if p.name.startswith(prefix)),
        key=lambda p: p.stat().st_mtime,
    )
    out = []
    for p in logs[-files:]:
        text = p.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {p.name}\n" + "\n".join(text))
    return "\n".join(out)


def discard(directory: Path) -> bool:
    """Remove a cleanly stopped session's folder (records, logs, status files), unless
    it holds output a cell's message pointed to (``output/``: a rank's output past
    the limit), which the user may still open; those folders go with the other
    stopped sessions' (see :func:`mlx_nbdist.processes.prune`). Returns whether it
    was removed."""
    import shutil

    output = directory / "output"
    if output.is_dir() and any(output.iterdir()):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not directory.exists()
