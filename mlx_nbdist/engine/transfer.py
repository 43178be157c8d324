"""Move a rank's array to the notebook without pickling it, and without a network hop
when the rank runs on the notebook's machine.

On Linux a rank on the same host writes the array once into a file in ``/dev/shm``;
the notebook maps that file (no copy) and unlinks it at once, so the memory lives as
long as the returned numpy array. Elsewhere (another host, no ``/dev/shm``) the array
travels as an ipyparallel buffer, still out of band of the pickle.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def pack(values: np.ndarray, prefix: str | None) -> tuple[dict[str, Any], np.ndarray | None]:
    """Describe ``values`` for the trip to the notebook.

    Args:
        values: the array (any layout).
        prefix: shared-memory file prefix when the notebook is on this host
            (``None``: send the array itself).

    Returns:
        ``(info, None)`` with ``info["shm"]`` the shared-memory file, or ``(info,
        values)``. Return the array as a top-level item of the result tuple:
        ipyparallel sends top-level arrays as raw buffers, nested ones inside the pickle.
    """
    values = np.ascontiguousarray(values)
    info: dict[str, Any] = {"dtype": values.dtype.str, "shape": values.shape}
    if prefix is None or values.nbytes == 0 or not shm_available():
        return info, values
    path = SHM_DIR / f"{prefix}-{os.getpid()}-{next(_counter)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        # one copy, by the kernel into tmpfs pages (faster than faulting in a mapping)
        view = memoryview(values.reshape(-1)).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)
    info["shm"] = str(path)
    return info, None


def unpack(info: dict[str, Any], values: np.ndarray | None) -> np.ndarray:
    """The notebook side of :func:`pack`: a numpy array (shared memory is mapped, not copied)."""
    if values is not None:
        return values
    path = info["shm"]
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the memory until the array is gone
    arr = np.frombuffer(mm, dtype=np.dtype(info["dtype"]))
    return arr.reshape(info["shape"])


def same_host(host: str) -> bool:
    return host == socket.gethostname()


def discard(prefix: str) -> None:
    """Remove shared-memory files left by a session (a transfer that never arrived)."""
    if shm_available():
        for p in SHM_DIR.glob(f"{prefix}-*"):
            try:
                p.unlink()
            except OSError:
                pass
