"""Watch a dispatched cell until every rank is done, and never let it hang.

The supervisor polls the ranks' replies; on top of ipyparallel it knows each rank's
process and what collective it last issued (from the rank's status file), so it can:

* end the cell within seconds when one rank failed and the others wait for it in a
  collective: first by *draining* (the finished ranks issue the collective the
  stuck ones wait in, with zeros, so they return; the session stays usable and the
  cell is marked invalid), and only if that fails by ending the stuck ranks;
* notice a rank whose process died (SIGKILL, ``os._exit``) and not wait for it;
* end the stuck ranks at the deadline, or on the user's interrupt after SIGINT and
  a short grace.

Ending a rank breaks the MLX group (it cannot be rebuilt in the same processes), so
the session is then marked broken and needs ``restart``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from .results import DIED, DRAINED, ERROR, KILLED, CollectiveRecord, RankFailure


class Ranks(Protocol):
    """What the supervisor needs from the session."""

    def rank_pid(self, rank: int) -> int: ...
    def rank_alive(self, rank: int) -> bool: ...
    def rank_record(self, rank: int) -> dict[str, Any]: ...
    def kill_ranks(self, ranks: list[int], sig: int) -> None: ...
    def drain_ranks(
        self, ranks: list[int], records: list[dict[str, Any]], timeout: float
    ) -> dict[int, list[str]]: ...


@dataclass
class Outcome:
    """How each rank's task ended, as far as the supervisor is concerned."""

    #: ranks whose reply arrived (ok or error)
    replied: list[int] = field(default_factory=list)
    #: failures the supervisor itself caused or observed (died, killed, drained)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    broken: str = ""
    valid: bool = True
    summary: str = ""
    timed_out: bool = False
    interrupted: bool = False


@dataclass
class Policy:
    """Timings of the supervisor, in seconds."""

    timeout: float | None = None
    #: after a rank failed, how long the others may keep running before they count as stuck
    failure_grace: float = 2.0
    #: how long a drain may take before the stuck ranks are ended
    drain_timeout: float = 3.0
    #: after SIGINT, how long before the ranks still running are ended
    interrupt_grace: float = 2.0
    poll: float = 0.02
    #: how often the rank processes are checked for life (each check reads /proc)
    alive_every: float = 0.2
    #: how often ``on_tick`` is called while a cell runs
    tick: float = 0.25
    #: after the first rank finished, how long before the others' status files are
    #: read to see whether they wait in a collective it never issued (replies of a
    #: cell arrive a fraction of a millisecond apart: reading then only delays them)
    stragglers_after: float = 0.05


class Supervisor:
    """Waits for one dispatched task (an execute or an apply) on a set of ranks."""

    def __init__(
        self,
        ranks: Ranks,
        futures: dict[int, Future],
        policy: Policy,
        on_tick: Callable[[], None] | None = None,
    ):
        self.s = ranks
        self.futures = futures
        self.policy = policy
        self.on_tick = on_tick
        self._last_tick = time.monotonic()  # the first tick after one interval
        self.out = Outcome()
        self._failed_at: float | None = None
        self._finished_at = 0.0  # when the first rank finished (see stragglers_after)
        self._drained = False
        self._alive_at = time.monotonic()  # the session checked them before dispatch

    # -- helpers ------------------------------------------------------------------
    def _pending(self) -> list[int]:
        return [r for r, f in self.futures.items() if not f.done()]

    def _errored(self) -> list[int]:
        return [r for r, f in self.futures.items() if f.done() and failed(f)]

    def _wait(self, ranks: list[int], timeout: float) -> None:
        wait_futures([self.futures[r] for r in ranks], timeout=timeout, return_when=FIRST_COMPLETED)

    def _records(self, rank: int) -> list[CollectiveRecord]:
        rec = self.s.rank_record(rank)
        return [CollectiveRecord.from_dict(d) for d in rec.get("recent", [])]

    def _count(self, rank: int) -> int:
        return int(self.s.rank_record(rank).get("collectives", 0))

    def _mark(self, ranks: list[int], cause: str, why: str) -> None:
        for r in ranks:
            self.out.failures[r] = RankFailure(
                rank=r, cause=cause, evalue=why, pending=self._records(r)[-3:]
            )

    def _end(self, ranks: list[int], why: str, cause: str = KILLED) -> None:
        if not ranks:
            return
        self._mark(ranks, cause, why)
        self.s.kill_ranks(ranks, signal.SIGKILL)
        self.out.broken = self.out.broken or why

    # -- the loop -------------------------------------------------------------------
    def wait(self) -> Outcome:
        start = time.monotonic()
        deadline = start + self.policy.timeout if self.policy.timeout else None
        try:
            while True:
                pending = self._pending()
                self._check_dead(pending)
                if not pending:
                    break
                pending = [r for r in self._pending() if r not in self.out.failures]
                if not pending:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self.out.timed_out = True
                    self._end(pending, f"deadline of {self.policy.timeout:g} s reached")
                    break
                if self._handle_failure(pending):
                    break
                self._wait(pending, self.policy.poll)
                self._tick()
        except KeyboardInterrupt:
            self._interrupt()
        self.out.replied = [r for r, f in self.futures.items() if f.done()]
        return self.out

    def _tick(self) -> None:
        """Call ``on_tick`` (live progress displays) at most every ``tick`` seconds."""
        now = time.monotonic()
        if self.on_tick is None or now - self._last_tick < self.policy.tick:
            return
        self._last_tick = now
        try:
            self.on_tick()
        except Exception:  # noqa: BLE001 - a display must never break the cell
            self.on_tick = None

    def _check_dead(self, pending: list[int]) -> None:
        now = time.monotonic()
        if now - self._alive_at < self.policy.alive_every:
            return
        self._alive_at = now
        # Not only the pending ranks: ipyparallel may already have failed the future
        # of an engine whose heartbeat stopped.
        maybe = [
            r
            for r, f in self.futures.items()
            if r not in self.out.failures and (not f.done() or failed(f))
        ]
        dead = [r for r in maybe if not self.s.rank_alive(r)]
        if not dead:
            return
        self._mark(dead, DIED, "process exited")
        self.out.broken = f"rank {', '.join(map(str, dead))} died"
        # Ranks blocked in a collective with a dead peer usually fail at once
        # ("connection to a peer was lost"); give them a moment, then end them.
        others = [r for r in pending if r not in dead]
        t_end = time.monotonic() + self.policy.failure_grace
        while others and time.monotonic() < t_end:
            self._wait(others, 0.1)
            others = [r for r in self._pending() if r not in self.out.failures]
        self._end(others, f"peer rank(s) {dead} died")

    def _handle_failure(self, pending: list[int]) -> bool:
        """React to ranks that failed while others still run; True when done."""
        finished = [r for r in self.futures if r not in pending]
        if not self._errored() and not finished:
            return False
        # Some ranks finished fine, others are still running: only a problem when
        # those are waiting in a collective the finished ones never issued.
        if not self._errored():
            now = time.monotonic()
            self._finished_at = self._finished_at or now
            if now - self._finished_at < self.policy.stragglers_after:
                return False
            if not self._stuck_beyond(pending, finished):
                return False
        if self._failed_at is None:
            self._failed_at = time.monotonic()
            return False
        if time.monotonic() - self._failed_at < self.policy.failure_grace:
            return False
        stuck = [r for r in pending if self._cell_collectives(r)]
        if not stuck:
            return False  # computing, not waiting on a peer: the deadline governs
        if not self._drained:
            self._drained = True
            if self._drain(stuck, finished):
                return not self._pending()
        self._end(stuck, "stuck in a collective after a peer failed")
        return True

    def _cell_collectives(self, rank: int) -> bool:
        cell = self.s.rank_record(rank).get("cell")
        return any(rec.cell == cell for rec in self._records(rank))

    def _stuck_beyond(self, pending: list[int], finished: list[int]) -> bool:
        top = max((self._count(r) for r in finished), default=0)
        return any(self._count(r) > top for r in pending)

    def _drain(self, stuck: list[int], finished: list[int]) -> bool:
        source = max(stuck, key=self._count)
        records = [
            dict(vars(rec), from_rank=source)
            for rec in self._records(source)
            if rec.seq > min((self._count(r) for r in finished), default=0)
        ]
        if not records:
            return False
        replayed = self.s.drain_ranks(finished, records, self.policy.drain_timeout)
        t_end = time.monotonic() + self.policy.drain_timeout
        while self._pending() and time.monotonic() < t_end:
            self._wait(self._pending(), 0.1)
        if self._pending():
            return False
        self.out.valid = False
        done = sorted({line for lines in replayed.values() for line in lines})
        for r in stuck:
            self.out.failures.setdefault(
                r,
                RankFailure(
                    rank=r,
                    cause=DRAINED,
                    evalue="released by replaying its collective on the ranks that skipped it",
                    pending=self._records(r)[-3:],
                ),
            )
        self.out.summary = (
            f"Drained: ranks {stuck} were waiting in {', '.join(done) or 'a collective'}; "
            f"ranks {sorted(replayed)} issued it with zeros so they could return. "
            "The session is still usable, but the values computed in this cell are invalid."
        )
        return True

    def _interrupt(self) -> None:
        self.out.interrupted = True
        pending = [r for r in self._pending() if r not in self.out.failures]
        self.s.kill_ranks(pending, signal.SIGINT)
        t_end = time.monotonic() + self.policy.interrupt_grace
        while True:
            try:
                pending = [r for r in self._pending() if r not in self.out.failures]
                if not pending or time.monotonic() > t_end:
                    break
                self._wait(pending, 0.1)
            except KeyboardInterrupt:
                break
        self._end(pending, "interrupted and did not stop after SIGINT")


def failed(fut: Future) -> bool:
    """ipyparallel resolves an execute that raised with the error as its *result*."""
    try:
        return fut.exception() is not None or isinstance(fut.result(), BaseException)
    except Exception:  # noqa: BLE001 - a cancelled or broken future: not a success
        return True


def error_of(fut: Future) -> BaseException | None:
    if not fut.done():
        return None
    exc = fut.exception()
    if exc is None and isinstance(fut.result(), BaseException):
        exc = fut.result()
    return exc


__all__ = ["Outcome", "Policy", "Supervisor", "DIED", "ERROR", "KILLED", "DRAINED"]
