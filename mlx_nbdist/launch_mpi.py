"""ipyparallel settings for engines started by ``mpirun`` with MLX's ``mpi`` backend.

The engines run :mod:`mlx_nbdist.engine.mpi_entry`, which initialises MLX's MPI group
before ipyparallel (and so mpi4py) starts; the engine ids then equal the MPI ranks.
"""

from __future__ import annotations

import sys
from typing import Any

#: Needed here: we may run as root, and tests oversubscribe 2 cores with 4 ranks.
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def cluster_kwargs(mpirun: str) -> dict[str, Any]:
    """Keyword arguments for ``ipyparallel.Cluster`` to launch engines through mpirun."""
    from traitlets.config import Config

    cfg = Config()
    cfg.MPIEngineSetLauncher.mpi_cmd = [mpirun]
    cfg.MPIEngineSetLauncher.mpi_args = list(MPI_ARGS)
    cfg.MPIEngineSetLauncher.engine_cmd = [sys.executable, "-m", "mlx_nbdist.engine.mpi_entry"]
    return {"engines": "mpi", "config": cfg}


def engine_env() -> dict[str, str]:
    """Extra environment for the ranks (mpirun's wheel sets OPAL_PREFIX itself)."""
    return {}
