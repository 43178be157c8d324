"""The processes a session starts: tell them from a reused PID, end them, and find
what sessions whose notebook is gone left behind.

A PID alone is not an identity (the kernel reuses them): every check pairs it with
the process's start time, as recorded when the session started it.

While a notebook runs, its session's :mod:`~mlx_nbdist.watchdog` ends everything if
the notebook dies. :func:`cleanup` (``%mlxdist cleanup``) is for what is left anyway
(a session from before the watchdog, a watchdog that was killed too): processes,
shared-memory segments and rank folders of dead sessions, and old session
directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from . import runtime, watchdog
from .watchdog import same_process, wait_ended

#: stopped sessions' directories kept by :func:`cleanup` (the newest ones) ...
KEEP_SESSIONS = 20
#: ... and for how long after they stopped, in seconds
KEEP_SECONDS = 24 * 3600
#: a ring hostfile a rank did not remove (killed inside ``mx.distributed.init``) is
#: stale after this many seconds
STALE_HOSTFILE = 3600
_SESSION_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")  # runtime.new_session_id()
_RANK_FOLDER = re.compile(r"^mlx_nbdist-(.+)-rank(\d+)-[^-]+$")  # bootstrap's mkdtemp


def children(pid: int) -> list[int]:
    """The descendants of ``pid``; for a process that is gone (or a zombie), the
    processes left in the process group it led (a killed controller's schedulers:
    while they remain, the kernel gives that group's ID to no new process)."""
    try:
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE:
            return [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        pass
    out = []
    for q in psutil.process_iter():
        try:
            if q.pid != pid and os.getpgid(q.pid) == pid:
                out.append(q.pid)
        except (OSError, psutil.Error):
            pass
    return out


def group_members(pgid: int, started: float, marker: str) -> list[tuple[int, float]]:
    """Processes in process group ``pgid`` started since ``started`` whose command line
    contains ``marker``: what a group leader forked, even after we last looked."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getpgid(p.pid) != pgid or marker not in " ".join(p.info["cmdline"] or []):
                continue
            begun = watchdog.start_time(p.pid)
            if begun >= started - watchdog.SAME_START:
                out.append((p.pid, begun))
        except (OSError, psutil.Error):
            pass
    return out


#: command lines of the processes a start launches (controller and its schedulers,
#: engines and their nannies, mpirun)
STARTED_BY_US = ("ipyparallel", "ipengine", "ipcontroller", "mpirun", "prterun", "mlx_nbdist")


def child_pids() -> set[int]:
    """PIDs of this process's descendants."""
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def started_since(before: set[int]) -> list[psutil.Process]:
    """Live descendants of this process not in ``before`` that a session start
    launched (their command line names ipyparallel, mpirun or mlx_nbdist)."""
    out = []
    for pid in child_pids() - before:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and any(
                k in " ".join(p.cmdline()) for k in STARTED_BY_US
            ):
                out.append(p)
        except psutil.Error:
            pass
    return out


def end_started_since(before: set[int], wait: float = 5.0,
                      others: Callable[[], set[int]] = set) -> list[psutil.Process]:
    """After an interrupted start: wait up to ``wait`` s for what it launched since
    ``before`` to go (ipyparallel's nannies follow their engines within seconds),
    end what is still there by PID and start time, and return what is left.
    ``others()``: the PIDs of other sessions of this process, launched meanwhile too
    (a spare brought up in the background), which are not the start's to end."""

    def left() -> list[psutil.Process]:
        theirs = others()
        return [p for p in started_since(before) if p.pid not in theirs]

    t_end = time.monotonic() + wait
    found = left()
    while found and time.monotonic() < t_end:
        time.sleep(0.1)
        found = left()
    if found:
        end_pids([x for p in found if (x := identity(p))])
        found = left()
    return found


def identity(p: int | psutil.Process) -> tuple[int, float] | None:
    """``(pid, start time)``: what identifies a process over time (see
    :func:`watchdog.start_time`); ``None`` if gone."""
    pid = p.pid if isinstance(p, psutil.Process) else p
    try:
        return (pid, watchdog.start_time(pid))
    except psutil.Error:
        return None


def running(ident: tuple[int, float]) -> bool:
    """The process runs, is not a zombie, and is the one ``ident`` (:func:`identity`)
    was taken of: a PID the system gave to another process is not it.

    Every cell asks this of every local rank before it is sent: on Linux it is one
    read of ``/proc/<pid>/stat`` (psutil reads it twice, 0.2 ms a rank: a third of
    the magic's overhead over ``%%px``); elsewhere, and in portable mode, psutil's.
    """
    return same_process(*ident)


def alive(p: psutil.Process) -> bool:
    """A process another library started and keeps a ``psutil.Process`` of (an
    ipyparallel launcher's) runs and is not a zombie; psutil tells a reused PID by
    its own record of the start."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_pids(pids: list[tuple[int, float]], grace: float = 3.0) -> None:
    """End the processes we started (checked by PID and start time), TERM then KILL."""
    procs = []
    for pid, started in pids:
        if same_process(pid, started):
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    alive = wait_ended(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_ended(alive, timeout=grace)


def end_recorded(directory: Path | None, grace: float = 3.0) -> list[int]:
    """End what a stopping session's record still lists, and remove its files.

    For :meth:`Session.stop`, after the cluster was stopped and before the record
    is marked stopped: the record written at start lists every process (the
    controller's schedulers included), so one whose parent died first (a killed
    controller) is still ended, by PID and start time, with its children and the
    process groups of those still running. Also removes the session's shared-memory
    segments and its ranks' private status folders on this machine. Returns the
    PIDs it ended. Never call it for a session that is still running.
    """
    if directory is None:
        return []
    rec = watchdog.read_record(directory)
    if rec is None or rec.get("state") == "stopped":
        return []
    pids = watchdog.recorded_pids(rec)
    pids.update(watchdog.related(pids, set()))
    live = {p: t for p, t in pids.items() if same_process(p, t)}
    end_pids(list(live.items()), grace)
    watchdog.remove_files(watchdog.session_id_of(directory, rec))
    return sorted(live)


def cleanup() -> list[str]:
    """End and remove what sessions whose notebook is gone left behind.

    For each session directory under :func:`runtime.runtime_root` whose notebook
    process is gone (a zombie counts as gone): SIGKILL its recorded processes (by
    PID and start time) with their children and group members, remove its
    shared-memory segments and rank folders, and mark it stopped. Stopped sessions'
    leftover files go too, and so do segments, rank folders and ring hostfiles that
    no session here claims and whose process is gone. Finally the directories of
    stopped sessions beyond the newest :data:`KEEP_SESSIONS`, or stopped for more
    than :data:`KEEP_SECONDS`, are removed.

    Returns one line per thing done, e.g. ``session X: ended pids [..], removed 3
    shared-memory segments, 2 rank folders`` (empty: nothing to clean up).
    """
    root = runtime.runtime_root()
    lines = []
    claimed: set[str] = set()
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.is_symlink():
            continue
        claimed.add(d.name)
        rec = watchdog.read_record(d)
        if rec is None:
            continue  # starting (no record yet), or not a session's
        sid = watchdog.session_id_of(d, rec)
        claimed.add(sid)
        if rec.get("state") == "stopped":
            segs, folders = watchdog.remove_files(sid)  # e.g. ranks killed by a stop
            done = watchdog.Reaped(sid, [], segs, folders)
        elif _client_alive(rec):
            continue
        else:
            done = watchdog.reap(d, rec)
        if done.describe():
            lines.append(done.describe())
    segs, folders, hostfiles = _unclaimed(claimed)
    kinds = (
        (segs, "shared-memory segment"),
        (folders, "rank folder"),
        (hostfiles, "ring hostfile"),
    )
    found = [watchdog.count_of(n, what) for n, what in kinds if n]
    if found:
        lines.append(f"removed {', '.join(found)} left by sessions with no record")
    pruned = prune(root)
    if pruned:
        dirs = watchdog.count_of(pruned, "old session directory", "old session directories")
        lines.append(f"removed {dirs}")
    return lines


def _unclaimed(claimed: set[str]) -> tuple[int, int, int]:
    """Remove segments, rank folders and ring hostfiles of no session in ``claimed``
    whose process is gone; returns how many of each."""
    segs = 0
    if watchdog.SHM_DIR.is_dir():
        for p in watchdog.SHM_DIR.glob("mlxnb-*"):
            # mlxnb-<session id>-<creator pid>-<token> (engine.transfer)
            parts = p.name[len("mlxnb-") :].rsplit("-", 2)
            if len(parts) != 3 or not parts[1].isdigit() or parts[0] in claimed:
                continue
            if _made_by_live(p, int(parts[1])) or not _mine(p):
                continue
            try:
                p.unlink()
                segs += 1
            except OSError:
                pass
    tmp = Path(tempfile.gettempdir())
    folders = 0
    for p in tmp.glob("mlx_nbdist-*-rank*-*"):
        m = _RANK_FOLDER.match(p.name)
        if not m or m.group(1) in claimed or p.is_symlink() or not p.is_dir() or not _mine(p):
            continue
        status = p / f"rank{m.group(2)}.json"
        try:
            pid = int(json.loads(status.read_text()).get("pid", 0))
            if _made_by_live(status, pid):
                continue
        except (OSError, ValueError, AttributeError):
            if time.time() - _mtime(p) < KEEP_SECONDS:
                continue  # just made (no status yet), or unreadable: leave it a while
        shutil.rmtree(p, ignore_errors=True)
        folders += not p.exists()
    hostfiles = 0
    for p in tmp.glob("mlx_nbdist-ring-*.json"):
        if _mine(p) and time.time() - _mtime(p) > STALE_HOSTFILE:
            try:
                p.unlink()
                hostfiles += 1
            except OSError:
                pass
    return segs, folders, hostfiles


def prune(root: Path, keep: int = KEEP_SESSIONS, max_age: float = KEEP_SECONDS) -> int:
    """Remove the directories of stopped sessions beyond the newest ``keep`` or
    stopped more than ``max_age`` seconds ago (and of starts that never wrote a
    record, after ``max_age``); returns how many were removed."""
    now = time.time()
    candidates = []
    for d in root.iterdir():
        if not d.is_dir() or d.is_symlink():
            continue
        rec = watchdog.read_record(d)
        if rec is None:
            if _SESSION_NAME.match(d.name) and now - _mtime(d) > max_age:
                candidates.append((_mtime(d), d))
            continue
        if rec.get("state") != "stopped":
            continue
        if not (_SESSION_NAME.match(d.name) or rec.get("session_id") == d.name):
            continue
        candidates.append((_mtime(d / watchdog.RECORD), d))
    candidates.sort(key=lambda c: c[0], reverse=True)
    removed = 0
    for i, (stamp, d) in enumerate(candidates):
        if i >= keep or now - stamp > max_age:
            shutil.rmtree(d, ignore_errors=True)
            removed += not d.exists()
    return removed


def _made_by_live(path: Path, pid: int) -> bool:
    """``path`` was made by process ``pid``, which still runs (a process that started
    after the file was last written is another one on a reused PID)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= _mtime(path) + 1.0
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False


def _mine(p: Path) -> bool:
    try:
        return p.lstat().st_uid == os.getuid()
    except OSError:
        return False


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _client_alive(rec: dict[str, Any]) -> bool:
    """The session's notebook runs (a zombie notebook is dead). A record of an older
    mlx_nbdist holds start times of another clock: its notebook counts as running
    while its PID does, so that a session still in use is never taken apart."""
    pid = int(rec.get("client_pid", 0))
    if rec.get("clock") != watchdog.CLOCK:
        try:
            return pid > 0 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    return watchdog.client_alive(pid, float(rec.get("client_started", 0)))
