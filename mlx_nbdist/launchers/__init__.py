"""The launchers, one class each, behind one registry.

Adding a launcher (Slurm's ``srun``, ``mlx.launch`` …) is adding a class to a module
here and a line to :data:`LAUNCHERS`; the magics' ``--launcher`` choices, the kernel
and :class:`~mlx_nbdist.Session` read the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import Backend
from ..errors import SetupError
from .base import Launcher
from .local import LocalLauncher
from .mpi import MPILauncher
from .ssh import SSHLauncher

if TYPE_CHECKING:
    from ..hosts import Placement

LAUNCHERS: dict[str, type[Launcher]] = {
    cls.name: cls for cls in (LocalLauncher, SSHLauncher, MPILauncher)
}


def default_name(backend: Backend | str, placement: Placement | None) -> str:
    """``mpi`` for the mpi backend, else ``ssh`` with hosts, else ``local``."""
    if backend == Backend.MPI:
        return MPILauncher.name
    return SSHLauncher.name if placement is not None else LocalLauncher.name


def backend_of(name: Any) -> Backend:
    """The :class:`Backend` called ``name``, or a :class:`SetupError` listing them."""
    try:
        return Backend(name)
    except ValueError:
        raise SetupError(
            f"unknown backend {name!r}; choose one of {', '.join(b.value for b in Backend)}"
        ) from None


def create(name: str, placement: Placement | None, n: int, **options: Any) -> Launcher:
    """An instance of the launcher called ``name`` for ``n`` ranks."""
    cls = LAUNCHERS.get(name)
    if cls is None:
        raise SetupError(f"unknown launcher {name!r}; choose one of {', '.join(LAUNCHERS)}")
    return cls(placement, n=n, **options)


__all__ = ["LAUNCHERS", "Launcher", "backend_of", "create", "default_name"]
