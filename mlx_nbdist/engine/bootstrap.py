"""Join the MLX group on an engine and prepare its namespace.

Starting a group takes three calls from the session, each on every engine:

1. :func:`probe`: who and where this engine is (PID, machine, addresses, whether it
   sees the notebook's process and the session directory). This is how the session
   knows which host an engine runs on and whether it can watch it locally.
2. :func:`free_ports`: a free port on each of this host's ring addresses, so the
   session can write MLX's ring hostfile with addresses and ports that are valid on
   *that* host (a remote host does not share the notebook's ports or disk).
3. :func:`bootstrap`, on every engine at once (the ring backend needs all ranks to
   initialise together), with the hostfile's *content*: it initialises MLX with
   ``strict=True`` (a non-strict init silently gives a group of one), checks the
   group's size and this rank, checks that every member of the ring belongs to
   this session (a stale process from an earlier session on a reused port could
   otherwise join it), and defines ``mx``, ``nn``, ``world``, ``rank`` and ``size``
   for the user's cells.

The session applies these through :mod:`mlx_nbdist.engine.rpc`. Nothing here imports
MLX until :func:`bootstrap` runs, and :func:`bootstrap` sets the backend's environment
(``CUDA_VISIBLE_DEVICES`` for nccl among it) before it imports ``mlx.core``: CUDA reads
that variable once, when the process first touches it. (Under ``mpirun`` the engine's
entry point, :mod:`.mpi_entry`, imports MLX first; that launcher offers ring and mpi
only.)
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..config import INLINE_BACKEND, Backend
from . import cells, output, stacks, state


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Say who and where this engine is (step 1 of a start).

    Args:
        cfg: ``session_dir`` and ``nonce`` (the session wrote the nonce to
            ``session_dir/probe``: reading it back proves a shared disk),
            ``client_pid`` and ``client_started`` (seeing that process proves a
            shared machine and PID space), ``controller_ip`` (to find the address
            this host reaches the controller from).

            ``gpus``: also count this host's NVIDIA GPUs (for nccl), without
            touching CUDA.

    Returns:
        ``pid``, ``started``, ``hostname``, ``machine``, ``addresses`` (IPv4),
        ``route`` (address towards the controller), ``shared_files``, ``sees_client``,
        ``gpus`` (0 unless asked) and ``cuda_visible`` (this engine's
        ``CUDA_VISIBLE_DEVICES``, ``None`` when unset).
    """
    from ..hosts import local_addresses, route_address
    from ..watchdog import start_time

    addresses = local_addresses()
    route = ""
    if cfg.get("controller_ip"):
        try:
            route = route_address(cfg["controller_ip"])  # UDP connect: no packet is sent
        except OSError:
            route = ""
    try:
        shared = (Path(cfg["session_dir"]) / "probe").read_text() == cfg["nonce"]
    except (OSError, KeyError):
        shared = False
    return {
        "pid": os.getpid(),
        "started": start_time(os.getpid()),
        "hostname": socket.gethostname(),
        "machine": machine_id(),
        "addresses": addresses,
        "route": route,
        "shared_files": shared,
        "sees_client": _same_process(int(cfg.get("client_pid", 0)), cfg.get("client_started")),
        "gpus": gpu_count() if cfg.get("gpus") else 0,
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def gpu_count() -> int:
    """NVIDIA GPUs on this host, without initialising CUDA in this process: the
    ``/dev/nvidiaN`` device files, else the lines of ``nvidia-smi -L``; 0 when none."""
    import glob
    import re
    import shutil
    import subprocess

    devices = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    if devices:
        return len(devices)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def machine_id() -> str:
    """Identifies this machine (same kernel, same boot): ``hostname/boot`` (see
    :func:`mlx_nbdist.platform.machine_id`; no ``/proc`` read in portable mode)."""
    from .. import platform

    return platform.machine_id()


def _same_process(pid: int, started: Any) -> bool:
    from ..watchdog import same_process

    return pid > 0 and started is not None and same_process(pid, float(started))


def free_ports(ips: list[str]) -> list[int]:
    """A port nothing listens on right now, on each of ``ips`` (step 2 of a start).

    Raises:
        OSError: an address is not one of this host's (the message names it).
    """
    socks, ports = [], []
    try:
        for ip in ips:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((ip, 0))
            except OSError as e:
                raise OSError(
                    f"cannot listen on {ip} on host {socket.gethostname()}: {e.strerror or e}"
                ) from None
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def warm(backend: str) -> None:
    """Import what :func:`bootstrap` will need, ahead of it (an engine of a spare
    cluster, waiting for a restart). MLX itself too, except for nccl, whose
    environment (``CUDA_VISIBLE_DEVICES``) must be set before MLX loads."""
    from . import monitor, tracker  # noqa: F401 - imported to be ready

    if Backend(backend) != Backend.NCCL:
        import mlx.core  # noqa: F401
        import mlx.nn  # noqa: F401


def bootstrap(cfg: dict[str, Any]) -> dict[str, Any]:
    """Initialise the MLX group on this engine; returns a :class:`RankInfo` as a dict.

    Args:
        cfg: ``rank`` (all but mpi), ``size``, ``backend`` (a :class:`Backend` value),
            ``hostfile_json`` (ring: the hostfile's content; it is written to a
            private file on this host) or ``hostfile`` (a path readable here),
            ``env`` (nccl, jaccl: variables set before MLX is imported, see
            :func:`mlx_nbdist.hosts.nccl_env`), ``env_files`` (``{NAME: content}``:
            each written to a private file on this host, ``NAME`` set to its path,
            removed after MLX read it: jaccl's ``MLX_IBV_DEVICES``),
            ``token`` (an int shared by this session's ranks), ``session_id``,
            ``session_dir``, ``client_pid``, ``client_started``, ``reap_pids``
            (``[pid, start time]`` pairs this rank ends if the client dies),
            ``engine_id``, ``host`` (the name this rank was launched on),
            ``shared_files`` (publish the status
            file in ``session_dir``; else in a private folder on this host),
            ``watch_client`` (end this engine when the client's process is gone;
            only possible when this host sees that process), ``init_barrier`` (ring:
            a folder all ranks see, so that rank 0 starts MLX's init first; see
            :func:`_rank0_first`).
    """
    from .monitor import Monitor
    from .tracker import Tracker

    if state.started():
        raise RuntimeError(f"rank {state.current().rank} is already bootstrapped")
    backend, size = Backend(cfg["backend"]), int(cfg["size"])
    # Left in the notebook's environment by an earlier ``mlx.launch`` run, these would
    # make MLX join *that* group (a group of one blocks trying to reach its ring).
    for var in _MLX_GROUP_VARS:
        os.environ.pop(var, None)
    env = dict(cfg.get("env") or {})
    files = dict(cfg.get("env_files") or {})
    if backend == Backend.RING and size > 1:
        env["MLX_RANK"] = str(cfg["rank"])
        env["MLX_RING_VERBOSE"] = "1"  # see _rank0_first; removed again after the init
        if cfg.get("hostfile_json"):
            files["MLX_HOSTFILE"] = cfg["hostfile_json"]
        else:
            env["MLX_HOSTFILE"] = cfg["hostfile"]
    written = []
    try:
        os.environ.update(env)  # before MLX (and so CUDA) starts in this process
        for name, content in files.items():
            written.append(_private_file(name, content))
            os.environ[name] = written[-1]
        import mlx.core as mx
        import mlx.nn as nn

        if not _available(mx, backend):
            raise RuntimeError(
                backend.unavailable(f"on host {socket.gethostname()}", mx.__version__)
            )
        if cfg.get("init_barrier") and size > 1:
            _rank0_first(Path(cfg["init_barrier"]), int(cfg["rank"]), size)
        if size == 1:
            # A group of one needs no backend (a ring of one cannot connect to itself):
            # MLX's singleton group makes every collective the identity.
            world = mx.distributed.init(strict=False)
        else:
            world = mx.distributed.init(backend=backend.value, strict=True)
    finally:
        for path in written:
            os.unlink(path)  # MLX reads them during init
        os.environ.pop("MLX_RING_VERBOSE", None)
    rank = world.rank()
    if world.size() != size:
        raise RuntimeError(f"rank {rank}: MLX group has size {world.size()}, expected {size}")
    if backend != Backend.MPI and size > 1 and rank != int(cfg["rank"]):
        raise RuntimeError(f"MLX gave rank {rank} to the engine told to be rank {cfg['rank']}")
    if size > 1:
        _check_membership(mx, world, int(cfg["token"]), cfg["session_id"])

    tracker = Tracker(world, rank, size, backend=backend)
    tracker.install()
    device = str(mx.default_device())
    shared = bool(cfg.get("shared_files", True))
    status_dir = (
        cfg["session_dir"]
        if shared
        else tempfile.mkdtemp(prefix=f"mlx_nbdist-{cfg['session_id']}-rank{rank}-")
    )
    monitor = Monitor(
        tracker,
        status_dir,
        client_pid=int(cfg["client_pid"]),
        client_started=float(cfg["client_started"]),
        # (the notebook sends them to one rank: the first that watches it)
        reap_pids={int(pid): float(t) for pid, t in cfg.get("reap_pids", [])},
        device=device,
        watch_client=bool(cfg.get("watch_client", True)),
    )
    st = state.EngineState(world, rank, size, cfg["session_id"], tracker, monitor)
    state.install(st)
    output.install(status_dir, rank)
    main_thread = stacks.install(status_dir, rank)
    _prepare_shell(mx, nn, st)
    monitor.start()
    return {
        "rank": rank,
        "engine_id": int(cfg["engine_id"]),
        "pid": os.getpid(),
        "host": cfg.get("host") or socket.gethostname(),
        "device": device,
        "size": world.size(),
        "backend": backend.value,
        "main_thread": main_thread,
    }


#: how long the ranks wait for each other before MLX's init, and how much later than
#: rank 0 the others start it, seconds
_BARRIER_TIMEOUT, _AFTER_RANK0 = 2.0, 0.02


def _rank0_first(folder: Path, rank: int, size: int) -> None:
    """Let every rank reach MLX's ring init, then rank 0 start it first.

    MLX's ring (0.32) has rank 0 listen, then connect to rank 1, and the last rank
    connect to rank 0, then listen; a connection refused because the other side is
    not listening yet is retried after a back-off of 1 s. Two things lost that
    second in about half of all starts and restarts here (seen in the ring's verbose
    log): the last rank connecting a fraction of a ms before rank 0 listened, and
    rank 0, woken by that connection, connecting back before the last rank listened.
    Against the first, each rank marks its arrival with a file in ``folder`` (a disk
    all ranks share) and, once all arrived, the others start 20 ms after rank 0.
    Against the second, the ring's verbose log is on during the init: the line rank 0
    writes between its accept and its connect lets the other side listen first
    (measured: 0 of 18 restarts lost the second with both, 2 of 6 with the barrier
    alone). A rank that does not arrive within the timeout only costs that wait.
    """
    (folder / f"rank{rank}").touch()
    deadline = time.monotonic() + _BARRIER_TIMEOUT
    while time.monotonic() < deadline:
        if all((folder / f"rank{r}").exists() for r in range(size)):
            break
        time.sleep(0.002)
    if rank > 0:
        time.sleep(_AFTER_RANK0)


def _available(mx: Any, backend: Backend) -> bool:
    try:
        return bool(mx.distributed.is_available(backend.value))
    except TypeError:  # mlx < 0.30.1: is_available() takes no backend
        return False


def _private_file(name: str, content: str) -> str:
    """Write ``content`` to a file only this user reads; returns its path."""
    # the ring's prefix is what ``%mlxdist cleanup`` looks for when a rank died
    kind = "ring" if name == "MLX_HOSTFILE" else name.lower().replace("_", "-")
    fd, path = tempfile.mkstemp(prefix=f"mlx_nbdist-{kind}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(content)
    return path


#: variables with which MLX finds a group to join; this session sets its own
_MLX_GROUP_VARS = (
    "MLX_RANK",
    "MLX_HOSTFILE",
    "MLX_WORLD_SIZE",
    "MLX_RING_VERBOSE",
    "MLX_IBV_DEVICES",
    "MLX_JACCL_COORDINATOR",
    "MLX_JACCL_DEVICES",
    "MLX_JACCL_RING",
    "NCCL_HOST_IP",
    "NCCL_PORT",
)


#: what a rank says when a stranger answered on the group's ports (the notebook side
#: starts again on it: :mod:`mlx_nbdist.session.formation`)
STRANGERS = "do not belong to session"


def _check_membership(mx: Any, world: Any, token: int, session_id: str) -> None:
    tokens = mx.distributed.all_gather(mx.array([token], dtype=mx.int32), group=world)
    got = tokens.tolist()
    strangers = [r for r, t in enumerate(got) if t != token]
    if strangers:
        raise RuntimeError(
            f"ranks {strangers} of the MLX group {STRANGERS} {session_id}: "
            "a process from an earlier session is listening on this session's ports. "
            "Run %mlxdist cleanup, then start again."
        )


def _prepare_shell(mx: Any, nn: Any, st: state.EngineState) -> None:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:  # plain process (tests of the engine code)
        return
    import mlx_nbdist  # its in-cell helpers: shard, plan, generate, load, lora, progress

    ip.user_ns.update(mx=mx, nn=nn, world=st.world, rank=st.rank, size=st.size,
                      mlx_nbdist=mlx_nbdist)
    if "matplotlib" in sys.modules or os.environ.get("MPLBACKEND") != INLINE_BACKEND:
        try:
            ip.run_line_magic("matplotlib", "inline")
        except Exception:  # noqa: BLE001 - figures are optional
            pass
    # else the engine (ipykernel) chose the inline backend: figures show inline once a
    # cell imports matplotlib, which is not imported here (0.45 s of every start)
    cells.install_hooks(ip)
    sys.breakpointhook = functools.partial(_no_debugger, st.rank)


def _no_debugger(rank: int, *args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` on a rank: no terminal to debug in (pdb read nothing and went
    on without a word): say so, and go on."""
    print(f"breakpoint() on rank {rank}: a rank has no terminal to debug in, so it goes on. "
          "To see where the ranks are, run %mlxdist where (or the dashboard); to look at "
          "values, print them, or pull them into the notebook "
          "(mlx_nbdist.current_session().pull('name')).",
          file=sys.stderr)


