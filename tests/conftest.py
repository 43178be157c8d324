"""Shared fixtures: real sessions (real engines, a real MLX group) and leak checks."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from mlx_nbdist import Session

os.environ.setdefault("MPLBACKEND", "Agg")
# no engines started ahead at %load_ext in this process (tests load the extension into
# one shell and start sessions of every kind): tests/test_standby.py turns it on, and
# the tutorial notebooks' kernels run with it, as a user's do
os.environ.setdefault("MLX_NBDIST_PREWARM", "0")
#: marks the processes this test run starts (they inherit the environment), so that the
#: leak checks judge only them, not another test run on the same machine
RUN_MARK = "MLX_NBDIST_TEST_RUN"
os.environ.setdefault(RUN_MARK, f"run-{os.getpid()}")


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def descendants() -> list[psutil.Process]:
    """Processes this test run started (children of pytest, at any depth)."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """PIDs still running after ``timeout`` seconds."""
    t_end = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < t_end:
        alive = [p for p in alive if psutil.pid_exists(p) and not _zombie(p)]
        time.sleep(0.1)
    return alive


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def listening_ports() -> set[int]:
    return {
        c.laddr.port
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr
    }


def session_ports(s: Session) -> set[int]:
    """The loopback ports a session's engines and controller listen on."""
    out: set[int] = set()
    for info in s.ranks.values():
        try:
            for c in psutil.Process(info.pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add(c.laddr.port)
        except psutil.Error:
            pass
    cpid = s.cluster.controller_pid()
    if cpid:
        try:
            out |= {
                c.laddr.port
                for c in psutil.Process(cpid).net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.Error:
            pass
    return out


#: set by tests after engines were started ahead (a spare, a standby)
NEW_SETTING = "MLXNB_TEST_SETTING"


def started_anew(s: Session, said: list[str], what: str, old: list[int]) -> None:
    """``s`` said that ``what`` (engines started ahead, PIDs ``old``) were not used
    because :data:`NEW_SETTING` changed since, and its rank 0 is a new engine that sees
    the setting's new value (``after``)."""
    assert (
        f"{what} are not usable (the environment ({NEW_SETTING}) changed since they "
        "started): starting new ones" in said
    ), said
    assert s.ranks[0].pid not in old
    r = s.run(f"import os\nos.environ.get({NEW_SETTING!r})")
    assert r.ranks[0].result_text == "'after'"


def session_pids(s: Session) -> list[int]:
    return [pid for pid, _ in s.processes()]


@pytest.fixture
def tracked() -> Iterator[Any]:
    """A tracker installed over ``mx.distributed`` in this process (a group of one),
    everything it wraps put back afterwards."""
    mx = pytest.importorskip("mlx.core")
    from mlx_nbdist.engine.tracker import OPS, TRANSFORMS, Tracker

    saved = [(mx.distributed, op) for op in OPS if hasattr(mx.distributed, op)]
    saved += [(mx, name) for name in (*TRANSFORMS, "eval", "jvp")]
    saved += [(mx.distributed.Group, "split")] if hasattr(mx.distributed.Group, "split") else []
    before = [(owner, name, getattr(owner, name)) for owner, name in saved]
    world = mx.distributed.init()
    tracker = Tracker(world, world.rank(), world.size())
    tracker.install()
    try:
        yield SimpleNamespace(mx=mx, tracker=tracker, world=world)
    finally:
        for owner, name, fn in before:
            setattr(owner, name, fn)


@pytest.fixture(scope="module")
def session2() -> Iterator[Session]:
    s = Session(2, timeout=60).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lm() -> dict[str, Any]:
    """The tiny mlx-lm models' helpers (tests/lm_models.py), run in this process."""
    from .lm_models import LM_COMMON

    ns: dict[str, Any] = {}
    exec(LM_COMMON, ns)  # noqa: S102 - our own code, the same the ranks run
    return ns


@pytest.fixture
def fresh2() -> Iterator[Session]:
    """A session of its own, for tests that break it."""
    s = Session(2, timeout=60).start()
    yield s
    s.stop()


def _ours_anywhere() -> dict[int, psutil.Process]:
    """Every ipyparallel/MPI/watchdog process this test run started, wherever it is
    now (orphans are re-parented to init, so looking only at pytest's descendants
    would miss them)."""
    mark = os.environ[RUN_MARK]
    out = {}
    for p in psutil.process_iter():
        try:
            mine = p.environ().get(RUN_MARK) == mark
        except psutil.Error:
            mine = False
        if mine and (is_ours(p) or _is_watchdog(p)):
            out[p.pid] = p
    return out


def _is_watchdog(p: psutil.Process) -> bool:
    try:
        return any("mlx_nbdist.watchdog" in a or "watchdog" in a for a in p.cmdline())
    except psutil.Error:
        return False


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test module ends every engine, controller and mpirun it started."""
    before = set(_ours_anywhere())
    yield
    new = [p for pid, p in _ours_anywhere().items() if pid not in before]
    left = [p for p in new if wait_gone([p.pid], timeout=10.0)]
    described = []
    for p in left:
        try:
            described.append(f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"{request.module.__name__} left processes running:\n" + "\n".join(described)


def is_ours(p: psutil.Process) -> bool:
    """An ipyparallel engine/controller (or our entry points for them) or MPI launcher
    process."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(
        k in cmd
        for k in (
            "ipyparallel",
            "ipengine",
            "ipcontroller",
            "mpirun",
            "prterun",
            "mlx_nbdist.engine.local_entry",
            "mlx_nbdist.engine.mpi_entry",
        )
    )
