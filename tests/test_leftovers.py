"""Nothing is left behind: a dead notebook's processes (also ranks holding the GIL and
a dead controller's schedulers), shared-memory segments, rank folders and old
session directories.

The notebook is a real client process (a script) killed with SIGKILL, and the
session's watchdog (:mod:`mlx_nbdist.watchdog`) ends what it left: the script uses
the session's own watchdog when the session starts one, else starts it itself.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlx_nbdist import Session, platform, processes, runtime, watchdog

from .conftest import is_ours, listening_ports, wait_gone

SHM = Path("/dev/shm")
#: sessions here make segment files in /dev/shm (Linux, not portable mode)
DEV_SHM = SHM.is_dir() and not platform.portable()
TMP = Path(tempfile.gettempdir())
#: a cell that holds the GIL for hours (the regex engine never lets go of it)
GIL_HOG = "import re\nre.match('(a+)+$', 'a' * 40 + 'b')"

#: marks the processes this module starts (they inherit the environment), so that the
#: leak check below judges only them: other test runs on this machine are not ours
MARK = "MLX_NBDIST_TEST_RUN"
RUN = f"leftovers-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers() -> Any:
    """conftest's check that the module ended every engine, controller (and here
    watchdog) it started, limited to processes started by this module."""
    old = os.environ.get(MARK)
    os.environ[MARK] = RUN
    yield
    if old is None:
        os.environ.pop(MARK, None)
    else:
        os.environ[MARK] = old
    mine = [p for p in psutil.process_iter() if _marked(p)]
    left = wait_gone([p.pid for p in mine], timeout=10)
    described = []
    for p in mine:
        if p.pid in left:
            try:
                described.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
                p.kill()
            except psutil.Error:
                pass
    assert not described, "left processes running:\n" + "\n".join(described)


def _marked(p: psutil.Process) -> bool:
    try:
        if p.environ().get(MARK) != RUN:
            return False
        return is_ours(p) or any("watchdog" in a for a in p.cmdline())
    except psutil.Error:
        return False


PRELUDE = '''
import json, os, sys, time
import psutil
from mlx_nbdist import Session
try:
    from mlx_nbdist import watchdog
except ImportError:  # a tree without the watchdog: the test shows what is left
    watchdog = None


def guard(s):
    """The session's watchdog: its own when it starts one, else one started here."""
    pid = getattr(s, "_watchdog", None)
    if pid is None and watchdog is not None:
        me = psutil.Process()
        pid = watchdog.start(s.directory, me.pid, watchdog.start_time(me.pid))
    return pid


def report(s, wd, **more):
    out = dict(pids=s.processes(), sid=s.session_id, dir=str(s.directory),
               ranks={r: i.pid for r, i in s.ranks.items()}, watchdog=wd, **more)
    print(json.dumps(out), flush=True)
    time.sleep(600)
'''


class Client:
    """A notebook stand-in: a script that starts a session and reports its PIDs."""

    def __init__(self, tmp_path: Path, body: str) -> None:
        script = tmp_path / "client.py"
        script.write_text(PRELUDE + body)
        self.proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "the client script failed (see its stderr above)"
        self.info: dict[str, Any] = json.loads(line)
        self.pairs = [(int(p), float(t)) for p, t in self.info["pids"]]
        self.pids = [p for p, _ in self.pairs]
        self.sid: str = self.info["sid"]
        self.directory = Path(self.info["dir"])
        wd = self.info.get("watchdog")
        if wd:
            self.pairs.append((wd, watchdog.start_time(wd)))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        """End what a failed test left (busy engines would slow every later test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid, started in self.pairs:
            if processes.same_process(pid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in [*SHM.glob(f"mlxnb-{self.sid}-*"), *TMP.glob(f"mlx_nbdist-{self.sid}-rank*")]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def alive(self) -> list[str]:
        out = []
        for pid, _ in self.pairs:
            try:
                out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.Error:
                pass
        return out

    def assert_all_gone(self, timeout: float = 15.0) -> None:
        pids = [p for p, _ in self.pairs]
        assert wait_gone(pids, timeout=timeout) == [], self.alive()
        assert self.info.get("watchdog"), "no watchdog was started"


def _busy(pid: int) -> float:
    try:
        return psutil.Process(pid).cpu_percent(0.5)
    except psutil.Error:
        return 0.0


def test_kernel_death_while_every_rank_holds_the_gil_leaves_nothing(tmp_path) -> None:
    """The ranks' own watchdog threads never run while a cell holds the GIL."""
    c = Client(
        tmp_path,
        "s = Session(2).start()\n"
        "wd = guard(s)\n"
        f"s.view([0, 1]).execute({GIL_HOG!r}, block=False)\n"
        "time.sleep(1.0)\n"
        "report(s, wd)\n",
    )
    try:
        ranks = list(c.info["ranks"].values())
        assert all(_busy(pid) > 30 for pid in ranks)  # both stuck in the regex
        assert len(c.pids) >= 12  # 2 engines, 2 nannies, the controller, 8 schedulers
        c.kill()
        t0 = time.monotonic()
        c.assert_all_gone(15)
        assert time.monotonic() - t0 < 15
        assert json.loads((c.directory / "session.json").read_text())["state"] == "stopped"
    finally:
        c.close()


def test_kernel_death_after_rank_0_died_leaves_nothing(tmp_path) -> None:
    """Rank 0 was the one told to end the controller."""
    c = Client(tmp_path, "s = Session(2).start()\nwd = guard(s)\nreport(s, wd)\n")
    try:
        rank0 = c.info["ranks"]["0"]
        os.kill(rank0, signal.SIGKILL)
        assert wait_gone([rank0], timeout=10) == []
        time.sleep(0.5)
        c.kill()
        c.assert_all_gone(15)
    finally:
        c.close()


def test_stop_after_the_controller_died_leaves_no_scheduler(fresh2: Session) -> None:
    s = fresh2
    cpid = s.cluster.controller_pid()
    schedulers = psutil.Process(cpid).children()
    assert len(schedulers) >= 4
    ports = set()
    for p in schedulers:
        ports |= {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert ports
    os.kill(cpid, signal.SIGKILL)
    assert wait_gone([cpid], timeout=10) == []
    s.stop()
    left = wait_gone([p.pid for p in schedulers], timeout=10)
    assert left == [], left
    assert not ports & listening_ports()


@pytest.mark.skipif(not DEV_SHM, reason="makes and counts Linux's /dev/shm segment files "
                    "(macOS and portable mode: tests/test_portable.py)")
def test_kernel_death_removes_segments_and_rank_folders(tmp_path) -> None:
    """Ranks that do not see the session directory (``assume_remote``) publish into
    folders of their own; each rank holds a shared-memory segment the notebook never
    mapped (one made in the background for a later pull)."""
    c = Client(
        tmp_path,
        "s = Session(2, assume_remote=True).start()\n"
        "wd = guard(s)\n"
        "s.run('from mlx_nbdist.engine import transfer\\n'\n"
        "      f'transfer._make({s.shm_prefix!r}, 1 << 20, False)')\n"
        "report(s, wd)\n",
    )
    try:
        assert len(list(SHM.glob(f"mlxnb-{c.sid}-*"))) == 2
        assert len(list(TMP.glob(f"mlx_nbdist-{c.sid}-rank*"))) == 2
        c.kill()
        c.assert_all_gone(15)
        assert wait_for(lambda: not list(SHM.glob(f"mlxnb-{c.sid}*")), 5)
        assert not list(TMP.glob(f"mlx_nbdist-{c.sid}-rank*"))
    finally:
        c.close()


def wait_for(cond: Any, timeout: float) -> bool:
    t_end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > t_end:
            return False
        time.sleep(0.1)
    return True


def test_stop_removes_the_ranks_private_folders() -> None:
    with Session(2, assume_remote=True) as s:
        sid = s.session_id
        assert len(list(TMP.glob(f"mlx_nbdist-{sid}-rank*"))) == 2
    try:
        assert wait_for(lambda: not list(TMP.glob(f"mlx_nbdist-{sid}-rank*")), 5)
    finally:
        for p in TMP.glob(f"mlx_nbdist-{sid}-rank*"):
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------ without engines
def _sleeper(with_child: bool = False) -> subprocess.Popen:
    code = "import time; time.sleep(300)"
    if with_child:
        code = (
            "import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {code!r}]); time.sleep(300)"
        )
    return subprocess.Popen([sys.executable, "-c", code])


def _started(pid: int) -> float:
    return watchdog.start_time(pid)


def _record(d: Path, sid: str, client: int, client_started: float, pids: list, state: str = "ready") -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (d / "session.json").write_text(json.dumps({
        "session_id": sid, "client_pid": client, "client_started": client_started,
        "clock": watchdog.CLOCK, "state": state, "pids": pids,
    }))


def _sid() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def test_watchdog_ends_a_dead_notebooks_processes_but_spares_reused_pids(tmp_path) -> None:
    from mlx_nbdist import watchdog

    notebook = _sleeper()
    ours = _sleeper(with_child=True)
    bystander = _sleeper()
    procs = [notebook, ours, bystander]
    kid = None
    try:
        assert wait_for(lambda: psutil.Process(ours.pid).children(), 10)
        kid = psutil.Process(ours.pid).children()[0]  # not recorded: adopted
        child = kid.pid
        sid = _sid()
        d = tmp_path / sid
        # the bystander is recorded with a wrong start time: a reused PID, not ours
        _record(d, sid, notebook.pid, _started(notebook.pid),
                [[ours.pid, _started(ours.pid)], [bystander.pid, _started(bystander.pid) - 100]])
        seg = SHM / f"mlxnb-{sid}-{ours.pid}-0"
        if DEV_SHM:
            seg.write_bytes(b"x")
        folder = Path(tempfile.mkdtemp(prefix=f"mlx_nbdist-{sid}-rank0-"))
        wd = watchdog.start(d, notebook.pid, _started(notebook.pid))
        time.sleep(1.5)
        assert ours.poll() is None and psutil.pid_exists(child)  # the notebook lives
        notebook.kill()  # not waited for: a zombie notebook is a dead one
        assert wait_for(lambda: psutil.Process(notebook.pid).status() == psutil.STATUS_ZOMBIE, 5)
        assert ours.wait(10) is not None
        assert wait_gone([child, wd], timeout=10) == []
        assert bystander.poll() is None
        assert not seg.exists() and not folder.exists()
        rec = json.loads((d / "session.json").read_text())
        assert rec["state"] == "stopped" and rec["pids"] == []
        assert "ended pids" in (d / "watchdog.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if kid is not None and kid.is_running():
            kid.kill()


def test_watchdog_leaves_when_its_session_is_stopped_or_over(tmp_path) -> None:
    from mlx_nbdist import watchdog

    me = psutil.Process()
    workers = [_sleeper() for _ in range(3)]
    try:
        def start(worker: subprocess.Popen) -> tuple[Path, int]:
            sid = _sid()
            _record(tmp_path / sid, sid, me.pid, _started(me.pid), [[worker.pid, _started(worker.pid)]])
            return tmp_path / sid, watchdog.start(tmp_path / sid)

        # the record says stopped (Session.stop ended everything): it leaves, touching nothing
        d, wd = start(workers[0])
        time.sleep(1.0)
        assert psutil.pid_exists(wd)
        _record(d, d.name, me.pid, _started(me.pid), [], state="stopped")
        assert wait_gone([wd], timeout=3) == []
        assert workers[0].poll() is None
        # every process it watched exited and left no files: it leaves
        d, wd = start(workers[0])
        workers[0].kill()
        workers[0].wait()
        assert wait_gone([wd], timeout=4) == []
        assert json.loads((d / "session.json").read_text())["state"] == "ready"
        # the session directory was removed
        d, wd = start(workers[1])
        shutil.rmtree(d)
        assert wait_gone([wd], timeout=3) == []
        # stop() ends it at once; a PID that is not this session's watchdog is spared
        d, wd = start(workers[2])
        assert watchdog.stop(workers[2].pid, d) and workers[2].poll() is None
        assert watchdog.stop(wd, tmp_path / "another") and psutil.pid_exists(wd)
        assert watchdog.stop(wd, d)
        assert wait_gone([wd], timeout=1) == []
        assert all(w.poll() is None for w in workers[1:])
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()


def test_watchdog_will_not_start_for_a_process_that_is_not_the_notebook(tmp_path) -> None:
    from mlx_nbdist import watchdog

    me = psutil.Process()
    with pytest.raises(OSError, match="not the notebook"):
        watchdog.start(tmp_path, me.pid, _started(me.pid) - 50)


def test_cleanup_leaves_an_older_versions_session_alone_while_its_notebook_runs(
    tmp_path, monkeypatch
) -> None:
    """Records of an mlx_nbdist before start_time hold psutil's create_time: read with
    today's clock its notebook would look gone, and cleanup would take apart a session
    in use (its segments, its rank folders, its record)."""
    monkeypatch.setenv("MLX_NBDIST_RUNTIME", str(tmp_path))
    sid = _sid()
    d = runtime.runtime_root() / sid
    d.mkdir(mode=0o700)
    (d / "session.json").write_text(json.dumps({
        "session_id": sid, "client_pid": os.getpid(),
        "client_started": psutil.Process().create_time(), "state": "ready", "pids": []}))
    assert not any(sid in line for line in processes.cleanup())
    assert json.loads((d / "session.json").read_text())["state"] == "ready"
    # its notebook gone: cleaned up as before
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (d / "session.json").write_text(json.dumps({
        "session_id": sid, "client_pid": gone.pid, "client_started": 1.0, "state": "ready",
        "pids": []}))
    processes.cleanup()
    assert json.loads((d / "session.json").read_text())["state"] == "stopped"


def test_cleanup_removes_what_a_dead_session_left(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MLX_NBDIST_RUNTIME", str(tmp_path))
    root = runtime.runtime_root()
    notebook = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; never waited for
    orphan = _sleeper(with_child=True)
    bystander = _sleeper()
    made: list[Path] = []
    child = None
    try:
        assert wait_for(lambda: psutil.Process(orphan.pid).children(), 10)
        child = psutil.Process(orphan.pid).children()[0]
        assert wait_for(lambda: psutil.Process(notebook.pid).status() == psutil.STATUS_ZOMBIE, 10)
        sid = _sid()
        _record(root / sid, sid, notebook.pid, _started(notebook.pid),
                [[orphan.pid, _started(orphan.pid)]])
        segs = [SHM / f"mlxnb-{sid}-{orphan.pid}-{k}" for k in range(3)] if DEV_SHM else []
        for p in segs:
            p.write_bytes(b"x")
        folders = [Path(tempfile.mkdtemp(prefix=f"mlx_nbdist-{sid}-rank{r}-")) for r in (0, 1)]
        made += segs + folders
        # a live session (this process is its notebook) that started two days ago
        live = _sid()
        me = psutil.Process()
        _record(root / live, live, me.pid, _started(me.pid), [[bystander.pid, _started(bystander.pid)]])
        # stopped sessions: 22 recent ones and 2 of two days ago; and a folder of the user's
        old = time.time() - 2 * 86400
        base = _sid()[:-2]
        stopped = [f"{base}{k:02x}" for k in range(24)]
        for k, s in enumerate(stopped):
            _record(root / s, s, 1, 1.0, [], state="stopped")
            stamp = old - k if k >= 22 else time.time() - 60 * (k + 1)
            os.utime(root / s / "session.json", (stamp, stamp))
        os.utime(root / live / "session.json", (old, old))
        (root / "notes").mkdir()
        os.utime(root / "notes", (old, old))
        # a segment of a session with no record whose rank is gone, and one whose rank runs
        other = _sid()
        gone_seg = SHM / f"mlxnb-{other}-{notebook.pid}-0"
        live_seg = SHM / f"mlxnb-{other}-{os.getpid()}-1"
        if DEV_SHM:
            gone_seg.write_bytes(b"x")
            live_seg.write_bytes(b"x")
            made += [gone_seg, live_seg]

        lines = processes.cleanup()

        removed = [f"{len(segs)} shared-memory segments"] if segs else []
        expect = f"session {sid}: ended pids {sorted([orphan.pid, child.pid])}, removed "
        expect += ", ".join([*removed, "2 rank folders"])
        assert expect in lines, lines
        assert orphan.wait(10) is not None and wait_gone([child.pid], timeout=5) == []
        assert bystander.poll() is None
        assert not any(p.exists() for p in segs + folders)
        assert json.loads((root / sid / "session.json").read_text())["state"] == "stopped"
        if DEV_SHM:
            assert not gone_seg.exists() and live_seg.exists()
            assert any("left by sessions with no record" in line for line in lines), lines
        # pruned: the 2 old ones and the 3 beyond the newest 20 (the dead session's is
        # the newest); kept: the live session and the user's folder
        assert "removed 5 old session directories" in lines, lines
        assert (root / live).is_dir() and (root / "notes").is_dir() and (root / sid).is_dir()
        assert sorted(p.name for p in root.iterdir() if p.name in stopped) == stopped[:19]
        # nothing more to do
        assert [line for line in processes.cleanup() if sid in line or "old session" in line] == []
    finally:
        for p in (orphan, bystander, notebook):
            if p.poll() is None:
                p.kill()
            p.wait()
        if child is not None and child.is_running():
            child.kill()
        for p in made:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def test_a_stop_prunes_the_folders_of_stopped_sessions_beyond_the_newest(tmp_path, monkeypatch
                                                                        ) -> None:
    """Folders kept after a stop (a rank's output past the limit, a broken session's
    logs) must not pile up until someone runs %mlxdist cleanup."""
    monkeypatch.setenv("MLX_NBDIST_RUNTIME", str(tmp_path))
    root = runtime.runtime_root()
    base = _sid()[:-2]
    kept = [f"{base}{k:02x}" for k in range(processes.KEEP_SESSIONS + 2)]  # newest first
    for k, sid in enumerate(kept):
        _record(root / sid, sid, 1, 1.0, [], state="stopped")
        (root / sid / "output").mkdir()
        (root / sid / "output" / "cell3-rank0.txt").write_text("output past the limit")
        stamp = time.time() - 60 * (k + 1)
        os.utime(root / sid / "session.json", (stamp, stamp))
    with Session(2, spare=False) as s:
        s.run("x = 1")
        own = s.directory
    assert own is not None and not own.exists()  # a clean stop leaves nothing of its own
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(kept[: processes.KEEP_SESSIONS]), left


def test_cleanup_without_dev_shm_skips_segments_silently(tmp_path, monkeypatch) -> None:
    """macOS has no /dev/shm (sessions there make no segments)."""
    from mlx_nbdist import watchdog

    monkeypatch.setattr(watchdog, "SHM_DIR", tmp_path / "no-dev-shm")
    monkeypatch.setenv("MLX_NBDIST_RUNTIME", str(tmp_path / "root"))
    notebook = subprocess.Popen([sys.executable, "-c", "pass"])
    notebook.wait()
    sid = _sid()
    _record(runtime.runtime_root() / sid, sid, notebook.pid, 1.0, [])
    folder = Path(tempfile.mkdtemp(prefix=f"mlx_nbdist-{sid}-rank1-"))
    try:
        assert watchdog.shm_segments(sid) == [] and watchdog.remove_files("") == (0, 0)
        assert f"session {sid}: removed 1 rank folder" in processes.cleanup()
        assert not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _procfs_with_boot_time_moved(folder: Path, seconds: int) -> Path:
    """A procfs for psutil (``psutil.PROCFS_PATH``) that is the machine's, except that
    the kernel reports its boot time ``seconds`` later: what a clock slewed or stepped
    across a second does to ``btime`` (psutil adds it to every start time it reads)."""
    for entry in os.listdir("/proc"):
        if entry != "stat":
            (folder / entry).symlink_to(f"/proc/{entry}")
    lines = Path("/proc/stat").read_text().splitlines()
    moved = [f"btime {int(x.split()[1]) + seconds}" if x.startswith("btime ") else x for x in lines]
    (folder / "stat").write_text("\n".join(moved) + "\n")
    return folder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs: Linux")
@pytest.mark.parametrize("portable", [False, True])
def test_processes_are_known_after_the_clock_moves_the_boot_time(
    portable: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI saw every engine end itself, and the controller ended, mid-run: the clock
    moved /proc/stat's btime by a second, and every start time psutil read after that
    differed by a second from the notebook's, read before, so the ranks took the
    notebook for gone. A process's identity must not depend on the clock."""
    monkeypatch.setenv("MLX_NBDIST_PORTABLE", "1" if portable else "0")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ident = processes.identity(child.pid)
        me = processes.identity(os.getpid())
        assert ident is not None and me is not None
        before = psutil.Process(child.pid).create_time()
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(_procfs_with_boot_time_moved(tmp_path, 1)))
        # the control: psutil's own start time moved with the boot time
        assert psutil.Process(child.pid).create_time() == pytest.approx(before + 1, abs=0.02)
        assert processes.identity(child.pid) == (child.pid, pytest.approx(ident[1], abs=0.02))
        assert processes.running(ident) and watchdog.same_process(*ident)
        assert watchdog.client_alive(*me)  # what every rank asks of the notebook
        assert child.pid in watchdog.related({os.getpid(): me[1]}, set())
        assert watchdog.kill(dict([ident]), signal.SIGTERM) == [child.pid]  # still ours to end
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("portable", [False, True])
def test_running_tells_a_live_process_a_zombie_and_a_reused_pid(
    portable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLX_NBDIST_PORTABLE", "1" if portable else "0")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ident = processes.identity(child.pid)
        assert ident is not None and processes.running(ident)
        # the same PID, another start time: a process the system gave it to later
        assert not processes.running((child.pid, ident[1] - 5.0))
        child.kill()
        p = psutil.Process(child.pid)
        t_end = time.monotonic() + 10
        while p.status() != psutil.STATUS_ZOMBIE:  # not reaped yet: a zombie
            assert time.monotonic() < t_end
            time.sleep(0.01)
        assert not processes.running(ident)
    finally:
        child.kill()
        child.wait()
    assert not processes.running(ident)  # reaped: gone
