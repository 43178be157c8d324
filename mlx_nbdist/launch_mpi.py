"""ipyparallel settings for engines started by ``mpirun`` with MLX's ``mpi`` backend.

The engines run :mod:`mlx_nbdist.engine.mpi_entry`, which initialises MLX's MPI group
before ipyparallel (and so mpi4py) starts; the engine ids then equal the MPI ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: Needed here: we may run as root, and tests oversubscribe 2 cores with 4 ranks.
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


#: What ipyparallel gives the engines through the environment; mpirun only forwards
#: variables to other hosts when told to with ``-x NAME``.
IPP_ENV = ["IPP_CLUSTER_ID", "IPP_CONNECTION_INFO", "IPP_PROFILE_DIR"]


def cluster_kwargs(
    mpirun: str,
    *,
    hostfile: Path | None = None,
    export: list[str] | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``ipyparallel.Cluster`` to launch engines through mpirun.

    Args:
        mpirun: the ``mpirun`` to run.
        hostfile: an Open MPI hostfile (``name slots=k`` lines) placing the ranks on
            several hosts; ``None``: this machine (or what the batch system gives).
        export: environment variables to forward to the ranks (``-x NAME``), needed
            across hosts; the connection info of the controller is always added.
        python: the Python on the hosts (default: this one's path).
    """
    from traitlets.config import Config

    args = list(MPI_ARGS)
    if hostfile is not None:
        args += ["--hostfile", str(hostfile)]
        for name in dict.fromkeys([*IPP_ENV, *(export or [])]):
            args += ["-x", name]
    cfg = Config()
    cfg.MPIEngineSetLauncher.mpi_cmd = [mpirun]
    cfg.MPIEngineSetLauncher.mpi_args = args
    cfg.MPIEngineSetLauncher.engine_cmd = [
        python or sys.executable,
        "-m",
        "mlx_nbdist.engine.mpi_entry",
    ]
    return {"engines": "mpi", "config": cfg}


def engine_env() -> dict[str, str]:
    """Extra environment for the ranks (mpirun's wheel sets OPAL_PREFIX itself)."""
    return {}
