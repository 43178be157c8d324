"""The supervisor's decisions behind its ``Ranks`` protocol, with a fake session.

Real-engine tests of the same cases are in test_faults.py and
test_compound_faults.py; here the timing is ours, so each decision is checked
exactly (which rank is drained, ended, or left to the deadline, and why).
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import Future
from typing import Any

from mlx_nbdist.results import DIED, DRAINED, KILLED, PAUSED, Frame, RankStack
from mlx_nbdist.supervise import Policy, Supervisor

FAST = dict(failure_grace=0.2, drain_timeout=0.5, interrupt_grace=0.2, deadlock_grace=0.3,
            settle_grace=0.4,
            alive_every=0.02, poll=0.01, stragglers_after=0.0)


def rec(seq: int, op: str, cell: int, index: int, peer: int | None = None,
        shape: tuple[int, ...] = (4,), group_index: int = 0) -> dict[str, Any]:
    return dict(seq=seq, op=op, shape=list(shape), dtype="float32", peer=peer, nbytes=16,
                cell=cell, index=index, group_index=group_index)


class FakeRanks:
    """Ranks whose futures, status records and processes the test controls."""

    def __init__(self, n: int = 2, cell: int = 5):
        self.cell = cell
        self.futures = {r: Future() for r in range(n)}
        self.records: dict[int, dict[str, Any]] = {
            r: {"tracker_cell": cell, "cell_collectives": 0, "recent": [], "main_frame": "x:1:2"}
            for r in range(n)
        }
        self.alive = dict.fromkeys(range(n), True)
        self.paused = dict.fromkeys(range(n), False)
        self.infra = ""
        self.signals: list[tuple[list[int], int]] = []
        self.drain_plans: list[dict[int, list[dict[str, Any]]]] = []
        #: what a drain does: {rank: True (completes, releases the stuck) | False (blocks)}
        self.drain_completes: dict[int, bool] = {}
        #: each rank's stack when asked, and the ranks asked, in order
        self.stacks = {r: RankStack(r, [Frame("c.py", 3 + r, "<module>", cell="In [9]",
                                              text=f"step_{r}()")]) for r in range(n)}
        self.stacks_asked: list[list[int]] = []

    def issue(self, rank: int, op: str, peer: int | None = None, cell: int | None = None,
              shape: tuple[int, ...] = (4,), group_index: int | None = None) -> None:
        """``group_index``: its position over the whole group (0: over a subgroup);
        by default the rank's count, as a rank's tracker numbers its collectives."""
        r = self.records[rank]
        r["cell_collectives"] += 1
        if group_index is None:
            group_index = r["cell_collectives"]
        seq = len(r["recent"]) + 100
        r["recent"].append(rec(seq, op, cell or self.cell, r["cell_collectives"], peer, shape,
                               group_index))

    def finish(self, rank: int, error: BaseException | None = None) -> None:
        if error is None:
            self.futures[rank].set_result(None)
        else:
            self.futures[rank].set_exception(error)

    # -- the protocol ---------------------------------------------------------------
    def rank_alive(self, rank: int) -> bool:
        return self.alive[rank]

    def rank_paused(self, rank: int) -> bool:
        return self.paused[rank]

    def rank_exit(self, rank: int) -> str:
        return "killed by SIGKILL (signal 9)" if not self.alive[rank] else ""

    def rank_record(self, rank: int) -> dict[str, Any]:
        return self.records[rank]

    def kill_ranks(self, ranks: list[int], sig: int, *, local_only: bool = False) -> None:
        self.signals.append((list(ranks), sig))
        if sig == signal.SIGKILL:
            for r in ranks:
                self.alive[r] = False
                if not self.futures[r].done():
                    self.futures[r].set_exception(RuntimeError("killed"))

    def drain_ranks(self, plan, timeout):
        self.drain_plans.append(plan)
        blocked = [r for r in plan if not self.drain_completes.get(r, True)]
        if not blocked:
            for f in self.futures.values():
                if not f.done():
                    f.set_result(None)  # the stuck rank returns
        return {r: ["#1 all_sum"] for r in plan if r not in blocked}, blocked

    def infrastructure_problem(self) -> str:
        return self.infra

    def rank_stacks(self, ranks: list[int]) -> dict[int, RankStack]:
        self.stacks_asked.append(list(ranks))
        return {r: self.stacks[r] for r in ranks}


def supervise(fake: FakeRanks, timeout: float | None = 10.0):
    policy = Policy(timeout=timeout, **FAST)
    return Supervisor(fake, fake.futures, policy, cell=fake.cell).wait()


def test_a_replay_that_blocks_breaks_the_group_instead_of_reporting_a_drain() -> None:
    fake = FakeRanks()
    fake.issue(0, "all_sum")
    fake.finish(1, ValueError("rank one fails"))
    fake.drain_completes[1] = False
    out = supervise(fake)
    assert fake.drain_plans and fake.drain_plans[0][1][0]["op"] == "all_sum"
    assert out.failures[1].cause == KILLED  # blocked in its replay: ended too
    assert out.failures[0].cause == KILLED
    assert out.broken and not out.needs_alignment


def test_every_rank_a_drain_released_is_marked_drained() -> None:
    # 3 ranks: rank 2 raised; rank 0 is released by the first replay round, rank 1
    # issues one more collective and is released by the second
    fake = FakeRanks(n=3)
    fake.issue(0, "all_sum")
    fake.issue(1, "all_sum")
    fake.finish(2, ValueError("rank two fails"))
    rounds = []

    def drain(plan, timeout):
        rounds.append(plan)
        if len(rounds) == 1:
            fake.finish(0)
            fake.issue(1, "all_gather")
        else:
            fake.finish(1)
        return {r: ["#"] for r in plan}, []

    fake.drain_ranks = drain  # type: ignore[method-assign]
    out = supervise(fake)
    assert len(rounds) == 2
    assert out.failures[0].cause == DRAINED and out.failures[1].cause == DRAINED


def test_a_rank_that_runs_on_after_a_release_is_stopped_at_its_next_line() -> None:
    """A user trial: a rank raised in a tensor-parallel generate; each release let its
    peer generate the next token and wait again, so 4 rounds never caught up and the
    group was ended (14.7 s). The rank that runs on gets SIGINT: released once more,
    it stops (KeyboardInterrupt at its next line)."""
    fake = FakeRanks()
    fake.issue(0, "all_sum")
    fake.finish(1, ValueError("rank one fails"))
    rounds = []

    def drain(plan, timeout):
        rounds.append(plan)
        if any(sig == signal.SIGINT for _, sig in fake.signals):
            fake.finish(0, KeyboardInterrupt())
        else:
            fake.issue(0, "all_sum")  # the next token's collective: it waits again
        return {r: [f"#{len(rounds)} all_sum shape=(4,)"] for r in plan}, []

    fake.drain_ranks = drain  # type: ignore[method-assign]
    out = supervise(fake)
    assert len(rounds) == 2 and ([0], signal.SIGINT) in fake.signals
    assert out.failures[0].cause == DRAINED and out.needs_alignment and not out.broken
    # the collectives it waited in, a run of alike ones said once
    assert "were waiting in #1-#2 all_sum shape=(4,) (2);" in out.summary, out.summary


def test_a_rank_stuck_over_a_subgroup_is_ended_and_the_failed_ranks_error_kept() -> None:
    """A re-trial (mpi, world.split): the drain replayed a subgroup's all_sum over the
    world, blocked, and the failed rank was ended too: its error was shown nowhere."""
    fake = FakeRanks()
    fake.issue(0, "all_sum", group_index=0)
    fake.finish(1, ValueError("rank one fails"))
    out = supervise(fake)
    assert fake.drain_plans == [] and fake.signals == [([0], signal.SIGKILL)]
    assert out.failures[0].cause == KILLED and 1 not in out.failures


def test_a_completed_drain_must_still_be_proven_in_step() -> None:
    fake = FakeRanks()
    fake.issue(0, "all_sum")
    fake.finish(1, ValueError("rank one fails"))
    out = supervise(fake)
    assert out.failures[0].cause == DRAINED
    assert out.needs_alignment and not out.valid and not out.broken


def test_the_replay_plan_is_what_each_finished_rank_has_not_issued_in_this_cell() -> None:
    fake = FakeRanks()
    for op in ("all_sum", "all_gather", "all_sum"):
        fake.issue(0, op)
    fake.issue(1, "all_sum")  # rank 1 issued the first one, then raised
    fake.finish(1, ValueError("fails"))
    supervise(fake)
    assert [d["op"] for d in fake.drain_plans[0][1]] == ["all_gather", "all_sum"]
    assert [d["index"] for d in fake.drain_plans[0][1]] == [2, 3]


def test_counts_of_earlier_cells_do_not_make_a_slow_rank_stuck() -> None:
    fake = FakeRanks()
    fake.records[0]["recent"] = [rec(s, "all_sum", 4, s) for s in range(1, 4)]  # old cell
    fake.issue(0, "all_sum")
    fake.issue(1, "all_sum")
    fake.finish(1)
    threading.Timer(1.0, fake.finish, (0,)).start()  # rank 0 computes for 1 s
    out = supervise(fake)
    assert not fake.drain_plans and not out.failures and out.valid


def test_messages_name_only_this_cells_collectives() -> None:
    fake = FakeRanks()
    fake.records[1]["recent"] = [rec(7, "all_sum", 4, 1)]  # from the previous cell
    fake.finish(0)
    out = supervise(fake, timeout=0.3)  # rank 1 spins in Python; SIGINT does not stop it
    assert out.timed_out and out.failures[1].pending == []


def test_deadline_sends_sigint_before_sigkill() -> None:
    fake = FakeRanks()
    fake.finish(0)
    supervise(fake, timeout=0.2)
    assert [sig for _, sig in fake.signals] == [signal.SIGINT, signal.SIGKILL]


def test_sigint_is_sent_again_to_ranks_still_running_until_they_stop() -> None:
    # a SIGINT that reached a rank before it took the cell's request is lost: the
    # third one stops rank 1 here; rank 0 stopped on the first and gets no more
    fake = FakeRanks()
    kill = fake.kill_ranks

    def kill_ranks(ranks, sig, local_only=False):
        kill(ranks, sig)
        if sig == signal.SIGINT:
            if 0 in ranks and not fake.futures[0].done():
                fake.finish(0, KeyboardInterrupt())
            if len([s for s in fake.signals if 1 in s[0]]) == 3:
                fake.finish(1, KeyboardInterrupt())

    fake.kill_ranks = kill_ranks  # type: ignore[method-assign]
    policy = Policy(timeout=0.1, **{**FAST, "interrupt_grace": 5.0, "interrupt_resend": 0.1})
    out = Supervisor(fake, fake.futures, policy, cell=fake.cell).wait()
    assert fake.signals == [([0, 1], signal.SIGINT), ([1], signal.SIGINT), ([1], signal.SIGINT)]
    assert out.timed_out and not out.failures and not out.broken


def test_the_deadline_takes_stuck_ranks_stacks_once_before_any_signal() -> None:
    fake = FakeRanks(n=3)
    fake.finish(0)
    signals_when_asked = []
    ask = fake.rank_stacks

    def rank_stacks(ranks):
        signals_when_asked.append(len(fake.signals))
        return ask(ranks)

    fake.rank_stacks = rank_stacks  # type: ignore[method-assign]
    out = supervise(fake, timeout=0.2)
    assert fake.stacks_asked == [[1, 2]] and signals_when_asked == [0]
    assert out.failures[1].stack is fake.stacks[1]
    assert "at In [9], line 5, in <module>: step_2()" in out.failures[2].headline()


def test_drained_ranks_carry_where_they_were_stuck() -> None:
    fake = FakeRanks()
    fake.issue(0, "all_sum")
    fake.finish(1, ValueError("rank one fails"))
    out = supervise(fake)
    assert fake.stacks_asked == [[0]]  # the failed rank is not asked
    assert out.failures[0].cause == DRAINED and out.failures[0].stack is fake.stacks[0]


def test_a_failure_to_take_stacks_does_not_fail_the_cell_differently() -> None:
    fake = FakeRanks()
    fake.finish(0)

    def broken(ranks):
        raise OSError("no stack file")

    fake.rank_stacks = broken  # type: ignore[method-assign]
    out = supervise(fake, timeout=0.2)
    assert out.timed_out and out.failures[1].cause == KILLED and out.failures[1].stack is None


def test_receivers_waiting_on_each_other_are_a_deadlock() -> None:
    fake = FakeRanks()
    fake.issue(0, "recv", peer=1)
    fake.issue(1, "recv", peer=0)
    for r in (0, 1):
        fake.records[r]["recvd"] = {str(1 - r): 1}
    out = supervise(fake, timeout=30)
    assert "deadlock" in out.broken
    assert {f.cause for f in out.failures.values()} == {KILLED}


def test_receivers_whose_messages_were_sent_are_computing_not_deadlocked() -> None:
    # each rank sent to the other before its recv: the recvs complete, then both
    # compute for longer than the deadlock grace in one mx.eval
    fake = FakeRanks()
    for r in (0, 1):
        fake.issue(r, "send", peer=1 - r)
        fake.issue(r, "recv", peer=1 - r)
        fake.records[r]["sent"] = {str(1 - r): 1}
        fake.records[r]["recvd"] = {str(1 - r): 1}
    out = supervise(fake, timeout=1.0)
    assert out.timed_out and "deadlock" not in out.broken


def test_a_rank_that_moves_is_not_a_deadlock() -> None:
    fake = FakeRanks()
    fake.issue(0, "recv", peer=1)
    fake.issue(1, "recv", peer=0)
    stop = threading.Event()

    def move() -> None:
        i = 0
        while not stop.wait(0.05):
            i += 1
            fake.records[0]["main_frame"] = f"x:1:{i}"

    threading.Thread(target=move, daemon=True).start()
    try:
        out = supervise(fake, timeout=1.0)
    finally:
        stop.set()
    assert out.timed_out and "deadlock" not in out.broken


def test_a_paused_rank_dropped_by_the_controller_is_paused_not_dead() -> None:
    fake = FakeRanks()
    fake.issue(0, "all_sum")
    fake.paused[1] = True
    fake.finish(1, RuntimeError("EngineError: engine died"))
    out = supervise(fake)
    assert out.failures[1].cause == PAUSED
    assert out.failures[0].cause == KILLED
    assert ([1], signal.SIGKILL) in fake.signals  # the stopped process is ended too
    assert "paused" in out.broken


def test_a_dead_rank_says_how_it_ended() -> None:
    fake = FakeRanks()
    fake.alive[1] = False
    out = supervise(fake)
    assert out.failures[1].cause == DIED and "SIGKILL" in out.failures[1].evalue
    assert out.broken


def test_controller_death_ends_the_cell() -> None:
    fake = FakeRanks()
    fake.infra = "the ipyparallel controller (pid 5) exited; results cannot reach the notebook"
    out = supervise(fake)
    assert out.broken == fake.infra
    assert set(out.failures) == {0, 1}


def test_while_output_flows_the_loop_wakes_finely_for_held_back_updates() -> None:
    """After output woke the loop, it waits at most FLUSH_POLL (the live view shows a
    throttled update when its interval ends, not up to a poll later); with no output,
    it waits the whole poll."""
    import time

    from mlx_nbdist.supervise import FLUSH_POLL, FLUSH_WINDOW

    fake = FakeRanks()
    wake = threading.Event()
    sv = Supervisor(fake, fake.futures, Policy(timeout=10.0, **FAST), cell=fake.cell, wake=wake)
    t0 = time.monotonic()
    sv._wait([0, 1], 0.2)
    assert time.monotonic() - t0 >= 0.19  # quiet: the whole poll
    wake.set()  # output arrived
    sv._wait([0, 1], 0.2)
    t0 = time.monotonic()
    sv._wait([0, 1], 0.2)
    assert time.monotonic() - t0 < 0.1  # output flowing: FLUSH_POLL, not the poll
    assert FLUSH_POLL < 0.02 < FLUSH_WINDOW
    for f in fake.futures.values():
        f.set_result(None)


def test_a_rank_left_waiting_by_a_different_collective_is_ended_naming_both() -> None:
    """Rank 0's first all_sum was of 4 floats and it finished; rank 1's is of 6 and it
    does not move: ended once it has not moved for failure_grace, not at the deadline."""
    fake = FakeRanks()
    fake.issue(0, "all_sum", shape=(4,), group_index=1)
    fake.issue(1, "all_sum", shape=(6,), group_index=1)
    fake.finish(0)
    out = supervise(fake, timeout=30.0)
    assert out.failures[1].cause == KILLED and 0 not in out.failures
    assert not out.valid and not out.timed_out
    assert out.broken.startswith("collective 1 of this cell differs between the ranks "
                                 "(rank 0: all_sum shape=(4,) dtype=float32; rank 1: all_sum "
                                 "shape=(6,) dtype=float32)")
    assert not fake.drain_plans  # nothing to replay: the collective itself differs


def test_ranks_whose_collectives_differ_but_still_move_are_left_to_finish() -> None:
    """The collectives differ (the cell will fail on its ledgers) but both ranks keep
    issuing: they may pair up and return, so nobody is ended while they move."""
    fake = FakeRanks()
    fake.issue(0, "all_sum", shape=(4,), group_index=1)
    fake.issue(1, "all_sum", shape=(6,), group_index=1)

    def move() -> None:
        for k in range(2, 12):
            for r in (0, 1):
                fake.issue(r, "all_sum", group_index=k)
            threading.Event().wait(0.1)
        fake.finish(0)
        fake.finish(1)

    mover = threading.Thread(target=move)
    mover.start()
    out = supervise(fake, timeout=30.0)
    mover.join()
    assert out.failures == {} and not out.broken
    assert not any(sig == signal.SIGKILL for _, sig in fake.signals)


def test_a_mismatch_is_named_even_when_a_rank_raised() -> None:
    fake = FakeRanks()
    fake.issue(0, "all_gather", shape=(2, 3), group_index=1)
    fake.issue(1, "all_sum", shape=(2, 3), group_index=1)
    fake.finish(0, ValueError("rank zero fails after it"))
    out = supervise(fake, timeout=30.0)
    assert out.failures[1].cause == KILLED
    assert "rank 0: all_gather shape=(2, 3)" in out.broken
    assert "rank 1: all_sum shape=(2, 3)" in out.broken


def test_peers_of_a_failed_rank_stuck_settling_are_ended_and_it_is_left_to_reply() -> None:
    fake = FakeRanks()
    fake.issue(0, "recv", peer=1)
    fake.issue(1, "all_gather")
    fake.records[1]["settling"] = [rec(101, "all_gather", fake.cell, 1)]
    fake.records[1]["settling_after"] = "RuntimeError"

    def kill(ranks, sig, local_only=False):
        fake.signals.append((list(ranks), sig))
        if sig == signal.SIGKILL:
            for r in ranks:
                fake.alive[r] = False
                fake.futures[r].set_exception(RuntimeError("killed"))
            fake.finish(1, RuntimeError("the sampler fails"))  # its settle fails at once

    fake.kill_ranks = kill  # type: ignore[method-assign]
    out = supervise(fake, timeout=5.0)
    assert fake.signals == [([0], signal.SIGKILL)]
    assert out.failures[0].cause == KILLED and "whose cells failed" in out.failures[0].evalue
    assert 1 not in out.failures and not out.timed_out


def test_a_drain_after_a_deadline_does_not_blame_the_cells_code_for_what_it_settled() -> None:
    """A re-trial: an interrupted generation's drain said the ranks 'must issue (and
    evaluate) the same collectives': the interrupt ended the cell, not its code."""
    for timeout in (0.3, None):
        fake = FakeRanks()
        fake.issue(0, "all_sum")
        fake.records[0]["settling"] = [rec(101, "all_sum", fake.cell, 1)]
        if timeout:  # rank 1 runs past the deadline, takes SIGINT, is done; 0 waits
            def kill(ranks, sig, local_only=False, fake=fake):
                fake.signals.append((list(ranks), sig))
                if sig == signal.SIGINT and not fake.futures[1].done():
                    fake.finish(1, KeyboardInterrupt())

            fake.kill_ranks = kill  # type: ignore[method-assign]
        else:
            fake.finish(1, ValueError("rank one fails"))
        out = supervise(fake, timeout=timeout)
        assert "had left it unevaluated" in out.summary, out.summary
        assert ("must issue (and evaluate)" in out.summary) == (timeout is None), out.summary
