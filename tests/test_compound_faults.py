"""Compound faults on a real 2-rank MLX ring: the numbers a cell shows are right, or
the cell fails; the session never says "ready" on a guess (issue #12).

Each test reproduces a case in which an earlier version printed wrong values or
claimed a usable session, and checks the value the *next* cell computes.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import psutil
import pytest

from mlx_nbdist import CellError, CollectiveTimeout, Session, SessionBrokenError
from mlx_nbdist.results import DRAINED, ERROR, KILLED, PAUSED

from .conftest import wait_gone
from .test_faults import assert_works


def _usable_or_broken(s: Session) -> None:
    """After a fault: a session that says ready computes right values; else it says
    broken with a reason, and a restart brings it back."""
    if s.state == "ready":
        assert_works(s)
    else:
        assert s.state == "broken" and s.broken_reason
        with pytest.raises(SessionBrokenError, match="restart"):
            s.run("1")
        s.restart()
        assert_works(s)


TP_SETUP = """
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
mx.random.seed(0)
up = shard_linear(nn.Linear(8, 16), "all-to-sharded", group=world)
down = shard_linear(nn.Linear(16, 8), "sharded-to-all", group=world)
model = nn.Sequential(up, nn.ReLU(), down)
x = mx.random.normal((4, 8), key=mx.random.key(1))
def loss_fn(m, x):
    return (m(x) ** 2).mean()
"""


def test_tp_step_where_one_rank_raises_never_leaves_a_wrong_session(fresh2: Session) -> None:
    # item 1: forward and backward collectives (the backward ones are MLX's own,
    # invisible to the tracker); rank 1 raises before the step
    fresh2.run(TP_SETUP)
    step = (
        "if rank == 1:\n    raise RuntimeError('rank one fails')\n"
        "loss, grads = nn.value_and_grad(model, loss_fn)(model, x)\n"
        "mx.eval(loss, grads)"
    )
    with pytest.raises(CellError) as info:
        fresh2.run(step, timeout=60)
    assert info.value.result.ranks[1].status == ERROR
    assert not info.value.result.valid
    text = str(info.value)
    assert ("in step" in text) or ("broken" in text)
    _usable_or_broken(fresh2)


def test_unevaluated_collective_on_one_rank_cannot_corrupt_later_cells(fresh2: Session) -> None:
    # item 2: rank 0 creates an all_sum it never evaluates
    with pytest.raises(CellError) as info:
        fresh2.run(
            "if rank == 0:\n    z = mx.distributed.all_sum(mx.ones(4) * 10, group=world)",
            timeout=30,
        )
    assert info.value.result.ranks[0].status == DRAINED
    assert "all_sum shape=(4,)" in str(info.value)
    assert fresh2.state == "ready"
    # a valid cell with a slow rank is not taken for a stuck one
    r = fresh2.run(
        "import time\ny = mx.distributed.all_sum(mx.ones(3) * (rank + 1), group=world)\n"
        "mx.eval(y)\nif rank == 0:\n    time.sleep(4)\nprint(y.tolist())",
        timeout=30,
    )
    assert [r.stdout(k).strip() for k in (0, 1)] == ["[3.0, 3.0, 3.0]"] * 2
    assert r.valid
    # the held array, evaluated later on rank 0 only, has its old (settled) value
    r = fresh2.run("if rank == 0:\n    print(z.tolist())", timeout=30)
    assert r.stdout(0).strip() == "[10.0, 10.0, 10.0, 10.0]"
    assert_works(fresh2)


def test_unmatched_send_is_dropped_not_read_by_the_next_cell(fresh2: Session) -> None:
    # item 3: rank 0 sends 7s; rank 1 raises before its recv
    code = (
        "if rank == 0:\n    mx.eval(mx.distributed.send(mx.full((4,), 7.0), 1, group=world))\n"
        "else:\n    raise ValueError('no recv')"
    )
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=30)
    text = str(info.value)
    assert "never received" in text and "dropped" in text
    assert fresh2.state == "ready"
    r = fresh2.run(
        "if rank == 0:\n    mx.eval(mx.distributed.send(mx.ones(4), 1, group=world))\n"
        "else:\n    print(mx.distributed.recv((4,), mx.float32, 0, group=world).tolist())",
        timeout=30,
    )
    assert r.stdout(1).strip() == "[1.0, 1.0, 1.0, 1.0]"
    assert_works(fresh2)


def test_unmatched_send_in_a_cell_that_succeeds_fails_the_cell(fresh2: Session) -> None:
    code = "if rank == 0:\n    mx.eval(mx.distributed.send(mx.full((4,), 7.0), 1, group=world))"
    with pytest.raises(CellError, match="never received"):
        fresh2.run(code, timeout=30)
    r = fresh2.run(
        "if rank == 0:\n    mx.eval(mx.distributed.send(mx.ones(4) * 2, 1, group=world))\n"
        "else:\n    print(mx.distributed.recv((4,), mx.float32, 0, group=world).tolist())",
        timeout=30,
    )
    assert r.stdout(1).strip() == "[2.0, 2.0, 2.0, 2.0]"


def test_bool_collectives_and_messages_a_peer_left_are_drained_and_dropped(
        fresh2: Session) -> None:
    """Replays and drops looked MLX's dtype up by its name, which for ``bool`` is
    ``bool_``: a float32 case left the session ready, a bool one broke it."""
    with pytest.raises(CellError) as info:
        fresh2.run("if rank == 1:\n    raise ValueError('no sum')\n"
                   "mx.eval(mx.distributed.all_sum(mx.array([True, False]), group=world))",
                   timeout=30)
    assert "Drained" in info.value.summary, info.value.summary
    assert fresh2.state == "ready"
    with pytest.raises(CellError) as info:
        fresh2.run("if rank == 0:\n"
                   "    mx.eval(mx.distributed.send(mx.array([True, True]), 1, group=world))\n"
                   "else:\n    raise ValueError('no recv')", timeout=30)
    assert "never received" in str(info.value) and "dropped" in str(info.value)
    assert fresh2.state == "ready"
    r = fresh2.run(
        "if rank == 0:\n    mx.eval(mx.distributed.send(mx.array([False, True]), 1, group=world))\n"
        "else:\n    print(mx.distributed.recv((2,), mx.bool_, 0, group=world).tolist())",
        timeout=30)
    assert r.stdout(1).strip() == "[False, True]"  # not the dropped message
    assert_works(fresh2)


def test_run_from_two_threads_is_serialised(session2: Session) -> None:
    # item 4: two cells at once never pair one's all_sum with the other's
    errors: list[str] = []

    def cell(value: int) -> None:
        for _ in range(4):
            r = session2.run(
                f"print(mx.distributed.all_sum(mx.array([{value}.0]), group=world).item())",
                timeout=60,
            )
            got = {r.stdout(k).strip() for k in (0, 1)}
            if got != {str(2.0 * value)}:
                errors.append(f"cell of {value}: {got}")

    threads = [threading.Thread(target=cell, args=(v,)) for v in (1, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_check_collectives_compares_every_dimension_and_dtype(session2: Session) -> None:
    # item 5: a mismatch in the 9th dimension, 9 vs 10 dims, dtypes
    code = (
        "shape = (1,) * 8 + ((2,) if rank == 0 else (3,))\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(shape), group=world))"
    )
    with pytest.raises(CellError) as info:
        session2.run(code, check_collectives=True, timeout=30)
    for f in info.value.failures:
        assert f.ename == "CollectiveError"
        assert "rank 0: all_sum shape=(1, 1, 1, 1, 1, 1, 1, 1, 2)" in f.evalue
        assert "rank 1: all_sum shape=(1, 1, 1, 1, 1, 1, 1, 1, 3)" in f.evalue
    code = (
        "shape = (1,) * (9 if rank == 0 else 10)\n"
        "dt = mx.float16 if rank == 0 else mx.bfloat16\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(shape, dtype=dt), group=world))"
    )
    with pytest.raises(CellError) as info:
        session2.run(code, check_collectives=True, timeout=30)
    evalue = info.value.failures[0].evalue
    assert f"rank 0: all_sum shape={(1,) * 9} dtype=float16" in evalue
    assert f"rank 1: all_sum shape={(1,) * 10} dtype=bfloat16" in evalue
    assert session2.state == "ready"
    assert_works(session2)


def test_check_collectives_with_a_value_read_between_collectives_says_so(
        session2: Session) -> None:
    """A reviewer's case: rank 0 reads ``a`` before ``b`` is issued, so its ``a`` runs
    with rank 1's check of ``b``. The check took rank 0's tagged data for a signature
    and every rank failed with a bare MemoryError (a shape of 10**18 dimensions)."""
    code = ("a = mx.distributed.all_sum(mx.ones(4) * (rank + 1), group=world)\n"
            "if rank == 0:\n    print('peek', a.tolist())\n"
            "b = mx.distributed.all_sum(mx.ones(4) * 10 * (rank + 1), group=world)\n"
            "mx.eval(a, b)")
    with pytest.raises(CellError) as info:
        session2.run(code, check_collectives=True, timeout=60)
    names = {f.ename for f in info.value.failures}
    assert "MemoryError" not in names and "CollectiveError" in names, names
    assert "ran their collectives in different orders" in str(info.value)
    _usable_or_broken(session2)


def test_check_collectives_with_a_rank_that_raises_is_drained_fast(fresh2: Session) -> None:
    # item 8: the signature all_gather is tracked, so the waiting rank is released
    code = "if rank == 1:\n    raise RuntimeError('fails')\nmx.eval(mx.distributed.all_sum(mx.ones(5), group=world))"
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, check_collectives=True, timeout=60)
    assert time.monotonic() - t0 < 15
    assert info.value.result.ranks[0].status in (DRAINED, ERROR)
    assert "did not issue it" in str(info.value) or "Drained" in str(info.value)
    _usable_or_broken(fresh2)


def test_dead_rank_marks_the_session_broken_everywhere(fresh2: Session) -> None:
    # item 7: status, start and the error all say so
    with pytest.raises(CellError) as info:
        fresh2.run("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(1)", timeout=30)
    rendered = "\n".join(info.value._render_traceback_())
    assert "restart" in rendered
    assert "died while running task" not in rendered  # no ipyparallel internals
    assert "[rank 1] engine process died (exit code 3)" in rendered
    assert fresh2.state == "broken"
    assert fresh2.status().state == "broken"
    fresh2.start()  # does not claim a working group
    assert fresh2.state == "broken"


def test_rank_killed_between_cells_shows_in_status(fresh2: Session) -> None:
    os.kill(fresh2.ranks[1].pid, signal.SIGKILL)
    assert wait_gone([fresh2.ranks[1].pid]) == []
    st = fresh2.status()
    assert st.state == "broken" and "rank 1" in st.broken_reason
    assert "SIGKILL" in st.broken_reason


def test_interrupt_during_restart_leaves_a_stopped_session() -> None:
    # no spare: a restart onto warm engines takes ~0.3 s and could end before the alarm
    # (it did, once the spare was ready in time); a cold one starts processes, > 1 s
    s = Session(2, timeout=60, spare=False).start()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(KeyboardInterrupt):
                s.restart()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert s.state == "stopped"
        s.start()
        assert_works(s)
    finally:
        s.stop()


def test_paused_rank_is_not_called_dead_and_nothing_is_left(fresh2: Session) -> None:
    # item 9: SIGSTOP for longer than the controller's heartbeat allows
    victim = fresh2.ranks[1].pid
    threading.Timer(0.5, os.kill, (victim, signal.SIGSTOP)).start()
    try:
        with pytest.raises(CellError) as info:
            fresh2.run(
                "import time\ntime.sleep(2)\nmx.eval(mx.distributed.all_sum(mx.ones(2), group=world))",
                timeout=60,
            )
        statuses = {r: o.status for r, o in info.value.result.ranks.items()}
        assert statuses[1] == PAUSED, statuses
        assert "paused" in str(info.value)
        assert fresh2.state == "broken"
        fresh2.stop()
        assert wait_gone([victim]) == []  # the stopped process is ended too
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except OSError:
            pass


def test_failure_names_only_this_cells_collective(fresh2: Session) -> None:
    # item 10: cell 1 has an all_sum; cell 2 spins in Python until the deadline
    fresh2.run("mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))")
    with pytest.raises(CollectiveTimeout) as info:
        fresh2.run("if rank == 1:\n    while True:\n        pass", timeout=2)
    rendered = "\n".join(info.value._render_traceback_())
    assert "all_sum" not in rendered
    # SIGINT stopped the spinning rank: the group needs no restart
    assert info.value.result.ranks[1].failure.ename == "KeyboardInterrupt"
    assert fresh2.state == "ready"
    assert_works(fresh2)


def test_scheduler_death_is_noticed(fresh2: Session) -> None:
    # item 11: a controller scheduler dies while a cell runs
    controller = psutil.Process(fresh2.cluster.controller_pid())
    scheduler = controller.children()[0]
    threading.Timer(1.0, scheduler.kill).start()
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run("import time\ntime.sleep(5)\nprint('done')", timeout=60)
    assert time.monotonic() - t0 < 15
    assert "scheduler" in str(info.value) and "exited" in str(info.value)
    assert fresh2.state == "broken"


def test_both_ranks_in_recv_end_at_once(fresh2: Session) -> None:
    # item 12: a visible deadlock does not wait for the deadline
    code = "peer = 1 - rank\nmx.eval(mx.distributed.recv((4,), mx.float32, peer, group=world))"
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=120)
    assert time.monotonic() - t0 < 20
    assert "deadlock" in str(info.value)
    assert {o.status for o in info.value.result.ranks.values()} == {KILLED}
    fresh2.restart()
    assert_works(fresh2)


def test_singleton_session_ignores_a_left_over_mlx_launch_environment(monkeypatch) -> None:
    # item 13: MLX_HOSTFILE/MLX_RANK left in the notebook's environment
    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    monkeypatch.setenv("MLX_RANK", "1")
    with Session(1, start_timeout=60) as s:
        r = s.run("print(size, mx.distributed.all_sum(mx.ones(2), group=world).tolist())")
        assert r.stdout(0).strip() == "1 [1.0, 1.0]"


@pytest.mark.parametrize("bad", [-5, 0, math.nan, math.inf, "3"])
def test_bad_timeouts_are_refused_before_anything_runs(session2: Session, bad) -> None:
    with pytest.raises(ValueError, match="timeout"):
        session2.run("print(rank)", timeout=bad)
    assert session2.state == "ready"
    with pytest.raises(ValueError, match="timeout"):
        Session(2, timeout=bad)


def test_a_failing_display_formatter_warns_as_ipython_does(session2: Session) -> None:
    # item 16: the cell ran; only its value's HTML form failed
    from mlx_nbdist.session import DisplayWarning

    code = "class A:\n    def _repr_html_(self):\n        raise ValueError('bad html')\nA()"
    with pytest.warns(DisplayWarning) as caught:
        r = session2.run(code, timeout=30)
    # one warning per rank, each naming its rank
    assert sorted(str(w.message) for w in caught) == [
        f"rank {k}: showing the cell's result failed (ValueError: bad html)" for k in (0, 1)]
    assert r.ok and r.ranks[0].result["text/plain"].startswith("<__main__.A")


def test_a_cell_that_catches_the_interrupt_still_reports_it(fresh2: Session) -> None:
    # review: ranks that swallow KeyboardInterrupt end "ok", at different points
    code = (
        "import time\ntry:\n    for i in range(600):\n        time.sleep(0.1)\n"
        "except KeyboardInterrupt:\n    print('stopped at', i)\n"
    )
    from mlx_nbdist import CellInterrupted

    from .test_faults import _interrupt_after, _no_interrupt

    old = _interrupt_after(1.5)
    try:
        with pytest.raises(CellInterrupted) as info:
            fresh2.run(code, timeout=60)
    finally:
        _no_interrupt(old)
    assert fresh2.state == "ready"
    # no rank raised: the headline says what happened, not "0 of 2 ranks failed"
    assert str(info.value).splitlines()[0] == (
        "the cell was interrupted; no rank raised (each finished or caught it)"), str(info.value)


def test_ledgers_of_messages_only_ranks_agree_with_idle_ranks() -> None:
    from mlx_nbdist.outcomes import check_ledgers

    led = {
        0: {"n": 1, "digest": "none", "sent": {"1": [[16, "float32", [4], 0]]}, "recvd": {}},
        1: {"n": 1, "digest": "none", "sent": {}, "recvd": {"0": [[16, "float32", [4], 0]]}},
    }
    assert check_ledgers(led, [0, 1, 2], 3).problems == []
    led[1]["recvd"]["0"][0][3] = 1  # received after a collective the sender had not issued
    assert "different order" in check_ledgers(led, [0, 1, 2], 3).problems[0]


def test_a_message_of_another_size_is_the_cause_not_the_tag_read_after_it() -> None:
    """A re-trial: float32 (2,) sent, float16 (2,) received. The first line blamed the
    ranks' evaluation order (the tag read from the rest of the stream), the sizes came
    after."""
    from mlx_nbdist.outcomes import check_ledgers

    order = [{"op": "recv", "shape": [2], "dtype": "float16", "n": 1, "peer": 0,
              "with": {}, "settled": False}]
    led = {
        0: {"n": 1, "digest": "none", "sent": {"1": [[8, "float32", [2], 0]]}, "recvd": {}},
        1: {"n": 1, "digest": "none", "sent": {}, "recvd": {"0": [[4, "float16", [2], 0]]},
            "order": order},
    }
    problems = check_ledgers(led, [0, 1], 2).problems
    assert problems and all(not p.startswith("message 1 from rank 0 to rank 1 (recv")
                            for p in problems), problems
    assert "8 bytes sent" in problems[0], problems
    # another pair's sizes differ (rank 1 to rank 0): this pair's tag still says it
    led[1]["sent"] = {"0": [[8, "float32", [2], 0]]}
    led[0]["recvd"] = {"1": [[4, "float16", [2], 0]]}
    led[1]["recvd"]["0"][0][:3] = [8, "float32", [2]]
    assert any(p.startswith("message 1 from rank 0 to rank 1 (recv") for p in
               check_ledgers(led, [0, 1], 2).problems)
    led[1]["sent"], led[0]["recvd"] = {}, {}  # and alone, the sizes agree: the tag says it
    assert check_ledgers(led, [0, 1], 2).problems[0].startswith(
        "message 1 from rank 0 to rank 1 (recv shape=(2,) dtype=float16) read another "
        "message of rank 0")


def test_a_failed_rank_settling_in_issue_order_while_its_peer_generates_ends_fast(
        fresh2: Session) -> None:
    """A user trial: a pipelined generation whose sampler raises on rank 1. Rank 1's
    cell ends and evaluates, in issue order, the collectives it left unevaluated (the
    prompt's last all_gather, which mlx-lm leaves for later); rank 0, still generating,
    waits for a message: each waited for the other until the deadline (300 s), and the
    error was never shown. Now rank 0 is ended within seconds and rank 1's error shows."""
    pytest.importorskip("mlx_lm")
    from .lm_models import LM_COMMON

    fresh2.run(LM_COMMON + "\nimport mlx_nbdist\n"
               "pp = mlx_nbdist.shard(build_lm('qwen2', num_hidden_layers=4), 'pipeline')\n")
    with pytest.raises(CellError) as info:
        fresh2.run("mlx_nbdist.generate(pp, prompt, max_tokens=100, "
                   "sampler=failing_sampler(on_rank=1, at=3))", timeout=120)
    assert info.value.result.ranks[0].status == KILLED
    text = str(info.value)
    assert "RuntimeError: the sampler fails on rank 1" in text, text  # its reply, or its status
    assert "whose cells failed, evaluated the collectives they had left unevaluated" in text
    assert not isinstance(info.value, CollectiveTimeout)
    fresh2.restart()
    assert_works(fresh2)
