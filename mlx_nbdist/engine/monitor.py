"""A daemon thread on each rank that publishes its state and watches its client.

Every ``interval`` seconds it writes ``rank<r>.json`` in the session directory
(atomically, by rename) with the rank's state: idle or busy, the running cell and
since when, MLX memory, RSS and CPU, collectives issued and bytes moved, progress
bars and streamed scalars (:mod:`mlx_nbdist.engine.progress`), and the parameters of
a watched model (:meth:`Monitor.watch_model`). The notebook reads these files even
while the engine is busy running a cell, which is how it knows what a stuck rank is
waiting in, and how its dashboard and progress bars update live.

It also ends the engine (and, on rank 0, the controller) when the notebook's
process has gone away, so a crashed or killed kernel leaves nothing running. (A
rank whose cell holds the GIL never runs this thread: the session's
:mod:`mlx_nbdist.watchdog` process covers that. A rank on a host that cannot see the
notebook's process does not watch it: it relies on ipyparallel's heartbeat with the
controller instead, an idle engine stopping after missing its heartbeats.) A rank
that publishes into a private folder (it does not see the session directory)
removes it when it exits.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from .. import config, watchdog
from . import dtypes

if TYPE_CHECKING:
    from .tracker import Tracker

#: progress bars kept in the published state (the oldest finished ones are dropped)
MAX_BARS = 8
#: points kept per scalar; past this the history is thinned to every other point
MAX_POINTS = 256
#: parameters listed for a watched model (the totals cover all of them)
MAX_PARAMS = 48
#: how often a watched model's parameters are re-read, in seconds
MODEL_INTERVAL = 1.0
#: after a cell's start or end woke the thread, seconds it waits before it publishes.
#: A cell or call shorter than this is published once, after its reply; a longer one
#: twice, busy and (before its reply, see :meth:`Monitor.cell_finished`) ended: at
#: 10 ms a 20 ms pull of a slice paid both, 1.6-1.9 ms of it on 2 cores
WAKE_SETTLE = 0.05


class Monitor:
    """Publishes this rank's state; see the module docstring.

    ``watch_client=False`` on a host that cannot see the notebook's process.
    """

    def __init__(
        self,
        tracker: Tracker,
        session_dir: str,
        *,
        client_pid: int,
        client_started: float,
        reap_pids: dict[int, float] | None = None,
        device: str = "",
        interval: float = config.PUBLISH_INTERVAL,
        watch_client: bool = True,
    ):
        self.tracker = tracker
        self.watch_client = watch_client
        self.path = Path(session_dir) / f"rank{tracker.rank}.json"
        self.client_pid = client_pid
        self.client_started = client_started
        #: what to end when the notebook is gone: pid -> start time (watchdog.start_time)
        self.reap_pids = reap_pids or {}
        self.interval = interval
        self.state: dict[str, Any] = {
            "rank": tracker.rank,
            "pid": os.getpid(),
            "state": "idle",
            "cell": 0,
            "cell_started": None,
            "last_duration": None,
            "last_status": None,
            "device": device,
            "progress": {},
            "scalars": {},
            "model": None,
        }
        self._watch: str | None = None
        self._model_at = 0.0
        self._marked = 0  # the last cell noted in the ``.live`` file (see _mark_live)
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._stop = False
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the state, changed by the cell's thread
        self._write_lock = threading.Lock()  # the file
        self._busy_on_disk: int | None = None  # the cell the file says runs, if any
        self._thread = threading.Thread(target=self._loop, name="mlx_nbdist-monitor", daemon=True)
        #: the rank's own status folder (``bootstrap``'s mkdtemp), removed at exit
        self.private_dir = self.path.parent if _is_private(self.path.parent, tracker.rank) else None

    def start(self) -> None:
        """Publish now, then every ``interval`` seconds from the thread."""
        self.publish()
        if self.private_dir is not None:
            atexit.register(self.remove_private_dir)
        self._thread.start()

    def remove_private_dir(self) -> None:
        """Remove the rank's own status folder, if it has one."""
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def stop(self) -> None:
        """End the thread (at its next wake-up)."""
        self._stop = True
        self._wake.set()

    # -- called from the cell hooks on the engine's main thread -------------------
    def cell_started(self, cell: int) -> None:
        """Publish that ``cell`` runs (busy, since now)."""
        with self._lock:
            self.state.update(state="busy", cell=cell, cell_started=time.time())
        self._wake.set()  # the thread publishes at once; the cell does not wait for it

    def cell_finished(self, status: str) -> None:
        """Publish the end of the cell: idle (``ok``) or error, and how long it took.

        Published now, before the cell's reply, when the file says this cell is busy
        (``%mlxdist status`` right after the cell must not show it running) or the
        cell published bars or scalars (the notebook shows their final values once
        the cell ended). A cell over before the thread published it (the file still
        says idle) is published by the thread, after the reply left (see
        :data:`WAKE_SETTLE`).
        """
        with self._lock:
            started = self.state.get("cell_started") or time.time()
            self.state.update(
                state="idle" if status == "ok" else "error",
                last_duration=time.time() - started,
                last_status=status,
                cell_started=None,
            )
            cell = self.state.get("cell")
        with self._write_lock:  # (a publish under way lands first: then it is known)
            now = self._marked == cell or self._busy_on_disk == cell
            if now:
                try:
                    self._publish()
                except Exception:  # noqa: BLE001 - the thread publishes it then
                    now = False
        if not now:
            self._wake.set()

    def set_progress(self, key: str, value: dict[str, Any]) -> None:
        """Publish a progress bar (``n``, ``total``, ``desc``, ``rate``, ``cell``...)."""
        with self._lock:
            bars = self.state["progress"]
            bars[key] = value
            while len(bars) > MAX_BARS:
                done = [k for k, v in bars.items() if v.get("done")]
                del bars[(done or list(bars))[0]]
        self._mark_live(int(value.get("cell") or self.state.get("cell", 0)))

    def add_scalars(self, values: dict[str, float], step: int | None = None) -> None:
        """Append one point per name to the streamed scalars (``[step, value, cell]``)."""
        with self._lock:
            series = self.state["scalars"]
            cell = self.state.get("cell", 0)
            for name, value in values.items():
                points = series.setdefault(str(name), [])
                x = step if step is not None else (points[-1][0] + 1 if points else 0)
                points.append([x, float(value), cell])
                if len(points) > MAX_POINTS:
                    del points[::2]
        self._mark_live(cell)

    def _mark_live(self, cell: int) -> None:
        """Note, once per cell, that it published bars or scalars: the notebook reads
        this small file, not the whole state, to decide whether a finished cell
        needs a last progress display."""
        if cell != self._marked:
            self._marked = cell
            try:
                self.path.with_suffix(".live").write_text(str(cell))
            except OSError:
                pass

    def watch_model(self, name: str | None) -> None:
        """Publish the parameters (path, local shape, dtype, layer) of ``name``, now."""
        self._watch = name or None
        self._model_at = 0.0
        if self._watch is None:
            with self._lock:
                self.state["model"] = None
        try:  # now: a dashboard reads every rank's model once this call returned
            self.publish()
        except Exception:  # noqa: BLE001 - the thread publishes it then
            self._wake.set()

    def _refresh_model(self) -> None:
        if self._watch is None or time.monotonic() - self._model_at < MODEL_INTERVAL:
            return
        self._model_at = time.monotonic()
        try:
            summary = model_summary(self._watch)
        except Exception as e:  # noqa: BLE001 - a model being rebuilt can fail to walk
            summary = {"name": self._watch, "error": f"{type(e).__name__}: {e}"}
        with self._lock:
            self.state["model"] = summary

    # -- the thread -----------------------------------------------------------------
    def publish(self) -> None:
        """Write the state now. One publish at a time, from the snapshot to the file
        (the cell's thread publishes a cell's end while the thread may be half way
        through a snapshot of its start: that one must not land last)."""
        with self._write_lock:
            self._publish()

    def _publish(self) -> None:
        import mlx.core as mx

        self._refresh_model()
        with self._lock:
            state = copy.deepcopy(self.state)
        snap = dict(state, **self.tracker.snapshot())
        try:
            mem = self._proc.memory_info().rss
            cpu = self._proc.cpu_percent(None)
        except psutil.Error:
            mem, cpu = 0, 0.0
        try:
            host = psutil.virtual_memory()
            host_total, host_free = int(host.total), int(host.available)
        except (psutil.Error, OSError):
            host_total, host_free = 0, 0
        snap.update(
            main_frame=_main_frame(),
            active_memory=int(mx.get_active_memory()),
            peak_memory=int(mx.get_peak_memory()),
            rss=int(mem),
            host_memory=host_total,
            host_available=host_free,
            cpu_percent=float(cpu),
            updated=time.time(),
        )
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snap, default=str))
        os.replace(tmp, self.path)
        self._busy_on_disk = snap.get("cell") if snap.get("state") == "busy" else None

    def note_ledger(self, cell: int) -> None:
        """Note, before the cell's reply leaves, that ``cell`` sent a ledger (the
        notebook then waits for it: see ``Session._ledger_missing``). Written by the
        cell's thread, not published: the notebook must not depend on when the
        thread publishes."""
        try:
            self.path.with_suffix(".ledger").write_text(str(cell))
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stop:
            if self._wake.wait(self.interval):
                # woken by a cell's start or end: let its reply leave first (a publish
                # holds the GIL for a while: 0.8 ms of every cell's round trip here)
                time.sleep(WAKE_SETTLE)
            self._wake.clear()
            if self.watch_client and not self._client_alive():
                self._reap_and_exit()
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - a monitor must never kill its engine
                pass

    def _client_alive(self) -> bool:
        # a killed client whose parent has not reaped it yet is gone too
        return watchdog.client_alive(self.client_pid, self.client_started)

    def _reap_and_exit(self) -> None:
        watchdog.kill(self.reap_pids, signal.SIGTERM)  # a PID reused since: spared
        self.remove_private_dir()
        os._exit(0)


def _is_private(folder: Path, rank: int) -> bool:
    """``folder`` is one ``bootstrap`` made for this rank alone
    (``<tmp>/mlx_nbdist-<session id>-rank<r>-XXXX``), not the session directory."""
    return folder.parent == Path(tempfile.gettempdir()) and bool(
        re.match(rf"^mlx_nbdist-.+-rank{rank}-[^-]+$", folder.name)
    )


def _main_frame() -> str:
    """Where the engine's main thread is (file, line, instruction): the notebook sees
    a rank that does not move, e.g. one blocked inside MLX."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_lasti}"


def model_summary(name: str) -> dict[str, Any]:
    """Parameters of the model ``name`` in this rank's namespace, as plain data.

    Reads shapes and dtypes only (no evaluation), so it is safe from the monitor's
    thread while a cell runs. ``layer`` is the class of the module owning each
    parameter: ``AllToShardedLinear`` / ``ShardedToAllLinear`` mark sharded layers.
    """
    import mlx.nn as nn
    from IPython import get_ipython
    from mlx.utils import tree_flatten

    ip = get_ipython()
    ns = ip.user_ns if ip is not None else {}
    if name not in ns:
        return {"name": name, "error": f"{name!r} is not defined on this rank"}
    model = ns[name]
    if not isinstance(model, nn.Module):
        return {"name": name, "error": f"{name!r} is a {type(model).__name__}, not an nn.Module"}
    layers = dict(tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    flat = tree_flatten(model.parameters())
    params, total, nbytes = [], 0, 0
    for path, arr in flat:
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        size = int(arr.size)
        total += size
        nbytes += int(arr.nbytes)
        if len(params) < MAX_PARAMS:
            params.append(
                {
                    "path": path,
                    "shape": list(arr.shape),
                    "dtype": dtypes.dtype_name(arr.dtype),
                    "layer": type(layers.get(owner, model)).__name__,
                }
            )
    return {
        "name": name,
        "type": type(model).__name__,
        "params": params,
        "count": len(flat),
        "elements": total,
        "nbytes": nbytes,
    }
