"""Issue #12: what the magics say when something is wrong, on a real 2-rank group
through a real IPython shell.

Byte counts of ``show --text`` per dtype, refused ``--ranks``/``--timeout``/
``%config MLXDist.timeout`` values, a Ctrl-C during ``start``, model commands given
the wrong object, and identical failures on several ranks reported once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mlx_nbdist import CellError, Session, api
from mlx_nbdist.session.spare import SpareState
from mlx_nbdist.viz import human_bytes

from .conftest import descendants, is_ours, strip_ansi, wait_gone


@pytest.fixture(scope="module")
def ip() -> Iterator[InteractiveShell]:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mlx_nbdist")
    yield shell
    api.set_current_session(None)


@pytest.fixture
def on(ip: InteractiveShell, session2: Session) -> Iterator[InteractiveShell]:
    """The shell with conftest's 2-rank session as the current one."""
    api.set_current_session(session2)
    yield ip
    api.set_current_session(None)


def run(ip: InteractiveShell, cell: str, capfd: pytest.CaptureFixture[str]) -> tuple:
    result = ip.run_cell(cell)
    out, err = capfd.readouterr()
    return result, strip_ansi(out), strip_ansi(err)


def assert_one_line_usage_error(res, out: str, err: str, *expected: str) -> str:
    assert isinstance(res.error_in_exec, UsageError), (type(res.error_in_exec), out, err)
    text = out + err
    for words in expected:
        assert words in text, (words, text)
    assert "Traceback" not in text and "AttributeError" not in text, text
    return text


# --------------------------------------------------------------------------- 6: bytes

DTYPES = {"float16": 2, "int8": 1, "int32": 4, "bfloat16": 2, "float32": 4}


def table_rows(text: str) -> dict[int, list[str]]:
    """rank -> the cells of its row in the table ``format_tensor`` prints."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("----"))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("total"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[int(cells[0])] = cells
    return rows


def footer(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("total "))


@pytest.fixture(scope="module")
def tensors(session2: Session) -> Session:
    code = "\n".join(
        [f"t_{dt} = mx.ones((64, 128), dtype=mx.{dt})" for dt in DTYPES]
        + [
            "mx.random.seed(0)",  # quantized layers are initialised randomly per rank
            "ql = nn.QuantizedLinear(64, 128, group_size=32, bits=4)",
            "m16 = nn.Linear(64, 128)",
            "m16.set_dtype(mx.float16)",
            "import mlx_nbdist",
            'm16 = mlx_nbdist.shard(m16, "all-to-sharded")',
        ]
    )
    session2.run(code)
    return session2


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_show_text_bytes_follow_the_dtype(on, tensors, capfd, dtype: str) -> None:
    res, out, err = run(on, f"%mlxdist show t_{dtype} --text", capfd)
    assert res.success, (out, err)
    each = 64 * 128 * DTYPES[dtype]
    rows = table_rows(out)
    assert sorted(rows) == [0, 1]
    for r in (0, 1):
        assert rows[r][3] == dtype and rows[r][4] == human_bytes(each), rows[r]
    assert footer(out) == (
        f"total {human_bytes(2 * each)} on 2 ranks; unsharded {human_bytes(each)}"
    )


def test_show_text_bytes_of_a_quantized_weight_and_a_sharded_float16(on, tensors, capfd):
    res, out, err = run(on, "%mlxdist show ql.weight --text", capfd)
    assert res.success, (out, err)
    packed = 128 * (64 * 4 // 32) * 4  # (128, 8) uint32 words
    rows = table_rows(out)
    assert [rows[r][3] for r in (0, 1)] == ["uint32", "uint32"]
    assert [rows[r][4] for r in (0, 1)] == [human_bytes(packed)] * 2
    assert footer(out).endswith(f"unsharded {human_bytes(packed)}")

    res, out, err = run(on, "%mlxdist show m16.weight --text", capfd)
    assert res.success, (out, err)
    rows = table_rows(out)  # each rank holds (64, 64) float16 of the (128, 64) weight
    assert [rows[r][4] for r in (0, 1)] == [human_bytes(64 * 64 * 2)] * 2
    assert footer(out) == (
        f"total {human_bytes(128 * 64 * 2)} on 2 ranks; unsharded {human_bytes(128 * 64 * 2)}"
    )


# --------------------------------------------------------------------------- 13: parsing


@pytest.mark.parametrize("ranks", ["0,", ",1", "0,,1"])
def test_ranks_with_an_empty_item_are_refused(on, capfd, ranks: str) -> None:
    res, out, err = run(on, f"%%mlxdist --ranks {ranks}\nprint('ran on', rank)", capfd)
    assert_one_line_usage_error(res, out, err, f"'{ranks}'", "comma", "e.g. 0,2")
    assert "ran on" not in out


@pytest.mark.parametrize("flag", ["--timeout nan", "--timeout inf", "--timeout=-inf",
                                  "--timeout -1", "--timeout -0.5", "--timeout NaN"])
def test_timeouts_that_are_not_deadlines_are_refused(on, capfd, flag: str) -> None:
    res, out, err = run(on, f"%%mlxdist {flag}\nprint('ran on', rank)", capfd)
    assert_one_line_usage_error(res, out, err, "--timeout", "0 means no deadline")
    assert "ran on" not in out


@pytest.mark.parametrize(("body", "line"), [
    ("await asyncio.sleep(0)", 2),
    ("async with contextlib.AsyncExitStack():\n    pass", 2),
    ("for i in range(1):\n    [x async for x in agen()]", 3),
])
def test_await_outside_a_function_is_refused_before_any_rank_runs(on, capfd, body, line) -> None:
    # an engine never finishes a cell run as a coroutine: it hung until the deadline
    cell = f"%%mlxdist\nprint('ran on', rank)\n{body}"
    res, out, err = run(on, cell, capfd)
    assert_one_line_usage_error(res, out, err, f"line {line} of the cell uses await", "thread")
    assert "ran on" not in out


def test_the_way_the_await_error_suggests_runs_the_coroutine(on, capfd) -> None:
    cell = (
        "%%mlxdist\nimport asyncio, concurrent.futures\n"
        "async def main():\n    await asyncio.sleep(0.01)\n    return rank * 10\n"
        "print('got', concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main())"
        ".result())"
    )
    res, out, err = run(on, cell, capfd)
    assert res.success and "got 0" in out and "got 10" in out, (out, err)


def test_only_await_outside_a_function_counts() -> None:
    from mlx_nbdist.cellcheck import top_level_await

    assert top_level_await("async def f():\n    await g()\nx = lambda: 1") is None
    assert top_level_await("%time x = 1\n!ls\nclass A:\n    y = 2") is None
    assert top_level_await("s = 'await x'  # await y") is None
    # decorators, defaults and bases run in the cell's scope: a coroutine cell too
    assert top_level_await("x = 1\n@deco(await g())\ndef f():\n    pass") == 2
    assert top_level_await("def f(a=await g()):\n    return a") == 1
    assert top_level_await("x = 1\n\nf = lambda a=await g(): a") == 3
    # not compilable: the ranks report the syntax error
    assert top_level_await("x = 1\nclass A:\n    y = await g()") is None
    assert top_level_await("def f(:") is None


def test_timeout_zero_still_means_no_deadline(on, capfd) -> None:
    res, out, err = run(on, "%%mlxdist --timeout 0\nprint('ran on', rank)", capfd)
    assert res.success and "ran on 0" in out and "ran on 1" in out, (out, err)


def test_config_timeout_that_is_not_a_deadline_is_a_clear_error(ip, fresh2, capfd,
                                                                 caplog) -> None:
    """Once a clear error per bad value, when it is set; the deadline stays what it was
    and no rank is ended (a session of its own: before the first fix a -5 s deadline
    ended every rank; before the second the error came only at the next cell)."""
    api.set_current_session(fresh2)
    ip.run_line_magic("config", "MLXDist.timeout = 300.0")
    try:
        for value, shown in (("-5", "-5"), ("float('nan')", "nan"),
                             ("float('-inf')", "-inf")):
            caplog.clear()
            with caplog.at_level("ERROR"):
                ip.run_line_magic("config", f"MLXDist.timeout = {value}")
            assert f"MLXDist.timeout = {shown} is not a deadline" in caplog.text, caplog.text
            assert "%config MLXDist.timeout = 300" in caplog.text
            res, out, err = run(ip, "%%mlxdist\nprint('ran on', rank)", capfd)
            assert res.success and "ran on 1" in out, (out, err)
            assert fresh2.state == "ready"  # no rank was ended
    finally:  # IPython's own config keeps what %config was given: a good value over it
        ip.run_line_magic("config", "MLXDist.timeout = 300.0")
    api.set_current_session(None)


# --------------------------------------------------------------------------- 16a: Ctrl-C


@pytest.mark.parametrize(
    "stage, lost",
    [("starting 2 engines", False), ("joining the MLX group", False),
     ("joining the MLX group", True)],
    ids=["controller-up", "engines-up", "teardown-missed-them"],
)
def test_ctrl_c_during_start_is_one_line_and_leaves_nothing(
    ip, session2, capfd, monkeypatch, stage: str, lost: bool
) -> None:
    """A KeyboardInterrupt raised where start reports ``stage`` (the controller is up;
    the engines are up) ends in one line and no process of the start survives, even
    when the session's own teardown missed them (``lost``: an interrupt that landed
    before the session knew of its processes)."""
    from mlx_nbdist import magics

    missed: list[Session] = []
    if lost:
        monkeypatch.setattr(Session, "_teardown", lambda self: missed.append(self))
    api.set_current_session(None)
    before = {p.pid for p in descendants()}
    real = magics._Progress.update

    def update(self, message: str) -> None:
        real(self, message)
        if message.startswith(stage):
            raise KeyboardInterrupt

    monkeypatch.setattr(magics._Progress, "update", update)
    res, out, err = run(ip, "%mlxdist start -n 2", capfd)
    text = assert_one_line_usage_error(res, out, err)
    assert "UsageError: start interrupted; nothing is left running" in text
    assert "KeyboardInterrupt" not in text
    assert api.current_session(required=False) is None
    # the other session's spare may be coming up meanwhile (it starts once that
    # session is idle): its processes are its own, and the start must leave them alone
    t_end = time.monotonic() + 60
    while session2.spare_state == SpareState.STARTING and time.monotonic() < t_end:
        time.sleep(0.1)
    assert session2.spare_state in (SpareState.READY, SpareState.NOT_YET)
    theirs = session2.own_pids()
    started = [p.pid for p in descendants()
               if p.pid not in before and p.pid not in theirs and is_ours(p)]
    assert wait_gone(started, timeout=1.0) == []
    assert session2.state == "ready"  # the other session was not touched
    monkeypatch.undo()
    for s in missed:  # let its ipyparallel objects know (else they stop it at exit)
        s._teardown()


# --------------------------------------------------------------------------- 16b: wrong objects


@pytest.fixture(scope="module")
def odd(session2: Session) -> Session:
    session2.run("x = 5\na = mx.ones((rank + 1, 3))\nlin = nn.Linear(4, 4)")
    return session2


@pytest.mark.parametrize(
    "line",
    ["%mlxdist plan x", "%mlxdist shard x", "%mlxdist check x",
     "%mlxdist gradsync x --step 'x'"],
)
def test_model_commands_on_an_int_say_so(on, odd, capfd, line: str) -> None:
    command = line.split()[1]
    res, out, err = run(on, line, capfd)
    # plan (and shard, which plans first) asks rank 0 alone; the others ask every rank
    where = "[rank 0]" if command in ("plan", "shard") else "[ranks 0-1]"
    assert_one_line_usage_error(
        res, out, err, f"{where} 'x' is an int, not a model (an mlx.nn.Module)",
        f"{command} needs the name of a model")
    assert odd.pull("x") == {0: 5, 1: 5}  # shard did not rebind it


@pytest.mark.parametrize("line", ["%mlxdist show x", "%mlxdist show x --text",
                                  "%mlxdist show x.weight --text"])
def test_show_of_an_int_says_so(on, odd, capfd, line: str) -> None:
    res, out, err = run(on, line, capfd)
    assert_one_line_usage_error(res, out, err, "'x' is an int", "mx.array")


def test_show_of_a_model_asks_for_a_parameter(on, odd, capfd) -> None:
    res, out, err = run(on, "%mlxdist show lin --text", capfd)
    assert_one_line_usage_error(res, out, err, "'lin' is a Linear; name a parameter")


@pytest.mark.parametrize("flag", ["", " --text"])
def test_show_of_an_array_shaped_per_rank_names_the_shapes(on, odd, capfd, flag: str) -> None:
    res, out, err = run(on, f"%mlxdist show a{flag}", capfd)
    text = assert_one_line_usage_error(
        res, out, err, "a has shape (1, 3) on rank 0 but (2, 3) on rank 1: show needs")
    assert "ValueError" not in text


@pytest.mark.parametrize("flag", ["", " --text"])
def test_an_unknown_parameter_is_one_line_with_suggestions(on, odd, capfd, flag: str) -> None:
    res, out, err = run(on, f"%mlxdist show lin.weigth{flag}", capfd)
    text = assert_one_line_usage_error(res, out, err, "'weigth' is not a parameter of Linear",
                                       "did you mean weight")
    assert "\"'weigth'" not in text  # the message, not its repr


# --------------------------------------------------------------------------- 16c: grouping


def rendered(err: CellError) -> str:
    return strip_ansi("\n".join(err._render_traceback_()))


def test_identical_syntax_errors_are_reported_once(on, session2, capfd) -> None:
    # rank 1 runs one more cell, so its next traceback says Cell In[N+1]
    res, _, _ = run(on, "%%mlxdist --ranks 1\npass", capfd)
    assert res.success
    res, out, err = run(on, "%%mlxdist\nx_bad = (1,\n", capfd)
    e = res.error_in_exec
    assert isinstance(e, CellError)
    cells = {f.rank: re.findall(r"In\[\d+\]", strip_ansi("\n".join(f.traceback)))
             for f in e.failures}
    assert cells[0] and cells[0] != cells[1]  # the ranks' tracebacks really differ
    assert [g.ranks for g in e.groups] == [[0, 1]]
    msg = str(e).splitlines()
    assert msg[0] == "2 of 2 ranks failed"
    # the cell's line, not the temporary file IPython compiled it as (1234567890.py)
    assert msg[1] == "[ranks 0-1] SyntaxError: incomplete input (line 1 of the cell)", msg
    text = out + err
    assert text.count("SyntaxError: incomplete input (") == 1, text
    assert text.count("x_bad = (1,") == 1, text
    assert "[rank 0]" not in text and "[rank 1]" not in text
    assert rendered(e).count("Cell In[") == 1


def test_identical_runtime_errors_grouped_distinct_ones_kept(on, capfd) -> None:
    res, out, err = run(on, "%%mlxdist\n1 / 0", capfd)
    e = res.error_in_exec
    assert isinstance(e, CellError) and [g.ranks for g in e.groups] == [[0, 1]]
    assert (out + err).count("ZeroDivisionError: division by zero") == 2  # headline + tb
    assert "[ranks 0-1] ZeroDivisionError: division by zero" in out + err

    # same exception, different lines: both tracebacks, each under its rank
    res, out, err = run(on, "%%mlxdist\nif rank == 0:\n    1 / 0\nelse:\n    1 / 0", capfd)
    e = res.error_in_exec
    assert [g.ranks for g in e.groups] == [[0], [1]]
    text = rendered(e)
    i0, i1 = text.index("[rank 0] ZeroDivisionError"), text.index("[rank 1] ZeroDivisionError")
    assert i0 < i1
    assert "----> 2" in text[i0:i1] and "----> 4" in text[i1:]

    # different messages: kept apart too
    res, out, err = run(on, "%%mlxdist\nraise ValueError(f'bad {rank}')", capfd)
    e = res.error_in_exec
    assert [g.ranks for g in e.groups] == [[0], [1]]
    assert "[rank 0] ValueError: bad 0" in out + err and "[rank 1] ValueError: bad 1" in out + err


def test_grouping_keeps_rank_numbers_and_each_distinct_traceback() -> None:
    """Without engines: ranks 0 and 2 failed alike (their ``Cell In[N]`` differ), rank 1
    differently, rank 3 was drained; the rendering names every rank once."""
    from mlx_nbdist.results import (
        DRAINED,
        ERROR,
        CellResult,
        CollectiveRecord,
        RankFailure,
        RankOutput,
    )

    def tb(n: int, line: int) -> list[str]:
        return [f"\x1b[36mCell In[{n}], line {line}\x1b[39m", f"----> {line} boom()",
                "RuntimeError: boom"]

    rec = CollectiveRecord(seq=3, op="all_sum", shape=(2,), dtype="float32")
    fails = {
        0: RankFailure(0, ERROR, "RuntimeError", "boom", tb(5, 2)),
        1: RankFailure(1, ERROR, "RuntimeError", "boom", tb(4, 3)),
        2: RankFailure(2, ERROR, "RuntimeError", "boom", tb(7, 2)),
        3: RankFailure(3, DRAINED, pending=[rec]),
        4: RankFailure(4, DRAINED, pending=[rec]),
    }
    ranks = {r: RankOutput(r, r, status=f.cause, failure=f) for r, f in fails.items()}
    e = CellError(CellResult(cell=1, ranks=ranks), "summary line")
    assert [g.ranks for g in e.groups] == [[0, 2], [1], [3, 4]]
    assert str(e).splitlines() == [
        "5 of 5 ranks failed",
        "[ranks 0, 2] RuntimeError: boom",
        "[rank 1] RuntimeError: boom",
        "[ranks 3-4] was stuck in #3 all_sum shape=(2,) dtype=float32; released by "
        "replaying it on its peers",
        "summary line",
    ]
    text = rendered(e)
    assert text.count("Cell In[") == 2 and "Cell In[5], line 2" in text
    assert "Cell In[4], line 3" in text and "Cell In[7]" not in text
    assert "last collectives on ranks 3-4: #3 all_sum shape=(2,) dtype=float32" in text
    assert text.splitlines()[0] == "CellError: 5 of 5 ranks failed"
    assert text.splitlines()[-1] == "summary line"


def test_a_breakpoint_on_a_rank_says_it_cannot_stop_there(session2) -> None:
    """pdb on an engine read nothing and went on without a word (the user trial)."""
    r = session2.run("if rank == 1:\n    breakpoint()\nprint('after', rank)")
    assert "breakpoint() on rank 1: a rank has no terminal to debug in" in r.ranks[1].stderr, (
        r.ranks[1].stderr)
    assert "%mlxdist where" in r.ranks[1].stderr and not r.ranks[0].stderr
    assert [r.stdout(k).strip() for k in (0, 1)] == ["after 0", "after 1"]


def test_a_rank_traceback_loses_only_our_frames_and_the_applys() -> None:
    """ipyparallel's do_apply and its one-line code string, and mlx_nbdist's engine
    frames, go; a user's exec'd code (``<string>`` past line 1), a step's frame and a
    message line that names a file stay (a reviewer's cases)."""
    from mlx_nbdist.outcomes import _trim_internal

    tb = ("-----\nNameError   Traceback (most recent call last)\n"
          "File /x/site-packages/ipyparallel/engine/kernel.py:157, in Kernel.do_apply(self)\n"
          "--> 157 exec(code)\n\n"
          "File <string>:1\n----> 1 'Could not get source'\n\n"
          "File /x/site-packages/mlx_nbdist/engine/rpc.py:12, in call(meta)\n   12 x\n\n"
          "File <string>:14, in f()\n---> 14 user\n\n"
          "File <gradsync --step>:2, in <lambda>(g)\n----> 2 nosuch(g)\n\n"
          "NameError: File /x/mlx_nbdist/engine/a.py:3, in f is in the message")
    kept = "\n".join(_trim_internal([tb]))
    assert "ipyparallel" not in kept and "Could not get source" not in kept
    assert "rpc.py" not in kept
    assert "File <string>:14, in f()" in kept and "nosuch(g)" in kept
    assert kept.endswith("NameError: File /x/mlx_nbdist/engine/a.py:3, in f is in the message")
    assert _trim_internal(["File /x/mlx_nbdist/engine/rpc.py:1, in f\n  x"]) == [
        "File /x/mlx_nbdist/engine/rpc.py:1, in f", "  x"]  # all ours: kept whole
