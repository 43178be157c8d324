"""The processes a session starts: tell them from a reused PID, end them, and find
those of sessions whose notebook is gone.

A PID alone is not an identity (the kernel reuses them): every check pairs it with
the process's start time, as recorded when the session started it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import psutil

from . import launch


def children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def group_members(pgid: int, started: float, marker: str) -> list[tuple[int, float]]:
    """Processes in process group ``pgid`` started since ``started`` whose command line
    contains ``marker``: what a group leader forked, even after we last looked."""
    out = []
    for p in psutil.process_iter(["create_time", "cmdline"]):
        try:
            if (
                os.getpgid(p.pid) == pgid
                and p.info["create_time"] >= started - 1.0
                and marker in " ".join(p.info["cmdline"] or [])
            ):
                out.append((p.pid, p.info["create_time"]))
        except (OSError, psutil.Error):
            pass
    return out


def end_pids(pids: list[tuple[int, float]], grace: float = 3.0) -> None:
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
        live = [p for p, t in pids if same_process(p, t)]
        end_pids(pids)
        if live:
            ended.append(f"session {rec['session_id']}: ended pids {live}")
        rec["state"], rec["pids"] = "stopped", []
        rec_path.write_text(json.dumps(rec))
    return ended


def same_process(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def _client_alive(rec: dict[str, Any]) -> bool:
    return same_process(int(rec.get("client_pid", 0)), float(rec.get("client_started", 0)))


def remote_kill(launcher: Any, pid: int, sig: int) -> Callable[[], None]:
    def job() -> None:
        try:
            launcher.ssh_sender.cmd_kill(pid, int(sig))
        except Exception:  # noqa: BLE001 - gone already, or the host is unreachable
            pass

    return job
