"""The spare cluster (mlx_nbdist.session.spare): a restart forms its group on engines
started while the session ran; real engines, a real MLX group."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest

from mlx_nbdist import CellError, Session
from mlx_nbdist.session import cluster as cluster_mod
from mlx_nbdist.viz.status import format_status

from .conftest import NEW_SETTING, session_pids, started_anew, wait_gone

pytestmark = pytest.mark.timeout(240)

CHECK = "float(mx.distributed.all_sum(mx.ones(1) * (rank + 1), group=world).item())"


def _until(done: Callable[[], bool], timeout: float = 90.0) -> None:
    """Wait until ``done()`` is true; fails after ``timeout`` seconds."""
    t_end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < t_end, f"not within {timeout:g} s: {done}"
        time.sleep(0.05)


def _wait_ready(s: Session) -> None:
    _until(lambda: s.spare_state == "ready")


def _sums_right(s: Session) -> None:
    """An all_sum of rank + 1 over the 2 ranks is 3 on each."""
    r = s.run(CHECK)
    assert [r.ranks[k].result_text for k in (0, 1)] == ["3.0", "3.0"]


def _spare_pids(s: Session) -> list[int]:
    assert s._spare is not None  # noqa: SLF001 - the test looks at what the spare started
    return [pid for pid, _ in s._spare.cluster.processes([])]  # noqa: SLF001


def test_a_restart_forms_the_group_on_the_warm_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    # no MPLBACKEND: the engines' own (ipykernel's inline backend), as in a notebook
    monkeypatch.delenv("MPLBACKEND", raising=False)
    s = Session(2, timeout=60)
    assert s.spare  # on by default
    try:
        s.start()
        s.run("x = 41 + rank")
        _wait_ready(s)
        spare_id = s._spare.cluster.session_id  # noqa: SLF001
        spare = _spare_pids(s)
        assert "spare engines for the next restart: ready" in format_status(s.status())
        old = session_pids(s)
        with pytest.raises(CellError):
            s.run("import os\nif rank == 1:\n    os._exit(3)\nimport time; time.sleep(2)", timeout=30)
        assert s.state == "broken"
        said: list[str] = []
        s.restart(said.append)
        assert s.session_id == spare_id, said
        assert any("spare engines, already started" in m for m in said), said
        assert not wait_gone(old), "the broken session's processes outlived the restart"
        assert {info.pid for info in s.ranks.values()} <= set(spare)
        _sums_right(s)
        with pytest.raises(CellError, match="NameError"):
            s.run("x")  # new engines: nothing of the old namespace
        # the engines imported no matplotlib; a figure still shows at the cell's end
        r = s.run("import matplotlib.pyplot as plt\nplt.plot([0, rank + 1])")
        for k in (0, 1):
            assert any("image/png" in o["data"] for o in r.ranks[k].outputs), r.ranks[k]
        assert s.spare_state in ("starting", "ready")  # the next restart's, warming
    finally:
        s.stop()
    assert s.spare_state == ""
    assert not wait_gone(old + spare), "processes outlived stop"


def test_a_restart_before_the_spare_is_up_waits_for_it() -> None:
    s = Session(2, timeout=60)
    try:
        s.start()
        assert s.spare_state == "starting"  # its delay has not passed
        said: list[str] = []
        s.restart(said.append)
        assert any("waiting for the spare engines" in m for m in said), said
        _sums_right(s)
    finally:
        s.stop()


def test_a_spare_that_failed_gives_a_cold_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Session(2, timeout=60)
    try:
        s.start()
        real_warm = cluster_mod.Cluster.warm

        def broken_warm(self: cluster_mod.Cluster, backend: object) -> None:
            raise RuntimeError("the spare's engines did not answer")

        monkeypatch.setattr(cluster_mod.Cluster, "warm", broken_warm)
        s._spare._go.set()  # noqa: SLF001 - no need to wait out its delay
        _until(lambda: not s._spare._thread.is_alive())  # noqa: SLF001
        failed = _spare_pids(s)
        monkeypatch.setattr(cluster_mod.Cluster, "warm", real_warm)
        said: list[str] = []
        s.restart(said.append)
        assert any("not usable (RuntimeError: the spare's engines did not answer)" in m
                   for m in said), said
        assert not wait_gone(failed), "the failed spare's processes outlived the restart"
        _sums_right(s)
    finally:
        s.stop()


def test_stop_while_the_spare_starts_leaves_nothing() -> None:
    s = Session(2, timeout=60)
    s.start()
    s._spare._go.set()  # noqa: SLF001 - stop in the middle of its start
    time.sleep(0.5)
    directory = s._spare.cluster.directory  # noqa: SLF001
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    s.stop()
    assert not wait_gone(list(mine)), "processes outlived stop"
    assert not directory.exists()


def test_no_spare_when_asked() -> None:
    s = Session(2, timeout=60, spare=False)
    try:
        s.start()
        time.sleep(1.5)
        assert s.spare_state == "off"
        assert "spare engines for the next restart: off (spare=False)" in format_status(
            s.status()
        )
        s.restart()
        assert s.spare_state == "off"
        _sums_right(s)
    finally:
        s.stop()


def test_a_spare_engine_killed_meanwhile_gives_a_cold_restart() -> None:
    import os
    import signal

    s = Session(2, timeout=60)
    try:
        s.start()
        _wait_ready(s)
        victim = s._spare.cluster.engine_pids()[1]  # noqa: SLF001 - say, the OOM killer
        os.kill(victim, signal.SIGKILL)
        assert not wait_gone([victim])
        _until(lambda: s.spare_state == "failed", timeout=10)
        assert "spare engines for the next restart: failed" in format_status(s.status())
        said: list[str] = []
        s.restart(said.append)
        assert any("spare engines are not usable" in m and "SIGKILL" in m for m in said), said
        _sums_right(s)
    finally:
        s.stop()


def test_a_spare_started_before_the_environment_changed_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Session(1, timeout=60)
    try:
        s.start()
        _wait_ready(s)
        spare = _spare_pids(s)
        monkeypatch.setenv(NEW_SETTING, "after")  # e.g. set in a notebook cell
        said: list[str] = []
        s.restart(said.append)
        started_anew(s, said, "the spare engines", spare)
    finally:
        s.stop()
    assert not wait_gone(spare), "the unused spare's processes outlived the restart"
