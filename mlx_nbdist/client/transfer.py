"""The notebook's end of slice transfers: one :class:`Receiver` per session.

:meth:`Receiver.pull` runs the whole exchange: it asks every rank for its slice
(``rpc.slice_of``) offering the local routes this process can take and the segments
its arrays still use, then turns each answer into a numpy array. The routes (a
shared-memory pool of ``/dev/shm`` files or of POSIX shared memory, reading the
rank's memory, an ipyparallel buffer) and the rank's side are described in
:mod:`mlx_nbdist.engine.transfer`; what this platform allows (and portable mode) in
:mod:`mlx_nbdist.platform`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import platform, watchdog
from ..engine import rpc
from ..engine.transfer import SHM_DIR, Route, registry
from ..platform import MAP_FLAGS

#: ``apply(fn, *args) -> {rank: fn's result}``: runs ``fn`` on every rank
Apply = Callable[..., dict[int, Any]]


def shm_available() -> bool:
    """The ``pool`` route: a writable ``/dev/shm`` that portable mode does not rule out."""
    return platform.has_dev_shm()


def local_routes() -> list[Route]:
    """The local routes this process can take, fastest first: a pool of ``/dev/shm``
    files, else of POSIX shared memory (macOS, portable mode); reading rank memory."""
    routes = []
    if shm_available():
        routes.append(Route.POOL)
    elif platform.has_posix_shm():
        routes.append(Route.SHM)
    if vm_available():
        routes.append(Route.VM)
    return routes


def discard(prefix: str) -> int:
    """Remove the shared memory a session's ranks left (segments never mapped, or
    made by a rank that died): its ``/dev/shm`` files, and the POSIX segments its
    ranks' registries name (the registries too). Call it once the ranks are gone;
    returns how many segments it removed."""
    removed = 0
    if shm_available():
        for p in SHM_DIR.glob(f"{prefix}-*"):
            try:
                p.unlink()
                removed += 1
            except OSError:
                pass
    pattern = registry(prefix, "*")
    return removed + watchdog.unlink_registered(list(pattern.parent.glob(pattern.name)))


class Lease:
    """Owns the view of one pool segment that a notebook array uses (the array's
    base); when the last array over it is gone the segment is free again (see
    :meth:`Receiver.held`)."""

    def __init__(self, segment: np.ndarray, info: dict[str, Any]) -> None:
        self.segment = segment  # keeps the mapping alive
        self.__array_interface__ = {
            "shape": tuple(info["shape"]), "typestr": info["dtype"], "version": 3,
            "data": (segment.ctypes.data, False),
        }  # fmt: skip


class RouteRefused(OSError):
    """A local route failed on the notebook's side (``route``: ``pool``, ``shm`` or ``vm``)."""

    def __init__(self, route: Route, err: OSError) -> None:
        super().__init__(err.errno, f"{route} transfer refused: {err}")
        self.route = route


class Receiver:
    """The notebook's end of one session's transfers.

    ``routes`` are the local routes offered to the ranks; one that fails here is
    withdrawn (:meth:`pull`). Thread-safe: arrays may be collected on any thread.
    """

    def __init__(self) -> None:
        self.routes: list[Route] = local_routes()
        self._lock = threading.Lock()
        #: held for one request and its reply: what the notebook holds must not change
        #: while a request that lists it is out
        self.request = threading.Lock()
        self._segments: dict[tuple[int, int], np.ndarray] = {}  # (pid, token) -> mapping
        self._live: dict[int, tuple[int, set[int]]] = {}  # rank -> (pid, tokens in use)

    def pull(self, apply: Apply, expr: str, max_elements: int | None, shm_prefix: str
             ) -> list[tuple[dict[str, Any], Any]]:
        """Every rank's slice of ``expr``: ``(metadata, values)`` per rank that holds
        it, by rank (every rank is asked in one request; a pipeline stage that does
        not hold ``expr`` answers ``None``).

        Args:
            apply: runs a function on every rank (the session's ``apply``, with the
                caller's handling of the ranks' errors).
            expr: a parameter path (``model.layers.0.weight``) or an array's name.
            max_elements: a strided sample of larger slices (``None``: all of it).
            shm_prefix: the session's prefix of shared-memory files.
        """
        while True:
            with self.request:
                got = self._ask(apply, expr, max_elements, shm_prefix, absent_ok=True)
                if not got:  # no rank holds it: the ranks' own lookup error, strictly
                    got = self._ask(apply, expr, max_elements, shm_prefix, absent_ok=False)
                try:
                    datas = self._unpack_all(got)
                except RouteRefused as e:
                    self.routes.remove(e.route)  # e.g. ptrace rules forbid reading rank memory
                    continue
            return [(meta, data) for (_r, (meta, _i, _v)), data in zip(got, datas, strict=True)]

    def _ask(self, apply: Apply, expr: str, max_elements: int | None, shm_prefix: str,
             *, absent_ok: bool) -> list[tuple[int, Any]]:
        """One ``slice_of`` request (under :attr:`request`): the answers by rank,
        without those of ranks that do not hold ``expr``."""
        got = apply(rpc.slice_of, expr, max_elements, shm_prefix, socket.gethostname(),
                    tuple(self.routes), self.held(), absent_ok)
        return sorted((r, v) for r, v in got.items() if v is not None)

    def _unpack_all(self, got: list[tuple[int, Any]]) -> list[Any]:
        vm = sum(1 for _, (_m, info, _v) in got if info and info.get("route") == "vm")
        # ranks read in parallel where cores are to spare (measured on 2 cores: two
        # reader threads halve the median but, competing with the engines and the
        # controller, take 3-6x longer one time in ten; one thread never did)
        workers = min(vm, (os.cpu_count() or 1) // 2)
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(lambda g: self.unpack(g[0], *g[1][1:]), got))
        return [self.unpack(r, info, values) for r, (_m, info, values) in got]

    def close(self) -> None:
        """Let go of every mapping (the ranks are gone); arrays keep their own."""
        with self._lock:
            self._segments.clear()
            self._live.clear()

    def held(self) -> dict[int, list[int]]:
        """Per rank, the tokens of segments that arrays here still use."""
        with self._lock:
            return {r: sorted(tokens) for r, (_pid, tokens) in self._live.items()}

    def mapped(self) -> int:
        """How many of the ranks' pool segments are mapped here."""
        with self._lock:
            return len(self._segments)

    def unpack(self, rank: int, info: dict[str, Any] | None, values: Any) -> Any:
        """The notebook side of ``engine.transfer.pack``: a numpy array (``None`` for
        no data).

        Raises:
            RouteRefused: the segment cannot be mapped or the rank's memory read.
        """
        if info is None or "route" not in info:
            return values
        self._forget(rank, info["pid"], info.get("drop", ()))
        route = Route(info["route"])
        try:
            if route is Route.VM:
                out = np.empty(info["nbytes"], dtype=np.uint8)
                vm_read(info["pid"], info["addr"], out)
                return out.view(np.dtype(info["dtype"])).reshape(info["shape"])
            return self._from_pool(rank, info)
        except OSError as e:
            raise RouteRefused(route, e) from e

    def _from_pool(self, rank: int, info: dict[str, Any]) -> np.ndarray:
        pid, token = info["pid"], info["token"]
        with self._lock:
            segment = self._segments.get((pid, token))
        if segment is None:
            if "name" in info:  # Route.SHM
                segment = _map_shm(info["name"], info["size"])
            else:
                segment = _map(Path(info["path"]), info["size"])
            with self._lock:
                self._segments[(pid, token)] = segment
        lease = Lease(segment, info)
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
        mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)  # both mappings keep the memory; no file is left
    return np.frombuffer(mm, np.uint8)


def _map_shm(name: str, size: int) -> np.ndarray:
    try:
        mm = platform.shm_attach(name, size)
    except ValueError as e:  # a name no rank of ours makes
        raise OSError(f"shared-memory segment {name!r}: {e}") from e
    finally:
        try:
            platform.shm_unlink(name)  # the mappings keep the memory; no name is left
        except (OSError, ValueError):
            pass
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
    """This platform can copy from another process's memory (Linux ``process_vm_readv``,
    not in portable mode)."""
    return _VM_READ is not None and platform.has_vm_read()


def vm_read(pid: int, addr: int, out: np.ndarray) -> None:
    """Copy ``out.nbytes`` bytes at ``addr`` in process ``pid`` into ``out``.

    ctypes releases the GIL for the call, so ranks can be read in parallel threads.
    """
    if not vm_available():
        raise OSError("process_vm_readv is not available on this platform "
                      f"(or portable mode is on: {platform.PORTABLE_ENV})")
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
