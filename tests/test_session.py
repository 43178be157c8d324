"""The session API on a real 2-rank MLX ring group."""

from __future__ import annotations

import json

import psutil
import pytest

from mlx_nbdist import CellError, NotStartedError, Session, SetupError
from mlx_nbdist.results import ERROR, OK

from .conftest import listening_ports, session_pids, session_ports, strip_ansi, wait_gone


def test_every_rank_joins_one_group(session2: Session) -> None:
    assert sorted(session2.ranks) == [0, 1]
    r = session2.run("print(rank, size, world.rank(), world.size(), type(mx).__name__, nn.Linear)")
    for k in (0, 1):
        words = r.stdout(k).split()
        assert words[:4] == [str(k), "2", str(k), "2"]
    pids = session2.apply(__import__("os").getpid)
    assert pids == {r: info.pid for r, info in session2.ranks.items()}


def test_all_sum_all_gather_send_recv(session2: Session) -> None:
    code = """
x = mx.ones(4) * (rank + 1)
s = mx.distributed.all_sum(x, group=world)
g = mx.distributed.all_gather(mx.array([rank * 10]), group=world)
if rank == 0:
    got = mx.distributed.send(mx.arange(3) + 100, 1, group=world)
else:
    got = mx.distributed.recv((3,), mx.int32, 0, group=world)
mx.eval(s, g, got)
"""
    session2.run(code)
    s = session2.pull("s")
    g = session2.pull("g")
    got = session2.pull("got")
    for r in (0, 1):
        assert s[r].tolist() == [3.0] * 4
        assert g[r].tolist() == [0, 10]
    assert got[1].tolist() == [100, 101, 102]


def test_output_is_grouped_and_ordered_by_rank(session2: Session) -> None:
    r = session2.run("import time\ntime.sleep(0.3 * (size - rank))\nprint('hello from', rank)\nrank * 7")
    assert list(r.ranks) == [0, 1]
    assert r.stdout(0) == "hello from 0\n"
    assert r.stdout(1) == "hello from 1\n"
    assert r.ranks[1].result_text == "7"
    assert r.ok and r.valid


def test_stderr_and_figures_come_back(session2: Session) -> None:
    code = (
        "import sys, matplotlib.pyplot as plt\n"
        "print('warn', rank, file=sys.stderr)\n"
        "plt.plot([0, rank + 1]); plt.show()"
    )
    r = session2.run(code)
    for k in (0, 1):
        assert r.ranks[k].stderr == f"warn {k}\n"
        assert any("image/png" in o["data"] for o in r.ranks[k].outputs)


def test_a_rank_that_raises_gives_a_typed_error_with_its_traceback(session2: Session) -> None:
    with pytest.raises(CellError) as info:
        session2.run("print('before', rank)\nif rank == 1:\n    raise KeyError('bad key on one rank')")
    err = info.value
    assert [f.rank for f in err.failures] == [1]
    assert err.failures[0].ename == "KeyError"
    assert "bad key on one rank" in err.failures[0].evalue
    assert any("raise KeyError" in strip_ansi(line) for line in err.failures[0].traceback)
    assert err.result.ranks[0].status == OK and err.result.ranks[0].stdout == "before 0\n"
    assert err.result.ranks[1].status == ERROR
    rendered = "\n".join(err._render_traceback_())
    assert "[rank 1] KeyError" in rendered
    # the session is still healthy afterwards
    assert session2.run("1 + 1").ranks[0].result_text == "2"


def test_subset_of_ranks_and_refused_collective(session2: Session) -> None:
    r = session2.run("print('only', rank)", ranks=[1])
    assert list(r.ranks) == [1] and r.stdout(1) == "only 1\n"
    with pytest.raises(CellError) as info:
        session2.run("mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))", ranks=[0], timeout=20)
    msg = info.value.failures[0].evalue
    assert "ranks [0] only" in msg and "wait forever for ranks [1]" in msg
    assert "the ring backend has no subgroups (of MLX's backends only mpi has" in msg, msg
    with pytest.raises(ValueError, match=r"ranks of this session are 0\.\.1"):
        session2.run("1", ranks=[5])
    assert session2.state == "ready"


def test_bad_arguments_are_refused_up_front() -> None:
    for n in (0, -1, 1.5, "2"):
        with pytest.raises(SetupError, match="-n must be"):
            Session(n)  # type: ignore[arg-type]
    with pytest.raises(SetupError, match="unknown backend"):
        Session(1, backend="gloo").start()
    with pytest.raises(NotStartedError):
        Session(1).run("1")


def test_stop_leaves_no_process_and_no_port() -> None:
    s = Session(2).start()
    s.run("mx.eval(mx.distributed.all_sum(mx.ones(1), group=world))")
    pids = session_pids(s)
    ports = session_ports(s)
    hostfile = json.loads((s.directory / "hostfile.json").read_text())
    ring_ports = {int(h[0].split(":")[1]) for h in hostfile}
    assert len(pids) >= 3 and ports
    # every process it started is recorded, ipyparallel's engine nannies included
    started = {c.pid for p in pids for c in psutil.Process(p).children(recursive=True)}
    assert started <= set(pids)
    s.stop()
    assert wait_gone(pids, timeout=0.3) == []  # ended by stop, not left to exit later
    assert not (ports | ring_ports) & listening_ports()
    assert not s.directory.exists()  # a clean stop leaves no session folder


def test_a_port_taken_while_the_group_forms_starts_again(monkeypatch) -> None:
    """Ports are picked free and bound by MLX later; another session forming at that
    moment can take one (seen: "[ring] Couldn't bind socket (error: 98)"). The start
    ends those engines and starts again with new ports, once."""
    from mlx_nbdist.errors import PortTakenError
    from mlx_nbdist.session import formation

    real, first = formation.form_group, []

    def taken_once(cluster, *a, **k):
        if not first:
            first.append([pid for pid, _ in cluster.processes([])])
            raise PortTakenError("the ring group did not form:\n  rank 1 (engine 1 on vm): "
                                 "RuntimeError: [ring] Couldn't bind socket (error: 98)")
        return real(cluster, *a, **k)

    monkeypatch.setattr(formation, "form_group", taken_once)
    said: list[str] = []
    s = Session(2).start(progress=said.append)
    try:
        assert any("took a port a rank had picked; starting again" in m for m in said), said
        assert first and first[0] and wait_gone(first[0]) == []  # the first ones were ended
        r = s.run("print(mx.distributed.all_sum(mx.ones(2), group=world).tolist())")
        assert r.stdout(0).strip() == r.stdout(1).strip() == "[2.0, 2.0]"
    finally:
        s.stop()


def test_one_rank_session_works() -> None:
    with Session(1) as s:
        r = s.run("print(size, mx.distributed.all_sum(mx.ones(2), group=world).tolist())")
        assert r.stdout(0) == "1 [1.0, 1.0]\n"


def test_everything_listens_on_loopback_and_files_are_private(session2: Session) -> None:
    import os
    import stat

    import psutil

    addrs = []
    for pid in session_pids(session2):
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        addrs += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    assert addrs and set(addrs) == {"127.0.0.1"}
    assert stat.S_IMODE(os.stat(session2.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(session2.directory.parent).st_mode) == 0o700
    security = session2.directory / "profile" / "security"
    conn_files = list(security.glob("ipcontroller-*.json"))
    assert conn_files
    for f in conn_files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_cleanup_ends_only_recorded_processes_of_dead_sessions(tmp_path, monkeypatch) -> None:
    import subprocess
    import sys

    from mlx_nbdist import runtime, watchdog
    from mlx_nbdist.processes import cleanup

    monkeypatch.setenv("MLX_NBDIST_RUNTIME", str(tmp_path))
    dead_client = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_client.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        started = watchdog.start_time(orphan.pid)
        d = runtime.session_dir("dead-session")
        (d / "session.json").write_text(json.dumps({
            "session_id": "dead-session", "client_pid": dead_client.pid, "client_started": 1.0, "clock": watchdog.CLOCK,
            "state": "ready",
            # the bystander is recorded with a wrong start time: a reused PID, not ours
            "pids": [[orphan.pid, started], [bystander.pid, started - 1000.0]],
        }))
        ended = cleanup()
        assert ended == [f"session dead-session: ended pids [{orphan.pid}]"]
        assert orphan.wait(10) is not None
        assert bystander.poll() is None
        assert json.loads((d / "session.json").read_text())["state"] == "stopped"
        assert cleanup() == []
    finally:
        for p in (orphan, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_pull_of_a_cell_defined_class_is_a_clear_error(session2: Session) -> None:
    session2.run("class Thing:\n    pass\nthing = Thing()")
    with pytest.raises(CellError) as info:
        session2.pull("thing", ranks=[0])
    assert "a class defined in a cell on the ranks" in info.value.failures[0].evalue
    assert session2.pull("rank") == {0: 0, 1: 1}


def test_rank_tracebacks_number_cells_as_the_notebook(session2: Session) -> None:
    # the engines count their own cells; the magic names a cell as the notebook does
    session2.run("def g():\n    raise ValueError('boom')", name="In [5001]")
    with pytest.raises(CellError) as info:
        session2.run("y = 2\ng()", name="In [5002]")
    text = strip_ansi("\n".join(info.value._render_traceback_()))
    assert "[ranks 0-1] ValueError: boom" in text
    assert "Cell In[5002], line 2" in text
    assert "Cell In[5001], line 2, in g()" in text


def test_a_rank_notes_its_ledger_before_its_reply(session2: Session) -> None:
    # the session tells a ledger lost on its way (iopub behind the reply) from a cell
    # without collectives by this note, written synchronously before the reply
    session2.run("mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))")
    cell = session2.cell
    assert [session2.group.rank_file(r, "ledger") for r in (0, 1)] == [str(cell)] * 2
    missing = session2._ledger_missing  # noqa: SLF001 - the check itself, with no ledgers
    assert missing(session2.group, {}, {0: None, 1: None})
    assert not missing(session2.group, {0: [], 1: []}, {0: None, 1: None})
    session2.run("x = 1")  # no collective: the note stays, the check stays quiet
    assert session2.group.rank_file(0, "ledger") == str(cell)
    assert not missing(session2.group, {}, {0: None, 1: None})


def test_a_rank_that_showed_busy_is_idle_on_disk_when_its_cell_returns(
    session2: Session,
) -> None:
    # the rank's thread publishes a cell's start; its end must be on disk before the
    # reply, or %mlxdist status right after the cell would show the rank still busy
    session2.run("import time\ntime.sleep(0.5)")
    for r in (0, 1):
        rec = session2.group.rank_record(r)
        assert rec["state"] == "idle" and rec["cell"] == session2.cell, rec


def test_interrupt_from_another_thread_stops_the_running_cell(session2: Session) -> None:
    """A re-trial: nothing in the API could interrupt ``Session.run`` from another
    thread (the dashboard's button and Ctrl-C reach only a notebook's cells)."""
    import threading
    import time

    from mlx_nbdist import CellInterrupted

    assert session2.interrupt() is False  # nothing runs
    got: list[BaseException] = []

    def cell() -> None:
        try:
            session2.run("import time\nfor _ in range(600):\n    time.sleep(0.1)")
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            got.append(e)

    t = threading.Thread(target=cell)
    t.start()
    while not session2.interrupt():
        time.sleep(0.05)  # until the cell runs
    t.join(30)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], CellInterrupted), got
    assert "the session is still usable" in str(got[0]), str(got[0])
    assert session2.run("print(rank)").stdout(1).strip() == "1"
