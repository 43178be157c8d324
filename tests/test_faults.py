"""Fault injection: no cell can hang the notebook.

Every test injects a real fault into a real 2-rank MLX ring group and checks that
the cell ends within a bound, that the error names the rank and the cause, and that
``restart`` (when needed) gives a working group again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from mlx_nbdist import CellError, CellInterrupted, CollectiveTimeout, Session, SessionBrokenError
from mlx_nbdist.results import DIED, DRAINED, ERROR, KILLED

from .conftest import session_pids, strip_ansi, wait_gone

ALL_SUM_OK = "y = mx.distributed.all_sum(mx.ones(3) * (rank + 1), group=world); print(y.tolist())"


def assert_works(s: Session) -> None:
    r = s.run(ALL_SUM_OK, timeout=30)
    expected = [float(sum(range(1, s.n + 1)))] * 3
    for k in range(s.n):
        assert r.stdout(k).strip() == str(expected)


def test_rank_raising_before_all_sum_is_drained_and_session_survives(fresh2: Session) -> None:
    code = "if rank == 1:\n    raise RuntimeError('rank one fails')\nmx.eval(mx.distributed.all_sum(mx.ones(5), group=world))"
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=60)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.failures[0].rank == 1 and err.failures[0].cause == ERROR  # the cause first
    assert err.result.ranks[0].status == DRAINED
    assert "Drained" in err.summary and "all_sum shape=(5,)" in err.summary
    assert not err.result.valid
    assert fresh2.state == "ready"
    assert_works(fresh2)


def test_collective_issued_lazily_is_completed_when_a_rank_raises(fresh2: Session) -> None:
    # rank 1 builds the all_sum lazily and raises before evaluating it: at the end of
    # its cell it evaluates the collectives it issued, so rank 0's gets its real peer
    code = (
        "y = mx.distributed.all_sum(mx.ones(2), group=world)\n"
        "if rank == 1:\n    raise ValueError('after issuing')\n"
        "print(y.tolist())"
    )
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=60)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.result.ranks[1].status == ERROR
    assert err.result.ranks[0].status == "ok"
    assert err.result.ranks[0].stdout.strip() == "[2.0, 2.0]"  # the right sum, not zeros
    assert fresh2.state == "ready"
    assert_works(fresh2)


def test_stuck_rank_that_cannot_be_drained_is_ended_then_restart(fresh2: Session) -> None:
    # rank 0 runs a compiled all_sum three times: the tracker sees the collective once
    # (when it is traced), so replaying it releases rank 0 once and no more.
    code = (
        "step = mx.compile(lambda x: mx.distributed.all_sum(x, group=world))\n"
        "if rank == 1:\n    raise ValueError('rank one fails')\n"
        "for _ in range(3):\n    mx.eval(step(mx.ones(2)))"
    )
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=60)
    assert time.monotonic() - t0 < 25
    err = info.value
    assert err.result.ranks[1].status == ERROR
    assert err.result.ranks[0].status == KILLED
    assert "broken" in str(err) and "restart" in str(err)
    assert fresh2.state == "broken"
    with pytest.raises(SessionBrokenError, match="restart"):
        fresh2.run("1")
    old = dict(fresh2.ranks)
    fresh2.restart()
    assert sorted(fresh2.ranks) == [0, 1]
    assert {r: i.pid for r, i in fresh2.ranks.items()} != {r: i.pid for r, i in old.items()}
    assert_works(fresh2)
    assert wait_gone([i.pid for i in old.values()]) == []


def test_deadline_stops_a_sleeping_rank_with_sigint_and_drains_its_peer(fresh2: Session) -> None:
    code = "import time\nif rank == 1:\n    time.sleep(600)\nmx.eval(mx.distributed.all_sum(mx.ones((2, 3)), group=world))"
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        fresh2.run(code, timeout=3)
    assert time.monotonic() - t0 < 15
    text = str(info.value) + "\n".join(info.value._render_traceback_())
    assert "deadline of 3 s" in text and "--timeout" in text
    assert "all_sum shape=(2, 3) dtype=float32" in text
    assert info.value.result.ranks[1].failure.ename == "KeyboardInterrupt"
    assert info.value.result.ranks[0].status == DRAINED
    # where the deadline found the waiting rank: its line in this cell
    stack = info.value.result.ranks[0].failure.stack
    assert stack is not None and stack.innermost().line == 4, stack
    assert stack.innermost().text.startswith("mx.eval(mx.distributed.all_sum(")
    assert "at cell #" in text and ", line 4, in <module>: mx.eval(" in text
    assert "in step" in text and not info.value.result.valid
    assert fresh2.state == "ready"  # proven in step, not guessed
    assert_works(fresh2)


def test_deadline_ends_a_rank_that_ignores_sigint(fresh2: Session) -> None:
    code = (
        "import signal, time\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    time.sleep(600)\nmx.eval(mx.distributed.all_sum(mx.ones((2, 3)), group=world))"
    )
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        fresh2.run(code, timeout=3)
    assert time.monotonic() - t0 < 15
    assert info.value.result.ranks[1].status == KILLED
    # the rank that ignored SIGINT was ended: the error says where it was
    assert ", line 4, in <module>: time.sleep(600)" in str(info.value)
    assert fresh2.state == "broken"
    fresh2.restart()
    assert_works(fresh2)


def test_rank_that_exits_is_reported_dead(fresh2: Session) -> None:
    code = "import os\nif rank == 1:\n    os._exit(3)\nmx.eval(mx.distributed.all_sum(mx.ones(2), group=world))"
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=60)
    assert time.monotonic() - t0 < 15
    statuses = {r: o.status for r, o in info.value.result.ranks.items()}
    assert statuses[1] == DIED
    assert statuses[0] in (ERROR, KILLED)  # "connection to a peer was lost", or ended
    assert "[rank 1] engine process died" in str(info.value)
    assert fresh2.status().alive[1] is False
    assert fresh2.rank_states()[1].state == "dead"
    fresh2.restart()
    assert_works(fresh2)


def test_engine_killed_from_outside_mid_cell(fresh2: Session) -> None:
    victim = fresh2.ranks[0].pid
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(CellError) as info:
        fresh2.run("import time\ntime.sleep(120)", timeout=60)
    assert time.monotonic() - t0 < 15
    assert info.value.result.ranks[0].status == DIED
    assert fresh2.state == "broken"
    fresh2.restart()
    assert_works(fresh2)


def test_engine_killed_between_cells_is_reported_before_dispatch(fresh2: Session) -> None:
    victim = fresh2.ranks[1].pid
    os.kill(victim, signal.SIGKILL)
    t_end = time.monotonic() + 5
    while fresh2.group.rank_alive(1) and time.monotonic() < t_end:
        time.sleep(0.05)
    with pytest.raises(SessionBrokenError) as info:
        fresh2.run("print(rank)", timeout=30)
    assert f"rank 1 (pid {victim}) exited since the last cell" in str(info.value)
    assert "restart" in str(info.value)
    assert fresh2.state == "broken"
    fresh2.restart()
    assert_works(fresh2)


def _interrupt_after(seconds: float):
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return old


def _no_interrupt(old) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_where_shows_every_rank_while_a_cell_hangs(fresh2: Session) -> None:
    code = (
        "import time\ndef wait_here():\n    time.sleep(600)\n"
        "if rank == 1:\n    wait_here()\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))"
    )
    errors: list[BaseException] = []

    def cell() -> None:
        try:
            fresh2.run(code, timeout=6)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=cell)
    t.start()
    time.sleep(2.0)
    stacks = fresh2.where()  # from another thread, while the cell runs
    t.join(60)
    assert not t.is_alive() and isinstance(errors[0], CollectiveTimeout)
    r0, r1 = stacks[0].innermost(), stacks[1].innermost()
    assert r0 is not None and r0.line == 6 and "all_sum" in r0.text, stacks[0]
    # rank 1 is inside a function of the cell: both frames, innermost last
    assert [(f.func, f.line) for f in stacks[1].frames] == [("<module>", 5), ("wait_here", 3)]
    assert r1 is not None and r1.text.strip() == "time.sleep(600)"
    assert stacks[1].format().splitlines()[0].endswith(", line 3, in wait_here")
    after = fresh2.where()  # between cells: idle, and the session still works
    assert all(st.note.startswith("idle") for st in after.values()), after
    assert_works(fresh2)


def test_an_interrupt_while_ranks_start_their_cell_still_stops_it(fresh2: Session) -> None:
    # IPython catches a KeyboardInterrupt raised in a pre_run_cell callback (where a
    # rank starts its cell) and runs the cell anyway: the rank was then ended after its
    # grace (EngineError, the session broken). Held until the cell's first statement,
    # the interrupt stops the cell and the session stays usable.
    fresh2.run(
        "import time\ndef _slow_start(info):\n    time.sleep(3.0)\n"
        "get_ipython().events.register('pre_run_cell', _slow_start)"
    )
    # SIGINT after the stacks are taken (up to 1 s): still inside _slow_start
    fresh2.policy = fresh2.policy.updated({"interrupt_grace": 10.0})
    old = _interrupt_after(0.6)  # inside _slow_start, after our own callback began the cell
    try:
        with pytest.raises(CellInterrupted) as info:
            fresh2.run("import time\ntime.sleep(60)\nprint('never')", timeout=120)
    finally:
        _no_interrupt(old)
    result = info.value.result
    assert {f.ename for f in result.failures} == {"KeyboardInterrupt"}, str(info.value)
    # nothing printed: neither IPython's report of an interrupt it swallowed ("Error in
    # callback ...") nor the cell's own line
    assert [result.stdout(r) for r in (0, 1)] == ["", ""], str(info.value)
    # the traceback is the cell's own, at its first line, not mlx_nbdist's
    tb = strip_ansi("\n".join(result.failures[0].traceback))
    assert "----> 1 import time" in tb and "mlx_nbdist/engine" not in tb, tb
    assert fresh2.state == "ready"
    fresh2.run("get_ipython().events.unregister('pre_run_cell', _slow_start)")
    assert_works(fresh2)


def test_a_rank_takes_one_interrupt_a_cell_so_repeats_spare_its_cleanup(fresh2: Session) -> None:
    # SIGINT is sent again every 0.5 s while ranks run (one that arrives before a rank
    # took the request is lost); a second one must not break the cell's except block
    code = (
        "import time\ntry:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n"
        "    time.sleep(1.2)\n    print('cleaned up')\n    raise\n"
    )
    fresh2.policy = fresh2.policy.updated({"interrupt_grace": 5.0})
    old = _interrupt_after(2.0)  # well inside the try: a held one would skip it
    try:
        with pytest.raises(CellInterrupted) as info:
            fresh2.run(code, timeout=120)
    finally:
        _no_interrupt(old)
    result = info.value.result
    assert [result.stdout(r) for r in (0, 1)] == ["cleaned up\n"] * 2, str(info.value)
    assert {f.ename for f in result.failures} == {"KeyboardInterrupt"}, str(info.value)
    assert fresh2.state == "ready"
    assert_works(fresh2)


def test_an_empty_cell_run_inside_a_cell_leaves_it_interruptible(fresh2: Session) -> None:
    # IPython ends an empty cell (post_run_cell) it never began (no pre_run_cell): that
    # end must not be taken for the outer cell's, which would then ignore SIGINT
    old = _interrupt_after(1.0)
    try:
        with pytest.raises(CellInterrupted) as info:
            fresh2.run("get_ipython().run_cell('')\nimport time\ntime.sleep(60)", timeout=120)
    finally:
        _no_interrupt(old)
    assert {f.ename for f in info.value.result.failures} == {"KeyboardInterrupt"}, str(info.value)
    assert fresh2.state == "ready"
    assert fresh2.run("x = 1\n").ok and fresh2.run("").ok  # and an empty cell of its own
    assert_works(fresh2)


def test_interrupt_during_hung_collective(fresh2: Session) -> None:
    old = _interrupt_after(2)
    t0 = time.monotonic()
    try:
        with pytest.raises(CellInterrupted) as info:
            fresh2.run(
                "import time\nif rank == 1:\n    time.sleep(600)\n"
                "mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))",
                timeout=120,
            )
    finally:
        _no_interrupt(old)
    assert time.monotonic() - t0 < 10
    # the sleeping rank stops on SIGINT, the waiting one is drained, the group checked
    assert info.value.result.ranks[0].status == DRAINED
    assert "in step" in str(info.value)
    assert fresh2.state == "ready"
    assert_works(fresh2)


def test_mismatched_shapes_are_caught_with_check_collectives(session2: Session) -> None:
    code = "n = 4 if rank == 0 else 3\nmx.eval(mx.distributed.all_sum(mx.ones(n), group=world))"
    with pytest.raises(CellError) as info:
        session2.run(code, check_collectives=True, timeout=30)
    for f in info.value.failures:
        assert f.ename == "CollectiveError"
        assert "rank 0: all_sum shape=(4,)" in f.evalue and "rank 1: all_sum shape=(3,)" in f.evalue
    assert session2.state == "ready"
    assert_works(session2)


def test_mismatched_shapes_without_checks_end_the_cell_and_name_both(fresh2: Session) -> None:
    """No --check-collectives: rank 0's all_sum of 4 floats pairs with rank 1's of 6,
    returns wrong values on rank 0 and leaves rank 1 waiting; the supervisor compares
    the ranks' records while the cell runs and ends it, naming both, long before the
    deadline (before, the cell hung until it and the error named neither shape)."""
    code = (
        "n = 4 if rank == 0 else 6\n"
        "y = mx.distributed.all_sum(mx.ones(n) * (rank + 1), group=world)\nprint(y)"
    )
    with pytest.raises(CellError) as info:
        fresh2.run(code, timeout=60)
    err = info.value
    assert not isinstance(err, CollectiveTimeout)
    text = str(err)
    assert "collective 1 of this cell differs between the ranks" in text
    assert "rank 0: all_sum shape=(4,) dtype=float32" in text
    assert "rank 1: all_sum shape=(6,) dtype=float32" in text
    assert not err.result.valid
    assert fresh2.state == "broken"
    fresh2.restart()
    assert_works(fresh2)


def test_mismatched_shapes_that_both_return_are_named_after_the_cell(session2: Session) -> None:
    """Same element count, other shapes: both ranks return (wrong values); the ranks'
    ledgers differ and the error names each rank's collective."""
    code = (
        "y = mx.distributed.all_sum(mx.arange(6).reshape((2, 3) if rank == 0 else (3, 2)),"
        " group=world)\nmx.eval(y)"
    )
    with pytest.raises(CellError) as info:
        session2.run(code, timeout=60)
    text = str(info.value)
    assert "rank 0: all_sum shape=(2, 3) dtype=int32" in text
    assert "rank 1: all_sum shape=(3, 2) dtype=int32" in text
    assert not info.value.result.valid
    assert session2.state == "ready"
    assert_works(session2)


def test_a_mismatch_deep_in_a_loop_is_named_at_its_place(session2: Session) -> None:
    """The 17th of 20 all_sums differs (4 floats against 2 x 2): both return, and the
    error names that collective, not only the counts."""
    code = (
        "for i in range(20):\n"
        "    x = mx.ones((2, 2)) if (rank == 1 and i == 16) else mx.ones(4)\n"
        "    mx.eval(mx.distributed.all_sum(x, group=world))"
    )
    with pytest.raises(CellError) as info:
        session2.run(code, timeout=60)
    text = str(info.value)
    assert "collective 17 of this cell differs between the ranks" in text, text
    assert "rank 1: all_sum shape=(2, 2)" in text
    assert session2.state == "ready"


def test_kernel_death_leaves_nothing_running(tmp_path) -> None:
    """A client process killed with SIGKILL: its engines and controller go too."""
    import subprocess
    import sys

    script = tmp_path / "client.py"
    script.write_text(
        "import json, sys, time\n"
        "from mlx_nbdist import Session\n"
        "s = Session(2).start()\n"
        "print(json.dumps([p for p, _ in s.processes()]), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        pids = __import__("json").loads(line)
        assert len(pids) >= 3
        proc.kill()
        proc.wait(10)
        assert wait_gone(pids, timeout=20) == [], [psutil.Process(p).cmdline() for p in pids if psutil.pid_exists(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stale_rank_on_an_old_port_does_not_join_a_new_session(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from mlx_nbdist import runtime
    from mlx_nbdist.engine.rpc import free_ports

    ports = free_ports(["127.0.0.1"] * 2)
    hostfile = runtime.write_ring_hostfile(
        tmp_path / "old.json", [[f"127.0.0.1:{p}"] for p in ports]
    )
    env = dict(os.environ, MLX_RANK="1", MLX_HOSTFILE=str(hostfile))
    stale = subprocess.Popen(
        [sys.executable, "-c", "import mlx.core as mx; mx.distributed.init(backend='ring', strict=True)"],
        env=env,
    )
    try:
        time.sleep(1.0)
        with Session(2) as s:
            used = {int(h[0].split(":")[1]) for h in json.loads((s.directory / "hostfile.json").read_text())}
            assert ports[1] not in used  # the stale rank's port is never reused
            assert_works(s)
            assert stale.poll() is None  # still waiting on its own ring, not in ours
    finally:
        stale.kill()
        stale.wait(10)


def test_soak_many_cells_and_restarts_leak_nothing() -> None:
    me = psutil.Process()
    with Session(2) as s:
        assert_works(s)
        fds0, threads0 = me.num_fds(), me.num_threads()
        for i in range(200):
            r = s.run(f"v = mx.distributed.all_sum(mx.array([{i}.0]), group=world).item()\nv")
            assert r.ranks[1].result_text == str(2.0 * i)
        for _ in range(2):
            old = session_pids(s)
            s.restart()
            assert wait_gone(old) == []
            assert_works(s)
        assert me.num_fds() <= fds0 + 20
        assert me.num_threads() <= threads0 + 4


def test_interpreter_exit_without_stop_leaves_nothing(tmp_path) -> None:
    """A script that starts a session and simply ends: atexit stops the session."""
    import json
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import json\n"
        "from mlx_nbdist import Session\n"
        "s = Session(2).start()\n"
        "s.run('mx.eval(mx.distributed.all_sum(mx.ones(1), group=world))')\n"
        "print(json.dumps([p for p, _ in s.processes()]), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) >= 3
    assert wait_gone(pids, timeout=15) == []
