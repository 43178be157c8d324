"""Move a rank's array to the notebook without pickling it, and without a copy in
the notebook when the rank runs on the notebook's machine.

Three routes (:class:`Route`), the fastest the notebook offers and the platform allows:

* ``pool`` or ``shm`` (a rank on the notebook's host, slices of at least
  :data:`POOL_MIN` bytes): each rank keeps a pool of shared-memory segments
  that both it and the notebook have mapped. The rank copies the slice into a free
  segment (the ranks copy in parallel, each on its own core); the notebook's array
  *is* the segment, nothing is copied or faulted in on its side. A segment is busy
  while any array in the notebook uses it; the notebook sends the tokens it still
  holds with each request and the rank reuses the others. Free segments beyond
  :data:`POOL_IDLE` bytes per rank are dropped. ``pool`` segments are files in
  Linux's ``/dev/shm`` (the fastest: made with ``MAP_POPULATE`` and
  ``posix_fallocate``); ``shm`` segments are POSIX shared memory (``shm_open``), the
  pool on macOS and in portable mode (:mod:`mlx_nbdist.platform`). Those cannot be
  listed on macOS, so each rank keeps the names of its ``shm`` segments in a file,
  ``<tmp>/<prefix>-segments-<pid>.json`` (:func:`registry`, written atomically,
  *before* a segment is made), from which the session's stop and the watchdog
  remove what a dead rank left.
* ``vm`` (same host): the rank keeps the array where it is and sends its address;
  the notebook copies it straight out of the rank's memory with Linux's
  ``process_vm_readv`` into an array of its own. Taken when no free segment fits:
  a new segment costs more than this copy (tmpfs pages are allocated and zeroed one
  4 KiB page at a time), so the rank makes one in the background for the next pull.
* ``buffer`` (another host, small slices, no local route offered) the array travels
  as an out-of-band ipyparallel buffer, still outside the pickle.

This module is the rank's side: :func:`pack` and :func:`release`, run by
``rpc.slice_of``. The notebook's side is :class:`mlx_nbdist.client.transfer.Receiver`,
one per session. Nothing here imports MLX.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import platform
from ..enums import TextEnum
from ..platform import MAP_FLAGS


class Route(TextEnum):
    """How a slice reaches the notebook (the values are what travels)."""

    POOL = "pool"  #: a segment of the rank's pool, a file in /dev/shm (Linux)
    SHM = "shm"  #: a segment of the rank's pool, POSIX shared memory (macOS, portable)
    VM = "vm"  #: the notebook reads the rank's memory (Linux process_vm_readv)
    BUFFER = "buffer"  #: an out-of-band ipyparallel buffer with the reply


SHM_DIR = platform.DEV_SHM
#: smaller slices travel with the reply (a segment would cost more than it saves)
POOL_MIN = 1 << 20
#: free pool memory a rank keeps for reuse; beyond it the oldest free segments go
POOL_IDLE = 256 << 20
#: a segment made for a later pull waits this long (s): made while the notebook is
#: still reading the rank's memory, it halved the speed of that read (2 cores)
MAKE_DELAY = 0.1
_UNIT = 1 << 20  # segment sizes are whole MiB, so slices of similar size share them
_counter = itertools.count()


@dataclass
class _Segment:
    token: int
    route: Route  # POOL: ``path`` is its file; SHM: ``name`` its POSIX name
    path: Path | None
    name: str
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
_NAMES: dict[str, str] = {}  # SHM segments made or being made: name -> prefix


def pack(
    values: np.ndarray, prefix: str | None, routes: tuple[str, ...] = ()
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Describe ``values`` for the trip to the notebook.

    Args:
        values: the array (any layout), in host memory this process owns (the
            ``vm`` route hands its address to the notebook).
        prefix: this session's shared-memory prefix when the notebook is on this
            host (``None``: send the array itself).
        routes: the local routes the notebook offers (:class:`Route` values:
            ``pool`` or ``shm``, and ``vm``).

    Returns:
        ``(info, None)`` with ``info["route"]`` ``pool``, ``shm`` or ``vm``, or
        ``(info, values)`` (``buffer``). Return the array as a top-level item of the
        result tuple: ipyparallel sends top-level arrays as raw buffers, nested ones
        inside the pickle.
    """
    info: dict[str, Any] = {"dtype": values.dtype.str, "shape": values.shape}
    local = prefix is not None and values.nbytes > 0
    pooled = Route.POOL if Route.POOL in routes else Route.SHM if Route.SHM in routes else None
    if local and pooled is not None and values.nbytes >= POOL_MIN:
        seg = _lease(prefix, values.nbytes, pooled,  # type: ignore[arg-type]
                     wait=Route.VM not in routes)
        if seg is not None:
            dst = np.frombuffer(seg.mm, np.uint8, count=values.nbytes)
            np.copyto(dst.view(values.dtype).reshape(values.shape), values)
            del dst  # a live export would keep the segment from being dropped later
            info.update(route=seg.route.value, pid=os.getpid(), token=seg.token,
                        size=seg.size, drop=_dropped())  # fmt: skip
            if seg.path is not None:
                info["path"] = str(seg.path)
            else:
                info["name"] = seg.name
            return info, None
    values = np.ascontiguousarray(values)
    if local and Route.VM in routes:
        token = next(_counter)
        _PINNED[token] = values
        info.update(route=Route.VM.value, pid=os.getpid(), addr=values.ctypes.data,
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


def shm_name(prefix: str, pid: int, token: int) -> str:
    """The POSIX name of a ``shm`` segment: ``/mlxnb.<hash of prefix>.<pid>.<token>``.

    Short (macOS allows 31 characters), and never like the ``pool`` route's files
    (``<prefix>-<pid>-<token>``), so the two cannot be confused in ``/dev/shm``.
    """
    tag = hashlib.blake2b(prefix.encode(), digest_size=3).hexdigest()
    return f"/mlxnb.{tag}.{pid:x}.{token:x}"


def registry(prefix: str, pid: int | str | None = None) -> Path:
    """The file listing the ``shm`` segment names that rank ``pid`` (default: this
    process) made for ``prefix``; ``pid="*"`` gives the pattern of all of them."""
    pid = os.getpid() if pid is None else pid
    return Path(tempfile.gettempdir()) / f"{prefix}-segments-{pid}.json"


def _lease(prefix: str, nbytes: int, route: Route = Route.POOL, *,
           wait: bool) -> _Segment | None:
    """A free segment of at least ``nbytes`` for ``route``, marked busy.

    When none fits one is made: here and now with ``wait``, else in the background
    for a later pull (``None`` now). ``None`` too when the system refuses it.
    """
    need = -(-nbytes // _UNIT) * _UNIT
    with _LOCK:
        fits = [s for s in _POOL.values()
                if not s.busy and s.route is route and need <= s.size <= 2 * need]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            seg.busy = True
            _trim()
            return seg
        if need >= _REFUSED[0] or (need in _MAKING and not wait):
            return None
        if not wait:
            t = _MAKING[need] = threading.Thread(target=_make, args=(prefix, need, False),
                                                 kwargs={"delay": MAKE_DELAY, "route": route},
                                                 name="mlx_nbdist-segment", daemon=True)
            t.start()
            return None
    return _make(prefix, need, True, route=route)


def _make(prefix: str, size: int, busy: bool, delay: float = 0.0,
          route: Route = Route.POOL) -> _Segment | None:
    """A new segment, added to the pool (``None``: the system refused it)."""
    time.sleep(delay)
    token = next(_counter)
    path: Path | None = None
    name = ""
    mm = None
    if route is Route.SHM:
        name = shm_name(prefix, os.getpid(), token)
        with _LOCK:
            _NAMES[name] = prefix
            _record(prefix)  # before it exists: a rank killed now leaves nothing unnamed
        try:
            mm = platform.shm_create(name, size)
        except (OSError, ValueError):
            mm = None
    else:
        path = SHM_DIR / f"{prefix}-{os.getpid()}-{token}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a write later
                mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
            finally:
                os.close(fd)
        except OSError:
            path.unlink(missing_ok=True)
    with _LOCK:
        _MAKING.pop(size, None)
        if mm is None:
            if name:
                _NAMES.pop(name, None)
                _record(prefix)
            _REFUSED[0] = min(_REFUSED[0], size)
            return None
        seg = _POOL[token] = _Segment(token, route, path, name, size, mm, busy)
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
        # the notebook unlinks a segment once mapped; this one may never have been
        if seg.path is not None:
            seg.path.unlink(missing_ok=True)
        else:
            platform.shm_unlink(seg.name)
            _record(_NAMES.pop(seg.name, ""))
        _DROPPED.append(seg.token)


def _record(prefix: str) -> None:
    """Rewrite ``prefix``'s registry of this rank's ``shm`` names (under _LOCK);
    removed when it lists none."""
    if not prefix:
        return
    path = registry(prefix)
    names = sorted(n for n, p in _NAMES.items() if p == prefix)
    if not names:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(names, f)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _dropped() -> list[int]:
    with _LOCK:
        out = list(_DROPPED)
        _DROPPED.clear()
    return out


def same_host(host: str) -> bool:
    """Whether ``host`` (the notebook's hostname) is this rank's host."""
    return host == socket.gethostname()
