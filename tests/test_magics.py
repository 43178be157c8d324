"""The magics through a real IPython InteractiveShell and a real 2-rank group."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets import TraitError

from mlx_nbdist import CellError, api

from .conftest import strip_ansi


@pytest.fixture(scope="module")
def ip() -> Iterator[InteractiveShell]:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mlx_nbdist")
    yield shell
    shell.run_line_magic("mlxdist", "stop")
    api.set_current_session(None)


def run(ip: InteractiveShell, cell: str, capfd: pytest.CaptureFixture[str]) -> tuple:
    result = ip.run_cell(cell)
    out, err = capfd.readouterr()
    return result, strip_ansi(out), strip_ansi(err)


def test_cell_magic_before_start_is_a_usage_error(ip, capfd) -> None:
    api.set_current_session(None)
    res, out, err = run(ip, "%%mlxdist\nprint(1)", capfd)
    assert isinstance(res.error_in_exec, UsageError)
    assert "run %mlxdist start -n N first" in out + err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "line, expected",
    [
        ("%mlxdist", "needs a command"),
        ("%mlxdist frobnicate", "invalid choice: 'frobnicate'"),
        ("%mlxdist start -n 0", "argument -n: must be at least 1, got 0"),
        ("%mlxdist timeline 0", "argument k: must be at least 1, got 0"),
        ("%mlxdist start -n two", "'two' is not a whole number"),
        ("%mlxdist start --backend gloo", "invalid choice: 'gloo'"),
        ("%mlxdist start --gpus 2", "unrecognized arguments: --gpus 2"),
    ],
)
def test_usage_errors_are_one_line(ip, capfd, line: str, expected: str) -> None:
    res, out, err = run(ip, line, capfd)
    assert isinstance(res.error_in_exec, UsageError), (out, err)
    assert expected in out + err
    assert "Traceback" not in out + err


def test_start_cell_status_and_errors(ip, capfd, tmp_path) -> None:
    # a comment ends a magic's line, as in the README's first cell
    res, out, _ = run(ip, "%mlxdist start -n 2            # controller + 2 engines", capfd)
    assert res.success, out
    assert "MLX group ready: 2 ranks, backend=ring, launcher=local" in out
    assert "engines registered: 2/2" in out
    assert "rank 0: Device(cpu" in out and "rank 1: Device(cpu" in out

    res, out, _ = run(ip, "%mlxdist start -n 2", capfd)
    assert res.success and "already running" in out
    res, out, err = run(ip, "%mlxdist start -n 3", capfd)
    assert isinstance(res.error_in_exec, UsageError)
    assert "%mlxdist restart -n 3" in out + err

    cell = (
        "%%mlxdist\n"
        "x = mx.ones(4) * (rank + 1)\n"
        "y = mx.distributed.all_sum(x, group=world)\n"
        "print(rank, y.tolist())\n"
        "y.sum().item()"
    )
    res, out, _ = run(ip, cell, capfd)
    assert res.success
    i0, i1 = out.index("[rank 0]"), out.index("[rank 1]")
    assert i0 < i1
    assert "0 [3.0, 3.0, 3.0, 3.0]" in out[i0:i1]
    assert "Out[rank 0]: 12.0" in out[i0:i1]
    assert "1 [3.0, 3.0, 3.0, 3.0]" in out[i1:]

    res, out, _ = run(ip, "%%mlxdist --ranks 1 --quiet  # rank 1 only\nprint('hidden', rank)", capfd)
    assert res.success and "hidden" not in out

    res, out, _ = run(ip, "%mlxdist status", capfd)
    assert "ready, 2 ranks" in out and "rank 1: idle" in out

    res, out, err = run(ip, "%%mlxdist\nprint('ok', rank)\nif rank == 0:\n    1 / 0", capfd)
    assert isinstance(res.error_in_exec, CellError)
    text = out + err
    assert "[rank 0] ZeroDivisionError" in text
    assert "ok 1" in text  # the rank that succeeded still shows its output
    assert "1 / 0" in text  # the failing rank's own traceback, not the client's

    res, out, err = run(ip, "%%mlxdist --ranks 0,7\n1", capfd)
    assert isinstance(res.error_in_exec, UsageError) and "0..1" in out + err

    res, out, _ = run(ip, "%%mlxdist --profile\nmx.eval(mx.distributed.all_sum(mx.ones(2)))", capfd)
    assert res.success, out
    for line, expected in (
        ("%mlxdist timeline 40", "%mlxdist timeline: k=40: there is 1 profiled cell(s)"),
        ("%mlxdist trace /nonexistent-dir/t.json", "%mlxdist trace: "),
        ("%mlxdist trace t.json -k 9", "k must be a whole number from 1 to 1"),
    ):
        res, out, err = run(ip, line, capfd)
        assert isinstance(res.error_in_exec, UsageError), (line, out, err)
        assert expected in out + err and "Traceback" not in out + err, (line, out + err)

    # two saves in a cell say so twice (a magic's value shows only on a cell's last line)
    res, out, _ = run(ip, "%%mlxdist\nimport mlx.nn as nn\nmx.random.seed(0)\nsv = nn.Linear(4, 4)",
                      capfd)
    res, out, _ = run(ip, f"%mlxdist save sv {tmp_path / 'a'}\n"
                          f"%mlxdist save sv {tmp_path / 'b'}", capfd)
    assert res.success and out.count("saved 'sv' (2 parameters) from 2 ranks") == 2, out

    # a look from another thread while a cell runs (a subshell, the cell hanging) answers
    # at once: it waited for the cell's end to write itself into the export's history
    cell = threading.Thread(target=api.current_session().run,
                            args=("import time\ntime.sleep(8)",))
    cell.start()
    time.sleep(2)  # the cell is running
    res, out, _ = run(ip, "%mlxdist where", capfd)
    assert res.success and "time.sleep(8)" in out, out
    assert cell.is_alive()
    cell.join(60)

    res, out, _ = run(ip, "%mlxdist stop", capfd)
    assert "stopped" in out
    res, out, err = run(ip, "%%mlxdist\n1", capfd)
    assert isinstance(res.error_in_exec, UsageError)
    res, out, err = run(ip, "%mlxdist where", capfd)  # one line, as the others (no traceback)
    assert isinstance(res.error_in_exec, UsageError) and "the session is stopped" in out + err


def test_config_sets_defaults(ip, capfd) -> None:
    ip.run_line_magic("config", "MLXDist.timeout = 42.0")
    magics = next(m for m in ip.configurables if type(m).__name__ == "MLXDist")
    assert magics.timeout == 42.0
    ip.run_line_magic("config", "MLXDist.timeout = 300.0")


@pytest.mark.parametrize(("line", "said"), [
    ("n = 2.5", "MLXDist.n = 2.5 is not a number of ranks"),
    ("n = 0", "MLXDist.n = 0 is not a number of ranks"),
    ("timeout = -5", "MLXDist.timeout = -5 is not a deadline"),
    ("timeout = float('nan')", "MLXDist.timeout = nan is not a deadline"),
    ("start_timeout = 0", "MLXDist.start_timeout = 0 is not a time to start in"),
    ("output_limit = -1", "MLXDist.output_limit = -1 is not a number of characters"),
    ("policy = {'bogus': 1}", "MLXDist.policy: 'bogus' is not a supervisor timing"),
    ("policy = {'interrupt_grace': -1}", "MLXDist.policy: interrupt_grace must be a number of "
     "seconds >= 0, got -1"),
    ("policy = {'drain_timeout': float('nan')}", "drain_timeout must be a number of seconds"),
])
def test_a_bad_setting_is_refused_when_set_naming_it(ip, caplog, line: str, said: str) -> None:
    """The user trial: bad values were taken silently and failed only at the next start
    or cell (``n = 2.5`` started 2 ranks). %config prints the error and keeps the old
    value."""
    magics = next(m for m in ip.configurables if type(m).__name__ == "MLXDist")
    name = line.split()[0]
    before = getattr(magics, name)
    try:
        with caplog.at_level("ERROR"):
            ip.run_line_magic("config", f"MLXDist.{line}")
        assert said in caplog.text, caplog.text
        assert getattr(magics, name) == before
    finally:  # IPython's own config keeps what %config was given: a good value over it
        ip.run_line_magic("config", f"MLXDist.{name} = {before!r}")


def test_start_on_a_broken_session_says_restart(ip, capfd) -> None:
    import os
    import signal

    from .conftest import wait_gone

    res, out, _ = run(ip, "%mlxdist start -n 2", capfd)
    assert res.success, out
    s = api.current_session()
    victim = s.ranks[1].pid
    os.kill(victim, signal.SIGKILL)
    assert wait_gone([victim]) == []
    res, out, err = run(ip, "%mlxdist start -n 2", capfd)
    assert isinstance(res.error_in_exec, UsageError)
    assert "broken" in out + err and "%mlxdist restart" in out + err
    assert "already running" not in out + err
    res, out, _ = run(ip, "%mlxdist status", capfd)
    assert "broken" in out and "rank 1" in out
    assert "spare engines for the next restart" in out
    res, out, _ = run(ip, "%mlxdist restart -n 2", capfd)  # the same N: the spare serves
    assert res.success, out
    assert "spare engines" in out  # the group formed on the spare, started or awaited
    res, out, _ = run(ip, "%%mlxdist\nprint(mx.distributed.all_sum(mx.ones(1), group=world).item())", capfd)
    assert res.success and out.count("2.0") == 2
    run(ip, "%mlxdist stop", capfd)


def test_start_without_a_spare(ip, capfd) -> None:
    res, out, _ = run(ip, "%mlxdist start -n 1 --no-spare", capfd)
    assert res.success, out
    s = api.current_session()
    assert s.spare is False and s.spare_state == "off"
    res, out, _ = run(ip, "%mlxdist status", capfd)
    assert "spare engines for the next restart: off (spare=False): a restart starts new" in out
    run(ip, "%mlxdist stop", capfd)


@pytest.mark.parametrize(
    "line, words",
    [
        ("start -n 2   # two ranks", ["start", "-n", "2"]),
        ("# only a comment", []),
        ("show model.w#1", ["show", "model.w#1"]),  # not at a word's start: kept
        ("gradsync m --step 'loss(m, x)  # y'", ["gradsync", "m", "--step", "loss(m, x)  # y"]),
        ('--step "a \\" # b" # c', ["--step", 'a " # b']),
    ],
)
def test_a_hash_that_starts_a_word_outside_quotes_starts_a_comment(line, words) -> None:
    import shlex

    from mlx_nbdist.magics import _without_comment

    assert shlex.split(_without_comment(line)) == words


def test_cell_line_is_parsed_once_per_line_and_bad_lines_fail_each_time() -> None:
    from mlx_nbdist.magics import _cell_args

    a = _cell_args("--ranks 0,1 --quiet")
    assert a is _cell_args("--ranks 0,1 --quiet")  # kept: the same line is not parsed again
    assert (a.ranks, a.quiet, a.timeout) == ([0, 1], True, None)
    assert _cell_args("").ranks is None
    for _ in range(2):  # an error is not cached away
        with pytest.raises(UsageError, match="--timeout"):
            _cell_args("--timeout -1")


def test_policy_is_rebuilt_only_when_the_setting_changes(ip) -> None:
    from mlx_nbdist.magics import MLXDist

    m = MLXDist(shell=ip)
    first = m._policy()
    assert m._policy() is first  # every cell asks: built once
    first.poll = 1.0  # changed in place (through Session.policy): a fresh one next time
    again = m._policy()
    assert again is not first and again.poll == 0.02
    m.policy = {"drain_timeout": 5}
    changed = m._policy()
    assert changed.drain_timeout == 5.0 and changed is not again
    with pytest.raises(TraitError, match="drain_timeout"):  # refused when set
        m.policy = {"drain_timeout": -1}
    assert m._policy() is changed


@pytest.mark.parametrize(("value", "said"), [
    ("-1", "'-1': give a number of seconds > 0 between updates (e.g. 0.5)"),
    ("0", "'0': give a number of seconds > 0 between updates"),
    ("nan", "'nan': give a number of seconds > 0 between updates"),
    ("soon", "'soon' is not a number of seconds"),
])
def test_a_dashboard_interval_that_is_not_one_is_refused(value: str, said: str) -> None:
    """The user trial: -1 was refused with the deadline's words ('0 means no
    deadline'), and 0 became 0.5 without a word."""
    from mlx_nbdist.magics import MLXDist, _line_parser

    with pytest.raises(UsageError, match=re.escape(said)):
        MLXDist._parse(_line_parser(), f"dashboard --interval {value}")
    assert MLXDist._parse(_line_parser(), "dashboard --interval 0.25").interval == 0.25
