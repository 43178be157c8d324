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

import os
import threading
from collections.abc import Callable

from .. import runtime
from ..config import Backend
from ..enums import SessionState, TextEnum
from ..launchers.local import LocalLauncher
from ..outcomes import short_error
from .cluster import Cancelled, Cluster


class SpareState(TextEnum):
    """Where a session's spare stands (``%mlxdist status``); compares equal to its value."""

    READY = "ready"  # a restart only forms the group
    STARTING = "starting"
    FAILED = "failed"  # a restart starts new engines
    OFF = "off"  # spare=False
    NONE = "none"  # kept for local engines only (not over ssh or mpirun)
    NOT_YET = ""  # wanted, not started yet (it waits for the session to be idle)

class Changed(Exception):
    """Engines started now would not inherit what the spare's did."""


#: how often the thread asks whether it may start, seconds
POLL = 0.05

#: what new engines inherit from the notebook's process: its environment and folder
Context = tuple[dict[str, str], str]


def context() -> Context:
    """The environment and working folder engines started now would inherit."""
    return dict(os.environ), os.getcwd()


def changes(then: Context, now: Context) -> str:
    """What differs between two :func:`context` s, for a message (``""``: nothing),
    e.g. ``the environment (OMP_NUM_THREADS)`` or ``the working folder``."""
    (env0, cwd0), (env1, cwd1) = then, now
    names = sorted(k for k in env0.keys() | env1.keys() if env0.get(k) != env1.get(k))
    out = []
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"the environment ({shown})")
    if cwd0 != cwd1:
        out.append(f"the working folder ({cwd1}, was {cwd0})")
    return " and ".join(out)


def spare_record(cluster: Cluster, *, n: int, backend: Backend) -> None:
    """A spare's record (see :meth:`Cluster.write_record`): its own processes, no
    ranks yet, ``starting`` (it never runs a cell)."""
    cluster.write_record(
        n=n,
        backend=backend,
        launcher=LocalLauncher.name,
        state=SessionState.STARTING,
        pids=cluster.processes([]),
        remote={},
    )


def local_bring_up(
    backend: Backend, record: Callable[[Cluster], None]
) -> Callable[[Cluster, Callable[[], bool]], None]:
    """What brings a spare of local engines up: controller and engines on this
    machine, then :meth:`Cluster.warm` for ``backend``; ``record(cluster)`` writes
    its record (see :meth:`Cluster.write_record`)."""

    def bring_up(c: Cluster, cancelled: Callable[[], bool]) -> None:
        c.bring_up(
            runtime.LOOPBACK, lambda msg: None, record=lambda: record(c), cancelled=cancelled
        )
        if not cancelled():
            c.warm(backend)

    return bring_up


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
        #: what its engines inherited (see :meth:`take`); ``None`` until they start
        self.context: Context | None = None
        self._up = False  # brought up and warmed, not cancelled
        self._ending = threading.Lock()
        self._ended = False
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
            self.context = context()
            bring_up(self.cluster, self._cancel.is_set)
            self._up = not self._cancel.is_set()
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
            and self._up
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
        """Wait for the spare; its cluster when it came up and engines started now
        would inherit what its engines did (environment variables, working folder),
        else ``None``: :attr:`error` says why, and the caller ends it (with
        :func:`end_later` once its own start is done, not to compete with it)."""
        changed = changes(self.context, context()) if self.context is not None else ""
        if changed:
            self.error = Changed(f"{changed} changed since they started")
            self.cancel()
            return None
        self._go.set()
        self._thread.join()
        if self.ready:
            return self.cluster
        if self.error is None and not self._cancel.is_set():
            exited = self.cluster.exited_while_starting()
            self.error = RuntimeError(f"its engines exited ({exited})")
        return None

    def why(self) -> str:
        """Why :meth:`take` found it not usable, for a message (``""``: it was)."""
        if self.error is None:
            return ""
        return str(self.error) if isinstance(self.error, Changed) else short_error(self.error)

    def cancel(self) -> None:
        """Stop its bring-up at its next step (:meth:`discard` then ends it sooner)."""
        self._cancel.set()
        self._go.set()

    def discard(self) -> None:
        """Give it up: stop its bring-up and end every process it started (once: a
        second call, from another thread too, waits for the first)."""
        self.cancel()
        with self._ending:
            if self._ended:
                return
            self._thread.join()
            self.end(self.cluster)
            self._ended = True

    @staticmethod
    def end(cluster: Cluster) -> None:
        """End every process of a spare ``cluster`` and remove its folder (it ran no
        cell: nothing there is worth keeping)."""
        try:
            cluster.stop(cluster.engine_pids())
        finally:
            runtime.discard(cluster.directory)


def end_later(spare: Spare) -> None:
    """End ``spare`` in a thread of its own: its bring-up stops at its next step and
    its processes are ended then (at exit, the watchdog of its cluster does it)."""
    spare.cancel()
    threading.Thread(target=spare.discard, name="mlx_nbdist-spare-end", daemon=True).start()
