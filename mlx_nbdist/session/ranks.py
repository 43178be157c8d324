"""The ranks of a formed group, as the supervisor sees them (:class:`supervise.Ranks`):
alive, paused or dead, their published records, signals, and the calls that bring
a group back in step after a failed cell (drain, drop unreceived messages, align).

A local rank (its process visible here) is checked and signalled by PID; a remote
one through ipyparallel's registration and the launcher (ssh, mpirun).
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from .. import config, processes, watchdog
from ..engine import rpc
from ..errors import StartError
from ..outcomes import short_error
from ..results import RankInfo, RankStack
from .cluster import Cluster, describe_exit
from .formation import Formed, RankPlace


class RankGroup:
    """The ranks of one started session (implements :class:`supervise.Ranks`)."""

    def __init__(self, cluster: Cluster, formed: Formed):
        self.cluster = cluster
        self.ranks: dict[int, RankInfo] = formed.ranks
        self.places: dict[int, RankPlace] = formed.places
        #: the local ranks' processes: rank -> (pid, start time), processes.identity
        self.procs: dict[int, tuple[int, float]] = {}
        #: each cell the group ran, by cell number: its name (``In [7]``) and source;
        #: stacks name their frames from it
        self.sources: dict[int, tuple[str, str]] = {}
        for r, info in self.ranks.items():
            if not self.places[r].local:
                continue
            ident = processes.identity(info.pid)
            if ident is None:
                raise StartError(f"rank {r} (pid {info.pid}) exited right after joining")
            self.procs[r] = ident

    @property
    def directory(self) -> Path:
        return self.cluster.directory

    def engine(self, rank: int) -> Any:
        """ipyparallel's view of rank ``rank``'s engine."""
        return self.cluster.client[self.ranks[rank].engine_id]

    def local_pids(self) -> list[int]:
        return [pid for pid, _started in self.procs.values()]

    # -- liveness -----------------------------------------------------------------
    def rank_alive(self, rank: int) -> bool:
        """A local rank: its process runs. A remote one: its engine is still registered
        with the controller (ipyparallel drops an engine whose heartbeat stops)."""
        ident = self.procs.get(rank)
        if ident is not None:
            return processes.running(ident)
        place = self.places.get(rank)
        client = self.cluster.client
        if place is None or place.local or client is None or rank not in self.ranks:
            return False
        try:
            return self.ranks[rank].engine_id in client.ids
        except Exception:  # noqa: BLE001 - a closed client: nothing is alive
            return False

    def rank_paused(self, rank: int) -> bool:
        """Its process is stopped (SIGSTOP, a debugger): alive, but runs nothing."""
        ident = self.procs.get(rank)
        if ident is None or not processes.running(ident):
            return False
        try:
            return psutil.Process(ident[0]).status() in (psutil.STATUS_STOPPED, "tracing-stop")
        except psutil.Error:
            return False

    def rank_exit(self, rank: int) -> str:
        """How a local rank's process ended (exit code or signal), when its launcher
        started it as this process's child; ``""`` when unknown."""
        pid = self.ranks[rank].pid if rank in self.ranks else None
        return describe_exit(self.cluster.exit_of(pid))

    def infrastructure_problem(self) -> str:
        return self.cluster.infrastructure_problem()

    def rank_stacks(self, ranks: list[int]) -> dict[int, RankStack]:
        """Where ``ranks``' main threads are now, trimmed to the user's code."""
        from . import stacks

        return stacks.request(self, ranks, self.sources, timeout=config.STACK_TIMEOUT)

    # -- what the ranks publish -----------------------------------------------------
    def rank_file(self, rank: int, ext: str) -> str:
        """The text of a rank's file in the session directory (status, ``.live`` note)."""
        place = self.places.get(rank)
        if place is not None and not place.shared_files:
            raise FileNotFoundError(f"rank {rank}'s files are not readable from here")
        return (self.directory / f"rank{rank}.{ext}").read_text()

    def rank_record(self, rank: int) -> dict[str, Any]:
        """The status record rank ``rank`` last published (``{}`` when unreadable)."""
        try:
            return json.loads(self.rank_file(rank, "json"))
        except (OSError, ValueError):
            return {}

    # -- signals --------------------------------------------------------------------
    def kill_ranks(self, ranks: list[int], sig: int, *, local_only: bool = False) -> None:
        """Signal ranks: by PID when local, through the launcher (ssh, mpirun) when
        not (unless ``local_only``); remote signals are sent in the background and
        waited for at most 5 s."""
        remote: dict[int, tuple[str, int]] = {}
        for r in ranks:
            ident = self.procs.get(r)
            if ident is None:
                if r in self.ranks:
                    remote[r] = (self.places[r].host, self.ranks[r].pid)
                continue
            watchdog.kill(dict([ident]), sig)
        if remote and not local_only:
            _run_all(self.cluster.remote_signals(remote, sig), wait=5.0)

    # -- bringing a group back in step ------------------------------------------------
    def call_each(
        self, calls: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]], timeout: float
    ) -> tuple[dict[int, Any], dict[int, str], list[int]]:
        """Apply ``fn(*args)`` on each rank at once and wait at most ``timeout`` for
        all: ``({rank: value}, {rank: error}, ranks that had not answered)``."""
        ars, errors = {}, {}
        for r, (fn, args) in calls.items():
            try:
                ars[r] = self.engine(r).apply_async(fn, *args)
            except Exception as e:  # noqa: BLE001 - e.g. its engine was unregistered
                errors[r] = short_error(e)
        t_end = time.monotonic() + timeout
        values, silent = {}, []
        for r, ar in ars.items():
            try:
                values[r] = ar.get(timeout=max(0.05, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                if ar.done():
                    errors[r] = short_error(e)
                else:
                    silent.append(r)
        return values, errors, silent

    def drain_ranks(
        self, plan: dict[int, list[dict[str, Any]]], timeout: float
    ) -> tuple[dict[int, list[str]], list[int]]:
        """Replay ``plan[r]`` on each rank ``r``; returns the lines each replayed and
        the ranks whose replay did not complete in ``timeout`` (still blocked in it)."""
        done, errors, silent = self.call_each(
            {r: (rpc.drain, (records,)) for r, records in plan.items()}, timeout
        )
        return {r: lines for r, lines in done.items() if lines}, sorted([*errors, *silent])

    def align_ranks(self, timeout: float) -> str:
        """Prove every rank's message streams are in step (a fresh nonce gathered by
        every rank); returns ``""`` when they are, else why not (the session's caller
        then marks the group broken). A rank that does not answer is ended."""
        nonce = secrets.randbits(60)
        got, errors, silent = self.call_each(
            {r: (rpc.align, (nonce,)) for r in self.ranks}, timeout
        )
        problems = [f"rank {r}: {e}" for r, e in sorted(errors.items())]
        problems += [
            f"rank {r} read wrong data ({', '.join(v['bad'])})" for r, v in got.items() if v["bad"]
        ]
        if silent:
            problems.append(f"ranks {silent} did not answer within {timeout:g} s")
            self.kill_ranks(silent, signal.SIGKILL)
        if not problems:
            return ""
        return (
            "the group's message streams are out of step after this cell ("
            + "; ".join(problems)
            + ")"
        )

    def receive_unmatched(self, pending: dict[int, list[dict[str, Any]]], timeout: float) -> str:
        """Have each rank receive (and drop) the messages sent to it in the last cell
        that it never received; returns ``""`` or why that failed."""
        _, errors, silent = self.call_each(
            {r: (rpc.receive_unmatched, (msgs,)) for r, msgs in pending.items()}, timeout
        )
        if silent:
            self.kill_ranks(silent, signal.SIGKILL)
        bad = [f"rank {r}: {e}" for r, e in sorted(errors.items())]
        bad += [f"rank {r}: no answer within {timeout:g} s" for r in silent]
        return "; ".join(bad)


def _run_all(jobs: list[Callable[[], None]], wait: float) -> None:
    """Run ``jobs`` in background threads; wait at most ``wait`` seconds for all."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    t_end = time.monotonic() + wait
    for t in threads:
        t.join(max(0.0, t_end - time.monotonic()))
