"""A session owns one ipyparallel cluster whose engines form one MLX group.

>>> from mlx_nbdist import Session
>>> with Session(n=2) as s:
...     r = s.run("y = mx.distributed.all_sum(mx.ones(2) * (rank + 1), group=world); print(y)")
...     print(r.stdout(0))
array([3, 3], dtype=float32)

Ranks are the session's: rank ``r`` is always ``r``, whatever ids ipyparallel gives
the engines (restarted engines get new ids).

The session is the facade: its state machine, one dispatch for :meth:`Session.run`
and :meth:`Session.apply`, and what a cell's end needs checked. The cluster's
processes are :class:`~.cluster.Cluster`'s, forming the group is
:mod:`~.formation`'s, the ranks' liveness and signals are :class:`~.ranks.RankGroup`'s,
the next restart's engines, warmed while the session runs, :class:`~.spare.Spare`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import _ipp, config, launchers, processes, runtime
from .. import hosts as _hosts
from ..backend_check import check_mlx
from ..cellcheck import refuse_top_level_await
from ..client.transfer import Receiver, discard
from ..engine import rpc
from ..enums import SessionState
from ..errors import (
    CellError,
    NotStartedError,
    PortTakenError,
    SessionBrokenError,
    StartError,
)
from ..history import Entry, cell_entry, render, target, write
from ..launchers.local import LocalLauncher
from ..outcomes import (
    check_ledgers,
    collect,
    ledgers_of,
    order_problems,
    raise_for,
    short_error,
)
from ..results import (
    DIED,
    DRAINED,
    PAUSED,
    CellResult,
    CollectiveRecord,
    RankInfo,
    RankStack,
    RankState,
    RankStatus,
)
from ..streams import CellStreams, OutputEvent
from ..supervise import Outcome, Supervisor, failed
from ..timelines import CellTimeline, CommStats
from . import diagnostics, formation, standby
from .cluster import Cluster, check_n
from .formation import RankPlace
from .profile import Profiles
from .ranks import RankGroup
from .spare import Spare, SpareState, end_later, local_bring_up, spare_record

STOPPED, STARTING, READY, BROKEN = (
    SessionState.STOPPED,
    SessionState.STARTING,
    SessionState.READY,
    SessionState.BROKEN,
)
Progress = Callable[[str], None]
#: ``timeout=DEFAULT``: the session's own deadline
DEFAULT: Any = type("Default", (), {"__repr__": lambda self: "DEFAULT"})()


class DisplayWarning(UserWarning):
    """A rank ran its cell, but showing the cell's result failed there."""


class OversubscribedWarning(UserWarning):
    """More ranks than CPU cores: it works, but collectives get slow."""


@dataclass
class SessionStatus:
    """What ``%mlxdist status`` shows."""

    state: SessionState
    n: int
    backend: str
    launcher: str
    session_id: str
    uptime: float
    broken_reason: str
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    alive: dict[int, bool] = field(default_factory=dict)
    live: dict[int, RankState] = field(default_factory=dict)
    #: the next restart's engines (see :attr:`Session.spare_state`)
    spare: SpareState = SpareState.NOT_YET


_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """N ipyparallel engines in one MLX distributed group, on one or several hosts.

    Args:
        n: number of ranks (default 2; with ``hostfile``, one per hostfile entry;
            with ``hosts``, one per host).
        backend: MLX backend (:class:`~mlx_nbdist.config.Backend`): ``ring`` (TCP),
            ``mpi``, ``nccl`` (NVIDIA GPUs) or ``jaccl`` (Thunderbolt RDMA between
            Macs). Default: the hostfile's ``backend``, else ``ring``; an explicit
            one wins over the hostfile's.
        launcher: one of :data:`mlx_nbdist.launchers.LAUNCHERS`: ``local``
            (ipyparallel local engines), ``ssh`` (ipyparallel's SSH engine launcher,
            on ``hosts``) or ``mpi`` (engines started by ``mpirun``); defaults to
            ``mpi`` for the mpi backend, else ``ssh`` when hosts are given, else
            ``local``.
        timeout: default deadline of a cell in seconds (``None``: no deadline).
        start_timeout: how long engines may take to register and join the group.
        check_collectives: verify op/shape/dtype across ranks before each collective.
        hosts: ``"a,b"`` or ``["a", "b"]``: spread the ranks over these hosts;
            ``"slurm"``: the nodes of the current Slurm allocation; ``"local"``:
            this machine even inside a Slurm allocation. Default: this machine, or
            the Slurm allocation when this process runs in one of several nodes.
        hostfile: MLX's hostfile (``{"hosts": [{"ssh": name, "ips": [...]}, ...]}``,
            as written by ``mlx.distributed_config``): entry ``i`` is rank ``i``.
        controller_ip: the address of this machine the hosts reach the controller
            on (default: the route towards the first host; ``0.0.0.0`` listens on
            every interface and is only used when asked for).
        ssh_cmd, scp_cmd: the commands ipyparallel's SSH launcher runs (default
            ``ssh``/``scp`` with BatchMode and a 10 s connect timeout).
        python: the Python interpreter on the hosts (default: this one's path).
        assume_remote: treat every rank as if on another machine even when this one
            sees its process and files (liveness through ipyparallel, signals
            through ssh, no status files); for tests and debugging.
        spare: keep a spare set of engines warm for the next :meth:`restart` (local
            launcher only; default :data:`mlx_nbdist.config.SPARE`): a restart then
            only forms a new group (see :mod:`mlx_nbdist.session.spare`).
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str | None = None,
        launcher: str | None = None,
        timeout: float | None = config.CELL_TIMEOUT,
        start_timeout: float = config.START_TIMEOUT,
        check_collectives: bool = False,
        hosts: str | Iterable[str] | None = None,
        hostfile: str | os.PathLike[str] | None = None,
        controller_ip: str | None = None,
        ssh_cmd: list[str] | None = None,
        scp_cmd: list[str] | None = None,
        python: str | None = None,
        assume_remote: bool = False,
        spare: bool | None = None,
    ):
        if n is not None:
            check_n(n)
        self.hosts = list(hosts) if hosts is not None and not isinstance(hosts, str) else hosts
        self.hostfile = hostfile
        self.placement = _hosts.resolve(hosts=self.hosts, hostfile=hostfile, n=n)
        self.n = int(self.placement.n if self.placement else (config.N if n is None else n))
        check_n(self.n)
        if backend is None:
            backend = (self.placement.backend_name if self.placement else "") or config.BACKEND
        self.backend = launchers.backend_of(backend)
        self.launcher = launcher or launchers.default_name(self.backend, self.placement)
        self.timeout = _check_timeout(timeout)
        #: characters of a cell's output per rank that reach the notebook (0: all)
        self.output_limit = config.OUTPUT_LIMIT
        self.start_timeout = start_timeout
        self.check_collectives = check_collectives
        self.controller_ip_requested = controller_ip
        self.ssh_cmd = list(ssh_cmd) if ssh_cmd else None
        self.scp_cmd = list(scp_cmd) if scp_cmd else None
        self.python = python
        self.assume_remote = assume_remote
        self.spare = config.SPARE if spare is None else bool(spare)
        self._spare: Spare | None = None
        #: what the last start or restart did otherwise than asked and why, e.g. not
        #: using engines started ahead (shown after it: the progress line is replaced)
        self.notes: list[str] = []
        self._busy = False  # a cell or apply runs
        self._idle_since = time.monotonic()
        self.policy = config.Policy()
        self._state = STOPPED
        #: True while :meth:`stop` ends the processes (ranks are going, not dead)
        self.stopping = False
        #: one cell, apply or push at a time: a second caller (another thread, a
        #: kernel subshell) waits, so two cells' collectives never interleave
        self._run_lock = threading.RLock()
        #: set by :meth:`interrupt` (another thread); the running cell's supervisor
        #: takes it as the kernel's interrupt at its next tick
        self._interrupt_requested = threading.Event()
        self.broken_reason = ""
        self.cluster: Cluster | None = None
        self.group: RankGroup | None = None
        #: the id and private folder (records, logs, rank status and output files) of
        #: the last start; kept after stop, for what the ranks wrote there
        self.session_id = ""
        self.directory: Path | None = None
        self._started_at = 0.0
        self._cell = 0
        #: the notebook's end of slice transfers (see ``mlx_nbdist.slices``)
        self.receiver = Receiver()
        #: the last profiled cells, clock offsets and probed bandwidth (``run(profile=True)``)
        self.profiles = Profiles(self)
        #: what ran on the ranks since the last (re)start, in order: what :meth:`export`
        #: writes (cells, added by :meth:`run`; notebook commands, by :meth:`record`)
        self.history: list[Entry] = []
        self._views: dict[tuple[int, tuple[int, ...]], Any] = {}

    # -- what it is now ------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        """``stopped`` -> ``starting`` -> ``ready`` (-> ``broken``) -> ``stopped``."""
        return self._state

    @property
    def client(self) -> Any:
        """The ipyparallel client (``None`` when stopped)."""
        return self.cluster.client if self.cluster else None

    @property
    def controller_ip(self) -> str:
        return self.cluster.controller_ip if self.cluster else "127.0.0.1"

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """Each rank's engine id, PID and host, as it joined the group."""
        return self.group.ranks if self.group else {}

    @property
    def places(self) -> dict[int, RankPlace]:
        """Where each rank runs (host, ring endpoints, reachable by PID and files)."""
        return self.group.places if self.group else {}

    @property
    def shm_prefix(self) -> str:
        """Prefix of this session's shared-memory transfer files (see engine.transfer)."""
        return f"mlxnb-{self.session_id}"

    @property
    def cell(self) -> int:
        """The number of the last cell (or apply) sent to the ranks; 0 before any."""
        return self._cell

    @property
    def uptime(self) -> float:
        """Seconds since the session (or its last restart) started; 0 when stopped."""
        if not self._started_at or self._state == STOPPED:
            return 0.0
        return time.time() - self._started_at

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> Session:
        """Start the controller and engines, join them in one MLX group, and check it.

        On a session already started this does nothing (a broken one stays broken:
        :meth:`restart` replaces it). The group forms on the engines started ahead
        (see :mod:`mlx_nbdist.session.standby`) when they were started for this
        session's ranks and backend.
        """
        say = progress or (lambda msg: None)
        if self._state in (READY, BROKEN):
            return self
        self.notes = []
        if standby.state() != SpareState.NONE:
            # what a start checks first: a start refused keeps the engines started ahead
            check_mlx()
            self._launcher().check(self.backend)
        held = standby.release()
        if held is None:
            return self._start(say, None)
        cluster = None
        try:
            local = self._local() and self.python is None
            cluster, why = held.take(self.n, self.backend, local, say)
            if cluster is None:
                self._note(say, why)
                return self._start(say, None)
            self._warn_oversubscribed(stacklevel=3)
            return self._start_on(say, cluster, "the engines started ahead")
        finally:
            if cluster is None:
                end_later(held.spare)  # once this start is done with the CPU

    def _start_on(self, say: Progress, cluster: Cluster, what: str) -> Session:
        """:meth:`_start` on ``cluster``, engines brought up ahead (``what``, for the
        note); on new ones when the group did not form on them."""
        try:
            return self._start(say, cluster)
        except StartError as e:  # its processes are ended
            self._note(say, f"{what} could not form the group ({short_error(e)}): "
                       "starting new ones")
            return self._start(say, None)

    def _note(self, say: Progress, message: str) -> None:
        """Say ``message`` and keep it in :attr:`notes` (it outlives the progress line)."""
        self.notes.append(message)
        say(message)

    def _start(self, say: Progress, spare: Cluster | None) -> Session:
        """:meth:`start`, on a ``spare`` cluster already up when given."""
        if self._state in (READY, BROKEN):
            if spare is not None:
                Spare.end(spare)  # another thread started the session meanwhile
            return self
        launcher = None
        if spare is None:
            launcher = self._launcher()
            check_mlx()  # before the launcher's backend check, which imports mlx.core
            launcher.check(self.backend)
            self._warn_oversubscribed()
        with self._run_lock:
            self._state = STARTING
            self.broken_reason = ""
            self.group = None
            self.history = []
            try:
                try:
                    self._bring_up(spare, launcher, say)
                except PortTakenError:
                    if self.placement is not None:
                        raise  # other hosts: the message says what to check
                    say("another process took a port a rank had picked; starting again")
                    self._teardown()
                    self._bring_up(None, self._launcher(), say)
            except BaseException:
                try:
                    self._teardown()
                finally:
                    self._state = STOPPED
                raise
            self._state = READY
        self._started_at = time.time()
        _LIVE.add(self)
        self._warm_spare()
        return self

    def _bring_up(self, spare: Cluster | None, launcher: launchers.Launcher | None,
                  say: Progress) -> None:
        """A cluster (the spare's, else a new one from ``launcher``) and its group."""
        self.cluster = spare or Cluster(launcher, self.n, self.start_timeout)
        self.session_id, self.directory = self.cluster.session_id, self.cluster.directory
        self._launch(self.cluster, say, up=spare is not None)

    def _launcher(self) -> launchers.Launcher:
        if self.placement is not None and self.placement.n != self.n:
            # ``n`` changed since (``%mlxdist restart -n``): place the new count
            self.placement = _hosts.resolve(hosts=self.hosts, hostfile=self.hostfile, n=self.n)
        return launchers.create(
            self.launcher,
            self.placement,
            self.n,
            ssh_cmd=self.ssh_cmd,
            scp_cmd=self.scp_cmd,
            python=self.python,
        )

    def _launch(self, cluster: Cluster, say: Progress, up: bool = False) -> None:
        """Bring ``cluster`` up (unless it is ``up``: a spare) and form the group."""
        if up:
            say(f"session {cluster.session_id}: the spare engines, already started")
        else:
            p = self.placement
            controller_ip = (
                runtime.LOOPBACK
                if p is None
                else _hosts.controller_address(p, self.controller_ip_requested)
            )
            cluster.bring_up(controller_ip, say, record=self._write_record)
        say(f"joining the MLX group ({self.backend} backend)")
        formed = formation.form_group(
            cluster, self.backend, assume_remote=self.assume_remote, timeout=self.start_timeout
        )
        cluster.watch_infrastructure()
        self.group = RankGroup(cluster, formed)
        self._write_record()

    def stop(self) -> None:
        """Stop the engines and controller; leaves no process or port behind.

        Safe from another thread while a cell runs (that cell then fails), and a
        second Ctrl-C while stopping does not leave it half done.
        """
        if self._state == STOPPED and self.cluster is None:
            return
        self.stopping = True
        clean = self._state == READY
        spare, self._spare = self._spare, None
        try:
            try:
                self._teardown()
            finally:
                if spare is not None:
                    spare.discard()
        finally:
            self._state = STOPPED
            self.stopping = False
            _LIVE.discard(self)
        if clean and self.directory is not None:
            # a clean stop leaves nothing; a broken session's or a failed start's
            # folder stays for its logs (pruned later, see processes.prune)
            runtime.discard(self.directory)
        # the folders kept (logs, output past the limit) go once 20 newer sessions
        # stopped, or after a day: without this only %mlxdist cleanup removed them
        with contextlib.suppress(OSError):
            processes.prune(runtime.runtime_root())

    def restart(self, progress: Progress | None = None) -> Session:
        """New engines, same N, backend and launcher; rank r is still rank r.

        With a spare (see ``spare``), the group forms on its engines, already started;
        else (or when the spare failed) new engines are started as :meth:`start` does.
        """
        say = progress or (lambda msg: None)
        self.notes = []
        spare, self._spare = self._spare, None
        cluster = None
        try:
            self.stop()
            if spare is not None and spare.state == SpareState.STARTING:
                say("waiting for the spare engines, still starting")
            cluster = spare.take() if spare is not None else None
        except BaseException:
            if spare is not None:
                spare.discard()
            raise
        try:
            if cluster is None:
                if spare is not None and spare.error is not None:
                    self._note(say, f"the spare engines are not usable ({spare.why()}): "
                               "starting new ones")
                return self._start(say, None)
            return self._start_on(say, cluster, "the spare engines")
        finally:
            if spare is not None and cluster is None:
                end_later(spare)  # once this restart is done with the CPU

    def _warn_oversubscribed(self, stacklevel: int = 4) -> None:
        cores = os.cpu_count() or 1
        if self.placement is None and self.n > cores:
            warnings.warn(
                f"{self.n} ranks on {cores} CPU cores: ranks share cores, so collectives "
                "and compute will be slow (fine for learning, not for timing)",
                OversubscribedWarning,
                stacklevel=stacklevel,
            )

    def _local(self) -> bool:
        """Engines on this machine only, started by the local launcher and treated
        as local (what a spare can be)."""
        return (
            self.placement is None
            and self.launcher == LocalLauncher.name
            and not self.assume_remote
        )

    def _spare_wanted(self) -> bool:
        """A spare is kept for local engines (a launcher on other hosts would hold
        their GPUs and ports for it) when ``spare`` is on."""
        return self.spare and self._local()

    def _warm_spare(self) -> None:
        """Start bringing up the next restart's engines, in the background."""
        if self._spare is not None or not self._spare_wanted():
            return
        cluster = Cluster(self._launcher(), self.n, self.start_timeout)
        record = functools.partial(spare_record, n=self.n, backend=self.backend)
        self._spare = Spare(cluster, local_bring_up(self.backend, record), ready=self._idle_for)

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """A cell or apply runs (the spare waits for an idle session: :meth:`_idle_for`)."""
        self._interrupt_requested.clear()  # one asked for before this call is not its
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            self._idle_since = time.monotonic()

    def interrupt(self) -> bool:
        """Interrupt the running cell or call from another thread, as Ctrl-C in the
        thread that runs it would: SIGINT to the ranks, a drain, the group checked
        (see docs/failure-modes.md); the call raises ``CellInterrupted`` in its thread,
        within about 0.25 s. Returns whether one was running."""
        if not self._busy:
            return False
        self._interrupt_requested.set()
        return True

    def _ticker(self, on_tick: Callable[[], None] | None) -> Callable[[], None]:
        """``on_tick``, after raising the interrupt :meth:`interrupt` asked for (a
        display that fails is dropped here, so the supervisor never drops the check)."""
        requested = self._interrupt_requested
        display = [on_tick]

        def tick() -> None:
            if requested.is_set():
                requested.clear()
                raise KeyboardInterrupt("interrupted by Session.interrupt()")
            if display[0] is not None:
                try:
                    display[0]()
                except Exception:  # noqa: BLE001 - a display must never break the cell
                    display[0] = None

        return tick

    def _idle_for(self) -> bool:
        """No cell or apply has run for :data:`~mlx_nbdist.config.SPARE_AFTER` seconds
        (the spare's start must not compete with the cells for the CPU: on 2 cores it
        once held up a rank's answer to an interrupt past its grace)."""
        return not self._busy and time.monotonic() - self._idle_since >= config.SPARE_AFTER

    @property
    def spare_state(self) -> SpareState:
        """``ready`` (a restart only forms the group), ``starting``, ``failed`` (a
        restart starts new engines), ``off`` (``spare=False``), ``none`` (only
        local engines keep one: not over ssh or mpirun), or ``""`` (none yet)."""
        if self._spare is not None:
            return self._spare.state
        if not self.spare:
            return SpareState.OFF
        return SpareState.NOT_YET if self._spare_wanted() else SpareState.NONE

    def _teardown(self) -> None:
        cluster, group = self.cluster, self.group
        try:
            if cluster is not None:
                # ranks stuck in a collective ignore SIGTERM: spare the launchers'
                # grace period (5 s per engine over ssh) and end them now
                stuck = list(group.ranks) if group and self._state == BROKEN else []
                cluster.stop(
                    group.local_pids() if group else [],
                    end_first=(lambda: group.kill_ranks(stuck, 9)) if stuck else None,
                    on_ended=lambda: self._write_record(stopped=True),
                )
        finally:
            if cluster is not None:
                discard(f"mlxnb-{cluster.session_id}")  # slices never pulled
            self.receiver.close()  # pulled arrays keep their own segments
            self._views = {}
            self.cluster = None  # the group stays: who ran where, what they wrote

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- processes ---------------------------------------------------------------------
    def processes(self) -> list[tuple[int, float]]:
        """``(pid, start time)`` of every local process this session started and that
        still runs: engines and their nannies, the controller and its schedulers,
        the launchers' processes."""
        if self.cluster is None:
            return []
        return self.cluster.processes(self.group.local_pids() if self.group else [])

    def own_pids(self) -> set[int]:
        """The PIDs of every local process this session runs, its spare's included
        (launched already, registered or not), and their descendants: what no other
        start may end."""
        spare = self._spare.cluster if self._spare is not None else None
        tops = [pid for pid, _ in self.processes()]
        tops += [pid for pid, _ in spare.processes([])] if spare is not None else []
        tops += [c.watchdog for c in (self.cluster, spare) if c is not None and c.watchdog]
        out: set[int] = set()
        for pid in tops:
            out.update((pid, *processes.children(pid)))
        return out

    def _write_record(self, stopped: bool = False) -> None:
        """The record the watchdog and ``%mlxdist cleanup`` read, of this session's
        cluster."""
        cluster = self.cluster
        assert cluster is not None
        cluster.write_record(
            n=self.n,
            backend=self.backend,
            launcher=self.launcher,
            state=STOPPED if stopped else self._state,
            pids=[] if stopped else self.processes(),
            remote={
                r: [p.host, self.ranks[r].pid]
                for r, p in self.places.items()
                if not p.local and r in self.ranks
            },
        )

    # -- what the notebook side reads of the ranks ---------------------------------------
    def rank_record(self, rank: int) -> dict[str, Any]:
        """The status record rank ``rank`` last published (``{}`` when unreadable)."""
        return self.group.rank_record(rank) if self.group else {}

    def published_in(self, cell: int) -> bool:
        """Whether a rank published progress bars or scalars during ``cell``."""
        for r in range(self.n):
            try:
                if self.group is not None and self.group.rank_file(r, "live") == str(cell):
                    return True
            except OSError:
                continue
        return False

    def where(self) -> dict[int, RankStack]:
        """Where every rank is now: its main thread's stack, innermost frame in the
        user's cell with that line (``%mlxdist where``).

        Works while a cell runs (from another thread, the dashboard's [Where]) and on
        a broken session: a rank writes its stack on a signal, even while blocked
        inside MLX. Each rank's :class:`~mlx_nbdist.results.RankStack` says why when
        it has none (idle between cells, not answering, files on another host).
        """
        group = self.group
        if group is None or self._state == STOPPED:
            raise NotStartedError("no session is running: start one with %mlxdist start -n N")
        return group.rank_stacks(sorted(group.ranks))

    def kill_ranks(self, ranks: list[int], sig: int, *, local_only: bool = False) -> None:
        """Send ``sig`` to ranks (by PID here, through the launcher elsewhere unless
        ``local_only``)."""
        if self.group is not None:
            self.group.kill_ranks(ranks, sig, local_only=local_only)

    def rank_states(self, records: dict[int, dict[str, Any]] | None = None) -> dict[int, RankState]:
        """Live state of every rank, read from the files the ranks publish (or from
        ``records``, what :meth:`rank_record` just returned for each rank)."""
        out = {}
        g = self.group
        for r in range(self.n):
            d = records[r] if records is not None else self.rank_record(r)
            st = RankState(rank=r, **{k: v for k, v in d.items() if k in _STATE_KEYS})
            st.state = _rank_status(d.get("state"))
            st.recent = [CollectiveRecord.from_dict(x) for x in d.get("recent", [])]
            if self._state in (READY, BROKEN) and g and r in g.ranks and not g.rank_alive(r):
                st.state = RankStatus.DEAD
            elif self._state == BROKEN and st.state != RankStatus.DEAD:
                st.state = RankStatus.BROKEN
            elif r in self.places and not self.places[r].shared_files and not d:
                st.state = RankStatus.UNKNOWN  # its status file is on its own host
            out[r] = st
        return out

    def status(self) -> SessionStatus:
        """The session as ``%mlxdist status`` shows it; a rank or controller that
        went away since the last cell marks the session broken here too."""
        if self._state == READY:
            self._check_alive()
        g = self.group
        return SessionStatus(
            state=self._state,
            n=self.n,
            backend=str(self.backend),
            launcher=self.launcher,
            session_id=self.session_id,
            uptime=self.uptime,
            broken_reason=self.broken_reason,
            ranks=dict(self.ranks),
            alive={r: g.rank_alive(r) for r in self.ranks} if g else {},
            live=self.rank_states() if self.directory else {},
            spare=self.spare_state,
        )

    # -- running code ------------------------------------------------------------------
    def _require(self) -> RankGroup:
        if self._state == STOPPED or self.group is None or self.client is None:
            raise NotStartedError("no session is running: start one with %mlxdist start -n N")
        if self._state == READY:
            self._check_alive()
        if self._state == BROKEN:
            raise SessionBrokenError(
                f"the MLX group is broken ({self.broken_reason}); "
                "run %mlxdist restart (or Session.restart()) to get new engines"
            )
        return self.group

    def _check_alive(self) -> None:
        """Mark the session broken when a rank's engine went away between cells
        (killed from outside, out of memory), or the controller did: its group can no
        longer form."""
        g = self.group
        if g is None:
            return
        dead = [r for r in g.ranks if not g.rank_alive(r)]
        if dead:
            self._break(
                ", ".join(
                    f"rank {r} (pid {g.ranks[r].pid}) exited since the last cell"
                    + (f" ({how})" if (how := g.rank_exit(r)) else "")
                    for r in dead
                )
            )
            return
        problem = g.infrastructure_problem()
        if problem:
            self._break(problem)

    def resolve_ranks(self, ranks: Iterable[int] | None) -> list[int]:
        """Validate a rank subset (``None``: every rank)."""
        if ranks is None:
            return list(range(self.n))
        out = sorted(dict.fromkeys(int(r) for r in ranks))
        bad = [r for r in out if not 0 <= r < self.n]
        if bad or not out:
            raise ValueError(
                f"--ranks {bad or '(empty)'}: ranks of this session are 0..{self.n - 1}"
            )
        return out

    def view(self, ranks: list[int]) -> Any:
        """ipyparallel's view of these ranks' engines (for what the session does not wrap).

        Made once per client and set of engines (a new view costs about as much as a
        tenth of a trivial cell's round trip)."""
        client = self.client
        key = (id(client), tuple(self.ranks[r].engine_id for r in ranks))
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = client[list(key[1])]
        return view

    def _deadline(self, timeout: Any) -> float | None:
        """The cell's deadline: the session's for ``DEFAULT``; refuses nonsense."""
        return self.timeout if timeout is DEFAULT else _check_timeout(timeout)

    def _dispatch(
        self,
        targets: list[int],
        send: Callable[[Any, dict[str, Any]], Any],
        meta: dict[str, Any],
        timeout: float | None,
        on_tick: Callable[[], None] | None = None,
        on_poll: Callable[[], None] | None = None,
        wake: threading.Event | None = None,
        group: RankGroup | None = None,
    ) -> tuple[dict[int, Any], CellResult, Outcome]:
        """Send one cell or apply to ``targets`` and supervise it to the end: the one
        path of :meth:`run` and :meth:`apply`. Raises as :func:`raise_for` says.
        ``group``: what the caller's :meth:`_require` just returned (checked once)."""
        with self._working():
            group = group if group is not None else self._require()
            self._cell += 1
            meta = {**meta, "cell": self._cell, "ranks": targets}
            t0 = time.monotonic()
            ar = send(self.view(targets), meta)
            futures = dict(zip(targets, _ipp.futures_of(ar), strict=True))
            policy = replace(self.policy, timeout=timeout)
            outcome = Supervisor(
                group, futures, policy, self._ticker(on_tick), cell=self._cell,
                on_poll=on_poll, wake=wake,
            ).wait()
            try:
                engine_ids = {r: info.engine_id for r, info in group.ranks.items()}
                result = collect(futures, outcome, self._cell, engine_ids, time.monotonic() - t0)
                if on_poll is not None:
                    on_poll()  # the output that arrived with the replies
                self._settle_group(group, result, outcome, futures)
            except BaseException:
                # e.g. a second Ctrl-C while the group was being checked: unproven
                self._break("interrupted before the group could be checked after the cell")
                raise
            if meta.get("profile"):
                self.profiles.record(self._cell, futures)
            self._forget(ar)
            notes = diagnostics.host_notes(group, self.backend, result, outcome)
            raise_for(result, outcome, timeout, notes)
            return futures, result, outcome

    def _settle_group(
        self, group: RankGroup, result: CellResult, outcome: Outcome, futures: dict[int, Any]
    ) -> None:
        """After a cell: a rank that died breaks the group; the ranks' ledgers must
        agree (unmatched messages are received and dropped); after a drain, a stop
        or a disagreement, the group must prove it is in step, or it is broken."""
        for f in result.failures:
            if f.cause == DIED and f.rank in group.procs:
                f.evalue = group.rank_exit(f.rank) or f.evalue  # ipyparallel said no more
        gone = [f.rank for f in result.failures if f.cause in (DIED, PAUSED)]
        if gone and not outcome.broken:
            outcome.broken = f"rank {', '.join(map(str, gone))} died"
        if outcome.drained and not outcome.broken and all(
                f.cause == DRAINED for f in result.failures):
            # nobody failed: a rank waited in a collective the others never issued, or
            # ran another's. The ledgers say which (a drain's replays are not in them,
            # and the alignment check decides whether the group is in step)
            found = order_problems(ledgers_of(futures), list(futures))
            outcome.problem = "\n".join(found) or outcome.problem
        if not outcome.broken and not outcome.drained:
            ledgers = ledgers_of(futures)
            if self._ledger_missing(group, ledgers, futures):
                outcome.needs_alignment = True
            check = check_ledgers(ledgers, list(futures), self.n)
            if check.unmatched:
                why = group.receive_unmatched(check.unmatched, self.policy.drain_timeout)
                if why:
                    outcome.broken = f"unreceived messages could not be dropped ({why})"
            if check.problems:
                outcome.problem = "\n".join(check.problems)
                outcome.valid = False
                outcome.needs_alignment = True
        if outcome.needs_alignment and not outcome.broken:
            problem = group.align_ranks(self.policy.align_timeout)
            if problem:
                outcome.broken = problem
                outcome.valid = False
            else:
                outcome.summary = (
                    outcome.summary + "\nThe group was checked afterwards and is in step: "
                    "the session is still usable."
                ).strip()
        if outcome.broken:
            self._break(outcome.broken)

    def _ledger_missing(
        self, group: RankGroup, ledgers: dict[int, Any], futures: dict[int, Any]
    ) -> bool:
        """A rank that noted (its ``.ledger`` file, written before its reply) that it
        sent a ledger for this cell, but whose ledger did not arrive: the comparison
        would be incomplete."""
        for r in futures:
            if r in ledgers:
                continue
            try:
                if group.rank_file(r, "ledger") == str(self._cell):
                    return True
            except OSError:
                continue
        return False

    def _break(self, reason: str) -> None:
        if self._state in (READY, BROKEN):
            if self._state == READY:
                self.broken_reason = reason
            self._state = BROKEN

    def run(
        self,
        code: str,
        *,
        ranks: Iterable[int] | None = None,
        timeout: Any = DEFAULT,
        check_collectives: bool | None = None,
        on_tick: Callable[[], None] | None = None,
        on_output: Callable[[OutputEvent], None] | None = None,
        output_limit: int | None = None,
        name: str | None = None,
        profile: bool = False,
    ) -> CellResult:
        """Run ``code`` as a cell on the ranks (default all) and collect their output.

        One cell runs at a time: a call from another thread waits for the running one.

        Args:
            code: the cell's source.
            ranks: run on these ranks only; a collective over the whole group from a
                subset is refused on the ranks rather than left to hang.
            timeout: deadline in seconds (a positive number); ``None`` means none;
                default: the session's.
            check_collectives: compare op/shape/dtype across ranks before each
                collective (default: the session's setting).
            on_tick: called about every 0.25 s while the cell runs (live displays
                read :meth:`rank_states` from it).
            on_output: called (in this thread) with every piece of output a rank
                writes, as it arrives: an :class:`~mlx_nbdist.streams.OutputEvent`
                (stdout/stderr text in the order written, displays and their
                updates, clears, the last expression). Each rank's events in order.
                If it has a ``flush()`` method, that is called on every poll (about
                every 20 ms), e.g. to show updates a display held back.
            output_limit: characters of output per rank that reach the notebook
                (default: the session's ``output_limit``, 1 MiB; 0: no limit); the
                rest goes to a file in the session directory, and a line says where.
            name: how stacks and errors name this cell (the magic passes ``In [7]``;
                default ``cell #k``, the session's count of cells and calls).
            profile: time every collective on every rank (``%%mlxdist --profile``): each
                is evaluated where it is issued, so compute and communication do not
                overlap; see :meth:`timeline`. The first profiled cell of a session also
                measures clock offsets and the backend's bandwidth (a 256 KiB all_sum).

        Raises:
            CellError: a rank raised, died, or was drained, or the ranks' collectives
                did not match (``err.result`` holds every rank's output);
                ``CollectiveTimeout`` at the deadline and ``CellInterrupted`` on
                interrupt are subclasses.
            ValueError: a bad ``timeout`` or ``ranks``; ``await`` outside a function
                (engines never finish such a cell).
        """
        deadline = self._deadline(timeout)
        refuse_top_level_await(code)
        check = self.check_collectives if check_collectives is None else check_collectives
        with self._run_lock:
            group = self._require()
            targets = self.resolve_ranks(ranks)
            if profile:
                self.profiles.prepare()  # once per start: clock offsets, bandwidth probe
            streams = CellStreams(targets)
            rank_of = {self.ranks[r].engine_id: r for r in targets}

            def send(view: Any, meta: dict[str, Any]) -> Any:
                # the cell's metadata travels as the request's label: one message per
                # rank; every output message is handed to ``streams`` as it arrives
                group.sources[meta["cell"]] = (name or f"cell #{meta['cell']}", code)
                return _ipp.execute_streaming(
                    view, code, json.dumps(meta), lambda eid, msg: streams.feed(rank_of[eid], msg)
                )

            def deliver() -> None:
                nonlocal on_output
                if on_output is None:
                    return
                try:
                    for ev in streams.take_events():
                        on_output(ev)
                    flush = getattr(on_output, "flush", None)
                    if flush is not None:
                        flush()
                except Exception:  # noqa: BLE001 - a display must never break the cell
                    on_output = None

            limit = self.output_limit if output_limit is None else int(output_limit)
            meta = {"mlxdist": 1, "check": bool(check), "output_limit": limit}
            number = re.fullmatch(r"In \[(\d+)\]", name or "")
            if number:  # the ranks number the cell as the notebook does (tracebacks)
                meta["number"] = int(number.group(1))
            if profile:
                meta["profile"] = True
            try:
                _, result, _ = self._dispatch(
                    targets, send, meta, deadline, on_tick, deliver, streams.changed, group
                )
            except CellError as e:
                _attach_items(e.result, streams)
                why = "; ".join(g.headline() for g in e.groups)
                self.history.append(
                    cell_entry(
                        code,
                        group.sources[self._cell][0],
                        targets,
                        self.n,
                        failed=why[:300] or "failed",
                    )
                )
                raise
            _attach_items(result, streams)
            self.history.append(cell_entry(code, group.sources[self._cell][0], targets, self.n))
            for out in result.ranks.values():
                for text in out.warnings:
                    warnings.warn(text, DisplayWarning, stacklevel=2)
            return result

    def apply(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: Iterable[int] | None = None,
        timeout: Any = DEFAULT,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Call ``fn(*args, **kwargs)`` on the ranks; returns ``{rank: value}``.

        ``fn`` is sent by reference when importable, else pickled; inside it the
        rank's names are available through ``mlx_nbdist.engine.state.current()``.
        Supervised and serialised like :meth:`run`.
        """
        deadline = self._deadline(timeout)
        with self._run_lock:
            group = self._require()
            targets = self.resolve_ranks(ranks)

            def send(view: Any, meta: dict[str, Any]) -> Any:
                return view.apply_async(rpc.call, meta, fn, *args, **kwargs)

            futures, _, outcome = self._dispatch(targets, send, {}, deadline, group=group)
            return {
                r: f.result()
                for r, f in futures.items()
                if r not in outcome.failures and not failed(f)
            }

    # -- history and export ------------------------------------------------------------
    def record(self, entry: Entry) -> None:
        """Add a notebook command to the history :meth:`export` writes: one that changed
        the ranks' state, as its in-cell equivalent, or one that only looked, as a
        comment (see :mod:`mlx_nbdist.history`). :meth:`run` adds its cells itself.
        Added at once, also while a cell runs: a look from another thread (``where``
        in a subshell while a cell hangs) must not wait for the cell (a list's append
        is atomic)."""
        self.history.append(entry)

    def export(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the cells this session ran on its ranks since its last (re)start, in
        order, as one standalone script for ``mlx.launch -n N --backend B -- python
        path`` or ``python -m mlx_nbdist run -n N path``; returns its path.

        Raises:
            ExportError: nothing ran on the ranks yet, or ``path`` exists and
                ``overwrite`` is false.
        """
        from .. import __version__

        with self._run_lock:
            entries = list(self.history)
        text = render(
            entries,
            self.n,
            str(self.backend),
            session_id=self.session_id,
            version=__version__,
            name=target(path).name,
        )
        return write(text, path, overwrite)

    def _forget(self, *ars: Any) -> None:
        """Drop finished messages from the client's caches (they grow without bound)."""
        try:
            done = [m for a in ars for m in a.msg_ids if m not in self.client.outstanding]
            self.client.purge_local_results(jobs=done)
        except Exception:  # noqa: BLE001 - caching is not correctness (or stop() ran)
            pass

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The value of ``name`` in each rank's namespace."""
        return self.apply(rpc.pull, name, ranks=ranks)

    # -- profiled cells ----------------------------------------------------------------
    def timeline(self, k: int = 1) -> CellTimeline:
        """The last ``k`` profiled cells as one lane per rank (``.figure()``,
        ``.summary()``, ``.stats``); see :mod:`mlx_nbdist.timelines`."""
        return self.profiles.timeline(k)

    def trace(self, path: str | os.PathLike[str], k: int = 1) -> Path:
        """Write the last ``k`` profiled cells as Chrome trace / Perfetto JSON."""
        return self.profiles.trace(path, k)

    def comm_stats(self, k: int = 1) -> CommStats:
        """Count, bytes, time, waiting and bandwidth per op and rank (last ``k`` cells)."""
        return self.profiles.stats(k)

    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Define names in each rank's namespace."""
        with self._run_lock:
            self._require()
            self.view(self.resolve_ranks(ranks)).push(namespace, block=True)


_STATE_KEYS = set(RankState.__dataclass_fields__) - {"rank"}


def _rank_status(value: Any) -> RankStatus:
    """A published state as a :class:`RankStatus` (``starting`` before any)."""
    try:
        return RankStatus(value)
    except ValueError:
        return RankStatus.STARTING


def _attach_items(result: CellResult, streams: CellStreams) -> None:
    """Each rank's output area, as it streamed, onto the cell's result."""
    for r, (_, items, _) in streams.snapshot().items():
        if r in result.ranks:
            result.ranks[r].items = items


def _check_timeout(timeout: Any) -> float | None:
    """A deadline in seconds: a positive finite number, or ``None`` for none."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def others_pids(session: Session | None) -> set[int]:
    """:meth:`Session.own_pids` of every live session of this process but ``session``:
    what a start interrupted while another session runs (or brings up its spare) must
    leave alone."""
    out: set[int] = set()
    for s in list(_LIVE):
        if s is not session:
            out |= s.own_pids()
    return out


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
