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
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from . import launch
from .engine import bootstrap as _bootstrap
from .errors import (
    CellError,
    CellInterrupted,
    CollectiveTimeout,
    NotStartedError,
    SessionBrokenError,
    SetupError,
    StartError,
)
from .results import (
    DIED,
    ERROR,
    CellResult,
    CollectiveRecord,
    RankFailure,
    RankInfo,
    RankOutput,
    RankState,
)
from .supervise import Outcome, Policy, Supervisor, error_of

STOPPED, STARTING, READY, BROKEN = "stopped", "starting", "ready", "broken"
Progress = Callable[[str], None]


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


class Session:
    """N ipyparallel engines in one MLX distributed group.

    Args:
        n: number of ranks.
        backend: MLX backend, ``ring`` (loopback TCP, default) or ``mpi``.
        launcher: ``local`` (ipyparallel local engines) or ``mpi`` (engines started
            by ``mpirun``); defaults to ``mpi`` for the mpi backend, else ``local``.
        timeout: default deadline of a cell in seconds (``None``: no deadline).
        start_timeout: how long engines may take to register and join the group.
        check_collectives: verify op/shape/dtype across ranks before each collective.
    """

    def __init__(
        self,
        n: int = 2,
        *,
        backend: str = "ring",
        launcher: str | None = None,
        timeout: float | None = 300.0,
        start_timeout: float = 120.0,
        check_collectives: bool = False,
    ):
        _check_n(n)
        self.n = int(n)
        self.backend = backend
        self.launcher = launcher or ("mpi" if backend == "mpi" else "local")
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.check_collectives = check_collectives
        self.policy = Policy()
        self.state = STOPPED
        self.broken_reason = ""
        self.session_id = ""
        self.directory: Path | None = None
        self.ranks: dict[int, RankInfo] = {}
        self.cluster: Any = None
        self.client: Any = None
        self._started_at = 0.0
        self._cell = 0
        self._procs: dict[int, psutil.Process] = {}

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> Session:
        """Start the controller and engines, join them in one MLX group, and check it."""
        say = progress or (lambda msg: None)
        if self.state in (READY, BROKEN):
            return self
        launch.check_backend(self.backend, self.launcher)
        cores = os.cpu_count() or 1
        if self.n > cores:
            warnings.warn(
                f"{self.n} ranks on {cores} CPU cores: ranks share cores, so collectives "
                "and compute will be slow (fine for learning, not for timing)",
                OversubscribedWarning,
                stacklevel=2,
            )
        self.state = STARTING
        try:
            self._launch(say)
        except BaseException:
            self._teardown()
            self.state = STOPPED
            raise
        self.state = READY
        self._started_at = time.time()
        _LIVE.add(self)
        return self

    def _launch(self, say: Progress) -> None:
        self.session_id = launch.new_session_id()
        self.directory = launch.session_dir(self.session_id)
        self.broken_reason = ""
        say(f"session {self.session_id}: starting controller")
        self.cluster = launch.make_cluster(
            n=self.n, launcher=self.launcher, session_id=self.session_id, directory=self.directory
        )
        self.cluster.start_controller_sync()
        say(f"starting {self.n} engines ({self.launcher} launcher)")
        self.cluster.start_engines_sync(self.n, environment=launch.engine_env(self.launcher))
        self._write_record()
        self.client = self.cluster.connect_client_sync()
        self._wait_for_engines(say)
        say(f"joining the MLX group ({self.backend} backend)")
        self._join_group()
        self._write_record()

    def _wait_for_engines(self, say: Progress) -> None:
        t_end = time.monotonic() + self.start_timeout
        seen = -1
        while len(self.client.ids) < self.n:
            if len(self.client.ids) != seen:
                seen = len(self.client.ids)
                say(f"engines registered: {seen}/{self.n}")
            if not self._engines_running():
                raise StartError(
                    "the engines exited while starting.\n" + launch.log_tail(self.directory)
                )
            if time.monotonic() > t_end:
                raise StartError(
                    f"only {len(self.client.ids)} of {self.n} engines registered within "
                    f"{self.start_timeout:g} s.\n" + launch.log_tail(self.directory)
                )
            time.sleep(0.1)
        say(f"engines registered: {self.n}/{self.n}")

    def _engines_running(self) -> bool:
        return all(es.running for es in self.cluster.engines.values())

    def _join_group(self) -> None:
        ids = sorted(self.client.ids)[: self.n]
        token = secrets.randbelow(2**31 - 1)
        hostfile = None
        if self.backend == "ring":
            ports = launch.free_ports(self.n)
            hostfile = str(launch.write_hostfile(self.directory / "hostfile.json", ports))
        me = psutil.Process()
        reap = [self.cluster.controller.process.pid] if self._controller_pid() else []
        base = dict(
            size=self.n,
            backend=self.backend,
            hostfile=hostfile,
            token=token,
            session_id=self.session_id,
            session_dir=str(self.directory),
            client_pid=me.pid,
            client_started=me.create_time(),
            reap_pids=reap,
        )
        ars = {
            eid: self.client[eid].apply_async(
                _bootstrap.bootstrap, dict(base, rank=i, engine_id=eid)
            )
            for i, eid in enumerate(ids)
        }
        infos, errors = {}, []
        t_end = time.monotonic() + self.start_timeout
        for eid, ar in ars.items():
            try:
                info = ar.get(timeout=max(0.1, t_end - time.monotonic()))
                infos[info["rank"]] = RankInfo(**info)
            except Exception as e:  # noqa: BLE001 - reported below with the engine id
                errors.append(f"engine {eid}: {_short_error(e)}")
        if errors:
            raise StartError(
                f"the {self.backend} group did not form:\n  " + "\n  ".join(errors)
            )
        if sorted(infos) != list(range(self.n)):
            raise StartError(f"ranks {sorted(infos)} do not cover 0..{self.n - 1}")
        self.ranks = dict(sorted(infos.items()))
        self._procs = {}
        for r, info in self.ranks.items():
            try:
                self._procs[r] = psutil.Process(info.pid)
            except psutil.Error as e:
                raise StartError(f"rank {r} (pid {info.pid}) exited right after joining") from e

    def stop(self) -> None:
        """Stop the engines and controller; leaves no process or port behind."""
        if self.state == STOPPED and self.cluster is None:
            return
        self._teardown()
        self.state = STOPPED
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
            pids = self._recorded_pids()
            try:
                self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - fall through to ending the PIDs
                pass
            _end_pids(pids)
        if self.directory is not None:
            self._write_record(stopped=True)
        self.client = None
        self.cluster = None
        self._procs = {}

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- process bookkeeping -------------------------------------------------------
    def _controller_pid(self) -> int | None:
        proc = getattr(getattr(self.cluster, "controller", None), "process", None)
        return getattr(proc, "pid", None)

    def _recorded_pids(self) -> list[tuple[int, float]]:
        pids: list[int] = [p.pid for p in self._procs.values()]
        if self.cluster is not None:
            cpid = self._controller_pid()
            if cpid:
                pids.append(cpid)
            for es in self.cluster.engines.values():
                for lnch in getattr(es, "launchers", {}).values():
                    p = getattr(getattr(lnch, "process", None), "pid", None)
                    if p:
                        pids.append(p)
                p = getattr(getattr(es, "process", None), "pid", None)
                if p:
                    pids.append(p)
        out = []
        for pid in dict.fromkeys(pids):
            try:
                out.append((pid, psutil.Process(pid).create_time()))
            except psutil.Error:
                pass
        return out

    def _write_record(self, stopped: bool = False) -> None:
        rec = {
            "session_id": self.session_id,
            "client_pid": os.getpid(),
            "client_started": psutil.Process().create_time(),
            "n": self.n,
            "backend": self.backend,
            "launcher": self.launcher,
            "state": STOPPED if stopped else self.state,
            "pids": [] if stopped else self._recorded_pids(),
        }
        path = self.directory / "session.json"
        path.write_text(json.dumps(rec))
        os.chmod(path, 0o600)

    # -- what the supervisor needs ---------------------------------------------------
    def rank_pid(self, rank: int) -> int:
        return self.ranks[rank].pid

    def rank_alive(self, rank: int) -> bool:
        p = self._procs.get(rank)
        try:
            return p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def rank_record(self, rank: int) -> dict[str, Any]:
        try:
            return json.loads((self.directory / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            return {}

    def kill_ranks(self, ranks: list[int], sig: int) -> None:
        for r in ranks:
            p = self._procs.get(r)
            if p is None:
                continue
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def drain_ranks(
        self, ranks: list[int], records: list[dict[str, Any]], timeout: float
    ) -> dict[int, list[str]]:
        ars = {
            r: self.client[self.ranks[r].engine_id].apply_async(_bootstrap.drain, records)
            for r in ranks
        }
        done: dict[int, list[str]] = {}
        t_end = time.monotonic() + timeout
        for r, ar in ars.items():
            try:
                done[r] = ar.get(timeout=max(0.05, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a drain that fails falls back to ending ranks
                self.last_drain_error = f"rank {r}: {_short_error(e)}"
                done[r] = []
        return {r: lines for r, lines in done.items() if lines}

    # -- running code ------------------------------------------------------------------
    def _require(self) -> None:
        if self.state == STOPPED or self.client is None:
            raise NotStartedError("no session is running: start one with %mlxdist start -n N")
        if self.state == BROKEN:
            raise SessionBrokenError(
                f"the MLX group is broken ({self.broken_reason}); "
                "run %mlxdist restart (or Session.restart()) to get new engines"
            )

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

    def _view(self, ranks: list[int]) -> Any:
        return self.client[[self.ranks[r].engine_id for r in ranks]]

    def _supervise(
        self,
        futures: dict[int, Any],
        timeout: float | None,
        on_tick: Callable[[], None] | None = None,
    ) -> Outcome:
        policy = Policy(**{**asdict(self.policy), "timeout": timeout})
        outcome = Supervisor(self, futures, policy, on_tick).wait()
        if outcome.broken:
            self.state = BROKEN
            self.broken_reason = outcome.broken
        return outcome

    def run(
        self,
        code: str,
        *,
        ranks: Iterable[int] | None = None,
        timeout: float | None = -1,
        check_collectives: bool | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> CellResult:
        """Run ``code`` as a cell on the ranks (default all) and collect their output.

        Args:
            code: the cell's source.
            ranks: run on these ranks only; a collective over the whole group from a
                subset is refused on the ranks rather than left to hang.
            timeout: deadline in seconds; ``-1`` uses the session default, ``None``
                means none.
            check_collectives: compare op/shape/dtype across ranks before each
                collective (default: the session's setting).
            on_tick: called about every 0.25 s while the cell runs (live displays
                read :meth:`rank_states` from it).

        Raises:
            CellError: a rank raised, died, or was drained (``err.result`` holds every
                rank's output); ``CollectiveTimeout`` at the deadline and
                ``CellInterrupted`` on interrupt are subclasses.
        """
        self._require()
        targets = self.resolve_ranks(ranks)
        timeout = self.timeout if timeout == -1 else timeout
        check = self.check_collectives if check_collectives is None else check_collectives
        self._cell += 1
        meta = {"mlxdist": 1, "cell": self._cell, "ranks": targets, "check": bool(check)}
        t0 = time.monotonic()
        # the cell's metadata travels as the request's label: one message per rank
        ar = self._view(targets).execute(code, silent=False, block=False, label=json.dumps(meta))
        futures = dict(zip(targets, ar._children, strict=True))
        outcome = self._supervise(futures, timeout, on_tick)
        result = self._collect(futures, outcome, time.monotonic() - t0)
        self._forget(ar)
        _raise_for(result, outcome, timeout)
        return result

    def apply(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: Iterable[int] | None = None,
        timeout: float | None = -1,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Call ``fn(*args, **kwargs)`` on the ranks; returns ``{rank: value}``.

        ``fn`` is sent by reference when importable, else pickled; inside it the
        rank's names are available through ``mlx_nbdist.engine.bootstrap.current()``.
        Supervised like :meth:`run`.
        """
        self._require()
        targets = self.resolve_ranks(ranks)
        timeout = self.timeout if timeout == -1 else timeout
        self._cell += 1
        meta = {"cell": self._cell, "ranks": targets}
        t0 = time.monotonic()
        ar = self._view(targets).apply_async(_bootstrap.call, meta, fn, *args, **kwargs)
        futures = dict(zip(targets, ar._children, strict=True))
        outcome = self._supervise(futures, timeout)
        result = self._collect(futures, outcome, time.monotonic() - t0)
        values = {r: f.result() for r, f in futures.items() if r not in outcome.failures}
        self._forget(ar)
        _raise_for(result, outcome, timeout)
        return values

    def _forget(self, *ars: Any) -> None:
        """Drop finished messages from the client's caches (they grow without bound)."""
        done = [m for a in ars for m in a.msg_ids if m not in self.client.outstanding]
        try:
            self.client.purge_local_results(jobs=done)
        except Exception:  # noqa: BLE001 - caching is not correctness
            pass

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The value of ``name`` in each rank's namespace."""
        return self.apply(_pull_name, name, ranks=ranks)

    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Define names in each rank's namespace."""
        self._require()
        self._view(self.resolve_ranks(ranks)).push(namespace, block=True)

    def _collect(self, futures: dict[int, Any], outcome: Outcome, elapsed: float) -> CellResult:
        outs: dict[int, RankOutput] = {}
        for r, fut in futures.items():
            if r in outcome.replied:
                _wait_output(fut)
            md = fut.output.metadata
            out = RankOutput(
                rank=r,
                engine_id=self.ranks[r].engine_id,
                stdout=md["stdout"] or "",
                stderr=md["stderr"] or "",
                outputs=list(md["outputs"] or []),
                result=(md["execute_result"] or {}).get("data"),
            )
            out.duration = _seconds(md["started"], md["completed"])
            exc = error_of(fut)
            if r in outcome.failures:
                out.failure = outcome.failures[r]
            elif exc is not None:
                out.failure = _failure_from(r, exc)
            if out.failure is not None:
                out.status = out.failure.cause
            outs[r] = out
        return CellResult(cell=self._cell, ranks=outs, elapsed=elapsed, valid=outcome.valid)

    # -- inspection ----------------------------------------------------------------------
    def rank_states(self) -> dict[int, RankState]:
        """Live state of every rank, read from the files the ranks publish."""
        out = {}
        for r in range(self.n):
            d = self.rank_record(r) if self.directory else {}
            st = RankState(rank=r, **{k: v for k, v in d.items() if k in _STATE_KEYS})
            st.recent = [CollectiveRecord.from_dict(x) for x in d.get("recent", [])]
            if self.state in (READY, BROKEN) and r in self.ranks and not self.rank_alive(r):
                st.state = "dead"
            elif self.state == BROKEN and st.state != "dead":
                st.state = "broken"
            out[r] = st
        return out

    def status(self) -> SessionStatus:
        return SessionStatus(
            state=self.state,
            n=self.n,
            backend=self.backend,
            launcher=self.launcher,
            session_id=self.session_id,
            uptime=time.time() - self._started_at if self._started_at else 0.0,
            broken_reason=self.broken_reason,
            ranks=dict(self.ranks),
            alive={r: self.rank_alive(r) for r in self.ranks},
            live=self.rank_states() if self.directory else {},
        )


_STATE_KEYS = set(RankState.__dataclass_fields__) - {"rank"}


def _seconds(start: Any, end: Any) -> float | None:
    if not start or not end:
        return None
    start, end = (datetime.fromisoformat(t) if isinstance(t, str) else t for t in (start, end))
    try:
        return (end - start).total_seconds()
    except TypeError:  # one naive, one aware
        return None


def _pull_name(name: str) -> Any:
    from IPython import get_ipython

    ns = get_ipython().user_ns
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return ns[name]


def _wait_output(fut: Any, timeout: float = 2.0) -> None:
    try:
        fut.output.result(timeout=timeout)
    except Exception:  # noqa: BLE001 - outputs are best effort after a reply
        pass


def _failure_from(rank: int, err: BaseException) -> RankFailure:
    ename = getattr(err, "ename", type(err).__name__)
    evalue = getattr(err, "evalue", str(err))
    tb = getattr(err, "traceback", None)
    if isinstance(tb, str):
        lines = tb.splitlines()
    elif isinstance(tb, list):
        lines = [str(x) for x in tb]
    else:
        lines = []
    cause = DIED if ename in ("EngineError",) else ERROR
    return RankFailure(
        rank=rank, cause=cause, ename=ename, evalue=evalue, traceback=_trim_internal(lines)
    )


def _trim_internal(lines: list[str]) -> list[str]:
    """Drop the traceback blocks of mlx_nbdist's own engine wrappers."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if not line.strip():
            blocks.append([])
        else:
            blocks[-1].append(line)
    keep = [b for b in blocks if b and not any("mlx_nbdist/engine/" in x for x in b[:1])]
    out: list[str] = []
    for b in keep:
        out += [*b, ""]
    return out[:-1] if out else lines


def _raise_for(result: CellResult, outcome: Outcome, timeout: float | None) -> None:
    if result.ok:
        return
    summary = outcome.summary
    if outcome.broken:
        summary = (summary + "\n" if summary else "") + (
            f"The MLX group is broken ({outcome.broken}); run %mlxdist restart."
        )
    if outcome.timed_out:
        summary += (
            f"\nThe cell ran past its deadline of {timeout:g} s. If it legitimately needs "
            "longer, run it with a larger --timeout (or set %config MLXDist.timeout)."
        )
        raise CollectiveTimeout(result, summary.strip())
    if outcome.interrupted:
        raise CellInterrupted(result, summary.strip())
    raise CellError(result, summary.strip())


def _short_error(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    if ename:
        return f"{ename}: {getattr(e, 'evalue', '')}"
    return f"{type(e).__name__}: {e}"


def _check_n(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SetupError(f"-n must be a whole number of ranks >= 1, got {n!r}")
    if n > 64:
        raise SetupError(f"-n {n} is more ranks than one machine can sensibly run (max 64)")


def _end_pids(pids: list[tuple[int, float]], grace: float = 3.0) -> None:
    """End the processes we started (checked by PID and start time), TERM then KILL."""
    procs = []
    for pid, started in pids:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 1.0:
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def cleanup() -> list[str]:
    """End the recorded processes of sessions whose notebook process is gone."""
    ended = []
    for rec_path in launch.runtime_root().glob("*/session.json"):
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError):
            continue
        if _client_alive(rec):
            continue
        pids = [(int(p), float(t)) for p, t in rec.get("pids", [])]
        live = [p for p, t in pids if _same_process(p, t)]
        _end_pids(pids)
        if live:
            ended.append(f"session {rec['session_id']}: ended pids {live}")
        rec["state"], rec["pids"] = STOPPED, []
        rec_path.write_text(json.dumps(rec))
    return ended


def _same_process(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def _client_alive(rec: dict[str, Any]) -> bool:
    return _same_process(int(rec.get("client_pid", 0)), float(rec.get("client_started", 0)))


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
