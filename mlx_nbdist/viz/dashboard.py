"""A live dashboard of a session: one row per rank, controls, progress, scalars, model.

``%mlxdist dashboard`` (or ``mlx_nbdist.dashboard()``) shows::

    VBox .mlxdist-dashboard
    ├── HTML .mlxdist-header     session id · backend · launcher · N ranks · uptime · state
    ├── HBox .mlxdist-controls   [Interrupt] [Restart] [Stop]  HTML .mlxdist-message
    ├── HTML .mlxdist-ranks      column titles, then one grid .mlxdist-rank-row per rank:
    │                            rank | state | running cell (for how long) | last cell
    │                            (duration, ok / error type) | MLX device | MLX memory
    │                            (active / peak) | RSS · CPU | collectives · bytes moved
    ├── VBox .mlxdist-progress   each rank's bars of its latest cell and the scalar plots
    │                            (see :mod:`mlx_nbdist.viz.progress`)
    ├── HTML .mlxdist-memory     memory over time per rank (RSS, MLX active), and a warning
    │                            for a rank whose machine runs out of memory
    │                            (see :mod:`mlx_nbdist.viz.memory`)
    ├── HTML .mlxdist-where      every rank's stack, after a click on [Where]
    ├── HTML .mlxdist-comm       the last ``--profile`` cell's collectives: share of the
    │                            time, bandwidth against the probe, who was waited for
    └── HTML .mlxdist-model      parameters and local shard shapes of a watched model

**Updates.** The ranks publish their state every 0.25 s (``engine/monitor.py``) and a
daemon thread of the dashboard reads it every ``interval`` seconds (default 0.5);
widget traits only send a message when a value changed. The rank table is one HTML
widget, not a widget per cell: a refresh during a cell changes most cells (running
time, CPU, memory, collectives), and each changed widget is one message on the
kernel's iopub channel, about 0.1 ms of the kernel's CPU each; with a widget per
cell a refresh of 2 ranks sent 11-12 messages, now 2-3. The thread never touches
the ipyparallel client, so it never blocks or disturbs a running cell. A rank whose
process is gone shows ``dead`` at the next poll; one whose monitor stopped
publishing for ``stale_after`` seconds (process stopped, or stuck holding the GIL)
shows ``hung``. The thread ends when the dashboard is closed, or a few seconds after
the session stopped (a restart in between keeps it going).

**Controls while a cell runs (measured with ipykernel 7.4).** A widget click is a
``comm_msg`` on the kernel's shell channel. Normally it waits in the main shell's
queue until the running cell ends: a click sent 1 s into a 4 s ``time.sleep`` cell
was handled 3.0 s later, right after the cell. ipykernel 7.4 routes a comm's
messages to a *subshell* (its own thread) when the comm is marked for one, and then
the same click was handled within 0.01 s, during the cell. So the dashboard asks its
kernel for a subshell (``create_subshell_request`` on the control channel, the
public JEP 91 message) and routes its buttons' comms there. With that:

* **Interrupt** during a ``%%mlxdist`` cell does what Jupyter's stop button does: the
  cell's supervisor sends SIGINT to the ranks still running, waits a short grace,
  then ends those that did not stop (the session is then broken and needs a
  restart). Between cells it sends SIGINT to ranks that are still busy (after an
  interrupted or timed-out call) and says when no rank is busy.
* **Where** shows every rank's current stack (innermost frame in the user's cell
  first), read from a signal-triggered dump (see :mod:`mlx_nbdist.session.stacks`):
  it never touches the ipyparallel client, so it works during a cell too.
* **Restart** / **Stop** during a cell interrupt it first, then restart / stop the
  session in the cell's own thread once the cell has ended (the ipyparallel client
  is not thread-safe, so nothing else touches it while the cell runs).

Where the kernel has no subshells (ipykernel < 7.4, another kernel), the buttons are
handled only between cells; the dashboard says so, and during a cell Jupyter's own
stop button (kernel interrupt -> ``KeyboardInterrupt`` -> the same supervisor path)
is the way to interrupt.
"""

from __future__ import annotations

import html
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import config
from .._ipykernel import control_subshell, route_to_subshell
from ..results import RankState
from .common import human_bytes, rank_hex
from .memory import MemoryHistory
from .progress import ProgressPanel, collect, running_cell
from .status import STATE_COLORS, dashboard_text, header_html, header_values, rank_values

COLUMNS: list[tuple[str, str, str]] = [
    # key, title, width
    ("rank", "rank", "56px"),
    ("state", "state", "84px"),
    ("cell", "running", "130px"),
    ("last", "last cell", "210px"),
    ("device", "device", "120px"),
    ("memory", "MLX active / peak", "160px"),
    ("process", "RSS · CPU", "130px"),
    ("collectives", "collectives · bytes", "160px"),
]
_HINT_LIVE = "buttons act while a cell runs"
_HINT_QUEUED = (
    "this kernel handles buttons only between cells; "
    "during a cell use Jupyter's stop button (■) to interrupt"
)


# --------------------------------------------------------------------------- values


def model_values(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A watched model's parameters per rank: ``{name, params: {path: {rank: shape}}}``."""
    per = {r: rec.get("model") for r, rec in records.items() if rec.get("model")}
    if not per:
        return {}
    name = next(iter(per.values())).get("name", "")
    params: dict[str, dict[str, Any]] = {}
    errors = {r: m["error"] for r, m in per.items() if m.get("error")}
    totals = {r: (m.get("elements", 0), m.get("nbytes", 0), m.get("count", 0))
              for r, m in per.items() if not m.get("error")}  # fmt: skip
    for r, m in sorted(per.items()):
        for p in m.get("params", []):
            row = params.setdefault(
                p["path"], {"layer": p.get("layer", ""), "dtype": p.get("dtype", ""), "shapes": {}}
            )
            row["shapes"][r] = tuple(p["shape"])
    return {"name": name, "params": params, "errors": errors, "totals": totals}


def model_html(mv: dict[str, Any], n: int) -> str:
    """The model section: one row per parameter, the local shape on each rank."""
    if not mv:
        return ""
    name = html.escape(mv["name"])
    if mv["errors"] and not mv["params"]:
        err = html.escape(next(iter(mv["errors"].values())))
        return f"<div><b>model {name}</b>: {err}</div>"
    ranks = list(range(n))
    head = "".join(f"<th>rank {r}</th>" for r in ranks)
    rows = []
    for path, row in mv["params"].items():
        shapes = [row["shapes"].get(r) for r in ranks]
        differ = len({s for s in shapes if s is not None}) > 1
        staged = None in shapes and any(s is not None for s in shapes)  # a pipeline stage's
        style = (' style="color:#1f77b4"' if differ or staged or "Sharded" in row["layer"]
                 else "")
        cells = "".join(f"<td>{_shape(s, r in mv['totals'] and staged)}</td>"
                        for r, s in zip(ranks, shapes, strict=True))
        rows.append(
            f"<tr{style}><td>{html.escape(path)}</td><td>{html.escape(row['layer'])}</td>"
            f"<td>{html.escape(row['dtype'])}</td>{cells}</tr>"
        )
    tot = "".join(
        f"<td>{mv['totals'][r][0]:,} el · {human_bytes(mv['totals'][r][1])}</td>"
        if r in mv["totals"] else "<td>-</td>"
        for r in ranks
    )  # fmt: skip
    count = max((t[2] for t in mv["totals"].values()), default=0)
    more = f" (first {len(mv['params'])} of {count})" if count > len(mv["params"]) else ""
    return (
        f"<div><b>model {name}</b>{more}: local shapes per rank "
        "(blue: sharded, different across ranks, or held by some ranks only: a "
        "pipeline stage)</div>"
        '<table style="font-size:12px; border-collapse:collapse">'
        f"<tr><th>parameter</th><th>layer</th><th>dtype</th>{head}</tr>"
        + "".join(rows)
        + f"<tr><td><b>total</b></td><td></td><td></td>{tot}</tr></table>"
    )


def _shape(s: tuple[int, ...] | None, elsewhere: bool = False) -> str:
    """A local shape; ``elsewhere``: the rank lacks a parameter other ranks hold."""
    if s is None:
        return "on another rank" if elsewhere else "-"
    return "(" + ", ".join(map(str, s)) + ")"


def _cells(rank: int, vals: dict[str, str]) -> dict[str, str]:
    """A rank's row as HTML per column: the rank in its colour, the state as a badge."""
    out = {}
    for key, text in vals.items():
        if key == "state":
            color = STATE_COLORS.get(text, "#333")
            out[key] = (
                f'<span class="mlxdist-badge" data-state="{html.escape(text)}" '
                f'style="color:#fff; background:{color}; padding:1px 6px; '
                f'border-radius:8px">{html.escape(text)}</span>'
            )
        elif key == "rank":
            out[key] = f'<b style="color:{rank_hex(rank)}">rank {rank}</b>'
        else:
            out[key] = html.escape(text)
    return out


_GRID = (
    "display:grid; grid-template-columns:"
    + " ".join(width for _, _, width in COLUMNS)
    + "; gap:0 6px"
)


_CELL_CLASS = {"state": ' class="mlxdist-state"'}


def _rank_table(rows: dict[int, dict[str, str]]) -> str:
    """The column titles, then a grid ``.mlxdist-rank-row`` (``data-rank``) per rank."""
    titles = "".join(f"<div><b>{t}</b></div>" for _, t, _ in COLUMNS)
    body = "".join(
        f'<div class="mlxdist-rank-row" data-rank="{r}" style="{_GRID}">'
        + "".join(f'<div{_CELL_CLASS.get(key, "")} data-col="{key}">{cells.get(key, "")}</div>'
                  for key, _, _ in COLUMNS)
        + "</div>"
        for r, cells in rows.items()
    )  # fmt: skip
    return f'<div style="{_GRID}">{titles}</div>{body}'


# --------------------------------------------------------------------------- dashboard


class Dashboard:
    """A live ipywidgets dashboard of a session (see the module docstring).

    Args:
        session: the session to show; ``None`` follows the current session (the one
            ``%mlxdist start`` made), including after a stop and a new start.
        model: name of a model in the ranks' namespace whose parameters and local
            shard shapes to show (the ranks publish them every second).
        interval: seconds between two polls of the ranks' state.
        stale_after: a rank whose state is older than this shows ``hung``.
        start: start the polling thread now.
        subshell: route the buttons to a kernel subshell so they act during a cell
            (``None``: when the kernel supports it).
    """

    def __init__(
        self,
        session: Any = None,
        *,
        model: str | None = None,
        interval: float = 0.5,
        stale_after: float = config.STALE_AFTER,
        start: bool = True,
        subshell: bool | None = None,
    ):
        import ipywidgets as w

        self._session = session
        self.model = model
        self.interval = interval
        self.stale_after = stale_after
        self.stop_grace = max(3.0, 4 * interval)
        self._lock = threading.RLock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = False
        self.polls = 0
        self._values: dict[str, Any] = {}
        self._shown_in: int | None = None

        self.header = w.HTML()
        self.header.add_class("mlxdist-header")
        self.buttons = {
            "interrupt": w.Button(description="Interrupt", icon="stop",
                                  tooltip="interrupt the running cell (SIGINT to busy ranks)"),
            "where": w.Button(description="Where", icon="search",
                              tooltip="show where every rank is (its stack)"),
            "restart": w.Button(description="Restart", icon="refresh",
                                tooltip="new engines, same N and backend"),
            "stop": w.Button(description="Stop", icon="power-off", button_style="danger",
                             tooltip="stop the engines and the controller"),
        }  # fmt: skip
        for name, b in self.buttons.items():
            b.add_class(f"mlxdist-{name}")
        self.buttons["interrupt"].on_click(lambda _: self._guarded(self.interrupt))
        self.buttons["where"].on_click(lambda _: self._guarded(self.where))
        self.buttons["restart"].on_click(lambda _: self._guarded(self.restart))
        self.buttons["stop"].on_click(lambda _: self._guarded(self.stop))
        self.message = w.HTML()
        self.message.add_class("mlxdist-message")
        self.hint = w.HTML()
        self.controls = w.HBox([*self.buttons.values(), self.message])
        self.controls.add_class("mlxdist-controls")
        #: each rank's cells as shown (HTML per column key); the table is one widget
        self.rows: dict[int, dict[str, str]] = {}
        self.ranks_box = w.HTML(_rank_table({}))
        self.ranks_box.add_class("mlxdist-ranks")
        self.progress = ProgressPanel()
        self.model_box = w.HTML()
        self.model_box.add_class("mlxdist-model")
        self.memory = MemoryHistory()
        self.memory_box = w.HTML()
        self.memory_box.add_class("mlxdist-memory")
        self.where_box = w.HTML()
        self.where_box.add_class("mlxdist-where")
        self.comm_box = w.HTML()
        self.comm_box.add_class("mlxdist-comm")
        self._comm_seen: tuple[str, int] = ("", 0)  # (session id, profiled cells) shown
        self.widget = w.VBox(
            [self.header, self.controls, self.hint, self.ranks_box, self.progress.widget,
             self.memory_box, self.comm_box, self.where_box, self.model_box]
        )  # fmt: skip
        self.widget.add_class("mlxdist-dashboard")

        use_subshell = subshell is None or subshell
        sid = control_subshell() if use_subshell else None
        self.live_controls = route_to_subshell(list(self.buttons.values()), sid)
        self.hint.value = f"<small>{_HINT_LIVE if self.live_controls else _HINT_QUEUED}</small>"
        if model:
            self.watch(model)
        self.refresh()
        if start:
            self.start()

    # -- session -----------------------------------------------------------------
    @property
    def session(self) -> Any:
        if self._session is not None:
            return self._session
        from ..api import current_session

        return current_session(required=False)

    def watch(self, model: str | None) -> None:
        """Show the parameters of ``model`` (a name on the ranks); ``None`` stops it."""
        from ..engine.rpc import watch_model

        self.model = model
        s = self.session
        if s is not None and s.state == "ready":
            s.apply(watch_model, model)

    # -- refresh -----------------------------------------------------------------
    def refresh(self) -> dict[str, Any]:
        """Read the ranks' state once and update every widget; returns :meth:`values`."""
        with self._lock:
            s = self.session
            hv = header_values(s)
            self.header.value = header_html(hv)
            ranks: dict[int, dict[str, str]] = {}
            records: dict[int, dict[str, Any]] = {}
            if s is not None:
                records = (
                    {r: s.rank_record(r) for r in range(s.n)} if s.directory is not None else {}
                )
                states = s.rank_states(records) if s.directory is not None else {
                    r: RankState(rank=r) for r in range(s.n)
                }  # fmt: skip
                now = time.time()
                sstate = s.state
                if sstate in ("ready", "broken") and s.stopping:
                    sstate = "stopped"  # stop() is ending the engines: not dead ranks
                for r, st in states.items():
                    ranks[r] = rank_values(
                        st, now=now, stale_after=self.stale_after, session_state=sstate
                    )
                self._show_rows(ranks)
                bars, scalars = collect(records)
                self.progress.update(bars, scalars, {r: v["state"] for r, v in ranks.items()})
                self.memory.update(records)
                self._show_comm(s)
                html_memory = self.memory.html()
                if self.memory_box.value != html_memory:
                    self.memory_box.value = html_memory
            mv = model_values(records) if self.model else {}
            html_model = model_html(mv, s.n if s is not None else 0)
            if self.model_box.value != html_model:
                self.model_box.value = html_model
            self.polls += 1
            self._values = {
                "header": hv,
                "ranks": ranks,
                "message": self.message.value,
                "progress": self.progress.values(),
                "model": mv,
                "memory": self.memory.values(),
                "comm": self.comm_box.value,
                "live_controls": self.live_controls,
            }
            return self._values

    def _show_rows(self, ranks: dict[int, dict[str, str]]) -> None:
        """The rank table: one message to the front end, and only when it changed."""
        self.rows = {r: _cells(r, vals) for r, vals in sorted(ranks.items())}
        table = _rank_table(self.rows)
        if self.ranks_box.value != table:
            self.ranks_box.value = table

    def _show_comm(self, s: Any) -> None:
        """The last profiled cell's summary (recomputed only when a new one arrived)."""
        profiles = getattr(s, "profiles", None)
        last = profiles.cells[-1] if profiles is not None and profiles.cells else None
        # the newest cell's number: the kept list stops growing at its limit
        key = (s.session_id or "", min((r.get("cell", 0) for r in last.values()), default=0)
               if last else 0, len(profiles.cells) if profiles is not None else 0)
        if key == self._comm_seen:
            return
        self._comm_seen = key
        text = ""
        if last:
            try:
                text = s.timeline(1).summary()
            except Exception:  # noqa: BLE001 - a display must never break the dashboard
                text = ""
        self.comm_box.value = (
            f"<div><b>collectives</b> (last <code>--profile</code> cell): {html.escape(text)}</div>"
            if text else ""
        )

    def values(self) -> dict[str, Any]:
        """The dashboard's state as plain values (header, ranks, progress, model, message)."""
        with self._lock:
            out = dict(self._values)
        out["message"] = self.message.value  # set by the buttons between two polls
        return out

    def text(self) -> str:
        """A plain-text rendering (front ends without widgets, logs)."""
        v = self.values()
        return dashboard_text(v.get("header", {}), v.get("ranks", {}))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data = dict(data or {})
        data["text/plain"] = self.text()
        return data

    def show(self) -> None:
        """Display the dashboard under the current cell."""
        from IPython import get_ipython
        from IPython.display import display

        ip = get_ipython()
        self._shown_in = getattr(ip, "execution_count", None)
        display(self._repr_mimebundle_(), raw=True)

    def _ipython_display_(self) -> None:
        # dashboard() already showed it in this cell: being the cell's value too
        # must not show it twice
        from IPython import get_ipython

        count = getattr(get_ipython(), "execution_count", None)
        if self._shown_in is not None and self._shown_in == count:
            return
        self.show()

    # -- polling -----------------------------------------------------------------
    def start(self) -> None:
        """Start (or restart) the polling thread."""
        with self._lock:
            if self.closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._halt.clear()
            self._thread = threading.Thread(
                target=self._loop, name="mlx_nbdist-dashboard", daemon=True
            )
            self._thread.start()

    @property
    def polling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        stopped_since: float | None = None
        while not self._halt.wait(self.interval):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a display must never die loudly
                self._say(f"refresh failed: {type(e).__name__}: {e}")
            s = self.session
            if s is None or s.state == "stopped":
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since > self.stop_grace:
                    break
            else:
                stopped_since = None
            if getattr(self.widget, "comm", True) is None:  # closed
                break

    def close(self) -> None:
        """Stop polling and close the widgets."""
        self.closed = True
        self._halt.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        for wdg in self._all_widgets():
            try:
                wdg.close()
            except Exception:  # noqa: BLE001
                pass

    def _all_widgets(self) -> list[Any]:
        return [self.widget, self.header, self.controls, self.message, self.hint,
                self.ranks_box, self.model_box, self.progress.widget,
                self.memory_box, self.comm_box, self.where_box,
                *self.buttons.values()]  # fmt: skip

    # -- controls ----------------------------------------------------------------
    def _say(self, text: str) -> str:
        self.message.value = f"<span>{html.escape(text)}</span>"
        return text

    def _guarded(self, fn: Callable[[], str]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - shown in the dashboard, not lost in a log
            self._say(f"{type(e).__name__}: {e}")

    def interrupt(self) -> str:
        """Interrupt: the running ``%%mlxdist`` cell, else SIGINT to busy ranks."""
        s = self.session
        if s is None or s.state == "stopped":
            return self._say("no session is running")
        live = running_cell(s)
        if live is not None:
            live.request_interrupt()
            timer = threading.Timer(1.5, self._sigint_if_undelivered, args=(s, live))
            timer.daemon = True
            timer.start()
            return self._say(
                "interrupting the running cell: SIGINT to its ranks, "
                "then ranks that do not stop are ended"
            )
        busy = [r for r, st in s.rank_states().items() if st.state == "busy"]
        if not busy:
            return self._say("no rank is busy: nothing to interrupt")
        s.kill_ranks(busy, signal.SIGINT)
        return self._say(f"sent SIGINT to busy rank(s) {busy}")

    def where(self) -> str:
        """Show every rank's current stack (during a cell too)."""
        s = self.session
        if s is None or s.state == "stopped":
            return self._say("no session is running")
        stacks = s.where()
        blocks = "".join(
            f'<pre style="margin:2px 0; color:{rank_hex(r)}">{html.escape(st.format())}</pre>'
            for r, st in stacks.items()
        )
        title = f"<div><b>where the ranks are</b> ({time.strftime('%X')})</div>"
        self.where_box.value = title + blocks
        busy = [r for r, st in stacks.items() if st.frames]
        return self._say(f"stacks of {len(stacks)} ranks; in cell code: {busy or 'none'}")

    def _sigint_if_undelivered(self, s: Any, live: Any) -> None:
        if live.interrupt_delivered.is_set() or running_cell(s) is not live:
            return
        busy = [r for r, st in s.rank_states().items() if st.state == "busy"]
        s.kill_ranks(busy, signal.SIGINT)
        self._say(f"the cell did not take the interrupt; sent SIGINT to rank(s) {busy}")

    def restart(self) -> str:
        """Restart the session (after interrupting a running cell)."""
        return self._lifecycle("restart")

    def stop(self) -> str:
        """Stop the session (after interrupting a running cell)."""
        return self._lifecycle("stop")

    def _lifecycle(self, action: str) -> str:
        s = self.session
        if s is None:
            return self._say("no session")
        live = running_cell(s)
        if live is not None:
            live.request_interrupt()
            live.after(lambda: self._do(action, s))
            return self._say(f"interrupting the running cell; then {action}")
        if getattr(s.client, "outstanding", None):
            return self._say(
                f"a call on the session is still running outside a %%mlxdist cell; "
                f"interrupt it with Jupyter's stop button, then {action}"
            )
        return self._do(action, s)

    def _do(self, action: str, s: Any) -> str:
        try:
            if action == "stop":
                if s.state == "stopped":
                    return self._say("the session is already stopped")
                self._say("stopping…")
                s.stop()
                self.refresh()
                return self._say(f"session {s.session_id} stopped")
            self._say("restarting…")
            s.restart()
            if self.model:
                self.watch(self.model)
            self.start()
            self.refresh()
            return self._say(f"restarted: session {s.session_id}, {s.n} ranks")
        except Exception as e:  # noqa: BLE001
            return self._say(f"{action} failed: {type(e).__name__}: {e}")


def dashboard(
    session: Any = None, *, model: str | None = None, interval: float = 0.5, show: bool = True
) -> Dashboard:
    """Show a live dashboard of the session (default: the current one).

    Args:
        session: the session; ``None`` follows the current session.
        model: a model name on the ranks whose parameters / shard shapes to show.
        interval: seconds between updates.
        show: display it under the current cell now.

    Returns:
        The :class:`Dashboard` (``.close()`` stops it; ``.values()`` reads it).
    """
    d = Dashboard(session, model=model, interval=interval)
    if show:
        d.show()
    return d
