"""The ipyparallel cluster of one session: its controller and engines, from start to
stop, and every process it made.

This is the one module that reads ipyparallel's cluster and launcher objects
(``cluster.controller.process``, ``engine_set.launchers``, ``engine_set.stop_data``):
they are public attributes, but what they hold depends on the launcher, so each read
is defensive.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import config, processes, runtime, watchdog
from ..config import Backend
from ..engine import rpc
from ..enums import SessionState
from ..errors import SetupError, StartError
from ..launchers import Launcher
from ..launchers.ssh import SSHLauncher
from ..outcomes import short_error

Progress = Callable[[str], None]


def check_n(n: Any) -> None:
    """A :class:`SetupError` unless ``n`` is a number of ranks one machine can run."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SetupError(f"-n must be a whole number of ranks >= 1, got {n!r}")
    if n > config.MAX_RANKS:
        raise SetupError(
            f"-n {n} is more ranks than one machine can sensibly run (max {config.MAX_RANKS})"
        )


class Cluster:
    """Controller and engines of one session, and the processes they made.

    Args:
        launcher: starts the engines.
        n: the number of engines.
        start_timeout: how long the engines may take to register.
    """

    def __init__(self, launcher: Launcher, n: int, start_timeout: float):
        self.launcher = launcher
        self.n = n
        self.start_timeout = start_timeout
        self.session_id = runtime.new_session_id()
        self.directory: Path = runtime.session_dir(self.session_id)
        self.controller_ip = runtime.LOOPBACK
        self.ipp: Any = None  # the ipyparallel Cluster
        self.client: Any = None
        #: the controller and its schedulers, watched while cells run
        #: the controller and its schedulers: what -> (pid, start time)
        self.infra: dict[str, tuple[int, float]] = {}
        self._infra_ok_at = float("-inf")  # when infrastructure_problem last found none
        self.watchdog: int | None = None  # its PID (see mlx_nbdist.watchdog)
        #: what each engine said of itself (:func:`formation.probe`), once :meth:`warm` ran
        self.probes: dict[int, dict[str, Any]] = {}

    # -- starting -------------------------------------------------------------------
    def start_controller(self, controller_ip: str) -> None:
        """Make the ipyparallel cluster and start its controller, listening on
        ``controller_ip`` only (``0.0.0.0``: every interface, only when asked for)."""
        import ipyparallel as ipp

        placement = self.launcher.placement
        self.controller_ip = controller_ip
        kwargs: dict[str, Any] = dict(
            n=self.n,
            cluster_id=self.session_id,
            profile_dir=str(self.directory / "profile"),
            controller_ip=controller_ip,
            controller_args=[
                f"--ping={config.HEARTBEAT_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={config.HEARTBEAT_MISSES}",
            ],
            delay=0.1,
            log_level=40,
            shutdown_atexit=True,
        )
        if controller_ip == "0.0.0.0" and placement is not None:
            from ..hosts import host_address, route_address

            # engines need a real address to connect to
            kwargs["controller_location"] = route_address(host_address(placement.hosts[0]))
        kwargs.update(self.launcher.cluster_kwargs(self.directory))
        self.ipp = ipp.Cluster(**kwargs)
        self.ipp.start_controller_sync()

    def start_watchdog(self) -> None:
        """A process that ends this session if this one dies (see mlx_nbdist.watchdog)."""
        try:
            self.watchdog = watchdog.start(self.directory)
        except OSError as e:
            warnings.warn(f"{e}; if this kernel dies, run %mlxdist cleanup", stacklevel=5)

    def start_engines(self, say: Progress) -> None:
        """Start the engines and wait until all registered."""
        try:
            self.ipp.start_engines_sync(self.n, environment=self.launcher.engine_env())
        except Exception as e:
            if self.launcher.placement is None:
                raise
            raise StartError(self.launcher.start_failure(self.ipp, short_error(e))) from e

    def bring_up(
        self,
        controller_ip: str,
        say: Progress,
        record: Callable[[], None],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Controller, watchdog and engines, until every engine registered: a start's
        steps before the group forms. ``record`` writes the session record (the
        watchdog follows it) once the controller runs and again with the engines.

        Raises:
            StartError: an engine exited, or not all registered in time.
            Cancelled: ``cancelled()`` turned true between two steps.
        """
        p = self.launcher.placement
        where = "" if p is None else f" on {controller_ip} for {p.source}"
        say(f"session {self.session_id}: starting controller{where}")
        self.start_controller(controller_ip)
        record()  # the controller and its schedulers, for the watchdog
        self.start_watchdog()
        _check(cancelled)
        on = "" if p is None else f" on {p.summary()}"
        say(f"starting {self.n} engines{on} ({self.launcher.name} launcher)")
        self.start_engines(say)
        record()
        self.connect(say, cancelled)

    def warm(self, backend: Backend) -> None:
        """Ask every registered engine who and where it is (kept as :attr:`probes` for
        the group's formation) and import what joining the group will need, so a
        restart onto these engines only forms the group."""
        from . import formation

        t_end = time.monotonic() + self.start_timeout
        ids = sorted(self.client.ids)[: self.n]
        self.probes = formation.probe(self, ids, t_end, gpus=backend == Backend.NCCL)
        ars = [self.client[eid].apply_async(rpc.warm, str(backend)) for eid in ids]
        for ar in ars:
            ar.get(timeout=max(0.1, t_end - time.monotonic()))

    def connect(self, say: Progress, cancelled: Callable[[], bool] = lambda: False) -> Any:
        """Connect the client and wait for all ``n`` engines to register."""
        self.client = self.ipp.connect_client_sync()
        t_end = time.monotonic() + self.start_timeout
        seen = -1
        while len(self.client.ids) < self.n:
            _check(cancelled)
            if len(self.client.ids) != seen:
                seen = len(self.client.ids)
                say(f"engines registered: {seen}/{self.n}")
            exited = self.exited_while_starting()
            if exited:
                raise StartError(
                    f"the engines exited while starting ({exited}){self.hosts_note()}. "
                    f"Their output, from {self.directory / 'profile' / 'log'}:\n"
                    + (
                        runtime.log_tail(self.directory, prefix="ipengine", files=self.n)
                        or runtime.log_tail(self.directory)
                    )
                )
            if time.monotonic() > t_end:
                raise StartError(
                    f"only {len(self.client.ids)} of {self.n} engines registered within "
                    f"{self.start_timeout:g} s{self.hosts_note()}.\n"
                    + runtime.log_tail(self.directory)
                )
            time.sleep(0.1)
        say(f"engines registered: {self.n}/{self.n}")
        return self.client

    def exited_while_starting(self) -> str:
        """Which engine processes (or ``mpirun``) this machine started have exited,
        e.g. ``engine pid 123 exit code 1``; ``""`` while all run.

        ipyparallel learns of an exit in a thread that hands it to its event loop,
        which does not run between the synchronous calls the session makes, so its
        ``running`` flags stay true: the processes are checked here instead. Engines
        started over ssh are not (ssh exits once it started a detached engine).
        """
        if self.ipp is None:
            return ""
        out = []
        for es in self.ipp.engines.values():
            sets = getattr(es, "launchers", None)
            if sets is not None:
                if isinstance(self.launcher, SSHLauncher):
                    continue
                for lnch in list(sets.values()):
                    proc = getattr(lnch, "process", None)
                    if proc is not None and not processes.alive(proc):
                        code = describe_exit(self.exit_of(proc.pid))
                        out.append(f"engine pid {proc.pid}" + (f" {code}" if code else ""))
                continue
            proc = getattr(es, "process", None)  # one launcher process: mpirun
            if proc is not None and not processes.alive(proc):
                out.append(f"{self.launcher.name} launcher's process (pid {proc.pid})")
            elif not es.running and getattr(es, "state", "") == "after":
                out.append("engine set stopped")
        return ", ".join(out)

    def hosts_note(self) -> str:
        """Which hosts engines were started on, and which of them stopped."""
        placement = self.launcher.placement
        if placement is None:
            return ""
        stopped = (
            self.launcher.stopped_hosts(self.ipp) if isinstance(self.launcher, SSHLauncher) else []
        )
        note = f" (engines started on {placement.summary()}; controller on {self.controller_ip}"
        if stopped:
            note += f"; the engine process exited on {', '.join(stopped)}"
        note += ")"
        if self.controller_ip != "0.0.0.0":
            note += (
                f". Check that every host reaches {self.controller_ip} (or pass "
                "--controller-ip) and runs the same Python environment"
            )
        return note

    def engine_pids(self) -> list[int]:
        """The engine processes this machine's launcher started (not mpirun's ranks)."""
        out = []
        for es in self.ipp.engines.values() if self.ipp is not None else []:
            for lnch in list(getattr(es, "launchers", {}).values()):
                pid = getattr(getattr(lnch, "process", None), "pid", None)
                if pid:
                    out.append(pid)
        return out

    def write_record(
        self,
        *,
        n: int,
        backend: Backend,
        launcher: str,
        state: SessionState,
        pids: list[tuple[int, float]],
        remote: dict[int, list[Any]],
    ) -> None:
        """The record the watchdog and ``%mlxdist cleanup`` read: whose this cluster
        is, its processes (``pids``) and the ranks on other machines (``remote``:
        rank -> ``[host, pid]``, which cleanup cannot end from here)."""
        rec = {
            "session_id": self.session_id,
            "client_pid": os.getpid(),
            "client_started": watchdog.start_time(os.getpid()),
            "clock": watchdog.CLOCK,
            "n": n,
            "backend": str(backend),
            "launcher": launcher,
            "state": state,
            "pids": pids,
            "controller_ip": self.controller_ip,
            "remote": remote,
        }
        runtime.write_record(self.directory, rec)

    @property
    def controller_location(self) -> str:
        """The address engines reach the controller on."""
        return self.ipp.controller_location

    def watch_infrastructure(self) -> None:
        """Remember the controller and the schedulers it forked: cells check they
        still run, and stop ends them even if the controller died first."""
        self.infra = {}
        cpid = self.controller_pid()
        controller = processes.identity(cpid) if cpid else None
        if controller is None:
            return
        self.infra["controller"] = controller
        for i, pid in enumerate(processes.children(cpid)):
            if (child := processes.identity(pid)) is not None:
                self.infra[f"controller's scheduler #{i + 1}"] = child

    def infrastructure_problem(self) -> str:
        """Why results can no longer reach the notebook: the controller or one of its
        schedulers exited (``""`` when all run).

        A clean answer is reused for ``Policy.alive_every`` seconds: a cell asks before
        dispatch and its supervisor again at once, and reading every scheduler's
        process each time cost about 0.5 ms a cell (bench: Session.run 1.04x -> 1.14x
        of ``%%px``); a controller that dies is still seen within that interval.
        """
        now = time.monotonic()
        if now - self._infra_ok_at < config.Policy.alive_every:
            return ""
        for what, ident in self.infra.items():
            if processes.running(ident):
                continue
            return (f"the ipyparallel {what} (pid {ident[0]}) exited; results cannot reach "
                    "the notebook")  # fmt: skip
        self._infra_ok_at = now
        return ""

    # -- processes ------------------------------------------------------------------
    def controller_pid(self) -> int | None:
        proc = getattr(getattr(self.ipp, "controller", None), "process", None)
        return getattr(proc, "pid", None)

    def processes(self, rank_pids: list[int]) -> list[tuple[int, float]]:
        """``(pid, start time)`` of every local process of this cluster that still
        runs: the ranks (``rank_pids``) and their nannies, the controller and its
        schedulers, the launchers' processes."""
        pids: list[int] = []
        for pid in rank_pids:  # each engine with ipyparallel's nanny that watches it
            pids += [pid, *processes.children(pid)]
        if self.ipp is not None:
            cpid = self.controller_pid()
            if cpid:
                pids += [cpid, *processes.children(cpid)]  # the controller forks its schedulers
            pids += self.engine_pids()
            for es in self.ipp.engines.values():
                p = getattr(getattr(es, "process", None), "pid", None)
                if p:
                    pids.append(p)
        out = [ident for ident in self.infra.values() if processes.running(ident)]
        out += [ident for pid in dict.fromkeys(pids) if (ident := processes.identity(pid))]
        return list(dict.fromkeys(x for x in out if x))

    def exit_of(self, pid: int | None) -> int | None:
        """The exit code of a local engine process ``pid`` when its launcher started it
        as this process's child (negative: the signal); ``None`` when unknown."""
        for es in self.ipp.engines.values() if self.ipp is not None else []:
            # an engine whose stop ipyparallel has processed: its launcher is gone
            stopped = (getattr(es, "stop_data", None) or {}).get("engines", {})
            for data in stopped.values():
                if data.get("pid") == pid and isinstance(data.get("exit_code"), int):
                    return data["exit_code"]
            for lnch in getattr(es, "launchers", {}).values():
                proc = getattr(lnch, "process", None)
                if proc is None or getattr(proc, "pid", None) != pid:
                    continue
                code = getattr(proc, "exit_code", None)
                if code is None:
                    try:  # reap it here if ipyparallel's waiting thread has not yet
                        code = proc.wait(timeout=0.5)
                    except Exception:  # noqa: BLE001 - still running, or reaped elsewhere
                        code = None
                    code = getattr(proc, "exit_code", None) if code is None else code
                return code
        return None

    def remote_signals(self, targets: dict[int, tuple[str, int]], sig: int) -> list[Callable]:
        """Jobs that signal ranks on other machines (see :meth:`Launcher.remote_signals`)."""
        return self.launcher.remote_signals(self.ipp, targets, sig)

    # -- stopping -------------------------------------------------------------------
    def stop(
        self,
        rank_pids: list[int],
        end_first: Callable[[], None] | None = None,
        on_ended: Callable[[], None] | None = None,
    ) -> None:
        """Close the client, stop the controller and engines, and end by PID whatever
        is left (also the controller's schedulers). ``end_first`` runs before the
        polite stop (e.g. SIGKILL to ranks stuck in a collective), ``on_ended`` once
        every process is gone, before the watchdog is stopped. A Ctrl-C during the
        stop ends the processes all the same, then is raised."""
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        interrupted = None
        if self.ipp is not None:
            pids = self.processes(rank_pids)
            cpid = self.controller_pid()
            c_started = next((t for p, t in pids if p == cpid), None)
            if end_first is not None:
                end_first()
            # the engines first, while the controller still takes their goodbye: they
            # exit in a fraction of a second then, and wait seconds when it is stopping
            processes.end_pids([p for p in pids if p[0] in rank_pids])
            try:
                self.ipp.stop_cluster_sync()
            except KeyboardInterrupt as e:
                interrupted = e
            except Exception:  # noqa: BLE001 - fall through to ending the PIDs
                pass
            processes.end_pids(pids)
            if cpid and c_started is not None:
                # the controller leads its own process group and forks its schedulers
                # into it: one forked after the list above was made is ended here
                processes.end_pids(
                    processes.group_members(cpid, c_started, "ipyparallel.controller")
                )
        processes.end_recorded(self.directory)  # e.g. a dead controller's schedulers
        if on_ended is not None:
            on_ended()
        if self.watchdog is not None:
            watchdog.stop(self.watchdog, self.directory)
            self.watchdog = None
        self.client = None
        self.ipp = None
        self.infra = {}
        if interrupted is not None:
            raise interrupted


class Cancelled(Exception):
    """A start given up half way (a spare cluster no longer wanted)."""


def _check(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise Cancelled


def describe_exit(code: int | None) -> str:
    """``-9`` -> ``killed by SIGKILL (signal 9; the out-of-memory killer sends it too)``."""
    if code is None:
        return ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = "; the out-of-memory killer sends it too" if -code == signal.SIGKILL else ""
        return f"killed by {name} (signal {-code}{extra})"
    return f"exit code {code}"
