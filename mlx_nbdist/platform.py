"""What this platform offers mlx_nbdist's data paths, and portable mode.

Linux gives three things that macOS (Apple Silicon) lacks: ``/proc``, a writable
``/dev/shm`` (the slice pool's files) and ``process_vm_readv`` (the notebook reading
a rank's memory). Each question takes the environment (``env``, default
``os.environ``) and the platform (``system``, default ``sys.platform``), so tests
can ask about a Mac here.

**Portable mode**: ``MLX_NBDIST_PORTABLE=1`` (also ``true``/``yes``) in the
notebook's environment, which the ranks inherit, makes mlx_nbdist behave as on
macOS: no reads of ``/proc`` of its own (psutil still reads it, as psutil does), no
``/dev/shm`` path, no ``process_vm_readv``. The slice pool then lives in POSIX
shared memory (``shm_open``), as on a Mac, so ``make test`` exercises a Mac's routes
on Linux.

This module is also the one adapter over CPython's private ``_posixshmem``
(``shm_open``/``shm_unlink``, what ``multiprocessing.shared_memory`` is built on).
Why not ``SharedMemory`` itself: before Python 3.13 it registers every segment it
creates *or attaches to* with multiprocessing's resource tracker, a helper process
per rank and per notebook that unlinks the segments (with a warning) when that
process exits. A rank's segment belongs to the notebook once mapped, so that would
unlink or warn about segments the protocol still uses; ``track=False`` exists only
from 3.13.

Standard library only (no MLX, no psutil at import): the watchdog, a plain script,
loads this file by path.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

try:  # CPython on POSIX; absent on Windows and some other builds
    import _posixshmem
except ImportError:  # pragma: no cover - every platform MLX runs on has it
    _posixshmem = None

#: the setting that turns portable mode on
PORTABLE_ENV = "MLX_NBDIST_PORTABLE"
_TRUE = {"1", "true", "yes", "on"}
DEV_SHM = Path("/dev/shm")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: how both sides map a segment: shared, its pages mapped now (Linux) not on first touch
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: the longest POSIX shared-memory name macOS accepts, the leading slash included
SHM_NAME_MAX = 31


def portable(env: Mapping[str, str] | None = None) -> bool:
    """Portable mode is on (``MLX_NBDIST_PORTABLE`` is ``1``, ``true`` or ``yes``)."""
    value = (os.environ if env is None else env).get(PORTABLE_ENV, "")
    return value.strip().lower() in _TRUE


def _linux(system: str | None) -> bool:
    return (sys.platform if system is None else system).startswith("linux")


def has_proc(env: Mapping[str, str] | None = None, system: str | None = None) -> bool:
    """mlx_nbdist may read ``/proc`` (Linux, not portable)."""
    return _linux(system) and not portable(env) and Path("/proc/self").is_dir()


def has_dev_shm(env: Mapping[str, str] | None = None, system: str | None = None) -> bool:
    """The slice pool may use files in a writable ``/dev/shm`` (Linux, not portable)."""
    return (_linux(system) and not portable(env) and DEV_SHM.is_dir()
            and os.access(DEV_SHM, os.W_OK))  # fmt: skip


def has_vm_read(env: Mapping[str, str] | None = None, system: str | None = None) -> bool:
    """The notebook may copy out of a rank's memory with ``process_vm_readv``
    (Linux, not portable; the ptrace rules may still refuse it per process)."""
    return _linux(system) and not portable(env)


def has_posix_shm() -> bool:
    """POSIX shared memory (``shm_open``) is there: the slice pool without ``/dev/shm``."""
    return _posixshmem is not None


def machine_id(env: Mapping[str, str] | None = None, system: str | None = None) -> str:
    """Identifies this machine (same kernel, same boot): ``hostname/boot``.

    ``boot`` is the kernel's own id of this boot, which no clock moves: Linux's boot id
    where ``/proc`` may be read, macOS's ``kern.bootsessionuuid``. Else (portable
    mode, or no answer) the boot time in whole seconds (psutil; imported here only,
    so this module loads without it), which a clock stepped or slewed across a second
    moves: the notebook and a rank that read it on either side of the move (a spare
    probed before a Mac slept, the restart after) took one machine for two.
    """
    boot = ""
    if has_proc(env, system):
        try:
            boot = BOOT_ID.read_text().strip()
        except OSError:
            boot = ""
    elif (sys.platform if system is None else system) == "darwin":
        # (this process's own: one sysctl a process; asked with env, each time)
        boot = _boot_session() if env is None else _sysctl("kern.bootsessionuuid", env)
    if not boot:
        import psutil

        boot = f"{psutil.boot_time():.0f}"
    return f"{socket.gethostname()}/{boot}"


@functools.cache
def _boot_session() -> str:
    return _sysctl("kern.bootsessionuuid")


def _sysctl(name: str, env: Mapping[str, str] | None = None) -> str:
    """``sysctl -n name`` (macOS, BSD); ``""`` when it gives no answer."""
    import shutil
    import subprocess

    path = (os.environ if env is None else env).get("PATH", "")
    # (an empty entry would be the working directory)
    dirs = [d for d in path.split(os.pathsep) if d] + ["/usr/sbin", "/sbin"]
    exe = shutil.which("sysctl", path=os.pathsep.join(dirs))
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


# --------------------------------------------------------- POSIX shared memory
def _need_shm() -> None:
    if _posixshmem is None:
        raise OSError("this Python has no POSIX shared memory (_posixshmem is missing)")


def _check_name(name: str) -> None:
    if not name.startswith("/") or "/" in name[1:] or len(name) > SHM_NAME_MAX:
        raise ValueError(f"bad shared-memory name {name!r}: '/' then at most "
                         f"{SHM_NAME_MAX - 1} characters, no other '/'")  # fmt: skip


def shm_create(name: str, size: int) -> mmap.mmap:
    """A new shared-memory segment ``name`` (``/...``) of ``size`` bytes, mapped.

    Raises:
        FileExistsError: ``name`` exists already.
        OSError: the system refused it (no memory, name too long); nothing is left.
    """
    _need_shm()
    _check_name(name)
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):  # Linux: ENOSPC now, not SIGBUS on a write later
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=MAP_FLAGS)
    except OSError:
        shm_unlink(name)
        raise
    finally:
        os.close(fd)


def shm_attach(name: str, size: int) -> mmap.mmap:
    """Map the first ``size`` bytes of the existing segment ``name``.

    Raises:
        FileNotFoundError: no such segment (unlinked, or its rank's machine differs).
    """
    _need_shm()
    _check_name(name)
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, size, flags=MAP_FLAGS)
    finally:
        os.close(fd)


def shm_unlink(name: str) -> bool:
    """Remove the segment ``name`` (mappings keep its memory); ``False`` if it was gone."""
    _need_shm()
    _check_name(name)
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        return False
    return True
