"""Move a rank's array to the notebook without pickling it, and without a copy in
the notebook when the rank runs on the notebook's machine.

Three routes, the fastest the notebook offers and the platform allows:

* ``pool`` (a rank on the notebook's host, ``/dev/shm`` writable, slices of at
  least :data:`POOL_MIN` bytes): each rank keeps a pool of shared-memory segments
  that both it and the notebook have mapped. The rank copies the slice into a free
  segment (the ranks copy in parallel, each on its own core); the notebook's array
  *is* the segment, nothing is copied or faulted in on its side. A segment is busy
  while any array in the notebook uses it; the notebook sends the tokens it still
  holds with each request and the rank reuses the others. Free segments beyond
  :data:`POOL_IDLE` bytes per rank are dropped.
* ``vm`` (same host): the rank keeps the array where it is and sends its address;
  the notebook copies it straight out of the rank's memory with Linux's
  ``process_vm_readv`` into an array of its own. Taken when no free segment fits:
  a new segment costs more than this copy (tmpfs pages are allocated and zeroed one
  4 KiB page at a time), so the rank makes one in the background for the next pull.
* elsewhere (another host, macOS's missing ``/dev/shm``) the array travels as an
  out-of-band ipyparallel buffer, still outside the pickle.

Ranks run :func:`pack` and :func:`release`; the notebook holds one :class:`Receiver`
per session.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")
#: smaller slices travel with the reply (a segment would cost more than it saves)
POOL_MIN = 1 << 20
#: free pool memory a rank keeps for reuse; beyond it the oldest free segments go
POOL_IDLE = 256 << 20
#: a segment made for a later pull waits this long (s): made while the notebook is
#: still reading the rank's memory, it halved the speed of that read (2 cores)
MAKE_DELAY = 0.1
_UNIT = 1 << 20  # segment sizes are whole MiB, so slices of similar size share them
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map pages now, not on first touch

_counter = itertools.count()


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


# --------------------------------------------------------------------- rank side
@dataclass
class _Segment:
    token: int
    path: Path
    size: int
    mm: mmap.mmap
    busy: bool = True


#: this rank's pool segments, by token
_POOL: dict[int, _Segment] = {}
#: arrays whose address went to the notebook (``vm``), by token, until it has read them
_PINNED: dict[int, np.ndarray] = {}
_LOCK = threading.Lock()  # _POOL and what follows: segments are also made in a thread
_MAKING: dict[int, threading.Thread] = {}  # segment size -> the thread making it
_DROPPED: list[int] = []  # dropped segments the notebook has not been told of
_REFUSED = [1 << 62]  # the smallest segment size /dev/shm refused


def pack(
    values: np.ndarray, prefix: str | None, routes: tuple[str, ...] = ()
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Describe ``values`` for the trip to the notebook.

    Args:
        values: the array (any layout).
        prefix: this session's shared-memory prefix when the notebook is on this
            host (``None``: send the array itself).
        routes: the local routes the notebook offers (``"pool"``, ``"vm"``).

    Returns:
        ``(info, None)`` with ``info["route"]`` ``pool`` or ``vm``, or ``(info,
        values)``. Return the array as a top-level item of the result tuple:
        ipyparallel sends top-level arrays as raw buffers, nested ones inside the pickle.
    """
    info: dict[str, Any] = {"dtype": values.dtype.str, "shape": values.shape}
    local = prefix is not None and values.nbytes > 0
    if local and "pool" in routes and values.nbytes >= POOL_MIN:
        seg = _lease(prefix, values.nbytes, wait="vm" not in routes)  # type: ignore[arg-type]
        if seg is not None:
            dst = np.frombuffer(seg.mm, np.uint8, count=values.nbytes)
            np.copyto(dst.view(values.dtype).reshape(values.shape), values)
            del dst  # a live export would keep the segment from being dropped later
            info.update(route="pool", pid=os.getpid(), token=seg.token, path=str(seg.path),
                        size=seg.size, drop=_dropped())  # fmt: skip
            return info, None
    values = np.ascontiguousarray(values)
    if local and "vm" in routes:
        token = next(_counter)
        _PINNED[token] = values
        info.update(route="vm", pid=os.getpid(), addr=values.ctypes.data,
                    nbytes=values.nbytes, token=token, drop=_dropped())  # fmt: skip
        return info, None
    return info, values


def release(held: list[int] | None) -> None:
    """Free every lent array and segment except those the notebook still ``held``.

    ``None`` (a caller that takes no part in the protocol) frees nothing. A reply
    that never reached the notebook is not held, so it is freed here too.
    """
    if held is None:
        return
    keep = set(held)
    with _LOCK:
        for t in [t for t in _PINNED if t not in keep]:
            del _PINNED[t]
        for seg in _POOL.values():
            seg.busy = seg.busy and seg.token in keep


def pool_state() -> dict[str, int]:
    """This rank's lent arrays and pool segments (counts and bytes)."""
    with _LOCK:
        busy = [s.size for s in _POOL.values() if s.busy]
        free = [s.size for s in _POOL.values() if not s.busy]
        return {"pinned": len(_PINNED), "busy": len(busy), "free": len(free),
                "busy_bytes": sum(busy), "free_bytes": sum(free)}  # fmt: skip


def settle() -> None:
    """Wait for segments being made in the background (tests, benchmarks)."""
    with _LOCK:
        threads = list(_MAKING.values())
    for t in threads:
        t.join()


def _lease(prefix: str, nbytes: int, *, wait: bool) -> _Segment | None:
    """A free segment of at least ``nbytes``, marked busy.

    When none fits one is made: here and now with ``wait``, else in the background
    for a later pull (``None`` now). ``None`` too when ``/dev/shm`` refuses it.
    """
    need = -(-nbytes // _UNIT) * _UNIT
    with _LOCK:
        fits = [s for s in _POOL.values() if not s.busy and need <= s.size <= 2 * need]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            seg.busy = True
            _trim()
            return seg
        if need >= _REFUSED[0] or (need in _MAKING and not wait):
            return None
        if not wait:
            t = _MAKING[need] = threading.Thread(target=_make, args=(prefix, need, False),
                                                 kwargs={"delay": MAKE_DELAY},
                                                 name="mlx_nbdist-segment", daemon=True)
            t.start()
            return None
    return _make(prefix, need, True)


def _make(prefix: str, size: int, busy: bool, delay: float = 0.0) -> _Segment | None:
    """A new segment, added to the pool (``None``: ``/dev/shm`` refused it)."""
    time.sleep(delay)
    token = next(_counter)
    path = SHM_DIR / f"{prefix}-{os.getpid()}-{token}"
    mm = None
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a write later
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
    except OSError:
        path.unlink(missing_ok=True)
    with _LOCK:
        _MAKING.pop(size, None)
        if mm is None:
            _REFUSED[0] = min(_REFUSED[0], size)
            return None
        seg = _POOL[token] = _Segment(token, path, size, mm, busy)
        _trim()
    return seg


def _trim() -> None:
    """Drop the oldest free segments while the free ones exceed POOL_IDLE (under _LOCK)."""
    free = sorted((s for s in _POOL.values() if not s.busy), key=lambda s: s.token)
    idle = sum(s.size for s in free)
    for seg in free:
        if idle <= POOL_IDLE:
            break
        idle -= seg.size
        del _POOL[seg.token]
        seg.mm.close()
        seg.path.unlink(missing_ok=True)  # the notebook unlinks it once mapped
        _DROPPED.append(seg.token)


def _dropped() -> list[int]:
    with _LOCK:
        out = list(_DROPPED)
        _DROPPED.clear()
    return out


def discard(prefix: str) -> None:
    """Remove shared-memory files left by a session (segments never mapped)."""
    if shm_available():
        for p in SHM_DIR.glob(f"{prefix}-*"):
            p.unlink(missing_ok=True)


def same_host(host: str) -> bool:
    return host == socket.gethostname()


# ----------------------------------------------------------------- notebook side
class _Lease:
    """Owns the view of one pool segment that a notebook array uses; when the last
    array over it is gone the segment is free again (see :meth:`Receiver.held`)."""

    def __init__(self, segment: np.ndarray, info: dict[str, Any]) -> None:
        self.segment = segment  # keeps the mapping alive
        self.__array_interface__ = {
            "shape": tuple(info["shape"]), "typestr": info["dtype"], "version": 3,
            "data": (segment.ctypes.data, False),
        }  # fmt: skip


class RouteRefused(OSError):
    """A local route failed on the notebook's side (``route``: ``pool`` or ``vm``)."""

    def __init__(self, route: str, err: OSError) -> None:
        super().__init__(err.errno, f"{route} transfer refused: {err}")
        self.route = route


class Receiver:
    """The notebook's end of one session's transfers.

    ``routes`` are the local routes offered to the ranks; one that fails here is
    withdrawn by the caller. Thread-safe: arrays may be collected on any thread.
    """

    def __init__(self) -> None:
        self.routes = [r for r, ok in (("pool", shm_available()), ("vm", vm_available())) if ok]
        self._lock = threading.Lock()
        self.request = threading.Lock()  #: held by the caller for one request and reply
        self._segments: dict[tuple[int, int], np.ndarray] = {}  # (pid, token) -> mapping
        self._live: dict[int, tuple[int, set[int]]] = {}  # rank -> (pid, tokens in use)

    def close(self) -> None:
        """Let go of every mapping (the ranks are gone); arrays keep their own."""
        with self._lock:
            self._segments.clear()
            self._live.clear()

    def held(self) -> dict[int, list[int]]:
        """Per rank, the tokens of segments that arrays here still use."""
        with self._lock:
            return {r: sorted(tokens) for r, (_pid, tokens) in self._live.items()}

    def unpack(self, rank: int, info: dict[str, Any] | None, values: Any) -> Any:
        """The notebook side of :func:`pack`: a numpy array (``None`` for no data).

        Raises:
            RouteRefused: the segment cannot be mapped or the rank's memory read.
        """
        if info is None or "route" not in info:
            return values
        self._forget(rank, info["pid"], info.get("drop", ()))
        try:
            if info["route"] == "vm":
                out = np.empty(info["nbytes"], dtype=np.uint8)
                _vm_read(info["pid"], info["addr"], out)
                return out.view(np.dtype(info["dtype"])).reshape(info["shape"])
            return self._from_pool(rank, info)
        except OSError as e:
            raise RouteRefused(info["route"], e) from e

    def _from_pool(self, rank: int, info: dict[str, Any]) -> np.ndarray:
        pid, token = info["pid"], info["token"]
        with self._lock:
            segment = self._segments.get((pid, token))
        if segment is None:
            segment = _map(Path(info["path"]), info["size"])
            with self._lock:
                self._segments[(pid, token)] = segment
        lease = _Lease(segment, info)
        with self._lock:
            self._live.setdefault(rank, (pid, set()))[1].add(token)
        done = weakref.finalize(lease, self._free, rank, pid, token)
        done.atexit = False
        return np.asarray(lease)

    def _forget(self, rank: int, pid: int, dropped: Any) -> None:
        """Unmap segments the rank dropped, and all of a restarted rank's old ones
        (each mapping goes with its last array)."""
        with self._lock:
            old = self._live.get(rank)
            if old is not None and old[0] != pid:
                self._segments = {k: v for k, v in self._segments.items() if k[0] != old[0]}
                del self._live[rank]
            for t in dropped:
                self._segments.pop((pid, t), None)

    def _free(self, rank: int, pid: int, token: int) -> None:
        with self._lock:
            live = self._live.get(rank)
            if live is not None and live[0] == pid:
                live[1].discard(token)


def _map(path: Path, size: int) -> np.ndarray:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)  # both mappings keep the memory; no file is left
    return np.frombuffer(mm, np.uint8)


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
