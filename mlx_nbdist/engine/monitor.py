"""A daemon thread on each rank that publishes its state and watches its client.

Every ``interval`` seconds it writes ``rank<r>.json`` in the session directory
(atomically, by rename) with the rank's state: idle or busy, the running cell and
since when, MLX memory, RSS and CPU, collectives issued and bytes moved, progress
bars. The notebook reads these files even while the engine is busy running a cell,
which is how it knows what a stuck rank is waiting in.

It also ends the engine (and, on rank 0, the controller) when the notebook's
process has gone away, so a crashed or killed kernel leaves nothing running.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil

from .tracker import Tracker


class Monitor:
    """Publishes this rank's state; see the module docstring."""

    def __init__(
        self,
        tracker: Tracker,
        session_dir: str,
        *,
        client_pid: int,
        client_started: float,
        reap_pids: list[int] | None = None,
        device: str = "",
        interval: float = 0.25,
    ):
        self.tracker = tracker
        self.path = Path(session_dir) / f"rank{tracker.rank}.json"
        self.client_pid = client_pid
        self.client_started = client_started
        self.reap_pids = reap_pids or []
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
        }
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._stop = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="mlx_nbdist-monitor", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    # -- called from the cell hooks on the engine's main thread -------------------
    def cell_started(self, cell: int) -> None:
        self.state.update(state="busy", cell=cell, cell_started=time.time())
        self._wake.set()  # the thread publishes at once; the cell does not wait for it

    def cell_finished(self, status: str) -> None:
        started = self.state.get("cell_started") or time.time()
        self.state.update(
            state="idle" if status == "ok" else "error",
            last_duration=time.time() - started,
            last_status=status,
            cell_started=None,
        )
        self._wake.set()

    def set_progress(self, key: str, value: dict[str, Any]) -> None:
        self.state["progress"][key] = value

    # -- the thread -----------------------------------------------------------------
    def publish(self) -> None:
        snap = dict(self.state, **self.tracker.snapshot())
        try:
            mem = self._proc.memory_info().rss
            cpu = self._proc.cpu_percent(None)
        except psutil.Error:
            mem, cpu = 0, 0.0
        snap.update(
            active_memory=int(mx.get_active_memory()),
            peak_memory=int(mx.get_peak_memory()),
            rss=int(mem),
            cpu_percent=float(cpu),
            updated=time.time(),
        )
        with self._lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(snap, default=str))
            os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._client_alive():
                self._reap_and_exit()
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - a monitor must never kill its engine
                pass

    def _client_alive(self) -> bool:
        try:
            p = psutil.Process(self.client_pid)
            return abs(p.create_time() - self.client_started) < 1.0 and p.is_running()
        except psutil.Error:
            return False

    def _reap_and_exit(self) -> None:
        for pid in self.reap_pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        os._exit(0)
