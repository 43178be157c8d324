"""Engines started ahead of the first start.

``%load_ext mlx_nbdist`` (and :func:`mlx_nbdist.prewarm`) brings up a spare cluster
(:class:`~.spare.Spare`) for the session a plain ``%mlxdist start`` asks for, the
default number of ranks and backend on local engines, while the user reads and
runs the cells before it. A start that asks for the same, with the same environment
and working folder, forms its group on those engines, which already imported MLX
and answered the probe (about 0.2 s for 2 ranks here, against 1.3-1.5 s for a start
that launches them); any other start ends them first and starts its own. A start
asked for while they still come up waits for them, which is never slower than
launching new ones then.

There is one standby per process, never running a cell; the watchdog of its cluster
ends it if the notebook's process is gone, and it is ended at exit, by
``%unload_ext`` and by :func:`discard`. Off with ``MLX_NBDIST_PREWARM=0`` in the
environment or ``c.MLXDist.prewarm = False`` in an IPython profile's config.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import config, launchers
from .. import hosts as _hosts
from ..config import Backend
from ..launchers.local import LocalLauncher
from .cluster import Cluster, check_n
from .spare import Spare, SpareState, local_bring_up, spare_record

#: ``MLX_NBDIST_PREWARM=0`` (or ``false``, ``no``, ``off``) turns it off
ENV = "MLX_NBDIST_PREWARM"

Progress = Callable[[str], None]


@dataclass
class _Standby:
    spare: Spare
    n: int
    backend: Backend


_lock = threading.Lock()
_held: _Standby | None = None


def enabled(env: dict[str, str] | None = None) -> bool:
    """Whether :data:`ENV` allows a standby (it does unless set to 0/false/no/off)."""
    value = (os.environ if env is None else env).get(ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


def prewarm(n: int = config.N, backend: str | Backend = config.BACKEND) -> bool:
    """Start bringing up local engines for a session of ``n`` ranks on ``backend``, in
    the background; ``False`` (and nothing started) when :func:`enabled` says no, a
    standby is already held, or that session would not use local engines (another
    backend's launcher, a Slurm allocation of several nodes)."""
    global _held
    check_n(n)
    backend = launchers.backend_of(str(backend))
    if not enabled() or not local(n, backend):
        return False
    with _lock:
        if _held is not None:
            return False
        cluster = Cluster(launchers.create(LocalLauncher.name, None, n), n, config.START_TIMEOUT)
        record = lambda c: spare_record(c, n=n, backend=backend)  # noqa: E731
        _held = _Standby(Spare(cluster, local_bring_up(backend, record)), n, backend)
    return True


def local(n: int, backend: Backend) -> bool:
    """Whether a plain start of ``n`` ranks on ``backend`` launches local engines."""
    try:
        placement = _hosts.resolve(n=n)
    except Exception:  # noqa: BLE001 - a bad setting: the start itself will say so
        return False
    return placement is None and launchers.default_name(backend, None) == LocalLauncher.name


def take(n: int, backend: Backend, say: Progress) -> Cluster | None:
    """The standby's cluster when it was brought up for ``n`` ranks on ``backend``
    and still fits (see :meth:`Spare.take`), waiting for it if it is still coming
    up; else ``None``, and whatever it started is ended (``say`` tells why)."""
    global _held
    with _lock:
        held, _held = _held, None
    if held is None:
        return None
    if (held.n, held.backend) != (n, backend):
        say(
            f"the engines started ahead were for {held.n} rank{'s' * (held.n != 1)} "
            f"({held.backend}): ending them, starting new ones"
        )
        _end_later(held)
        return None
    try:
        if held.spare.state == SpareState.STARTING:
            say("waiting for the engines started ahead, still starting")
        cluster = held.spare.take()
    except BaseException:  # Ctrl-C while waiting: nothing of it may stay behind
        held.spare.discard()
        raise
    if cluster is None:
        say(
            f"the engines started ahead are not usable ({held.spare.why() or 'stopped'}): "
            "starting new ones"
        )
    return cluster


def state() -> SpareState:
    """``starting``, ``ready``, ``failed``, or ``none`` when no standby is held."""
    held = _held
    return held.spare.state if held is not None else SpareState.NONE


def engine_pids() -> list[int]:
    """The standby's engine processes (``[]`` when none is held or none started yet)."""
    held = _held
    return held.spare.cluster.engine_pids() if held is not None else []


def discard(wait: bool = True) -> None:
    """End the standby's processes, if one is held (``wait=False``: in the
    background, so that a start that will not use them does not wait for it)."""
    global _held
    with _lock:
        held, _held = _held, None
    if held is not None:
        if wait:
            held.spare.discard()
        else:
            _end_later(held)


def _end_later(held: _Standby) -> None:
    """End ``held`` in a thread of its own: its bring-up stops at its next step, and
    its processes are ended then (at exit, the watchdog of its cluster does it)."""
    held.spare.cancel()
    threading.Thread(target=held.spare.discard, name="mlx_nbdist-standby-end", daemon=True).start()


atexit.register(discard)
