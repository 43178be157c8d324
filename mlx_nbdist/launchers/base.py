"""What every launcher gives a session: the ipyparallel cluster's arguments, the
engines' environment, which engine is which rank and on which host, how to signal a
rank this machine cannot reach by PID, and what to say when starting fails.

A launcher is one class here; :mod:`mlx_nbdist.launchers` keeps the registry that
the magics' ``--launcher`` choices, the kernel and :class:`~mlx_nbdist.Session` read.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config import INLINE_BACKEND, Backend
from ..errors import SetupError

if TYPE_CHECKING:
    from ..hosts import Placement

#: what a launcher hands the session to signal ranks in the background
Job = Callable[[], None]


class Launcher:
    """Starts a session's engines. Subclasses set the class attributes and override
    what differs; the defaults are those of engines on this machine.

    Args:
        placement: the hosts of the ranks (``None``: this machine).
        n: the number of ranks.
        ssh_cmd, scp_cmd: the commands ipyparallel's SSH launcher runs.
        python: the Python interpreter on the hosts (default: this one's path).
    """

    #: the ``--launcher`` name
    name: ClassVar[str] = ""
    #: one line for ``--help`` and the docs
    summary: ClassVar[str] = ""
    #: MLX backends whose groups this launcher's engines can form
    backends: ClassVar[tuple[Backend, ...]] = (Backend.RING, Backend.NCCL, Backend.JACCL)
    #: whether it needs hosts (a placement) / refuses them
    needs_hosts: ClassVar[bool] = False
    takes_hosts: ClassVar[bool] = True

    def __init__(
        self,
        placement: Placement | None = None,
        *,
        n: int = 1,
        ssh_cmd: list[str] | None = None,
        scp_cmd: list[str] | None = None,
        python: str | None = None,
    ):
        self.placement = placement
        self.n = n
        self.ssh_cmd = list(ssh_cmd) if ssh_cmd else None
        self.scp_cmd = list(scp_cmd) if scp_cmd else None
        self.python = python

    # -- checks ---------------------------------------------------------------------
    @property
    def runs_here(self) -> bool:
        """Every rank runs on this machine (no placement): what MLX can do here is
        what the ranks' MLX can do."""
        return self.placement is None

    def check(self, backend: Backend) -> None:
        """Raise :class:`SetupError` naming the fix when this launcher cannot start
        ``backend``'s group with this placement (before any process starts)."""
        if backend in (Backend.NCCL, Backend.JACCL) and self.runs_here:
            check_mlx_backend(backend)
        if backend not in self.backends:
            raise SetupError(
                f"--backend {backend} needs "
                + (
                    "--launcher mpi (the ranks must be started by mpirun)"
                    if backend == Backend.MPI
                    else f"a launcher other than {self.name}"
                )
            )
        if self.needs_hosts and self.placement is None:
            raise SetupError(
                f"--launcher {self.name} needs hosts: give --hostfile FILE or --hosts a,b"
            )
        if not self.takes_hosts and self.placement is not None:
            raise SetupError(
                f"--launcher {self.name} runs every rank on this machine, but "
                f"{self.placement.source} names other hosts: use --launcher ssh "
                "(the default with hosts) or mpi"
            )
        if backend == Backend.JACCL:
            if self.placement is None:
                raise SetupError(
                    "--backend jaccl connects Macs over Thunderbolt RDMA: give --hostfile "
                    'FILE whose hosts list their "rdma" devices (mlx.distributed_config '
                    "--backend jaccl writes one), or use --backend ring"
                )
            from ..hosts import ibv_devices

            ibv_devices(self.placement, ring=self.placement.jaccl_ring)

    # -- starting -------------------------------------------------------------------
    def cluster_kwargs(self, directory: Path) -> dict[str, Any]:
        """Keyword arguments for ``ipyparallel.Cluster`` that choose and configure the
        engine launcher (the session adds the controller's)."""
        return {}

    def engine_env(self) -> dict[str, str]:
        """Environment variables of the engine processes (plus the hostfile's ``envs``)."""
        env = {"PYTHONUNBUFFERED": "1", "MPLBACKEND": INLINE_BACKEND}
        if self.placement is not None:
            env.update(self.placement.env())
        return env

    def start_failure(self, cluster: Any, error: str) -> str:
        """The message for engines that could not be started (``error``: what
        ipyparallel said)."""
        return f"could not start the engines ({self.name} launcher): {error}"

    def host_pids(self, cluster: Any) -> dict[str, set[int]]:
        """PIDs of the engines this launcher started, by host (where it knows them)."""
        return {}

    # -- which engine is which rank -----------------------------------------------
    def assign(self, cluster: Any, probes: dict[int, dict[str, Any]]) -> dict[int, int]:
        """``{rank: engine id}``: engine order unless the launcher knows better."""
        return dict(enumerate(sorted(probes)))

    def host_of(self, rank: int, probe: dict[str, Any]) -> str:
        """The host name rank ``rank`` runs on, from its engine's ``probe``."""
        if self.placement is None:
            return probe["hostname"]
        from ..hosts import match_host

        return match_host(probe, self.placement.distinct(), {}) or probe["hostname"]

    # -- signals ------------------------------------------------------------------
    def remote_signals(
        self, cluster: Any, targets: dict[int, tuple[str, int]], sig: int
    ) -> list[Job]:
        """Jobs that deliver ``sig`` to ranks this machine cannot signal by PID;
        ``targets``: ``{rank: (host, pid)}``. Default: none can be reached."""
        return []


def check_mlx_backend(backend: Backend) -> None:
    """Raise :class:`SetupError` naming the fix when this machine's MLX lacks
    ``backend`` (for ranks that run here: checked before any engine starts)."""
    import mlx.core as mx

    try:
        ok = bool(mx.distributed.is_available(backend.value))
    except TypeError:  # mlx < 0.30.1: is_available() takes no backend
        ok = False
    if not ok:
        raise SetupError(backend.unavailable("on this machine", mx.__version__))


def end_all_engines(cluster: Any, sig: int = signal.SIGKILL) -> list[Job]:
    """One job per engine set that signals the whole set (e.g. an ``mpirun``)."""
    return [lambda es=es: es.signal(sig) for es in cluster.engines.values()]
