"""Dashboard, live progress and scalars, without a front end: widget state as values.

Like ipywidgets' own tests, widgets are created without a kernel and their traits
read back (``FloatProgress.value``, ``HTML.value``); the data comes from real ranks
of a real 2-rank MLX group.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from mlx_nbdist import CellError, CellInterrupted, Session, api
from mlx_nbdist.engine.progress import format_bar, log_scalars, progress
from mlx_nbdist.results import RankState
from mlx_nbdist.viz import human_bytes
from mlx_nbdist.viz.dashboard import Dashboard, model_values, rank_values
from mlx_nbdist.viz.progress import LiveCell, ProgressPanel, scalar_svg

from .conftest import strip_ansi

PROGRESS_CELL = """
import time
from mlx_nbdist.engine.progress import progress, log_scalars
for i in progress(range({steps}), desc="steps"):
    time.sleep({pause})
    log_scalars(loss=rank * 10 + i)
"""


def poll(fn: Callable[[], Any], timeout: float = 30.0, every: float = 0.1) -> Any:
    """``fn()`` once it is truthy; fails after ``timeout`` seconds (generous on busy cores)."""
    t_end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > t_end:
            raise AssertionError(f"condition not met within {timeout:g} s (last: {value!r})")
        time.sleep(every)


def busy_now(dash: Dashboard, session: Session) -> bool:
    """Every rank of the dashboard is busy in the session's latest cell (not a stale one)."""
    cell = f"cell {session.cell} ·"
    return all(
        v["state"] == "busy" and v["cell"].startswith(cell) for v in dash.values()["ranks"].values()
    )


# --------------------------------------------------------------------------- no session


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_bar_outside_a_rank() -> None:
    import mlx.core as mx

    buf = _Terminal()
    seen = []
    for i in progress(range(7), desc="train", file=buf):
        seen.append(i)
        log_scalars(loss=mx.array(0.5) + i)
    assert seen == list(range(7))
    last = buf.getvalue().split("\r")[-1]
    assert last.startswith("train: 100%|") and "| 7/7 [" in last
    assert "loss=6.5" in last and last.endswith("\n")

    buf = _Terminal()
    with progress(total=3, desc="manual", file=buf) as bar:
        for _ in range(3):
            bar.update()
    assert bar.n == 3 and bar.closed
    assert "| 3/3 [" in buf.getvalue().split("\r")[-1]
    assert format_bar({"n": 4, "total": None, "unit": "batch", "elapsed": 2.0, "rate": 2.0}) == (
        "4 batch [2.0s, 2 batch/s]"
    )


def test_text_bar_to_a_pipe_writes_whole_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """No terminal (a pipe, a log, a script under mlx.launch): the first and the last
    state as lines, no carriage returns (here all within one LINE_INTERVAL)."""
    import mlx.core as mx

    from mlx_nbdist.engine import progress as progress_mod

    monkeypatch.setattr(progress_mod, "LINE_INTERVAL", 3600.0)
    buf = io.StringIO()
    for i in progress(range(7), desc="train", file=buf):
        log_scalars(loss=mx.array(0.5) + i)
    text = buf.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("train:   0%|") and "| 0/7 [" in lines[0]
    assert lines[1].startswith("train: 100%|") and "| 7/7 [" in lines[1]
    assert "loss=6.5" in lines[1]


def test_rank_values_states() -> None:
    now = 1000.0
    busy = RankState(rank=1, state="busy", cell=4, cell_started=now - 2.5, updated=now - 0.2,
                     device="Device(cpu, 0)", active_memory=2048, peak_memory=4096,
                     rss=3 << 20, cpu_percent=97.0, collectives=5, bytes_moved=1 << 20,
                     last_duration=0.25, last_status="ZeroDivisionError")  # fmt: skip
    v = rank_values(busy, now=now, session_state="ready")
    assert v["state"] == "busy" and v["cell"] == "cell 4 · 2.50 s"
    assert v["last"] == "0.25 s · ZeroDivisionError"
    assert v["memory"] == "2.0 KiB / 4.0 KiB" and v["process"] == "3.0 MiB · 97%"
    assert v["collectives"] == "5 · 1.0 MiB"
    # a monitor that stopped publishing while the process lives: hung
    stale = RankState(rank=0, state="idle", updated=now - 10)
    assert rank_values(stale, now=now, stale_after=3.0)["state"] == "hung"
    assert rank_values(stale, now=now, session_state="stopped")["state"] == "stopped"
    assert rank_values(RankState(rank=0, state="dead"), now=now)["state"] == "dead"


def test_progress_panel_and_plot_values() -> None:
    panel = ProgressPanel()
    bars = {
        "c3-0": {
            0: {"desc": "epoch", "n": 10, "total": 10, "done": True, "cell": 3, "started": 1.0},
            1: {"desc": "epoch", "n": 4, "total": 10, "done": False, "cell": 3, "started": 1.0},
        }
    }
    scalars = {"loss": {0: [[0, 1.0, 3], [1, 0.5, 3]], 1: [[0, 2.0, 3], [1, float("nan"), 3]]}}
    panel.update(bars, scalars, {0: "idle", 1: "error"})
    v = panel.values()
    assert v["bars"]["c3-0"][0]["n"] == 10 and v["bars"]["c3-0"][1]["n"] == 4
    rows = [c for c in panel.bars_box.children if hasattr(c, "children")]
    (_, (bar0, _)), (_, (bar1, text1)) = panel._rows[("c3-0", 0)], panel._rows[("c3-0", 1)]
    assert len(rows) == 2
    assert (bar0.value, bar0.max, bar0.bar_style) == (10.0, 10.0, "success")
    assert (bar1.value, bar1.max, bar1.bar_style) == (4.0, 10.0, "danger")
    assert text1.value.startswith("4/10")
    svg = panel.plots.value
    assert svg.count("<polyline") == 2 and 'data-rank="0"' in svg and 'data-rank="1"' in svg
    assert v["scalars"]["loss"][0] == 0.5
    # non-finite points are left out of the plot
    one = scalar_svg("x", {0: [[0, float("inf"), 0], [1, 3.0, 0]]})
    assert one.count("<polyline") == 1 and "<circle" in one


# --------------------------------------------------------------------------- live cell


def test_cell_progress_is_live_per_rank(session2: Session) -> None:
    shown: list[Any] = []
    snapshots: list[dict[str, Any]] = []
    live = LiveCell(session2, mode="widget", display=shown.append)

    def tick() -> None:
        live.tick()
        if live.panel is not None:
            snapshots.append(live.panel.values())

    steps = 16
    with live:
        result = session2.run(PROGRESS_CELL.format(steps=steps, pause=0.15), on_tick=tick)
    assert result.ok
    assert len(shown) == 1 and shown[0] is live.panel.widget
    # it showed while the cell ran: some tick saw a bar in the middle
    partial = [
        s for s in snapshots
        if any(0 < b["n"] < steps for per in s["bars"].values() for b in per.values())
    ]  # fmt: skip
    assert partial, snapshots[-3:]
    final = live.panel.values()
    (per_rank,) = final["bars"].values()
    assert sorted(per_rank) == [0, 1]
    for r in (0, 1):
        assert per_rank[r]["n"] == steps and per_rank[r]["done"]
        # the last streamed loss of each rank is its own
        assert final["scalars"]["loss"][r] == r * 10 + steps - 1
    bar, _ = live.panel._rows[(next(iter(final["bars"])), 1)][1]
    assert bar.value == bar.max == steps


def test_live_cell_text_mode_and_silence(session2: Session) -> None:
    out = io.StringIO()
    live = LiveCell(session2, mode="text", stream=out)
    with live:
        session2.run(PROGRESS_CELL.format(steps=5, pause=0.05), on_tick=live.tick)
    text = out.getvalue()
    assert "[rank 0] steps 5/5" in text and "[rank 1] steps 5/5" in text
    assert "loss r0=4 r1=14" in text
    # a cell that publishes nothing shows nothing
    shown: list[Any] = []
    quiet = LiveCell(session2, mode="widget", display=shown.append)
    with quiet:
        session2.run("x = 1", on_tick=quiet.tick)
    assert shown == [] and quiet.panel is None
    # a cell over before the first tick still shows its bars once it has ended
    fast = LiveCell(session2, mode="widget", display=shown.append)
    with fast:
        session2.run(PROGRESS_CELL.format(steps=3, pause=0), on_tick=fast.tick)
    assert fast.ticks == 0 and len(shown) == 1
    (per_rank,) = fast.panel.values()["bars"].values()
    assert [(b["n"], b["done"]) for b in per_rank.values()] == [(3, True), (3, True)]


def test_cell_that_failed_before_dispatch_shows_no_bars(session2: Session) -> None:
    # the previous cell published bars; the next one never reaches the ranks (a bad
    # --timeout fails before dispatch): its area must not show the previous bars
    session2.run(PROGRESS_CELL.format(steps=3, pause=0))
    assert session2.published_in(session2.cell)
    before = session2.cell
    shown: list[Any] = []
    out = io.StringIO()
    widget = LiveCell(session2, mode="widget", display=shown.append)
    text = LiveCell(session2, mode="text", stream=out)
    for live in (widget, text):
        with pytest.raises(ValueError, match="timeout"), live:
            session2.run("x = 1", timeout=-1, on_tick=live.tick)
    assert session2.cell == before  # nothing was sent
    assert shown == [] and widget.panel is None and not widget.shown
    assert out.getvalue() == "" and not text.shown


# --------------------------------------------------------------------------- dashboard


def _row_shown(dash: Dashboard, rank: int) -> str:
    """Rank ``rank``'s row as the front end gets it: its part of the table widget."""
    value = dash.ranks_box.value
    start = value.index(f'data-rank="{rank}"')
    end = value.find('class="mlxdist-rank-row"', start)
    return value[start : end if end >= 0 else None]


def test_dashboard_follows_ranks_busy_idle_error(session2: Session) -> None:
    dash = Dashboard(session2, interval=0.2, subshell=False)
    try:
        h = dash.values()["header"]
        assert (h["session"], h["backend"], h["launcher"], h["n"], h["state"]) == (
            session2.session_id, "ring", "local", "2", "ready",
        )  # fmt: skip
        assert len(dash.rows) == 2 and dash.polling
        seen: list[dict[int, dict[str, str]]] = []
        badges: list[str] = []

        def tick() -> None:
            seen.append(dash.values()["ranks"])
            badges.append(_row_shown(dash, 1))

        session2.run("import time\ntime.sleep(2.0)", on_tick=tick)
        busy = [s for s in seen if all(s[r]["state"] == "busy" for r in (0, 1))]
        assert busy, seen[-2:]
        assert busy[-1][0]["cell"].startswith("cell ")
        # the widget itself said busy while the cell ran (what a browser shows)
        assert any('data-state="busy"' in b for b in badges)

        # after the cell: idle, last cell ok; collectives and memory match the ranks
        session2.run("y = mx.distributed.all_sum(mx.ones(1024), group=world); mx.eval(y)")
        # (the ranks publish their end-of-cell state a moment after replying)
        states = poll(lambda: (lambda st: st if all(
            st[r].state == "idle" and st[r].collectives >= 1 for r in (0, 1)
        ) else None)(session2.rank_states()))  # fmt: skip

        def settled() -> dict[int, dict[str, str]] | None:
            v = dash.values()["ranks"]
            ok = all(
                v[r]["state"] == "idle" and v[r]["last"].endswith("ok")
                and v[r]["collectives"] == (
                    f"{states[r].collectives} · {human_bytes(states[r].bytes_moved)}"
                )
                for r in (0, 1)
            )  # fmt: skip
            return v if ok else None

        v = poll(settled)
        for r in (0, 1):
            assert v[r]["device"] == states[r].device
            assert human_bytes(states[r].peak_memory) in v[r]["memory"]
            # the one table widget carries every rank's row, in its own place
            assert v[r]["collectives"] in _row_shown(dash, r), _row_shown(dash, r)
        assert 'data-state="idle"' in _row_shown(dash, 1)

        # a rank that raised: error, with the exception's type
        with pytest.raises(CellError):
            session2.run("if rank == 1:\n    1 / 0")
        v = poll(lambda: (lambda x: x if x[1]["state"] == "error" else None)(dash.values()["ranks"]))
        assert v[1]["last"].endswith("ZeroDivisionError") and v[0]["last"].endswith("ok")
    finally:
        dash.close()
    assert not dash.polling


def test_dashboard_memory_history_where_and_collectives(session2: Session) -> None:
    dash = Dashboard(session2, interval=0.2, subshell=False)
    try:
        # memory over time: samples of every rank, RSS as the ranks publish it
        mem = poll(lambda: (lambda m: m if len(m) == 2 and all(
            v["samples"] >= 3 for v in m.values()) else None)(dash.values()["memory"]))  # fmt: skip
        for r in (0, 1):
            assert mem[r]["rss"] > 10 << 20 and mem[r]["low"] == ""  # 24 GiB: not low
        assert "<svg" in dash.memory_box.value and "rank 1" in dash.memory_box.value
        # [Where] while a cell runs: the ranks' lines in it
        out: list[BaseException] = []

        def cell() -> None:
            try:
                session2.run("import time\ntime.sleep(3)")
            except BaseException as e:  # noqa: BLE001
                out.append(e)

        t = threading.Thread(target=cell)
        t.start()
        poll(lambda: busy_now(dash, session2))
        said = dash.where()
        t.join(30)
        assert not out and "in cell code: [0, 1]" in said, said
        assert dash.where_box.value.count("time.sleep(3)") == 2
        # the last profiled cell's collectives
        assert dash.values()["comm"] == ""
        session2.run("mx.eval(mx.distributed.all_sum(mx.ones(256), group=world))", profile=True)
        comm = poll(lambda: dash.values()["comm"])
        assert "all_sum at" in comm and "on ring (probe:" in comm
    finally:
        dash.close()


def test_dashboard_model_shard_shapes(session2: Session) -> None:
    session2.run(
        "from mlx.nn.layers.distributed import shard_linear\n"
        "mx.random.seed(0)\n"
        "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))\n"
        "model.layers[0] = shard_linear(model.layers[0], 'all-to-sharded', group=world)\n"
        "model.layers[2] = shard_linear(model.layers[2], 'sharded-to-all', group=world)\n"
    )
    expected = session2.apply(_shapes, "model")
    dash = Dashboard(session2, model="model", interval=0.2, subshell=False)
    try:
        mv = dash.values()["model"]["params"]  # every rank's, from the first read
        for path in expected[0]:
            for r in (0, 1):
                assert mv[path]["shapes"][r] == tuple(expected[r][path])
        assert mv["layers.0.weight"]["layer"] == "AllToShardedLinear"
        assert mv["layers.2.weight"]["layer"] == "ShardedToAllLinear"
        html = dash.model_box.value
        assert "layers.0.weight" in html and "rank 1" in html
        assert model_values({}) == {}
    finally:
        dash.close()
        session2.apply(_unwatch)


def _shapes(name: str) -> dict[str, tuple[int, ...]]:
    from IPython import get_ipython
    from mlx.utils import tree_flatten

    model = get_ipython().user_ns[name]
    return {p: tuple(a.shape) for p, a in tree_flatten(model.parameters())}


def _unwatch() -> None:
    from mlx_nbdist.engine.rpc import watch_model

    watch_model(None)


def test_dead_and_hung_ranks_show_within_seconds(fresh2: Session) -> None:
    dash = Dashboard(fresh2, interval=0.25, stale_after=2.0, subshell=False)
    pid0, pid1 = fresh2.ranks[0].pid, fresh2.ranks[1].pid
    try:
        poll(lambda: dash.values()["ranks"][0]["state"] == "idle")
        os.kill(pid0, signal.SIGSTOP)  # alive but silent: its monitor cannot publish
        try:
            poll(lambda: dash.values()["ranks"][0]["state"] == "hung", timeout=20)
        finally:
            os.kill(pid0, signal.SIGCONT)
        poll(lambda: dash.values()["ranks"][0]["state"] == "idle", timeout=20)
        os.kill(pid1, signal.SIGKILL)
        poll(lambda: dash.values()["ranks"][1]["state"] == "dead", timeout=20)
        assert 'data-state="dead"' in _row_shown(dash, 1)
    finally:
        dash.close()


def test_interrupt_button_during_a_cell_and_between_cells(fresh2: Session) -> None:
    # ranks get 10 s to stop on SIGINT, not 2: on a loaded CI machine a rank was once
    # ended (EngineError), most likely because the click landed while it was starting
    # the cell, where IPython swallowed the KeyboardInterrupt (now held until the
    # cell's first line: engine/interrupts.py); an interrupt never taken still fails it
    fresh2.policy = fresh2.policy.updated({"interrupt_grace": 10.0})
    dash = Dashboard(fresh2, interval=0.2, subshell=False)
    try:
        assert dash.interrupt() == "no rank is busy: nothing to interrupt"

        # during a %%mlxdist cell (a LiveCell): what a click from the subshell does
        def click_when_busy() -> None:
            poll(lambda: busy_now(dash, fresh2))
            dash.buttons["interrupt"].click()

        clicker = threading.Thread(target=click_when_busy)
        t0 = time.monotonic()
        with pytest.raises(CellInterrupted) as err, LiveCell(fresh2, mode="off") as live:
            clicker.start()
            fresh2.run("import time\ntime.sleep(120)", on_tick=live.tick, timeout=300)
        clicker.join()
        assert time.monotonic() - t0 < 100  # well before the 120 s sleep would end
        assert live.interrupt_delivered.is_set()
        assert "interrupting the running cell" in dash.values()["message"]
        assert {f.ename for f in err.value.result.failures} <= {"KeyboardInterrupt", ""}, str(
            err.value
        )

        # between cells: a rank still busy (a call from another thread) gets SIGINT
        fresh2.run("1") if fresh2.state == "ready" else fresh2.restart()
        errors: list[BaseException] = []

        def background() -> None:
            try:
                fresh2.run("import time\ntime.sleep(120)", timeout=300)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        worker = threading.Thread(target=background)
        worker.start()
        poll(lambda: busy_now(dash, fresh2))
        assert dash.interrupt() == "sent SIGINT to busy rank(s) [0, 1]"
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert errors and isinstance(errors[0], CellError)
        assert "KeyboardInterrupt" in strip_ansi(str(errors[0]))
    finally:
        dash.close()


def test_restart_and_stop_buttons(fresh2: Session) -> None:
    dash = Dashboard(fresh2, interval=0.2, subshell=False)
    try:
        old = fresh2.session_id
        # restart clicked while a cell runs: the cell is interrupted, then the session restarts
        def click_when_busy() -> None:
            poll(lambda: busy_now(dash, fresh2))
            dash.buttons["restart"].click()

        clicker = threading.Thread(target=click_when_busy)
        with pytest.raises(CellInterrupted), LiveCell(fresh2, mode="off") as live:
            clicker.start()
            fresh2.run("import time\ntime.sleep(120)", on_tick=live.tick, timeout=300)
        clicker.join()
        assert fresh2.state == "ready" and fresh2.session_id != old
        assert fresh2.run("print(rank)").stdout(1) == "1\n"
        poll(lambda: dash.values()["header"]["session"] == fresh2.session_id)
        poll(lambda: all(v["state"] == "idle" for v in dash.values()["ranks"].values()))

        # stop between cells: the session stops and the poller ends by itself
        dash.buttons["stop"].click()
        assert fresh2.state == "stopped"
        assert dash.values()["header"]["state"] == "stopped"
        assert all(v["state"] == "stopped" for v in dash.values()["ranks"].values())
        poll(lambda: not dash.polling, timeout=20)
        assert "stopped" in dash.values()["message"]
    finally:
        dash.close()


def test_dashboard_magic_and_function(session2: Session, capfd: pytest.CaptureFixture[str]) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    import mlx_nbdist.magics as magics_mod

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mlx_nbdist")
    previous = api.current_session(required=False)
    api.set_current_session(session2)
    try:
        res = ip.run_cell("%mlxdist dashboard --interval 0.3")
        assert res.success, res.error_in_exec
        out = strip_ansi(capfd.readouterr().out)
        assert f"session {session2.session_id}: ready, 2 ranks" in out
        assert "rank 0:" in out and "rank 1:" in out
        first = magics_mod._DASHBOARD
        assert first is not None and first.polling and first.session is session2
        assert first.live_controls is False  # no kernel here: buttons act between cells
        ip.run_cell("%mlxdist dashboard")
        assert not first.polling  # running it again replaces the old one
        res = ip.run_cell("%mlxdist auto maybe")
        assert res.error_in_exec is not None
    finally:
        if magics_mod._DASHBOARD is not None:
            magics_mod._DASHBOARD.close()
            magics_mod._DASHBOARD = None
        api.set_current_session(previous)


def test_public_names() -> None:
    import mlx_nbdist
    from mlx_nbdist.engine import progress as engine_progress
    from mlx_nbdist.viz import dashboard as viz_dashboard

    assert mlx_nbdist.progress is engine_progress.progress
    assert mlx_nbdist.log_scalars is engine_progress.log_scalars
    assert mlx_nbdist.dashboard is viz_dashboard.dashboard
