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
class Standby:
    """Engines started ahead for a local session of ``n`` ranks on ``backend``."""

    spare: Spare
    n: int
    backend: Backend

    def take(
        self, n: int, backend: Backend, local: bool, say: Progress
    ) -> tuple[Cluster | None, str]:
        """``(its cluster, "")`` when it was brought up for ``n`` local ranks on
        ``backend`` and still fits (see :meth:`Spare.take`), waiting for it if it is
        still coming up (``say`` tells so); else ``(None, why)``, and the caller ends
        it (after its own start: ending it would compete with that for the CPU)."""
        if not local or (self.n, self.backend) != (n, backend):
            return None, (
                f"the engines started ahead were for {self.n} local "
                f"rank{'s' * (self.n != 1)} ({self.backend}): ending them, starting new ones"
            )
        try:
            if self.spare.state == SpareState.STARTING:
                say("waiting for the engines started ahead, still starting")
            cluster = self.spare.take()
        except BaseException:  # Ctrl-C while waiting: nothing of it may stay behind
            self.spare.discard()
            raise
        if cluster is None:
            return None, (
                f"the engines started ahead are not usable ({self.spare.why() or 'stopped'}): "
                "starting new ones"
            )
        return cluster, ""


_lock = threading.Lock()
_held: Standby | None = None


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
        _held = Standby(Spare(cluster, local_bring_up(backend, record)), n, backend)
    return True


def local(n: int, backend: Backend) -> bool:
    """Whether a plain start of ``n`` ranks on ``backend`` launches local engines."""
    try:
        placement = _hosts.resolve(n=n)
    except Exception:  # noqa: BLE001 - a bad setting: the start itself will say so
        return False
    return placement is None and launchers.default_name(backend, None) == LocalLauncher.name


def release() -> Standby | None:
    """The standby, no longer held here (``None`` when none is): the caller takes it
    (:meth:`Standby.take`) or ends it (:func:`~.spare.end_later`)."""
    global _held
    with _lock:
        held, _held = _held, None
    return held


def state() -> SpareState:
    """``starting``, ``ready``, ``failed``, or ``none`` when no standby is held."""
    held = _held
    return held.spare.state if held is not None else SpareState.NONE


def describe() -> str:
    """One line on the standby for ``%mlxdist status`` (``""`` when none is held)."""
    held = _held
    if held is None:
        return ""
    ranks = f"{held.n} rank{'s' * (held.n != 1)}"
    return f"engines started ahead for {ranks} ({held.backend}): {held.spare.state}"


def engine_pids() -> list[int]:
    """The standby's engine processes (``[]`` when none is held or none started yet)."""
    held = _held
    return held.spare.cluster.engine_pids() if held is not None else []


def discard() -> None:
    """End the standby's processes, if one is held."""
    held = release()
    if held is not None:
        held.spare.discard()


atexit.register(discard)
