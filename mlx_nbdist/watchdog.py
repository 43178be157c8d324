"""One small process per session that ends the session when the notebook dies.

Each rank also watches the notebook (:mod:`mlx_nbdist.engine.monitor`), but from a
Python thread: a rank whose cell holds the GIL (a C call that never lets go of it,
such as a catastrophic regex) never runs that thread, and only rank 0 is told to end
the controller. The watchdog is a process of its own and needs nothing from the
ranks. It runs on the notebook's machine and

* every :data:`INTERVAL` seconds checks the notebook's process (PID and start time;
  a zombie counts as gone) and re-reads the session record, ``session.json`` in the
  session directory (``"pids": [[pid, start time], ...]``, rewritten by the session
  as it starts), so the session starts it once and it follows what is recorded;
* every :data:`SCAN_INTERVAL` seconds adopts the live children of those processes
  and the members of the process groups they lead (the controller's schedulers, a
  cell's subprocesses), each by PID and start time, so one that outlives its parent
  is still known;
* when the notebook is gone, SIGKILLs all of them (a PID whose start time does not
  match belongs to someone else and is spared; a signal needs no GIL), removes the
  session's shared-memory segments (``/dev/shm/mlxnb-<session id>-*``, and the POSIX
  segments named in the ranks' registries, ``<tmp>/mlxnb-<session id>-segments-*.json``;
  see :mod:`mlx_nbdist.engine.transfer`) and its ranks' private status folders
  (``<tmp>/mlx_nbdist-<session id>-rank*``), marks the record stopped and exits;
* exits without touching anything when the record says ``stopped``
  (:meth:`Session.stop` ended everything), when the session directory is gone, or
  when every process it watched has exited and the session left no files.

It is detached from the notebook (its parent exits at once, so init adopts it) in a
session of its own: neither the kernel's death nor a signal to the kernel's process
group reaches it, and it never becomes the kernel's zombie. It runs as a plain
script (psutil and the standard library only), not as ``-m mlx_nbdist.watchdog``:
importing the package would load MLX; it loads :mod:`mlx_nbdist.platform` (standard
library only) by its path. Its log is ``watchdog.log`` in the session directory.
Works wherever psutil does (Linux, macOS); where there is no ``/dev/shm`` (macOS) or
in portable mode it looks at no ``/dev/shm`` path and removes the POSIX segments the
registries name (``shm_unlink``), which cannot be listed there.

:func:`mlx_nbdist.processes.cleanup` uses the same functions (:func:`reap`) for
sessions whose notebook died without a watchdog. Every check of a process by PID and
start time, here and in the package, takes the start time from :func:`start_time`
(the kernel's value, unchanged by the clock); :func:`_psutil_start` is the one
adapter over a psutil private, with the reason.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil


def _platform() -> ModuleType:
    """:mod:`mlx_nbdist.platform`: imported in the package, loaded by path when this
    file runs as a script (importing the package would load MLX)."""
    if __package__:
        from . import platform

        return platform
    path = Path(__file__).with_name("platform.py")
    spec = importlib.util.spec_from_file_location("mlx_nbdist_platform", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


platform = _platform()

#: seconds between two looks at the notebook's process and the record
INTERVAL = 0.5
#: seconds between two scans for the recorded processes' children and group members
SCAN_INTERVAL = 2.0
#: how long the watchdog waits for the processes it killed to be gone
KILL_WAIT = 5.0
SHM_DIR = Path("/dev/shm")
RECORD = "session.json"
LOG = "watchdog.log"
#: a session id that is safe in a file name pattern (``runtime.new_session_id``)
_SID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Pids = dict[int, float]  # pid -> start time (start_time)
_SCRIPT = os.path.abspath(__file__)
#: runs this file as a script without putting its folder (the package) on sys.path
_BOOT = "import runpy, sys; del sys.argv[0]; runpy.run_path(sys.argv[0], run_name='__main__')"


# ------------------------------------------------------------------ the notebook side
def start(
    session_dir: str | os.PathLike[str],
    client_pid: int | None = None,
    client_started: float | None = None,
    *,
    timeout: float = 20.0,
) -> int:
    """Start the watchdog of the session in ``session_dir``; returns its PID.

    ``client_pid``/``client_started`` identify the notebook's process (default: this
    process). Returns once the watchdog has checked that process and read the
    record (about 0.1 s); call it after the session first wrote ``session.json``
    (or before: it waits for the record). End it with :func:`stop`, or let it see
    the record marked ``stopped``.

    Raises:
        OSError: it could not be started (the message says why).
    """
    if client_pid is None:
        client_pid = os.getpid()
    if client_started is None:
        client_started = start_time(client_pid)
    cmd = [sys.executable, "-c", _BOOT, _SCRIPT, os.path.abspath(session_dir),
           str(int(client_pid)), repr(float(client_started))]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",  # ``-c`` puts the working directory on sys.path: nothing to import there
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise OSError(f"the session watchdog did not start within {timeout:g} s") from None
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0 or not text.isdigit():
        why = text or err.decode(errors="replace").strip() or f"exit {proc.returncode}"
        raise OSError(f"the session watchdog did not start: {why.splitlines()[-1]}")
    return int(text)


def stop(pid: int, session_dir: str | os.PathLike[str], timeout: float = 2.0) -> bool:
    """End the watchdog ``pid`` started for ``session_dir`` (checked by its command
    line, so a reused PID is never hit); ``True`` when it is gone."""
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
        if _SCRIPT not in cmd or os.path.abspath(session_dir) not in cmd:
            return True
        p.terminate()
        return not wait_ended([p], timeout)
    except psutil.Error:
        pass
    return True


#: seconds between two looks at processes that were told to end
_ENDED_POLL = 0.02


def wait_ended(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until ``procs`` have ended; the ones still running after ``timeout``.

    A process that has exited counts as ended even before it is reaped: an orphan
    (a nanny or scheduler whose parent went first) stays a zombie until init reaps
    it, which some inits do only every second or so (``psutil.wait_procs`` would
    wait for that). Our own children are reaped here.
    """
    alive = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(_ENDED_POLL)


def _running(p: psutil.Process) -> bool:
    try:
        if p.status() != psutil.STATUS_ZOMBIE:
            return True
        p.wait(0)  # ours: reap it; another's: returns or raises at once
    except (psutil.Error, ChildProcessError, OSError):
        pass
    return False


# ------------------------------------------------------------------------ records
def read_record(session_dir: Path) -> dict[str, Any] | None:
    """The session's record, ``None`` when missing or half written."""
    try:
        rec = json.loads((session_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def recorded_pids(rec: dict[str, Any] | None) -> Pids:
    out: Pids = {}
    for item in (rec or {}).get("pids", []):
        try:
            out[int(item[0])] = float(item[1])
        except (TypeError, ValueError, IndexError):
            continue
    return out


def mark_stopped(session_dir: Path, **extra: Any) -> None:
    """Mark the record stopped (no processes left), atomically."""
    rec = read_record(session_dir)
    if rec is None:
        return
    rec.update(state="stopped", pids=[], **extra)
    path = session_dir / RECORD
    tmp = path.with_name(f".{RECORD}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(rec))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def session_id_of(session_dir: Path, rec: dict[str, Any] | None) -> str:
    sid = str((rec or {}).get("session_id") or session_dir.name)
    return sid if _SID.match(sid) else ""


# ---------------------------------------------------------------------- processes
#: two readings of one process's :func:`start_time` differ by less than this (the
#: kernel counts it in clock ticks, 0.01 s)
SAME_START = 0.05
#: a session record's ``"clock"``: its start times are :func:`start_time`'s (records
#: without it, of an older mlx_nbdist, hold psutil's ``create_time``)
CLOCK = "start_time"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def start_time(pid: int) -> float:
    """When process ``pid`` started, as every process on this machine reads it, at
    any time: with the PID, what tells a process from a later one on a reused PID.
    Raises ``psutil.NoSuchProcess`` when no process has that PID.

    The kernel's value, unchanged by the clock: seconds from boot on Linux (one read
    of ``/proc/<pid>/stat`` where we may read ``/proc``), a date on macOS. psutil's
    public ``create_time`` changes it by the clock: on Linux it adds the boot time the
    kernel reports at the moment of reading (``btime``, whole seconds, which moves by
    a second when the clock is slewed across one, and by any amount when it is
    stepped); on macOS (psutil 7) it corrects by the boot time this process read
    when it imported psutil. Two readings then differ, and a notebook looked gone to
    its ranks, which ended the session (CI saw it).
    """
    if use_proc():
        stat = proc_stat(pid)
        if stat is None:
            raise psutil.NoSuchProcess(pid)
        return stat.started
    return _psutil_start(pid)


def _psutil_start(pid: int) -> float:
    """psutil's reading of :func:`start_time`.

    The one use of a psutil private: its per-platform ``create_time(monotonic=True)``
    (psutil 7.2; Linux, macOS), the kernel's value as it is, on which psutil keys its
    own identity of a process (``Process._get_ident``). Older psutil: on Linux its
    start time less its boot time, read together; elsewhere ``create_time``, which
    corrected nothing before psutil 7.
    """
    proc = psutil.Process(pid)
    try:
        return float(proc._proc.create_time(monotonic=True))
    except (TypeError, AttributeError):  # psutil < 7.2: no such argument
        pass
    if not sys.platform.startswith("linux"):
        return proc.create_time()
    boot = psutil.boot_time()
    for _ in range(3):  # the boot time moved between the readings: again
        # a new Process: one's create_time is kept from its first reading
        started = psutil.Process(pid).create_time()
        again = psutil.boot_time()
        if again == boot:
            break
        boot = again
    return started - boot


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says of a process."""

    state: str  # "R", "S", "Z" (a zombie) ...
    started: float  # seconds from boot (see start_time)


def proc_stat(pid: int) -> ProcStat | None:
    """One read of ``/proc/<pid>/stat`` (Linux; ``None`` when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # after "pid (comm) ": state is field 3, start time (clock ticks) field 22
        fields = stat[stat.rindex(b")") + 2 :].split()
        return ProcStat(fields[0].decode(), int(fields[19]) / _CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return None


def use_proc() -> bool:
    """We may read ``/proc`` (Linux, not portable mode): one read there answers what
    psutil answers with several."""
    return not platform.portable() and _proc_here()


@functools.cache
def _proc_here() -> bool:
    return platform.has_proc(env={})  # the machine's part, once (portable mode: each time)


def _live_start(pid: int) -> float | None:
    """:func:`start_time` of process ``pid`` when it runs and is not a zombie, else
    ``None`` (``psutil.AccessDenied`` passes: the system will not tell)."""
    if use_proc():
        stat = proc_stat(pid)
        return None if stat is None or stat.state == "Z" else stat.started
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return None
        return start_time(pid)
    except psutil.AccessDenied:
        raise
    except psutil.Error:
        return None


def same_process(pid: int, started: float) -> bool:
    """``pid`` is running, is not a zombie, and started at ``started``: one read of
    ``/proc/<pid>/stat`` where we may (every cell asks it of every local rank)."""
    try:
        now = _live_start(pid)
    except psutil.Error:
        return False
    return now is not None and abs(now - started) < SAME_START


def client_alive(pid: int, started: float) -> bool:
    """The notebook's process runs (a zombie, whose parent has not reaped it yet, is
    gone); when the system will not tell, it counts as running."""
    if pid <= 0:
        return False
    try:
        now = _live_start(pid)
    except psutil.Error:  # AccessDenied
        return True
    return now is not None and abs(now - started) < SAME_START


def related(known: Pids, leaders: set[int]) -> Pids:
    """The live children (at any depth) of the running ``known`` processes, and the
    members of the process groups they lead, each with its start time.

    ``leaders`` (updated here) holds the known PIDs seen leading their own process
    group while running. Their groups are swept even once they are gone (the
    controller killed, its schedulers left): while a group has members the kernel
    does not hand its ID to a new process, so the group is still the one that
    process led. A group seen without members is forgotten (its ID may be reused),
    and a known PID now held by another process (another start time) is skipped.
    """
    table: dict[int, tuple[int, float, int]] = {}  # pid -> ppid, started, pgid
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info["ppid"]
        if ppid is None:  # a zombie or another user's (macOS)
            continue
        try:
            table[p.pid] = (ppid, start_time(p.pid), os.getpgid(p.pid))
        except (OSError, psutil.Error):
            continue
    running = [
        pid for pid, t in known.items() if pid in table and abs(table[pid][1] - t) < SAME_START
    ]
    leaders.update(pid for pid in running if table[pid][2] == pid)
    groups = {pgid for _ppid, _t, pgid in table.values()}
    for pid in list(leaders):
        if pid not in groups or (pid in table and pid not in running):
            leaders.discard(pid)  # no member left, or its ID is someone else's now
    skip = {os.getpid(), 0, 1, *known}
    by_parent: dict[int, list[int]] = {}
    for pid, (ppid, _t, _g) in table.items():
        by_parent.setdefault(ppid, []).append(pid)
    out: Pids = {}
    todo = list(running)
    while todo:  # children of running known processes, and theirs
        for child in by_parent.get(todo.pop(), []):
            if child not in out and child not in skip:
                out[child] = table[child][1]
                todo.append(child)
    for pid, (_ppid, started, pgid) in table.items():
        if pgid in leaders and pid not in skip and started >= known[pgid] - SAME_START:
            out.setdefault(pid, started)
    return out


def kill(pids: Pids, sig: int = signal.SIGKILL) -> list[int]:
    """Signal the processes that are still the recorded ones; returns their PIDs."""
    hit = []
    for pid, started in sorted(pids.items()):
        if pid in (0, 1, os.getpid()):
            continue
        try:
            if not same_process(pid, started):
                continue
            psutil.Process(pid).send_signal(sig)
            hit.append(pid)
        except psutil.Error:
            continue
    return hit


def wait_gone(pids: Pids, timeout: float) -> Pids:
    """The processes still running (not zombies) after up to ``timeout`` seconds."""
    t_end = time.monotonic() + timeout
    alive = dict(pids)
    while True:
        alive = {p: t for p, t in alive.items() if same_process(p, t)}
        if not alive or time.monotonic() >= t_end:
            return alive
        time.sleep(0.05)


# --------------------------------------------------------------------------- files
def shm_segments(session_id: str) -> list[Path]:
    """This user's ``/dev/shm`` segment files of the session (none without /dev/shm,
    or in portable mode)."""
    if not session_id or not _SID.match(session_id) or not SHM_DIR.is_dir():
        return []
    if platform.portable():
        return []
    return [p for p in SHM_DIR.glob(f"mlxnb-{glob.escape(session_id)}-*") if _owned(p)]


def registries(session_id: str) -> list[Path]:
    """This user's registries of the session's POSIX segments, one per rank process
    (``engine.transfer.registry``: ``<tmp>/mlxnb-<session id>-segments-<pid>.json``)."""
    if not session_id or not _SID.match(session_id):
        return []
    tmp = Path(tempfile.gettempdir())
    found = tmp.glob(f"mlxnb-{glob.escape(session_id)}-segments-[0-9]*.json")
    return [p for p in found if p.is_file() and not p.is_symlink() and _owned(p)]


def registered_names(reg: Path) -> list[str]:
    """The segment names a registry lists (those our ranks make: ``/mlxnb.*``)."""
    try:
        names = json.loads(reg.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n.startswith("/mlxnb.")]


def unlink_registered(regs: list[Path]) -> int:
    """Unlink the POSIX segments that registries (this user's) name, then the
    registries; returns how many segments were still there."""
    removed = 0
    for reg in regs:
        if reg.is_symlink() or not _owned(reg):
            continue
        if platform.has_posix_shm():
            for name in registered_names(reg):
                try:
                    removed += platform.shm_unlink(name)
                except (OSError, ValueError):
                    continue
        reg.unlink(missing_ok=True)
    return removed


def remove_registered(session_id: str) -> int:
    """Unlink the POSIX segments the session's registries name (:func:`unlink_registered`)."""
    return unlink_registered(registries(session_id))


def rank_folders(session_id: str) -> list[Path]:
    """Private status folders of the session's ranks on this machine (ranks that did
    not see the session directory make one with ``tempfile.mkdtemp``)."""
    if not session_id or not _SID.match(session_id):
        return []
    tmp = Path(tempfile.gettempdir())
    found = tmp.glob(f"mlx_nbdist-{glob.escape(session_id)}-rank[0-9]*-*")
    return [p for p in found if p.is_dir() and not p.is_symlink() and _owned(p)]


def remove_files(session_id: str) -> tuple[int, int]:
    """Remove the session's segments (files and registered POSIX ones) and rank
    folders; returns how many of each."""
    segs = remove_registered(session_id)
    for p in shm_segments(session_id):
        try:
            p.unlink()
            segs += 1
        except FileNotFoundError:
            pass
        except OSError:
            continue
    folders = 0
    for p in rank_folders(session_id):
        shutil.rmtree(p, ignore_errors=True)
        folders += not p.exists()
    return segs, folders


def leftovers(session_id: str) -> bool:
    return bool(shm_segments(session_id) or registries(session_id) or rank_folders(session_id))


def _owned(p: Path) -> bool:
    try:
        return p.lstat().st_uid == os.getuid()
    except OSError:
        return False


# ---------------------------------------------------------------------- reaping
@dataclass
class Reaped:
    """What :func:`reap` did to one session."""

    session_id: str
    pids: list[int] = field(default_factory=list)
    segments: int = 0
    folders: int = 0

    def describe(self) -> str:
        """``session X: ended pids [...], removed 3 shared-memory segments, 2 rank
        folders`` (empty when nothing was done)."""
        parts = []
        if self.pids:
            parts.append(f"ended pids {self.pids}")
        removed = []
        if self.segments:
            removed.append(count_of(self.segments, "shared-memory segment"))
        if self.folders:
            removed.append(count_of(self.folders, "rank folder"))
        if removed:
            parts.append("removed " + ", ".join(removed))
        return f"session {self.session_id}: " + ", ".join(parts) if parts else ""


def count_of(n: int, what: str, plural: str | None = None) -> str:
    """``1 rank folder``, ``2 rank folders``."""
    return f"{n} {what if n == 1 else plural or what + 's'}"


def reap(
    session_dir: Path,
    rec: dict[str, Any] | None = None,
    known: Pids | None = None,
    leaders: set[int] | None = None,
    *,
    by: str = "cleanup",
) -> Reaped:
    """End everything a session whose notebook is gone left: its recorded processes
    (``known`` adds more, ``leaders`` the group leaders seen among them; see
    :func:`related`) with their children and group members, SIGKILLed; its segments
    and rank folders; then mark its record stopped. Never call it for a live session.
    """
    rec = read_record(session_dir) if rec is None else rec
    procs: Pids = {**recorded_pids(rec), **(known or {})}
    leaders = set(leaders or ())
    out = Reaped(session_id_of(session_dir, rec))
    hit: set[int] = set()
    for _ in range(3):  # a process may fork between the scan and the signal: look again
        procs.update(related(procs, leaders))
        new = kill({p: t for p, t in procs.items() if p not in hit})
        if not new:
            break
        hit.update(new)
        wait_gone({p: procs[p] for p in new}, KILL_WAIT)
    out.pids = sorted(hit)
    out.segments, out.folders = remove_files(out.session_id)
    if rec is not None and session_dir.is_dir():
        mark_stopped(session_dir, ended_by=by, ended_at=time.time())
    return out


# ---------------------------------------------------------------------- the process
class Watchdog:
    """The loop of the watchdog process; see the module docstring."""

    def __init__(self, session_dir: Path, client_pid: int, client_started: float):
        self.dir = session_dir
        try:
            seen = start_time(client_pid)
        except psutil.Error as e:
            raise OSError(f"the notebook's process {client_pid} is not running") from e
        if abs(seen - client_started) >= SAME_START:
            raise OSError(f"process {client_pid} is not the notebook (another start time)")
        self.client_pid, self.client_started = client_pid, seen
        self.known: Pids = {}
        self.leaders: set[int] = set()
        self.session_id = session_id_of(session_dir, None)
        self._scanned = 0.0
        self.step(scan=True)

    def step(self, scan: bool = False) -> str | None:
        """One look; returns why the watchdog is done (``None``: keep watching)."""
        rec = read_record(self.dir)
        if rec is not None:
            if rec.get("state") == "stopped":
                return "the session was stopped"
            self.session_id = session_id_of(self.dir, rec)
            for pid, started in recorded_pids(rec).items():
                self.known.setdefault(pid, started)
        if not client_alive(self.client_pid, self.client_started):
            if not self.dir.is_dir() and not self.known:
                return "the notebook is gone and so is the session directory"
            done = reap(self.dir, rec, self.known, self.leaders, by="watchdog")
            return "the notebook is gone: " + (done.describe() or "nothing was left")
        if not self.dir.is_dir():
            return "the session directory was removed"
        if scan or time.monotonic() - self._scanned >= SCAN_INTERVAL:
            self._scanned = time.monotonic()
            self.known.update(related(self.known, self.leaders))
        gone = self.known and not any(same_process(p, t) for p, t in self.known.items())
        if gone and not leftovers(self.session_id):
            return "every process of the session has exited"
        return None

    def run(self) -> str:
        while True:
            time.sleep(INTERVAL)
            why = self.step()
            if why is not None:
                return why


def _log(session_dir: Path, msg: str) -> None:
    try:
        with open(session_dir / LOG, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()}] {msg}\n")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    """``watchdog.py SESSION_DIR CLIENT_PID CLIENT_STARTED`` (see :func:`start`)."""
    args = sys.argv[1:] if argv is None else argv
    session_dir, client_pid, client_started = Path(args[0]), int(args[1]), float(args[2])
    if os.fork():  # the starter's child returns at once: init adopts the watchdog
        os._exit(0)
    try:
        dog = Watchdog(session_dir, client_pid, client_started)
    except Exception as e:  # noqa: BLE001 - told to the starter, which raises it
        print(f"{type(e).__name__}: {e}", flush=True)
        os._exit(1)
    _log(session_dir, f"watching notebook pid {client_pid}, {len(dog.known)} processes")
    print(os.getpid(), flush=True)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the starter reads until these close
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        why = dog.run()
    except Exception as e:  # noqa: BLE001 - logged: nobody reads this process's stderr
        why = f"failed: {type(e).__name__}: {e}"
    _log(session_dir, f"exiting: {why}")
    os._exit(0)


if __name__ == "__main__":
    main()
