"""Watch a dispatched cell until every rank is done, and never let it hang.

The supervisor polls the ranks' replies; on top of ipyparallel it knows each rank's
process and what collectives it issued in this cell (from the rank's status file),
so it can:

* end the cell within seconds when one rank failed and the others wait for it in a
  collective: first by *draining* (the finished ranks issue the collectives the
  stuck ones wait in, with zeros, so they return; the cell is marked invalid), and
  only if that fails by ending the stuck ranks;
* notice a rank whose process died (SIGKILL, ``os._exit``), one that is paused
  (SIGSTOP, a debugger) and was dropped by the controller, the controller or one
  of its schedulers dying, and ranks that all wait to receive from each other;
* at the deadline or on the user's interrupt, send SIGINT first (a rank running
  Python stops; it is sent again to local ranks while they run, since one that arrived before a
  rank took the request is lost, and a rank takes one per cell: see
  :mod:`mlx_nbdist.engine.interrupts`), drain what waits on it, and end only what
  still runs.

A drain, or any stop that left the group in use, sets ``needs_alignment``: the
session then trusts the group only once every rank has answered an alignment check
(a fresh nonce gathered by every rank, see :func:`mlx_nbdist.engine.tracker.align`);
otherwise it declares the group broken.
Ending a rank breaks the MLX group (it cannot be rebuilt in the same processes), so
the session is then marked broken and needs ``restart``.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import mismatch
from .config import Policy
from .results import DIED, DRAINED, ERROR, KILLED, PAUSED, CollectiveRecord, RankFailure, RankStack

_RECV = ("recv", "recv_like")
#: while a rank's output flows (some arrived in the last FLUSH_WINDOW seconds), the
#: loop wakes at least every FLUSH_POLL seconds instead of every ``Policy.poll``, so
#: an update the live view held back (its throttle) is shown when its interval ends
FLUSH_POLL = 0.005
FLUSH_WINDOW = 0.25


class Ranks(Protocol):
    """What the supervisor needs from the session."""

    def rank_alive(self, rank: int) -> bool: ...
    def rank_paused(self, rank: int) -> bool: ...
    def rank_exit(self, rank: int) -> str: ...
    def rank_record(self, rank: int) -> dict[str, Any]: ...
    def kill_ranks(self, ranks: list[int], sig: int, *, local_only: bool = False) -> None: ...
    def drain_ranks(
        self, plan: dict[int, list[dict[str, Any]]], timeout: float
    ) -> tuple[dict[int, list[str]], list[int]]: ...
    def infrastructure_problem(self) -> str: ...
    def rank_stacks(self, ranks: list[int]) -> dict[int, RankStack]: ...


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
    #: the group was used in a way that must be proven in step before the next cell
    needs_alignment: bool = False
    #: why the cell fails although every rank finished (its ranks' ledgers disagree)
    problem: str = ""
    #: collectives were replayed to release ranks (the ranks' ledgers miss them)
    drained: bool = False


class Supervisor:
    """Waits for one dispatched task (an execute or an apply) on a set of ranks."""

    def __init__(
        self,
        ranks: Ranks,
        futures: dict[int, Future],
        policy: Policy,
        on_tick: Callable[[], None] | None = None,
        cell: int = 0,
        on_poll: Callable[[], None] | None = None,
        wake: threading.Event | None = None,
    ):
        self.s = ranks
        self.futures = futures
        self.policy = policy
        self.on_tick = on_tick
        #: called every poll (``poll`` seconds), and at once when ``wake`` is set
        #: (streamed output arrived): delivers that output; cheap
        self.on_poll = on_poll
        self.wake = wake
        if wake is not None:
            for fut in futures.values():
                fut.add_done_callback(lambda _f: wake.set())
        self.cell = cell
        self._last_tick = time.monotonic()  # the first tick after one interval
        self.out = Outcome()
        self._failed_at: float | None = None
        self._finished_at = 0.0  # when the first rank finished (see stragglers_after)
        self._drained = False
        self._begun = time.monotonic()
        #: (the ranks' collective counts, since when) while a failed rank settles
        self._settle_stall: tuple[tuple[int, ...], float] | None = None
        #: failed ranks whose peers were ended while they settled, left to reply until
        self._settlers: tuple[set[int], float] | None = None
        self._alive_at = time.monotonic()  # the session checked them before dispatch
        self._recv_wait: tuple[Any, float] | None = None  # (what, since) for deadlocks
        #: (what differs, the running ranks' collective counts, since) while the
        #: ranks' collectives differ (see :meth:`_check_mismatch`)
        self._mismatch: tuple[str, tuple[int, ...], float] | None = None
        #: status records read in the current health check (see :meth:`_record`)
        self._records: dict[int, dict[str, Any]] | None = None
        self._output_at = -FLUSH_WINDOW  # when ``wake`` last woke the loop (output)
        #: where stuck ranks were when first found stuck (see :meth:`_take_stacks`)
        self._stacks: dict[int, RankStack] = {}

    # -- helpers ------------------------------------------------------------------
    def _pending(self) -> list[int]:
        return [r for r, f in self.futures.items() if not f.done()]

    def _running(self) -> list[int]:
        return [r for r in self._pending() if r not in self.out.failures]

    def _errored(self) -> list[int]:
        return [r for r, f in self.futures.items() if f.done() and failed(f)]

    def _wait(self, ranks: list[int], timeout: float) -> None:
        """Until one of ``ranks`` finishes (or, with ``wake``, anything arrives)."""
        if self.wake is None:
            futs = [self.futures[r] for r in ranks]
            wait_futures(futs, timeout=timeout, return_when=FIRST_COMPLETED)
            return
        if not any(self.futures[r].done() for r in ranks):
            now = time.monotonic()
            if now - self._output_at < FLUSH_WINDOW:
                timeout = min(timeout, FLUSH_POLL)
            if self.wake.wait(timeout):
                self._output_at = time.monotonic()
        self.wake.clear()

    def _record(self, rank: int) -> dict[str, Any]:
        """``rank``'s status record: read once per health check while one runs (its
        checks read every rank's several times), else read now."""
        if self._records is None:
            return self.s.rank_record(rank)
        if rank not in self._records:
            self._records[rank] = self.s.rank_record(rank)
        return self._records[rank]

    def _cell_records(self, rank: int) -> list[CollectiveRecord]:
        """The collectives ``rank`` issued in this cell, as far as its status file says."""
        rec = self._record(rank)
        out = [CollectiveRecord.from_dict(d) for d in rec.get("recent", [])]
        return sorted((r for r in out if r.cell == self.cell), key=lambda r: r.index)

    def _cell_count(self, rank: int) -> int:
        rec = self._record(rank)
        if rec.get("tracker_cell") != self.cell:
            return 0
        return int(rec.get("cell_collectives", 0))

    def _mark(self, ranks: list[int], cause: str, why: str) -> None:
        for r in ranks:
            self.out.failures[r] = RankFailure(
                rank=r, cause=cause, evalue=why, pending=self._cell_records(r)[-3:],
                stack=self._stacks.get(r),
            )

    def _take_stacks(self, ranks: list[int]) -> None:
        """Ask ``ranks`` where they are, once each (the first time they are found
        stuck, before any signal moves them); a failure to ask never fails the cell."""
        ask = [r for r in ranks if r not in self._stacks and self.s.rank_alive(r)]
        if not ask:
            return
        try:
            self._stacks.update(self.s.rank_stacks(ask))
        except Exception:  # noqa: BLE001 - stacks explain a failure; they are not it
            pass

    def _end(self, ranks: list[int], why: str, cause: str = KILLED) -> None:
        if not ranks:
            return
        self._take_stacks(ranks)
        self._mark([r for r in ranks if r not in self.out.failures], cause, why)
        self.s.kill_ranks(ranks, signal.SIGKILL)
        self.out.broken = self.out.broken or why

    # -- the loop -------------------------------------------------------------------
    def wait(self) -> Outcome:
        start = time.monotonic()
        deadline = start + self.policy.timeout if self.policy.timeout else None
        try:
            while True:
                self._check_health()
                pending = self._running()
                if not pending:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self.out.timed_out = True
                    self._stop(pending, f"deadline of {self.policy.timeout:g} s reached")
                    break
                if self._handle_failure(pending):
                    break
                self._wait(pending, self.policy.poll)
                if self.on_poll is not None:
                    self.on_poll()
                self._tick()
        except KeyboardInterrupt:
            self.out.interrupted = True
            self._stop(self._running(), "interrupted and did not stop after SIGINT")
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

    # -- health: processes, controller, deadlocks ------------------------------------
    def _check_health(self) -> None:
        now = time.monotonic()
        if now - self._alive_at < self.policy.alive_every:
            return
        self._alive_at = now
        problem = self.s.infrastructure_problem()
        if problem:
            self._end(self._running(), problem)
            self.out.broken = problem
            return
        self._check_dead()
        self._records = {}  # the same snapshot for both checks (they only read it)
        try:
            self._check_mismatch()
            self._check_deadlock()
            if now - self._begun >= self.policy.failure_grace:  # none before: cheap cells
                self._check_failed_settling(self._running())
        finally:
            self._records = None

    def _check_mismatch(self) -> None:
        """Two ranks' n-th collectives over the whole group in this cell differ (op,
        shape or dtype): the values are wrong whatever happens next (the cell fails
        when it ends: its ledgers differ), and a rank may wait for data that never
        comes. Ranks that still move (issue collectives) are left to finish; once none
        has moved for ``failure_grace``, the running ones are ended (the group's
        streams are out of step: a restart is needed)."""
        running = self._running()
        if not running:
            return
        records = {r: self._cell_records(r) for r in self.futures if r not in self.out.failures}
        by_rank = {
            r: {
                (rec.trace, rec.group_index): mismatch.signature(
                    rec.op, rec.shape, rec.dtype, rec.check)
                for rec in recs
                if rec.group_index and rec.op not in mismatch.P2P
            }
            for r, recs in records.items()
        }
        sent, received = {}, {}
        for r, recs in records.items():
            for rec in recs:
                if rec.op in mismatch.P2P and rec.group_index and rec.peer is not None:
                    key = (r, rec.peer, rec.group_index) if rec.op == "send" else (
                        rec.peer, r, rec.group_index)
                    box = sent if rec.op == "send" else received
                    box[key] = (rec.nbytes, rec.dtype, tuple(rec.shape))
        found = mismatch.first_mismatch(by_rank)
        consequence = mismatch.CONSEQUENCE
        if found is None:
            found = mismatch.first_message_mismatch(sent, received)
            consequence = mismatch.MESSAGE_CONSEQUENCE
        if found is None:
            return
        counts = tuple(self._cell_count(r) for r in running)
        now = time.monotonic()
        if self._mismatch is None or self._mismatch[1] != counts:
            self._mismatch = (found, counts, now)
            return
        if now - self._mismatch[2] < self.policy.failure_grace:
            return
        self.out.valid = False
        self.out.broken = self.out.broken or f"{found}. {consequence}"
        self._end(running, "the ranks issued different collectives")

    def _check_dead(self) -> None:
        # Not only the pending ranks: ipyparallel may already have failed the future
        # of an engine whose heartbeat stopped.
        maybe = [
            r
            for r, f in self.futures.items()
            if r not in self.out.failures and (not f.done() or failed(f))
        ]
        dead = [r for r in maybe if not self.s.rank_alive(r)]
        # a paused process (SIGSTOP, a debugger) is alive; the controller drops its
        # engine once its heartbeat stops, which fails its future
        paused = [
            r for r in maybe if r not in dead and self.futures[r].done() and self.s.rank_paused(r)
        ]
        for r in dead:
            self._mark([r], DIED, self.s.rank_exit(r) or "process exited")
        if paused:
            self._mark(
                paused,
                PAUSED,
                "its process is paused (stopped by SIGSTOP or a debugger) and the "
                "controller dropped its engine after its heartbeat stopped",
            )
        if not dead and not paused:
            return
        gone = sorted(dead + paused)
        what = "died" if not paused else ("was paused too long" if not dead else "died or paused")
        self.out.broken = f"rank {', '.join(map(str, gone))} {what}"
        # Ranks blocked in a collective with a dead peer usually fail at once
        # ("connection to a peer was lost"); give them a moment, then end them.
        others = [r for r in self._running() if r not in gone]
        t_end = time.monotonic() + self.policy.failure_grace
        while others and time.monotonic() < t_end:
            self._wait(others, 0.1)
            others = self._running()
        self._end(others, f"peer rank(s) {gone} {what}")
        if paused:  # a stopped process ignores everything but SIGKILL
            self.s.kill_ranks(paused, signal.SIGKILL)

    def _check_deadlock(self) -> None:
        """Every running rank's last collective is a receive from another running rank,
        and none moves (no new collective, its main thread at the same instruction) for
        ``deadlock_grace``: nothing can ever arrive."""
        running = self._running()
        if len(running) < 2 or len(running) != len(self.futures):
            self._recv_wait = None
            return
        waits = {}
        for r in running:
            recs = self._cell_records(r)
            where = self._record(r).get("main_frame")
            if not recs or recs[-1].op not in _RECV or not where:
                self._recv_wait = None
                return
            waits[r] = (recs[-1].seq, recs[-1].peer, where)
        if any(peer not in waits for _, peer, _ in waits.values()):
            self._recv_wait = None
            return
        for r, (_, peer, _) in waits.items():
            # a receive whose message the peer already sent completes: not a deadlock
            got = int(self._record(r).get("recvd", {}).get(str(peer), 0))
            sent = int(self._record(peer).get("sent", {}).get(str(r), 0))
            if sent >= got:
                self._recv_wait = None
                return
        now = time.monotonic()
        if self._recv_wait is None:
            self._recv_wait = (waits, now)
            return
        before, since = self._recv_wait
        same = all(before.get(r) == w for r, w in waits.items())
        if not same:
            self._recv_wait = (waits, now)
            return
        if now - since < self.policy.deadlock_grace:
            return
        cycle = ", ".join(f"rank {r} waits in recv from rank {w[1]}" for r, w in waits.items())
        self._end(running, f"deadlock: {cycle}; nothing can arrive")

    # -- failures while others run ------------------------------------------------
    def _handle_failure(self, pending: list[int]) -> bool:
        """React to ranks that failed while others still run; True when done."""
        if self._mismatch is not None:
            return False  # the ranks' collectives differ: _check_mismatch ends them
        if self._settlers and time.monotonic() >= self._settlers[1]:
            late, self._settlers = [r for r in pending if r in self._settlers[0]], None
            for r in late:  # it did not reply: say what its cell failed with
                error = self.s.rank_record(r).get("settling_after") or "an error"
                self._end([r], f"its cell failed ({error}); ended while it evaluated the "
                               "collectives it had left unevaluated")
            if late:
                return not self._running()
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
        stuck = [r for r in pending if self._in_collective(r)]
        if self._settlers and time.monotonic() < self._settlers[1]:
            # a failed rank whose peers were ended (see _check_failed_settling): its
            # settle fails once MLX sees them gone, and its reply brings its error
            stuck = [r for r in stuck if r not in self._settlers[0]]
        if not stuck:
            return False  # computing, not waiting on a peer: the deadline governs
        if not self._drained:
            self._drained = True
            self._take_stacks(stuck)
            if self._drain(stuck, finished):
                return not self._running()
        self._end(stuck, "stuck in a collective after a peer failed")
        return True

    def _check_failed_settling(self, pending: list[int]) -> None:
        """A rank whose cell failed evaluates, as it ends, the collectives it left
        unevaluated, in the order it issued them; a peer still in its cell evaluates its
        own in the order its code asks (mlx-lm's generation leaves a prompt's last
        collectives for later). Each may then wait for the other forever. Once no rank
        has moved for ``settle_grace``, the peers still in their cells are ended: the
        failed rank's settle then fails and its error reaches the notebook, or it is
        ended ``drain_timeout`` later, its error taken from its status (the deadline
        would have ended both, the error unseen)."""
        records = {r: self._record(r) for r in pending}
        failing = [r for r in pending if records[r].get("settling_after")]
        others = [r for r in pending if r not in failing and self._in_collective(r)]
        if not failing or not others:
            self._settle_stall = None
            return
        # moving: a rank issues collectives, or a failed rank's settle runs one more
        counts = (*(self._cell_count(r) for r in pending),
                  *(int(records[r].get("settled", 0)) for r in failing))
        now = time.monotonic()
        if self._settle_stall is None or self._settle_stall[0] != counts:
            self._settle_stall = (counts, now)
        elif now - self._settle_stall[1] >= self.policy.settle_grace:
            self._settle_stall = None
            self._settlers = (set(failing), now + self.policy.drain_timeout)
            self._end(others, f"stuck in a collective while ranks {failing}, whose cells "
                              "failed, evaluated the collectives they had left unevaluated")

    def _in_collective(self, rank: int) -> bool:
        """Whether ``rank`` issued a collective in this cell (it may be waiting in it)."""
        return self._cell_count(rank) > 0

    def _stuck_beyond(self, pending: list[int], finished: list[int]) -> bool:
        top = max((self._cell_count(r) for r in finished), default=0)
        return any(self._cell_count(r) > top for r in pending)

    def _drain(self, stuck: list[int], finished: list[int]) -> bool:
        """Release ``stuck`` by replaying, on each finished rank, the stuck ranks'
        collectives of this cell that it did not issue; a few rounds, as long as the
        stuck ranks make progress. True when none is left waiting."""
        helpers = [r for r in finished if r not in self.out.failures and self.s.rank_alive(r)]
        replayed: dict[int, list[str]] = {}
        released = False
        settling: set[int] = set()
        released_ranks: set[int] = set()  # every rank a round released, not the last only
        issued: dict[int, int] = {}  # per helper: what it issued in this cell, replays too
        for _ in range(4):
            source = max(stuck, key=self._cell_count)
            records = self._cell_records(source)
            plan = {}
            for f in helpers:
                # a helper's status file may not show its replays yet
                have = issued[f] = max(self._cell_count(f), issued.get(f, 0))
                recs = [dict(vars(rec), from_rank=source) for rec in records if rec.index > have]
                if any(not r["group_index"] and not r["trace"] for r in recs):
                    return False  # over a subgroup: a replay over the world cannot match it
                # the status file keeps the last records only: a gap cannot be replayed
                if recs and recs[0]["index"] == have + 1:
                    plan[f] = recs
            if not plan:
                break
            before = max(self._cell_count(r) for r in stuck)
            settling |= {r for r in stuck if self.s.rank_record(r).get("settling")}
            released_ranks |= set(stuck)
            self.out.drained = True
            done, blocked = self.s.drain_ranks(plan, self.policy.drain_timeout)
            for r, lines in done.items():
                replayed.setdefault(r, []).extend(lines)
            for f, recs in plan.items():
                issued[f] += len(recs)
            if blocked:
                self._end(blocked, "blocked replaying a collective for a stuck peer")
                return False
            t_end = time.monotonic() + self.policy.drain_timeout
            replayed_to = max(issued.values())
            while self._running() and time.monotonic() < t_end:
                self._wait(self._running(), 0.1)
                if any(self._cell_count(r) > replayed_to for r in self._running()):
                    break  # released, it ran on into a collective no helper issued
            if not self._running():
                released = True
                break
            stuck = self._running()
            if max(self._cell_count(r) for r in stuck) <= before:
                break  # no progress: it waits in something the records do not show
            # it ran on (a loop: a generation issues its collectives token by token):
            # stop it at its next line once the next round releases it, or it would
            # issue more for as long as it runs (local ranks: a signal sent over ssh may
            # land seconds later, in a cell nobody interrupted)
            self.s.kill_ranks(stuck, signal.SIGINT, local_only=True)
        if not released:
            return False
        self.out.valid = False
        self.out.needs_alignment = True
        done = _runs({line for lines in replayed.values() for line in lines})
        stuck = sorted(released_ranks)
        for r in stuck:
            self.out.failures.setdefault(
                r,
                RankFailure(
                    rank=r,
                    cause=DRAINED,
                    evalue="released by replaying its collective on the ranks that skipped it",
                    pending=self._cell_records(r)[-3:],
                    stack=self._stacks.get(r),
                ),
            )
        self.out.summary = (
            f"Drained: ranks {stuck} were waiting in {done or 'a collective'}; "
            f"ranks {sorted(replayed)} issued it with zeros so they could return. "
            "The values computed in this cell are invalid."
        )
        if settling:
            self.out.summary += (
                f" Ranks {sorted(settling)} had left it unevaluated: a cell's collectives "
                "are evaluated when it ends, so that none can pair with a later cell's"
            )
            # stopped: the interrupt or the deadline ended the cell, not its code
            stopped = self.out.interrupted or self.out.timed_out
            self.out.summary += "." if stopped else (
                "; every rank must issue (and evaluate) the same collectives.")
        return True

    # -- deadline and interrupt ---------------------------------------------------
    def _stop(self, pending: list[int], why: str) -> None:
        """SIGINT the running ranks; drain what then waits on them; end the rest."""
        if not pending:
            return
        self.out.needs_alignment = True
        try:
            self._take_stacks(pending)  # where the deadline or the interrupt found them
            self.s.kill_ranks(pending, signal.SIGINT)
            sent = time.monotonic()
            t_end = sent + self.policy.interrupt_grace
            resend = self.policy.interrupt_resend
            while self._running() and time.monotonic() < t_end:
                self._wait(self._running(), min(0.1, resend or 0.1))
                if resend and self._running() and time.monotonic() - sent >= resend:
                    # local ranks only: a signal sent over ssh may land seconds later,
                    # held and raised in a cell nobody interrupted
                    self.s.kill_ranks(self._running(), signal.SIGINT, local_only=True)
                    sent = time.monotonic()
            still = self._running()
            finished = [r for r in self.futures if r not in still]
            stuck = [r for r in still if self._in_collective(r)]
            if still and finished and stuck == still and not self._drained:
                self._drained = True
                self._failed_at = self._failed_at or time.monotonic()
                self._drain(still, finished)
        except KeyboardInterrupt:
            pass  # a second interrupt: end them now
        still = self._running()
        self._end(still, why)
        stopped = [r for r in pending if r not in still and r not in self.out.failures]
        if stopped:
            note = f"ranks {stopped} stopped on SIGINT"
            self.out.summary = (self.out.summary + "\n" if self.out.summary else "") + note
            self.out.valid = False


def _runs(lines: set[str]) -> str:
    """Replayed collectives in order, runs of alike ones in a line: ``#20 all_sum
    shape=(1, 128)`` ... ``#35 ...`` -> ``#20-#35 all_sum shape=(1, 128) ... (16)``
    (a generation's rank waits in one a token)."""
    parsed = []
    for line in lines:
        m = re.fullmatch(r"#(\d+) (.*)", line)
        parsed.append((int(m.group(1)), m.group(2)) if m else (-1, line))
    out: list[list[Any]] = []
    for n, rest in sorted(parsed):
        if out and n >= 0 and out[-1][2] == rest and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n, rest])
    return ", ".join(
        rest if a < 0 else f"#{a} {rest}" if a == b else f"#{a}-#{b} {rest} ({b - a + 1})"
        for a, b, rest in out)


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


__all__ = ["Outcome", "Policy", "Supervisor", "DIED", "ERROR", "KILLED", "DRAINED", "PAUSED"]
