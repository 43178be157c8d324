"""A session owns one ipyparallel cluster whose engines form one MLX group.

>>> from mlx_nbdist import Session
>>> with Session(n=2) as s:
...     r = s.run("y = mx.distributed.all_sum(mx.ones(2) * (rank + 1), group=world); print(y)")
...     print(r.stdout(0))
array([3, 3], dtype=float32)

Ranks are the session's: rank ``r`` is always ``r``, whatever ids ipyparallel gives
the engines (restarted engines get new ids).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import secrets
import signal
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

from . import _ipp, launch, processes, watchdog
from . import hosts as _hosts
from .engine import bootstrap as _bootstrap
from .engine import transfer
from .errors import (
    CellError,
    NotStartedError,
    SessionBrokenError,
    SetupError,
    StartError,
)
from .outcomes import check_ledgers, collect, ledgers_of, raise_for, short_error
from .results import (
    DIED,
    PAUSED,
    CellResult,
    CollectiveRecord,
    RankInfo,
    RankState,
)
from .streams import CellStreams, OutputEvent
from .supervise import Outcome, Policy, Supervisor, failed


class SessionState(str, Enum):
    """The one state of a session; compares equal to its value (``"ready"``)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"

    def __str__(self) -> str:
        return self.value


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

    state: str
    n: int
    backend: str
    launcher: str
    session_id: str
    uptime: float
    broken_reason: str
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    alive: dict[int, bool] = field(default_factory=dict)
    live: dict[int, RankState] = field(default_factory=dict)


_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


@dataclass
class RankPlace:
    """Where a rank runs, as the session found out when it started.

    Attributes:
        host: the host name it was launched on (``ssh`` name), or this machine's name.
        addresses: its MLX ring endpoints (``ip:port``); empty for the mpi backend.
        local: its process is visible here (same machine and PID space): liveness
            and signals go through the PID; else through ipyparallel (registration)
            and the launcher's ssh.
        shared_files: its status file is in the session directory (shared disk).
    """

    host: str
    addresses: list[str] = field(default_factory=list)
    local: bool = True
    shared_files: bool = True

    def describe(self) -> str:
        ips = sorted({a.rsplit(":", 1)[0] for a in self.addresses})
        return f"{self.host} ({', '.join(ips)})" if ips and ips != [self.host] else self.host


class Session:
    """N ipyparallel engines in one MLX distributed group, on one or several hosts.

    Args:
        n: number of ranks (default 2; with ``hostfile``, one per hostfile entry;
            with ``hosts``, one per host).
        backend: MLX backend, ``ring`` (TCP, default) or ``mpi``.
        launcher: ``local`` (ipyparallel local engines), ``ssh`` (ipyparallel's SSH
            engine launcher, on ``hosts``) or ``mpi`` (engines started by
            ``mpirun``); defaults to ``mpi`` for the mpi backend, else ``ssh`` when
            hosts are given, else ``local``.
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
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str = "ring",
        launcher: str | None = None,
        timeout: float | None = 300.0,
        start_timeout: float = 120.0,
        check_collectives: bool = False,
        hosts: str | Iterable[str] | None = None,
        hostfile: str | os.PathLike[str] | None = None,
        controller_ip: str | None = None,
        ssh_cmd: list[str] | None = None,
        scp_cmd: list[str] | None = None,
        python: str | None = None,
        assume_remote: bool = False,
    ):
        if n is not None:
            _check_n(n)
        self.hosts = list(hosts) if hosts is not None and not isinstance(hosts, str) else hosts
        self.hostfile = hostfile
        self.placement = _hosts.resolve(hosts=self.hosts, hostfile=hostfile, n=n)
        self.n = int(self.placement.n if self.placement else (2 if n is None else n))
        _check_n(self.n)
        self.backend = backend
        self.launcher = launcher or (
            "mpi" if backend == "mpi" else ("ssh" if self.placement is not None else "local")
        )
        self.timeout = _check_timeout(timeout)
        #: characters of a cell's output per rank that reach the notebook (0: all)
        self.output_limit = 1 << 20
        self.start_timeout = start_timeout
        self.check_collectives = check_collectives
        self.controller_ip_requested = controller_ip
        self.controller_ip = launch.LOOPBACK
        self.ssh_cmd = list(ssh_cmd) if ssh_cmd else None
        self.scp_cmd = list(scp_cmd) if scp_cmd else None
        self.python = python
        self.assume_remote = assume_remote
        self.policy = Policy()
        self._state = STOPPED
        #: True while :meth:`stop` ends the processes (ranks are going, not dead)
        self.stopping = False
        #: one cell, apply or push at a time: a second caller (another thread, a
        #: kernel subshell) waits, so two cells' collectives never interleave
        self._run_lock = threading.RLock()
        self.broken_reason = ""
        self.session_id = ""
        self.directory: Path | None = None
        self.ranks: dict[int, RankInfo] = {}
        self.places: dict[int, RankPlace] = {}
        self.cluster: Any = None
        self.client: Any = None
        self._started_at = 0.0
        self._cell = 0
        self._procs: dict[int, psutil.Process] = {}
        #: the controller and its schedulers, watched while cells run
        self._infra: dict[str, psutil.Process] = {}
        self._watchdog: int | None = None  # its PID (see mlx_nbdist.watchdog)
        #: the notebook's end of slice transfers (see ``mlx_nbdist.slices``)
        self.receiver = transfer.Receiver()

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        """``stopped`` -> ``starting`` -> ``ready`` (-> ``broken``) -> ``stopped``."""
        return self._state

    def start(self, progress: Progress | None = None) -> Session:
        """Start the controller and engines, join them in one MLX group, and check it.

        On a session already started this does nothing (a broken one stays broken:
        :meth:`restart` replaces it).
        """
        say = progress or (lambda msg: None)
        if self._state in (READY, BROKEN):
            return self
        if self.placement is not None and self.placement.n != self.n:
            # ``n`` changed since (``%mlxdist restart -n``): place the new count
            self.placement = _hosts.resolve(hosts=self.hosts, hostfile=self.hostfile, n=self.n)
        launch.check_backend(self.backend, self.launcher, self.placement)
        cores = os.cpu_count() or 1
        if self.placement is None and self.n > cores:
            warnings.warn(
                f"{self.n} ranks on {cores} CPU cores: ranks share cores, so collectives "
                "and compute will be slow (fine for learning, not for timing)",
                OversubscribedWarning,
                stacklevel=2,
            )
        with self._run_lock:
            self._state = STARTING
            try:
                self._launch(say)
            except BaseException:
                try:
                    self._teardown()
                finally:
                    self._state = STOPPED
                raise
            self._state = READY
        self._started_at = time.time()
        _LIVE.add(self)
        return self

    def _launch(self, say: Progress) -> None:
        self.session_id = launch.new_session_id()
        self.directory = launch.session_dir(self.session_id)
        self.broken_reason = ""
        self.places = {}
        p = self.placement
        self.controller_ip = (
            launch.LOOPBACK
            if p is None
            else _hosts.controller_address(p, self.controller_ip_requested)
        )
        where = "" if p is None else f" on {self.controller_ip} for {p.source}"
        say(f"session {self.session_id}: starting controller{where}")
        self.cluster = launch.make_cluster(
            n=self.n,
            launcher=self.launcher,
            session_id=self.session_id,
            directory=self.directory,
            placement=p,
            controller_ip=self.controller_ip,
            ssh_cmd=self.ssh_cmd,
            scp_cmd=self.scp_cmd,
            python=self.python,
        )
        self.cluster.start_controller_sync()
        self._write_record()  # the controller and its schedulers, for the watchdog
        self._start_watchdog()
        on = "" if p is None else f" on {p.summary()}"
        say(f"starting {self.n} engines{on} ({self.launcher} launcher)")
        try:
            self.cluster.start_engines_sync(self.n, environment=launch.engine_env(self.launcher, p))
        except Exception as e:
            if p is None:
                raise
            failed = [h for h, lnch in self._ssh_launchers() if lnch.state == "before"]
            for es in self.cluster.engines.values():  # never started: nothing to stop
                for ident, lnch in list(getattr(es, "launchers", {}).items()):
                    if getattr(lnch, "state", "") == "before":
                        es.launchers.pop(ident, None)
            where = f" on host {', '.join(failed)}" if failed else f" on {p.summary()}"
            raise StartError(
                f"could not start the engines{where} ({self.launcher} launcher): "
                f"{short_error(e)}. Check that `ssh HOST` works without a prompt from "
                "this machine and that the hosts have this Python environment "
                f"({self.python or 'the same path as here'})."
            ) from e
        self._write_record()
        self.client = self.cluster.connect_client_sync()
        self._wait_for_engines(say)
        say(f"joining the MLX group ({self.backend} backend)")
        self._join_group()
        self._write_record()

    def _start_watchdog(self) -> None:
        """A process that ends this session if this one dies (see mlx_nbdist.watchdog)."""
        try:
            self._watchdog = watchdog.start(self.directory)
        except OSError as e:
            warnings.warn(f"{e}; if this kernel dies, run %mlxdist cleanup", stacklevel=4)

    def _wait_for_engines(self, say: Progress) -> None:
        t_end = time.monotonic() + self.start_timeout
        seen = -1
        while len(self.client.ids) < self.n:
            if len(self.client.ids) != seen:
                seen = len(self.client.ids)
                say(f"engines registered: {seen}/{self.n}")
            if not self._engines_running():
                raise StartError(
                    f"the engines exited while starting{self._launch_hosts_note()}.\n"
                    + launch.log_tail(self.directory)
                )
            if time.monotonic() > t_end:
                raise StartError(
                    f"only {len(self.client.ids)} of {self.n} engines registered within "
                    f"{self.start_timeout:g} s{self._launch_hosts_note()}.\n"
                    + launch.log_tail(self.directory)
                )
            time.sleep(0.1)
        say(f"engines registered: {self.n}/{self.n}")

    def _launch_hosts_note(self) -> str:
        """Which hosts engines were started on, and which of them stopped."""
        if self.placement is None:
            return ""
        stopped = sorted(
            {h for h, lnch in self._ssh_launchers() if getattr(lnch, "state", "") == "after"}
        )
        note = f" (engines started on {self.placement.summary()}; controller on "
        note += f"{self.controller_ip}"
        if stopped:
            note += f"; the engine process exited on {', '.join(stopped)}"
        note += ")"
        if self.controller_ip != "0.0.0.0":
            note += (
                f". Check that every host reaches {self.controller_ip} (or pass "
                "--controller-ip) and runs the same Python environment"
            )
        return note

    def _ssh_launchers(self) -> list[tuple[str, Any]]:
        """``(host name, launcher)`` of every engine started over ssh."""
        out = []
        for es in self.cluster.engines.values() if self.cluster is not None else []:
            for ident, lnch in list(getattr(es, "launchers", {}).items()):
                if hasattr(type(lnch), "ssh_sender"):  # the class: the property runs ssh
                    out.append((str(ident).rsplit("/", 1)[0], lnch))
        return out

    def _engines_running(self) -> bool:
        return all(es.running for es in self.cluster.engines.values())

    def _join_group(self) -> None:
        ids = sorted(self.client.ids)[: self.n]
        t_end = time.monotonic() + self.start_timeout
        me = psutil.Process()
        probes = self._probe(ids, me, t_end)
        order = self._assign(probes)  # rank -> engine id
        places = {r: self._place(r, probes[eid]) for r, eid in order.items()}
        local = {
            r: (
                not self.assume_remote
                and probes[eid]["machine"] == _bootstrap.machine_id()
                and processes.same_process(probes[eid]["pid"], probes[eid]["started"])
            )
            for r, eid in order.items()
        }
        hostfile_json = None
        if self.backend == "ring":
            endpoints = self._ring_endpoints(order, places, probes, t_end)
            for r, eps in endpoints.items():
                places[r].addresses = eps
            hostfile_json = json.dumps([endpoints[r] for r in range(self.n)])
            launch.write_ring_hostfile(
                self.directory / "hostfile.json", [endpoints[r] for r in range(self.n)]
            )
        for r in places:
            places[r].local = local[r]
            places[r].shared_files = not self.assume_remote and probes[order[r]]["shared_files"]
        watch = {r: not self.assume_remote and probes[order[r]]["sees_client"] for r in order}
        # One rank that sees this process ends the controller if the notebook dies.
        reaper = next((r for r in sorted(order) if watch[r]), None)
        cpid = self._controller_pid()
        reap = [cpid, *processes.children(cpid)] if cpid else []
        base = dict(
            size=self.n,
            backend=self.backend,
            hostfile_json=hostfile_json,
            token=secrets.randbelow(2**31 - 1),
            session_id=self.session_id,
            session_dir=str(self.directory),
            client_pid=me.pid,
            client_started=me.create_time(),
        )
        ars = {
            r: self.client[eid].apply_async(
                _bootstrap.bootstrap,
                dict(
                    base,
                    rank=r,
                    engine_id=eid,
                    host=places[r].host,
                    shared_files=places[r].shared_files,
                    watch_client=watch[r],
                    reap_pids=reap if r == reaper else [],
                ),
            )
            for r, eid in order.items()
        }
        infos, errors = {}, []
        for r, ar in ars.items():
            try:
                info = ar.get(timeout=max(0.1, t_end - time.monotonic()))
                infos[info["rank"]] = RankInfo(**info)
            except Exception as e:  # noqa: BLE001 - reported below with the engine id
                errors.append(f"rank {r} ({self._where(order[r], places[r])}): {short_error(e)}")
        if errors:
            hint = ""
            if self.placement is not None and self.backend == "ring":
                hint = (
                    "\nThe ring connects every rank to its neighbours on the addresses in "
                    f"{self.directory / 'hostfile.json'}: check that the hosts reach each "
                    'other there (firewalls, the hostfile\'s "ips").'
                )
            raise StartError(
                f"the {self.backend} group did not form:\n  " + "\n  ".join(errors) + hint
            )
        if sorted(infos) != list(range(self.n)):
            raise StartError(f"ranks {sorted(infos)} do not cover 0..{self.n - 1}")
        self.ranks = dict(sorted(infos.items()))
        self.places = dict(sorted(places.items()))
        self._watch_infrastructure()
        self._procs = {}
        for r, info in self.ranks.items():
            if not self.places[r].local:
                continue
            try:
                self._procs[r] = psutil.Process(info.pid)
            except psutil.Error as e:
                raise StartError(f"rank {r} (pid {info.pid}) exited right after joining") from e

    def _watch_infrastructure(self) -> None:
        """Remember the controller and the schedulers it forked: cells check they
        still run, and stop ends them even if the controller died first."""
        self._infra = {}
        cpid = self._controller_pid()
        try:
            controller = psutil.Process(cpid) if cpid else None
        except psutil.Error:
            controller = None
        if controller is None:
            return
        self._infra["controller"] = controller
        for i, child in enumerate(controller.children(recursive=True)):
            self._infra[f"controller's scheduler #{i + 1}"] = child

    def _where(self, eid: int, place: RankPlace | None = None) -> str:
        return f"engine {eid}" + (f" on {place.describe()}" if place else "")

    def _probe(self, ids: list[int], me: psutil.Process, t_end: float) -> dict[int, dict]:
        """Step 1: ask every engine who and where it is."""
        nonce = secrets.token_hex(16)
        marker = self.directory / "probe"
        marker.write_text(nonce)
        os.chmod(marker, 0o600)
        cfg = dict(
            session_dir=str(self.directory),
            nonce=nonce,
            client_pid=me.pid,
            client_started=me.create_time(),
            controller_ip=(
                self.controller_ip
                if self.controller_ip != "0.0.0.0"
                else self.cluster.controller_location
            ),
        )
        ars = {eid: self.client[eid].apply_async(_bootstrap.probe, cfg) for eid in ids}
        probes, errors = {}, []
        for eid, ar in ars.items():
            try:
                probes[eid] = ar.get(timeout=max(0.1, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                errors.append(f"engine {eid}: {short_error(e)}")
        if errors:
            raise StartError("engines did not answer:\n  " + "\n  ".join(errors))
        return probes

    def _assign(self, probes: dict[int, dict]) -> dict[int, int]:
        """Which engine is which rank: placement order for ssh, engine order otherwise."""
        ids = sorted(probes)
        if self.launcher != "ssh":
            return dict(enumerate(ids))
        p = self.placement
        pids: dict[str, set[int]] = {}
        for host, lnch in self._ssh_launchers():
            if getattr(lnch, "pid", None):
                pids.setdefault(host, set()).add(int(lnch.pid))
        on: dict[str, list[int]] = {}
        for eid in ids:
            host = _hosts.match_host(probes[eid], p.distinct(), pids)
            if host is None:
                pr = probes[eid]
                raise StartError(
                    f"cannot tell which host engine {eid} runs on (pid {pr['pid']}, "
                    f"hostname {pr['hostname']}, addresses {', '.join(pr['addresses'])}); "
                    f"hosts: {p.summary()}"
                )
            on.setdefault(host, []).append(eid)
        order: dict[int, int] = {}
        for host, count in p.counts().items():
            got = on.get(host, [])
            if len(got) != count:
                raise StartError(
                    f"host {host}: {count} ranks placed there but {len(got)} engines "
                    "registered from it"
                )
            order.update(zip(p.ranks_on(host), sorted(got), strict=True))
        return dict(sorted(order.items()))

    def _place(self, rank: int, probe: dict[str, Any]) -> RankPlace:
        if self.placement is None:
            return RankPlace(host=probe["hostname"])
        if self.launcher == "ssh":
            return RankPlace(host=self.placement.hosts[rank].name)
        host = _hosts.match_host(probe, self.placement.distinct(), {})  # mpirun placed it
        return RankPlace(host=host or probe["hostname"])

    def _ring_ips(self, rank: int, place: RankPlace, probe: dict[str, Any]) -> list[str]:
        if self.placement is None:
            return [launch.LOOPBACK]
        host = self.placement.hosts[rank]
        if host.ips:
            missing = [ip for ip in host.ips if ip not in probe["addresses"]]
            if missing:
                raise StartError(
                    f'host {host.name}: {", ".join(missing)} (its "ips" in '
                    f"{self.placement.source}) is not an address of that machine; it has "
                    f"{', '.join(probe['addresses'])}"
                )
            return list(host.ips)
        if not probe["route"] or probe["route"].startswith("127."):
            raise StartError(
                f"host {host.name}: cannot tell which of its addresses "
                f"({', '.join(probe['addresses'])}) the other hosts reach; give its "
                'address in a hostfile ("ips")'
            )
        return [probe["route"]]

    def _ring_endpoints(
        self,
        order: dict[int, int],
        places: dict[int, RankPlace],
        probes: dict[int, dict],
        t_end: float,
    ) -> dict[int, list[str]]:
        """Step 2: each rank picks free ports on its own host's ring addresses."""
        ips = {r: self._ring_ips(r, places[r], probes[order[r]]) for r in order}
        endpoints: dict[int, list[str]] = {}
        todo = list(order)
        for _ in range(4):
            ars = {
                r: self.client[order[r]].apply_async(_bootstrap.free_ports, ips[r]) for r in todo
            }
            for r, ar in ars.items():
                try:
                    ports = ar.get(timeout=max(0.1, t_end - time.monotonic()))
                except Exception as e:  # noqa: BLE001
                    raise StartError(
                        f"rank {r} ({self._where(order[r], places[r])}): {short_error(e)}"
                    ) from None
                endpoints[r] = [f"{ip}:{port}" for ip, port in zip(ips[r], ports, strict=True)]
            # two ranks on one host may draw the same free port: draw again for those
            seen: dict[str, int] = {}
            todo = []
            for r in sorted(endpoints):
                for ep in endpoints[r]:
                    if ep in seen and r not in todo:
                        todo.append(r)
                    seen.setdefault(ep, r)
            if not todo:
                return endpoints
        raise StartError("could not find distinct free ports for the ring endpoints")

    def stop(self) -> None:
        """Stop the engines and controller; leaves no process or port behind.

        Safe from another thread while a cell runs (that cell then fails), and a
        second Ctrl-C while stopping does not leave it half done.
        """
        if self._state == STOPPED and self.cluster is None:
            return
        self.stopping = True
        try:
            self._teardown()
        finally:
            self._state = STOPPED
            self.stopping = False
            _LIVE.discard(self)

    def restart(self, progress: Progress | None = None) -> Session:
        """New engines, same N, backend and launcher; rank r is still rank r."""
        self.stop()
        return self.start(progress)

    def _teardown(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        if self.cluster is not None:
            pids = self.processes()
            cpid = self._controller_pid()
            c_started = next((t for p, t in pids if p == cpid), None)
            if self._state == BROKEN and self.ranks:
                # ranks stuck in a collective ignore SIGTERM: spare the launchers'
                # grace period (5 s per engine over ssh) and end them now
                self.kill_ranks(list(self.ranks), signal.SIGKILL)
            interrupted = None
            try:
                self.cluster.stop_cluster_sync()
            except KeyboardInterrupt as e:  # end the processes all the same, then raise
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
            if interrupted is not None:
                self._forget_processes()
                raise interrupted
        self._forget_processes()

    def _forget_processes(self) -> None:
        if self.directory is not None:
            processes.end_recorded(self.directory)  # e.g. a dead controller's schedulers
            self._write_record(stopped=True)
        if self._watchdog is not None:
            watchdog.stop(self._watchdog, self.directory)
            self._watchdog = None
        if self.session_id:
            transfer.discard(self.shm_prefix)  # slices that never reached the notebook
        self.receiver.close()  # pulled arrays keep their own segments
        self.client = None
        self.cluster = None
        self._procs = {}
        self._infra = {}

    @property
    def shm_prefix(self) -> str:
        """Prefix of this session's shared-memory transfer files (see engine.transfer)."""
        return f"mlxnb-{self.session_id}"

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- process bookkeeping -------------------------------------------------------
    def _controller_pid(self) -> int | None:
        proc = getattr(getattr(self.cluster, "controller", None), "process", None)
        return getattr(proc, "pid", None)

    def processes(self) -> list[tuple[int, float]]:
        """``(pid, start time)`` of every local process this session started and that
        still runs: engines and their nannies, the controller and its schedulers,
        the launchers' processes."""
        pids: list[int] = []
        for p in self._procs.values():  # each engine with ipyparallel's nanny that watches it
            pids += [p.pid, *processes.children(p.pid)]
        if self.cluster is not None:
            cpid = self._controller_pid()
            if cpid:
                pids += [cpid, *processes.children(cpid)]  # the controller forks its schedulers
            for es in self.cluster.engines.values():
                for lnch in getattr(es, "launchers", {}).values():
                    p = getattr(getattr(lnch, "process", None), "pid", None)
                    if p:
                        pids.append(p)
                p = getattr(getattr(es, "process", None), "pid", None)
                if p:
                    pids.append(p)
        out = [(p.pid, p.create_time()) for p in self._infra.values() if _running(p)]
        for pid in dict.fromkeys(pids):
            try:
                out.append((pid, psutil.Process(pid).create_time()))
            except psutil.Error:
                pass
        return list(dict.fromkeys(out))

    def _write_record(self, stopped: bool = False) -> None:
        rec = {
            "session_id": self.session_id,
            "client_pid": os.getpid(),
            "client_started": psutil.Process().create_time(),
            "n": self.n,
            "backend": self.backend,
            "launcher": self.launcher,
            "state": str(STOPPED if stopped else self._state),
            "pids": [] if stopped else self.processes(),
            "controller_ip": self.controller_ip,
            # ranks on other machines: cleanup cannot end them by PID from here
            "remote": {
                r: [p.host, self.ranks[r].pid]
                for r, p in self.places.items()
                if not p.local and r in self.ranks
            },
        }
        path = self.directory / "session.json"
        path.write_text(json.dumps(rec))
        os.chmod(path, 0o600)

    # -- what the supervisor needs ---------------------------------------------------
    def rank_pid(self, rank: int) -> int:
        return self.ranks[rank].pid

    def rank_alive(self, rank: int) -> bool:
        """A local rank: its process runs. A remote one: its engine is still registered
        with the controller (ipyparallel drops an engine whose heartbeat stops)."""
        p = self._procs.get(rank)
        if p is not None:
            try:
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False
        place = self.places.get(rank)
        if place is None or place.local or self.client is None or rank not in self.ranks:
            return False
        try:
            return self.ranks[rank].engine_id in self.client.ids
        except Exception:  # noqa: BLE001 - a closed client: nothing is alive
            return False

    def rank_record(self, rank: int) -> dict[str, Any]:
        try:
            return json.loads(self._rank_file(rank, "json"))
        except (OSError, ValueError):
            return {}

    def _rank_file(self, rank: int, ext: str) -> str:
        """The text of a rank's file in the session directory (status, ``.live`` note)."""
        place = self.places.get(rank)
        if self.directory is None or (place is not None and not place.shared_files):
            raise FileNotFoundError(f"rank {rank}'s files are not readable from here")
        return (self.directory / f"rank{rank}.{ext}").read_text()

    def published_in(self, cell: int) -> bool:
        """Whether a rank published progress bars or scalars during ``cell``."""
        for r in range(self.n):
            try:
                if self._rank_file(r, "live") == str(cell):
                    return True
            except OSError:
                continue
        return False

    def kill_ranks(self, ranks: list[int], sig: int) -> None:
        """Signal ranks: by PID when local, through the launcher's ssh (or mpirun) when
        not; remote signals are sent in the background and waited for at most 5 s."""
        remote = []
        for r in ranks:
            p = self._procs.get(r)
            if p is None:
                if r in self.ranks:
                    remote.append(r)
                continue
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        if remote:
            self._signal_remote(remote, sig)

    def _signal_remote(self, ranks: list[int], sig: int, wait: float = 5.0) -> None:
        jobs: list[Callable[[], None]] = []
        if self.launcher == "ssh":
            by_host = {h: lnch for h, lnch in self._ssh_launchers()}
            for r in ranks:
                lnch = by_host.get(self.places[r].host)
                if lnch is not None:
                    jobs.append(processes.remote_kill(lnch, self.ranks[r].pid, sig))
        elif self.launcher == "mpi" and sig == signal.SIGKILL and self.cluster is not None:
            # mpirun cannot signal one remote rank; ending it ends the job (the group
            # is broken by ending any rank anyway)
            for es in self.cluster.engines.values():
                jobs.append(lambda es=es: es.signal(signal.SIGKILL))
        threads = [threading.Thread(target=job, daemon=True) for job in jobs]
        for t in threads:
            t.start()
        t_end = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, t_end - time.monotonic()))

    def drain_ranks(
        self, plan: dict[int, list[dict[str, Any]]], timeout: float
    ) -> tuple[dict[int, list[str]], list[int]]:
        """Replay ``plan[r]`` on each rank ``r``; returns the lines each replayed and
        the ranks whose replay did not complete in ``timeout`` (still blocked in it)."""
        ars = {}
        done: dict[int, list[str]] = {}
        blocked: list[int] = []
        for r, records in plan.items():
            try:
                ars[r] = self.client[self.ranks[r].engine_id].apply_async(_bootstrap.drain, records)
            except Exception as e:  # noqa: BLE001 - e.g. its engine was unregistered
                self.last_drain_error = f"rank {r}: {short_error(e)}"
                blocked.append(r)
        t_end = time.monotonic() + timeout
        for r, ar in ars.items():
            try:
                done[r] = ar.get(timeout=max(0.05, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a drain that fails falls back to ending ranks
                self.last_drain_error = f"rank {r}: {short_error(e)}"
                blocked.append(r)
        return {r: lines for r, lines in done.items() if lines}, sorted(blocked)

    def align_ranks(self, timeout: float) -> str:
        """Prove every rank's message streams are in step (a fresh nonce gathered by
        every rank); returns ``""`` when they are, else why not (the session's caller
        then marks the group broken). A rank that does not answer is ended."""
        nonce = secrets.randbits(60)
        ars, problems = {}, []
        for r in self.ranks:
            try:
                ars[r] = self.client[self.ranks[r].engine_id].apply_async(_bootstrap.align, nonce)
            except Exception as e:  # noqa: BLE001
                problems.append(f"rank {r}: {short_error(e)}")
        t_end = time.monotonic() + timeout
        silent = []
        for r, ar in ars.items():
            try:
                got = ar.get(timeout=max(0.05, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                if not ar.done():
                    silent.append(r)
                else:
                    problems.append(f"rank {r}: {short_error(e)}")
                continue
            if got["bad"]:
                problems.append(f"rank {r} read wrong data ({', '.join(got['bad'])})")
        if silent:
            problems.append(f"ranks {silent} did not answer within {timeout:g} s")
            self.kill_ranks(silent, signal.SIGKILL)
        if not problems:
            return ""
        return (
            "the group's message streams are out of step after this cell ("
            + "; ".join(problems)
            + ")"
        )

    def receive_unmatched(self, pending: dict[int, list[dict[str, Any]]], timeout: float) -> str:
        """Have each rank receive (and drop) the messages sent to it in the last cell
        that it never received; returns ``""`` or why that failed."""
        ars = {
            r: self.client[self.ranks[r].engine_id].apply_async(_bootstrap.receive_unmatched, msgs)
            for r, msgs in pending.items()
        }
        t_end = time.monotonic() + timeout
        bad = []
        for r, ar in ars.items():
            try:
                ar.get(timeout=max(0.05, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                bad.append(f"rank {r}: {short_error(e)}")
                if not ar.done():
                    self.kill_ranks([r], signal.SIGKILL)
        return "; ".join(bad)

    def infrastructure_problem(self) -> str:
        """Why results can no longer reach the notebook: the controller or one of its
        schedulers exited (``""`` when all run)."""
        for what, p in self._infra.items():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                pass
            return f"the ipyparallel {what} (pid {p.pid}) exited; results cannot reach the notebook"
        return ""

    def rank_paused(self, rank: int) -> bool:
        """Its process is stopped (SIGSTOP, a debugger): alive, but runs nothing."""
        p = self._procs.get(rank)
        try:
            return p is not None and p.status() in (psutil.STATUS_STOPPED, "tracing-stop")
        except psutil.Error:
            return False

    def rank_exit(self, rank: int) -> str:
        """How a local rank's process ended (exit code or signal), when its launcher
        started it as this process's child; ``""`` when unknown."""
        pid = self.ranks[rank].pid if rank in self.ranks else None
        for es in self.cluster.engines.values() if self.cluster is not None else []:
            # an engine whose stop ipyparallel has processed: its launcher is gone
            stopped = (getattr(es, "stop_data", None) or {}).get("engines", {})
            for data in stopped.values():
                if data.get("pid") == pid and isinstance(data.get("exit_code"), int):
                    return _describe_exit(data["exit_code"])
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
                return _describe_exit(code)
        return ""

    # -- running code ------------------------------------------------------------------
    def _require(self) -> None:
        if self._state == STOPPED or self.client is None:
            raise NotStartedError("no session is running: start one with %mlxdist start -n N")
        if self._state == READY:
            self._check_alive()
        if self._state == BROKEN:
            raise SessionBrokenError(
                f"the MLX group is broken ({self.broken_reason}); "
                "run %mlxdist restart (or Session.restart()) to get new engines"
            )

    def _check_alive(self) -> None:
        """Mark the session broken when a rank's engine went away between cells
        (killed from outside, out of memory), or the controller did: its group can no
        longer form."""
        dead = [r for r in self.ranks if not self.rank_alive(r)]
        if dead:
            self._break(
                ", ".join(
                    f"rank {r} (pid {self.ranks[r].pid}) exited since the last cell"
                    + (f" ({how})" if (how := self.rank_exit(r)) else "")
                    for r in dead
                )
            )
            return
        problem = self.infrastructure_problem()
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

    def _engine_ids(self) -> dict[int, int]:
        return {r: info.engine_id for r, info in self.ranks.items()}

    def _view(self, ranks: list[int]) -> Any:
        return self.client[[self.ranks[r].engine_id for r in ranks]]

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
    ) -> tuple[dict[int, Any], CellResult, Outcome]:
        """Send one cell or apply to ``targets`` and supervise it to the end: the one
        path of :meth:`run` and :meth:`apply`. Raises as :func:`raise_for` says."""
        self._cell += 1
        meta = {**meta, "cell": self._cell, "ranks": targets}
        t0 = time.monotonic()
        ar = send(self._view(targets), meta)
        futures = dict(zip(targets, ar._children, strict=True))
        policy = Policy(**{**asdict(self.policy), "timeout": timeout})
        outcome = Supervisor(
            self, futures, policy, on_tick, cell=self._cell, on_poll=on_poll, wake=wake
        ).wait()
        try:
            result = collect(
                futures, outcome, self._cell, self._engine_ids(), time.monotonic() - t0
            )
            if on_poll is not None:
                on_poll()  # the output that arrived with the replies
            self._settle_group(result, outcome, futures)
        except BaseException:
            # e.g. a second Ctrl-C while the group was being checked: unproven
            self._break("interrupted before the group could be checked after the cell")
            raise
        self._forget(ar)
        raise_for(result, outcome, timeout, self._host_notes(result, outcome))
        return futures, result, outcome

    def _settle_group(self, result: CellResult, outcome: Outcome, futures: dict[int, Any]) -> None:
        """After a cell: a rank that died breaks the group; the ranks' ledgers must
        agree (unmatched messages are received and dropped); after a drain, a stop
        or a disagreement, the group must prove it is in step, or it is broken."""
        for f in result.failures:
            if f.cause == DIED and f.rank in self._procs:
                f.evalue = self.rank_exit(f.rank) or f.evalue  # ipyparallel said no more
        gone = [f.rank for f in result.failures if f.cause in (DIED, PAUSED)]
        if gone and not outcome.broken:
            outcome.broken = f"rank {', '.join(map(str, gone))} died"
        if not outcome.broken and not outcome.drained:
            # (a drain's replays are not in the ledgers: the alignment check decides)
            ledgers = ledgers_of(futures)
            if self._ledger_missing(ledgers, futures):
                outcome.needs_alignment = True
            check = check_ledgers(ledgers, list(futures), self.n)
            if check.unmatched:
                why = self.receive_unmatched(check.unmatched, self.policy.drain_timeout)
                if why:
                    outcome.broken = f"unreceived messages could not be dropped ({why})"
            if check.problems:
                outcome.problem = "\n".join(check.problems)
                outcome.valid = False
                outcome.needs_alignment = True
        if outcome.needs_alignment and not outcome.broken:
            problem = self.align_ranks(self.policy.align_timeout)
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

    def _ledger_missing(self, ledgers: dict[int, Any], futures: dict[int, Any]) -> bool:
        """A rank that says (status file) it issued collectives in this cell but whose
        ledger did not arrive: the comparison would be incomplete."""
        for r in futures:
            if r in ledgers:
                continue
            rec = self.rank_record(r)
            if rec.get("tracker_cell") == self._cell and rec.get("cell_collectives"):
                return True
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

        Raises:
            CellError: a rank raised, died, or was drained, or the ranks' collectives
                did not match (``err.result`` holds every rank's output);
                ``CollectiveTimeout`` at the deadline and ``CellInterrupted`` on
                interrupt are subclasses.
            ValueError: a bad ``timeout`` or ``ranks``.
        """
        deadline = self._deadline(timeout)
        check = self.check_collectives if check_collectives is None else check_collectives
        with self._run_lock:
            self._require()
            targets = self.resolve_ranks(ranks)

            streams = CellStreams(targets)
            rank_of = {self.ranks[r].engine_id: r for r in targets}

            def send(view: Any, meta: dict[str, Any]) -> Any:
                # the cell's metadata travels as the request's label: one message per
                # rank; every output message is handed to ``streams`` as it arrives
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
            try:
                _, result, _ = self._dispatch(
                    targets, send, meta, deadline, on_tick, deliver, streams.changed
                )
            except CellError as e:
                _attach_items(e.result, streams)
                raise
            _attach_items(result, streams)
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
        rank's names are available through ``mlx_nbdist.engine.bootstrap.current()``.
        Supervised and serialised like :meth:`run`.
        """
        deadline = self._deadline(timeout)
        with self._run_lock:
            self._require()
            targets = self.resolve_ranks(ranks)

            def send(view: Any, meta: dict[str, Any]) -> Any:
                return view.apply_async(_bootstrap.call, meta, fn, *args, **kwargs)

            futures, _, outcome = self._dispatch(targets, send, {}, deadline)
            return {
                r: f.result()
                for r, f in futures.items()
                if r not in outcome.failures and not failed(f)
            }

    def _host_notes(self, result: CellResult, outcome: Outcome) -> str:
        """For a multi-host session: which host each failed rank is on, which hosts
        lost contact with the controller, and which do not answer on the network."""
        if self.placement is None or result.ok:
            return ""
        failed = sorted(f.rank for f in result.failures if f.rank in self.places)
        if not failed:
            return ""
        try:
            registered = set(self.client.ids)
        except Exception:  # noqa: BLE001
            registered = set()
        lines = []
        # engines the controller dropped, except those the supervisor ended itself
        lost = [
            r
            for r in failed
            if self.ranks[r].engine_id not in registered
            and getattr(outcome.failures.get(r), "cause", DIED) == DIED
        ]
        for r in lost:
            place = self.places[r]
            running = r in self._procs and self.rank_alive(r)
            alive = " (its process is still running)" if running else ""
            lines.append(
                f"rank {r} on host {place.describe()}: the controller lost contact with its "
                f"engine (no heartbeat){alive}; host {place.host} or its network link is down."
            )
            fail = result.ranks[r].failure
            if fail is not None and fail.ename == "EngineError":
                fail.evalue = f"lost contact with host {place.host}: {fail.evalue}"
        trouble = outcome.timed_out or outcome.broken or outcome.interrupted or lost
        if trouble and self.backend == "ring":
            silent = _unanswering({r: self.places[r].addresses for r in failed})
            for host in sorted({self.places[r].host for r in silent}):
                ranks = [r for r in silent if self.places[r].host == host]
                eps = sorted({a for r in ranks for a in self.places[r].addresses})
                lines.append(
                    f"host {host} (ranks {ranks}) does not answer at {', '.join(eps)} from "
                    "this machine: it is down or cut off the network."
                )
        lines.append(
            "Failed ranks run on: "
            + "; ".join(f"rank {r} on {self.places[r].describe()}" for r in failed)
        )
        return "\n".join(lines)

    def _forget(self, *ars: Any) -> None:
        """Drop finished messages from the client's caches (they grow without bound)."""
        try:
            done = [m for a in ars for m in a.msg_ids if m not in self.client.outstanding]
            self.client.purge_local_results(jobs=done)
        except Exception:  # noqa: BLE001 - caching is not correctness (or stop() ran)
            pass

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The value of ``name`` in each rank's namespace."""
        return self.apply(_pull_name, name, ranks=ranks)

    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Define names in each rank's namespace."""
        with self._run_lock:
            self._require()
            self._view(self.resolve_ranks(ranks)).push(namespace, block=True)

    # -- inspection ----------------------------------------------------------------------
    def rank_states(self) -> dict[int, RankState]:
        """Live state of every rank, read from the files the ranks publish."""
        out = {}
        for r in range(self.n):
            d = self.rank_record(r) if self.directory else {}
            st = RankState(rank=r, **{k: v for k, v in d.items() if k in _STATE_KEYS})
            st.recent = [CollectiveRecord.from_dict(x) for x in d.get("recent", [])]
            if self._state in (READY, BROKEN) and r in self.ranks and not self.rank_alive(r):
                st.state = "dead"
            elif self._state == BROKEN and st.state != "dead":
                st.state = "broken"
            elif r in self.places and not self.places[r].shared_files and not d:
                st.state = "unknown"  # its status file is on its own host
            out[r] = st
        return out

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

    def status(self) -> SessionStatus:
        """The session as ``%mlxdist status`` shows it; a rank or controller that
        went away since the last cell marks the session broken here too."""
        if self._state == READY:
            self._check_alive()
        return SessionStatus(
            state=self._state,
            n=self.n,
            backend=self.backend,
            launcher=self.launcher,
            session_id=self.session_id,
            uptime=self.uptime,
            broken_reason=self.broken_reason,
            ranks=dict(self.ranks),
            alive={r: self.rank_alive(r) for r in self.ranks},
            live=self.rank_states() if self.directory else {},
        )


_STATE_KEYS = set(RankState.__dataclass_fields__) - {"rank"}


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


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running()
    except psutil.Error:
        return False


def _describe_exit(code: int | None) -> str:
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


def _pull_name(name: str) -> Any:
    from IPython import get_ipython

    ns = get_ipython().user_ns
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    value = ns[name]
    cls = type(value)
    if cls.__module__ == "__main__":
        # pickled by reference to a class the notebook does not have: ipyparallel would
        # fail to rebuild it in the notebook and never complete the call
        raise TypeError(
            f"{name!r} is a {cls.__name__}, a class defined in a cell on the ranks, which "
            "the notebook cannot rebuild; pull plain data (arrays, numbers, dicts), or use "
            "mlx_nbdist.slices()/show() for a model's parameters"
        )
    return value


def _unanswering(endpoints: dict[int, list[str]], timeout: float = 1.0) -> list[int]:
    """Ranks none of whose ``ip:port`` endpoints answers a TCP connect within
    ``timeout`` (a refused connection is an answer: the host is there)."""
    results: dict[str, bool] = {}

    def knock(ep: str) -> None:
        ip, port = ep.rsplit(":", 1)
        try:
            socket.create_connection((ip, int(port)), timeout=timeout).close()
            results[ep] = True
        except ConnectionRefusedError:
            results[ep] = True
        except OSError:
            results[ep] = False

    eps = sorted({e for lst in endpoints.values() for e in lst})
    threads = [threading.Thread(target=knock, args=(e,), daemon=True) for e in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return [r for r, lst in endpoints.items() if lst and not any(results.get(e) for e in lst)]


def _check_n(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SetupError(f"-n must be a whole number of ranks >= 1, got {n!r}")
    if n > 64:
        raise SetupError(f"-n {n} is more ranks than one machine can sensibly run (max 64)")


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
