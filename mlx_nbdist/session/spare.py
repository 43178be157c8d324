"""A spare cluster: the next start's controller and engines, brought up in the
background while the session runs, so that a restart only forms a group.

A restart is what a user does after every failure that leaves the group broken (a
rank that died, ranks stuck in a collective): starting a controller and engines is
most of its time (Python start-up and imports, registration: about 1.5 s of 2.3 s for
2 ranks here). The session asks for a spare once it is ready (and after each restart); it is brought
up once no cell has run for :data:`~mlx_nbdist.config.SPARE_AFTER` seconds (so its
start-up does not compete with the cells for the CPU),
and a restart takes it: the old cluster is stopped and the group forms on the spare's
engines, which already answered the probe and imported MLX (:meth:`Cluster.warm`).
A restart asked for before the spare is up waits for it (no longer than a cold start
from that moment), and one whose spare failed starts cold.

The spare is a whole :class:`Cluster` of its own, with its own session id, folder,
record and watchdog, so everything that belongs to one start still does; it never
runs a cell. ``Session.stop`` ends it with the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import runtime
from ..enums import TextEnum
from .cluster import Cancelled, Cluster


class SpareState(TextEnum):
    """Where a session's spare stands (``%mlxdist status``); compares equal to its value."""

    READY = "ready"  # a restart only forms the group
    STARTING = "starting"
    FAILED = "failed"  # a restart starts new engines
    OFF = "off"  # spare=False
    NONE = "none"  # kept for local engines only (not over ssh or mpirun)
    NOT_YET = ""  # wanted, not started yet (it waits for the session to be idle)

#: how often the thread asks whether it may start, seconds
POLL = 0.05


class Spare:
    """Bring ``cluster`` up in a background thread, once ``ready()`` says so.

    Args:
        cluster: a cluster not yet started.
        bring_up: starts it (controller, engines, warm-up); it must give up with
            :class:`Cancelled` when its ``cancelled()`` argument turns true.
        ready: asked every :data:`POLL` seconds until true (the session has been
            idle a while); :meth:`take` does not wait for it.
    """

    def __init__(
        self,
        cluster: Cluster,
        bring_up: Callable[[Cluster, Callable[[], bool]], None],
        ready: Callable[[], bool] = lambda: True,
    ):
        self.cluster = cluster
        #: why the spare could not be brought up (``None``: it came up, or is coming)
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._go = threading.Event()  # set: no more waiting for ``ready``
        self._ready = ready
        self._thread = threading.Thread(
            target=self._run, args=(bring_up,), name="mlx_nbdist-spare", daemon=True
        )
        self._thread.start()

    def _run(self, bring_up: Callable[[Cluster, Callable[[], bool]], None]) -> None:
        while not self._go.wait(POLL):
            if self._ready():
                break
        if self._cancel.is_set():
            return
        try:
            bring_up(self.cluster, self._cancel.is_set)
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - kept: the restart starts cold and says why
            self.error = e

    @property
    def ready(self) -> bool:
        """Up and warmed, and none of its engines has exited since (killed, say, by
        the out-of-memory killer): a restart now only forms the group."""
        return (
            not self._thread.is_alive()
            and self.error is None
            and not self._cancel.is_set()
            and not self.cluster.exited_while_starting()
        )

    @property
    def state(self) -> SpareState:
        """``starting``, ``ready`` or ``failed``."""
        if self._thread.is_alive():
            return SpareState.STARTING
        return SpareState.READY if self.ready else SpareState.FAILED

    def take(self) -> Cluster | None:
        """Wait for the spare; its cluster when it came up, else ``None`` (and whatever
        it started is ended)."""
        self._go.set()
        self._thread.join()
        if self.ready:
            return self.cluster
        if self.error is None and not self._cancel.is_set():
            exited = self.cluster.exited_while_starting()
            self.error = RuntimeError(f"its engines exited ({exited})")
        self.discard()
        return None

    def discard(self) -> None:
        """Give it up: stop its bring-up and end every process it started."""
        self._cancel.set()
        self._go.set()
        self._thread.join()
        self.end(self.cluster)

    @staticmethod
    def end(cluster: Cluster) -> None:
        """End every process of a spare ``cluster`` and remove its folder (it ran no
        cell: nothing there is worth keeping)."""
        try:
            cluster.stop(cluster.engine_pids())
        finally:
            runtime.discard(cluster.directory)
