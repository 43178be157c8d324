"""Move a rank's array to the notebook without pickling it, and without a network hop
when the rank runs on the notebook's machine.

Three routes, the fastest that works:

* ``vm`` (Linux, the rank's process visible to the notebook): the rank keeps the
  array where it is and sends its address; the notebook copies it straight from the
  rank's memory into a new array with ``process_vm_readv`` (one copy, no file, no
  page of shared memory to fault in). The rank holds the array until the notebook
  says it has read it (the token rides on its next request, :func:`release`).
* ``shm`` (a rank on the same host where ``vm`` is refused): the rank writes the
  array once into a file in ``/dev/shm``; the notebook maps it (no copy) and unlinks
  it at once, so the memory lives as long as the returned numpy array.
* elsewhere (another host, no ``/dev/shm``) the array travels as an ipyparallel
  buffer, still out of band of the pickle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()
#: arrays whose address went to the notebook, by token, until it has read them
_PINNED: dict[int, np.ndarray] = {}


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def pack(
    values: np.ndarray, prefix: str | None, *, vm: bool = False
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Describe ``values`` for the trip to the notebook.

    Args:
        values: the array (any layout).
        prefix: shared-memory file prefix when the notebook is on this host
            (``None``: send the array itself).
        vm: the notebook reads this process's memory (with ``prefix`` set only).

    Returns:
        ``(info, None)`` with ``info["addr"]`` (vm) or ``info["shm"]``, or ``(info,
        values)``. Return the array as a top-level item of the result tuple:
        ipyparallel sends top-level arrays as raw buffers, nested ones inside the pickle.
    """
    values = np.ascontiguousarray(values)
    info: dict[str, Any] = {"dtype": values.dtype.str, "shape": values.shape}
    if prefix is None or values.nbytes == 0:
        return info, values
    if vm:
        token = next(_counter)
        _PINNED[token] = values
        info.update(pid=os.getpid(), addr=values.ctypes.data, nbytes=values.nbytes, token=token)
        return info, None
    if not shm_available():
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


def release(tokens: list[int]) -> None:
    """Let go of arrays the notebook has read (see ``vm`` above)."""
    for t in tokens:
        _PINNED.pop(t, None)


def pinned() -> int:
    """How many arrays wait for the notebook to read them."""
    return len(_PINNED)


def unpack(info: dict[str, Any], values: np.ndarray | None) -> np.ndarray:
    """The notebook side of :func:`pack`: a numpy array.

    Raises:
        OSError: the rank's memory cannot be read (``vm``): ask again without it.
    """
    if values is not None:
        return values
    dtype = np.dtype(info["dtype"])
    if "addr" in info:
        out = np.empty(info["nbytes"], dtype=np.uint8)
        _vm_read(info["pid"], info["addr"], out)
        return out.view(dtype).reshape(info["shape"])
    path = info["shm"]
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the memory until the array is gone
    return np.frombuffer(mm, dtype=dtype).reshape(info["shape"])


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_vm_read() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    return fn


_VM_READ = _libc_vm_read()


def vm_available() -> bool:
    """This platform can copy from another process's memory (Linux ``process_vm_readv``)."""
    return _VM_READ is not None


def _vm_read(pid: int, addr: int, out: np.ndarray) -> None:
    """Copy ``out.nbytes`` bytes at ``addr`` in process ``pid`` into ``out``.

    ctypes releases the GIL for the call, so ranks can be read in parallel threads.
    """
    if _VM_READ is None:
        raise OSError("process_vm_readv is not available on this platform")
    done, total = 0, out.nbytes
    base = out.ctypes.data
    while done < total:
        local = _IOVec(base + done, total - done)
        remote = _IOVec(addr + done, total - done)
        n = _VM_READ(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"reading rank memory (pid {pid}): {os.strerror(err)}")
        done += n


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
