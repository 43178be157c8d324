"""Join the MLX group on an engine and prepare its namespace.

The session calls :func:`bootstrap` on every engine at once (the ring backend needs
all ranks to initialise together). It initialises MLX with ``strict=True`` (a
non-strict init silently gives a group of one), checks the group's size and this
rank, checks that every member of the ring belongs to this session (a stale
process from an earlier session on a reused port could otherwise join it), and
defines ``mx``, ``nn``, ``world``, ``rank`` and ``size`` for the user's cells.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from .monitor import Monitor
from .tracker import Tracker


@dataclass
class EngineState:
    """What the bootstrap installed on this engine."""

    world: Any
    rank: int
    size: int
    session_id: str
    tracker: Tracker
    monitor: Monitor


_STATE: EngineState | None = None


def current() -> EngineState:
    """The engine's state; raises when called outside a started rank."""
    if _STATE is None:
        raise RuntimeError(
            "this code must run inside a %%mlxdist cell on a started rank "
            "(mlx_nbdist's bootstrap has not run in this process)"
        )
    return _STATE


def bootstrap(cfg: dict[str, Any]) -> dict[str, Any]:
    """Initialise the MLX group on this engine; returns a :class:`RankInfo` as a dict.

    Args:
        cfg: ``rank`` (ring only), ``size``, ``backend`` (``ring`` or ``mpi``),
            ``hostfile`` (ring), ``token`` (an int shared by this session's ranks),
            ``session_id``, ``session_dir``, ``client_pid``, ``client_started``,
            ``reap_pids`` (PIDs rank 0 ends if the client dies), ``engine_id``.
    """
    global _STATE
    import mlx.core as mx
    import mlx.nn as nn

    if _STATE is not None:
        raise RuntimeError(f"rank {_STATE.rank} is already bootstrapped")
    backend, size = cfg["backend"], int(cfg["size"])
    if not mx.distributed.is_available(backend):
        raise RuntimeError(
            f"this MLX build has no '{backend}' distributed backend "
            f"(mlx {mx.__version__}); install mlx>=0.29 with distributed support"
        )
    if size == 1:
        # A group of one needs no backend (a ring of one cannot connect to itself):
        # MLX's singleton group makes every collective the identity.
        world = mx.distributed.init(strict=False)
    else:
        if backend == "ring":
            os.environ["MLX_RANK"] = str(cfg["rank"])
            os.environ["MLX_HOSTFILE"] = cfg["hostfile"]
        world = mx.distributed.init(backend=backend, strict=True)
    rank = world.rank()
    if world.size() != size:
        raise RuntimeError(f"rank {rank}: MLX group has size {world.size()}, expected {size}")
    if backend == "ring" and rank != int(cfg["rank"]):
        raise RuntimeError(f"MLX gave rank {rank} to the engine told to be rank {cfg['rank']}")
    if size > 1:
        _check_membership(mx, world, int(cfg["token"]), cfg["session_id"])

    tracker = Tracker(world, rank, size)
    tracker.install()
    device = str(mx.default_device())
    monitor = Monitor(
        tracker,
        cfg["session_dir"],
        client_pid=int(cfg["client_pid"]),
        client_started=float(cfg["client_started"]),
        reap_pids=list(cfg.get("reap_pids", [])) if rank == 0 else [],
        device=device,
    )
    _STATE = EngineState(world, rank, size, cfg["session_id"], tracker, monitor)
    _prepare_shell(mx, nn, _STATE)
    monitor.start()
    return {
        "rank": rank,
        "engine_id": int(cfg["engine_id"]),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": device,
        "size": world.size(),
        "backend": backend,
    }


def _check_membership(mx: Any, world: Any, token: int, session_id: str) -> None:
    tokens = mx.distributed.all_gather(mx.array([token], dtype=mx.int32), group=world)
    got = tokens.tolist()
    strangers = [r for r, t in enumerate(got) if t != token]
    if strangers:
        raise RuntimeError(
            f"ranks {strangers} of the MLX group do not belong to session {session_id}: "
            "a process from an earlier session is listening on this session's ports. "
            "Run %mlxdist cleanup, then start again."
        )


def _prepare_shell(mx: Any, nn: Any, st: EngineState) -> None:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:  # plain process (tests of the engine code)
        return
    ip.user_ns.update(mx=mx, nn=nn, world=st.world, rank=st.rank, size=st.size)
    try:
        ip.run_line_magic("matplotlib", "inline")
    except Exception:  # noqa: BLE001 - figures are optional
        pass

    def pre_run_cell(info: Any) -> None:
        begin(_cell_meta(ip))

    def post_run_cell(result: Any) -> None:
        st.monitor.cell_finished("ok" if result.success else type(result.error_in_exec).__name__)

    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)


def begin(meta: dict[str, Any]) -> None:
    """Start a cell or apply on this rank: cell number, active ranks, check mode."""
    st = current()
    cell = int(meta.get("cell", 0))
    st.tracker.begin_cell(cell, meta.get("ranks"), bool(meta.get("check")))
    st.monitor.cell_started(cell)


def _cell_meta(ip: Any) -> dict[str, Any]:
    """The session sends a cell's metadata as the execute request's label."""
    try:
        label = ip.kernel.get_parent()["metadata"].get("label") or ""
    except Exception:  # noqa: BLE001 - no kernel (plain shell): no metadata
        return {}
    if not label.startswith('{"mlxdist"'):
        return {}
    return json.loads(label)


def call(meta: dict[str, Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` for :meth:`Session.apply` with the cell's metadata in effect."""
    begin(meta)
    status = "ok"
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        status = type(e).__name__
        raise
    finally:
        current().monitor.cell_finished(status)


def drain(records: list[dict[str, Any]]) -> list[str]:
    """Replay a stuck peer's collectives here (see :func:`tracker.drain`)."""
    from .tracker import drain as _drain

    return _drain(current().tracker, records)


def heartbeat() -> float:
    """A trivial call used to check that an engine answers."""
    return time.time()
