"""A rank's output (issue #13, the rank side): ordered, bounded, never lost, well formed.

The engine-side pieces of :mod:`mlx_nbdist.engine.output` are tested in this process
with stand-in kernel streams (and scratch fds in place of 1 and 2); the whole path on
real ranks, through ``Session.run`` and its ``on_output`` stream of iopub messages,
both with ipykernel's own fd watching (a real notebook) and without it (engines
started under pytest, where ipykernel does not watch fds).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

import pytest

from mlx_nbdist import Session
from mlx_nbdist.engine.output import NOTICE_RE, Output, notice, overflow_path, sanitize
from mlx_nbdist.streams import Kind, OutputEvent

# -- the engine side, with stand-in kernel streams ----------------------------------------


class FakeOut:
    """Like ipykernel's OutStream: buffers writes, sends one message per flush."""

    def __init__(self, name: str, sent: list[tuple[str, str]]) -> None:
        self.name = name
        self.sent = sent
        self.parts: list[str] = []
        self.topic = b"stream." + name.encode()

    def write(self, text: str) -> int:
        assert isinstance(text, str)
        text.encode("utf-8")  # what the kernel's JSON packer would choke on
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        if self.parts:
            self.sent.append((self.name, "".join(self.parts)))
            self.parts = []


def fake_output(folder: Path, limit: int | None = None) -> tuple[Output, list[tuple[str, str]]]:
    sent: list[tuple[str, str]] = []
    return Output(folder, 3, FakeOut("stdout", sent), FakeOut("stderr", sent), limit=limit), sent


def flush(out: Output) -> None:
    out.stdout.flush()
    out.stderr.flush()


def test_each_stream_flushes_the_other_first_and_batches_otherwise(tmp_path: Path) -> None:
    out, sent = fake_output(tmp_path)
    print("a", file=out.stdout)
    print("b", file=out.stderr)
    print("c", file=out.stdout)
    for i in range(1000):
        print(i, file=out.stdout)
    flush(out)
    many = "".join(f"{i}\n" for i in range(1000))
    assert sent == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n" + many)]
    # what the kernel reads through the wrapper is the kernel stream's
    assert out.stdout.topic == b"stream.stdout"
    assert out.stdout.encoding == "UTF-8" and out.stdout.writable()


def test_bad_text_and_bytes_become_replacement_characters(tmp_path: Path) -> None:
    assert sanitize("a\udcffb\ud800") == "a\ufffdb\ufffd"
    assert sanitize("\ud83d\ude00") == "\U0001f600"  # a pair written as two code units
    out, sent = fake_output(tmp_path)
    out.stdout.write("lone \udcff \ud800\n")
    out.stdout.buffer.write(b"bin \xff\xfe ")
    out.stdout.buffer.write("é".encode()[:1])  # a character split over two writes
    out.stdout.buffer.write("é\n".encode()[1:])
    out.stdout.buffer.write("ü".encode()[:1])  # cut at the end of the cell
    out.end_cell()
    flush(out)
    assert sent == [("stdout", "lone \ufffd \ufffd\nbin \ufffd\ufffd é\n\ufffd")]


def test_past_the_limit_the_cell_goes_to_a_file_after_one_notice(tmp_path: Path) -> None:
    out, sent = fake_output(tmp_path, limit=100)
    out.begin_cell(7)
    out.stdout.write("x" * 60)
    out.stderr.write("y" * 30 + "\n")
    out.stdout.write("z" * 50)  # crosses the limit: 9 characters fit
    out.stderr.write("late\n")
    out.end_cell()
    flush(out)
    path = overflow_path(tmp_path, 7, 3)
    assert path == tmp_path / "output" / "cell7-rank3.txt"
    shown = "".join(t for _, t in sent)
    assert shown == "x" * 60 + "y" * 30 + "\n" + "z" * 9 + "\n" + notice(3, 100, path) + "\n"
    assert path.read_text() == "z" * 41 + "late\n"
    m = NOTICE_RE.match(notice(3, 100, path))
    assert m and m["rank"] == "3" and m["size"] == "100 B" and m["path"] == str(path)
    assert notice(0, 1 << 20, "/p") == "[rank 0: output past 1.0 MiB is in /p]"
    # the next cell starts from zero, and may have a limit of its own
    sent.clear()
    out.begin_cell(8, limit=10)
    out.stdout.write("0123456789")
    out.stdout.write("\r")
    out.end_cell()
    flush(out)
    assert sent == [
        ("stdout", "0123456789\n" + notice(3, 10, overflow_path(tmp_path, 8, 3)) + "\n")
    ]
    assert overflow_path(tmp_path, 8, 3).read_bytes() == b"\r"


def test_fd_output_is_drained_at_the_end_of_each_cell(tmp_path: Path) -> None:
    """Scratch fds stand for 1 and 2: what a subprocess or ``os.write`` put there
    before ``end_cell`` is in the streams when it returns, 20 cells out of 20."""
    out, sent = fake_output(tmp_path)
    fds = {"stdout": os.open(os.devnull, os.O_WRONLY), "stderr": os.open(os.devnull, os.O_WRONLY)}
    out.capture_fds(fds)
    try:
        for i in range(20):
            out.begin_cell(i)
            subprocess.run(["echo", f"sub{i}"], stdout=fds["stdout"], check=True)
            os.write(fds["stdout"], f"fd{i} é".encode()[:-1])  # é split over two writes
            os.write(fds["stdout"], "é".encode()[1:] + b"\n")
            os.write(fds["stderr"], f"err{i}\n".encode())
            out.end_cell()
            flush(out)
            got = {name: "".join(t for n, t in sent if n == name) for name in ("stdout", "stderr")}
            assert got == {"stdout": f"sub{i}\nfd{i} é\n", "stderr": f"err{i}\n"}, i
            sent.clear()
        # a flush sends what the fds hold too (the kernel flushes before a display)
        os.write(fds["stdout"], b"before the display\n")
        out.stdout.flush()
        assert sent == [("stdout", "before the display\n")]
    finally:
        out.uninstall()
        for fd in fds.values():
            os.close(fd)


def test_uninstall_gives_the_fds_back(tmp_path: Path) -> None:
    out, _ = fake_output(tmp_path)
    fd = os.open(os.devnull, os.O_WRONLY)
    before = os.fstat(fd)
    out.capture_fds({"stdout": fd})
    try:
        assert os.fstat(fd).st_ino != before.st_ino  # a pipe now
    finally:
        out.uninstall()
    after = os.fstat(fd)
    os.close(fd)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


# -- on real ranks --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def watched2() -> Iterator[Session]:
    """A session whose engines run as in a notebook: ipykernel watches fd 1 and 2
    (it does not when ``PYTEST_CURRENT_TEST`` is in the engines' environment)."""
    saved = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        s = Session(2, timeout=60).start()
    finally:
        if saved is not None:
            os.environ["PYTEST_CURRENT_TEST"] = saved
    yield s
    s.stop()


@pytest.fixture(params=["plain", "ipykernel-watched"])
def ranks2(request: pytest.FixtureRequest) -> Session:
    return request.getfixturevalue("session2" if request.param == "plain" else "watched2")


def run_events(s: Session, code: str) -> tuple[object, dict[int, list[OutputEvent]]]:
    events: list[OutputEvent] = []
    r = s.run(code, on_output=events.append)
    per_rank = {
        k: [e for e in events if e.rank == k and e.kind in (Kind.STDOUT, Kind.STDERR)]
        for k in (0, 1)
    }
    return r, per_rank


def joined(events: list[OutputEvent]) -> list[tuple[str, str]]:
    """Runs of one stream's events, their text joined: a print is several writes
    (its arguments, separators and end), which the stream's batching timer may
    send apart."""
    return [
        (kind.value, "".join(e.text for e in evs))
        for kind, evs in groupby(events, key=lambda e: e.kind)
    ]


def test_interleaved_stdout_and_stderr_keep_their_order(session2: Session) -> None:
    code = "import sys\nfor i in range(5):\n    print('o', i)\n    print('e', i, file=sys.stderr)\n"
    _, per_rank = run_events(session2, code)
    for k in (0, 1):
        got = joined(per_rank[k])
        want = [x for i in range(5) for x in (("stdout", f"o {i}\n"), ("stderr", f"e {i}\n"))]
        assert got == want


def test_fd_level_output_right_before_the_end_is_never_lost(ranks2: Session) -> None:
    code = (
        "import os, subprocess\n"
        "subprocess.run(['echo', f'sub {{rank}} {i}'])\n"
        "os.write(1, f'fd-out {{rank}} {i}\\n'.encode())\n"
        "os.write(2, f'fd-err {{rank}} {i}\\n'.encode())\n"
        "None\n"
    )
    missing = []
    for i in range(20):
        r = ranks2.run(code.format(i=i))
        for k in (0, 1):
            out, err = r.ranks[k].stdout, r.ranks[k].stderr
            if out != f"sub {k} {i}\nfd-out {k} {i}\n" or err != f"fd-err {k} {i}\n":
                missing.append((i, k, out, err))
    assert not missing, f"{len(missing)} of 40 rank-cells lost fd output: {missing[:3]}"


def test_fd_output_comes_before_the_cells_result(ranks2: Session) -> None:
    events: list[OutputEvent] = []
    ranks2.run("import subprocess\nsubprocess.run(['echo', 'before'])\n42", on_output=events.append)
    for k in (0, 1):
        got = [(e.kind, e.text or e.data.get("text/plain")) for e in events if e.rank == k]
        assert got == [(Kind.STDOUT, "before\n"), (Kind.RESULT, "42")], got


def test_a_subprocess_line_comes_before_the_next_print(ranks2: Session) -> None:
    """The subprocess finished before ``print``: its line is first, every time."""
    code = "import subprocess\nsubprocess.run(['echo', 'sub {i}'])\nprint('after {i}')\n"
    wrong = []
    for i in range(10):
        r = ranks2.run(code.format(i=i))
        wrong += [(i, k, r.ranks[k].stdout) for k in (0, 1)
                  if r.ranks[k].stdout != f"sub {i}\nafter {i}\n"]  # fmt: skip
    assert not wrong, wrong


def test_a_forked_childs_output_reaches_the_notebook(session2: Session) -> None:
    code = (
        "import os, sys\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child', rank, end=''); print(' line'); print('partial', end='')\n"
        "    sys.stdout.flush(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent')\n"
    )
    r = session2.run(code)
    for k in (0, 1):
        assert r.ranks[k].stdout == f"child {k} line\npartialparent\n"


def test_binary_buffer_and_bad_text_reach_the_notebook(ranks2: Session) -> None:
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'bin \\xff\\xfe\\n')\n"
        "sys.stdout.buffer.write('é'.encode()[:1]); sys.stdout.buffer.write('é\\n'.encode()[1:])\n"
        "print('lone \\udcff \\ud800')\n"
        "print('pair \\ud83d\\ude00')\n"
        "sys.stderr.buffer.write(b'err \\xff\\n')\n"
        "sys.stdout.buffer.flush()\n"
        "print('still here')\n"
    )
    r = ranks2.run(code)
    for k in (0, 1):
        assert (
            r.ranks[k].stdout
            == "bin \ufffd\ufffd\né\nlone \ufffd \ufffd\npair \U0001f600\nstill here\n"
        )
        assert r.ranks[k].stderr == "err \ufffd\n"
    assert ranks2.run("print('next')").ranks[0].stdout == "next\n"


def test_a_50_mb_print_is_bounded_and_the_rest_is_in_a_file(session2: Session) -> None:
    r = session2.run("print('x' * 50_000_000)\nprint('tail')\n")
    limit = 1 << 20
    assert session2.directory is not None
    for k in (0, 1):
        out = r.ranks[k].stdout
        assert len(out) < limit + 300
        assert out.startswith("x" * limit)
        line = out[limit:].strip("\n")
        m = NOTICE_RE.match(line)
        assert m, line
        assert m["rank"] == str(k) and m["size"] == "1.0 MiB"
        path = Path(m["path"])
        assert path == overflow_path(session2.directory, r.cell, k)
        assert path.stat().st_size == 50_000_000 - limit + len("\ntail\n")
        with open(path) as f:
            f.seek(path.stat().st_size - 10)
            assert f.read() == "xxxx\ntail\n"
    # the next cell has its own budget
    assert session2.run("print('small')").ranks[1].stdout == "small\n"


def test_ten_thousand_tiny_prints_arrive_complete_in_order_in_few_messages(
    session2: Session,
) -> None:
    code = (
        "import sys\n"
        "print('start', file=sys.stderr)\n"
        "for i in range(10_000):\n"
        "    print(i)\n"
        "print('end', file=sys.stderr)\n"
    )
    r, per_rank = run_events(session2, code)
    for k in (0, 1):
        want = "".join(f"{i}\n" for i in range(10_000))
        assert joined(per_rank[k]) == [("stderr", "start\n"), ("stdout", want), ("stderr", "end\n")]
        assert sum(e.kind == Kind.STDOUT for e in per_rank[k]) <= 10
        assert r.ranks[k].stdout == "".join(f"{i}\n" for i in range(10_000))


def test_the_limit_is_set_per_cell_and_by_the_magic(session2: Session) -> None:
    r = session2.run("print('y' * 5000)", output_limit=1000)
    out = r.ranks[0].stdout
    assert out.startswith("y" * 1000) and len(out) < 1300
    m = NOTICE_RE.match(out[1000:].strip("\n"))
    assert m and m["size"] == "1000 B"
    assert session2.run("print('y' * 5000)", output_limit=0).ranks[0].stdout == "y" * 5000 + "\n"
    from IPython.core.interactiveshell import InteractiveShell

    from mlx_nbdist import api

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mlx_nbdist")
    api.set_current_session(session2)
    try:
        ip.run_line_magic("config", "MLXDist.output_limit = 100")
        magics = next(m for m in ip.configurables if type(m).__name__ == "MLXDist")
        assert magics.output_limit == 100
        seen = []
        real = session2.run
        session2.run = lambda *a, **k: seen.append(k.get("output_limit")) or real(*a, **k)  # type: ignore[method-assign]
        try:
            ip.run_cell_magic("mlxdist", "--ranks 0", "print('z' * 500)")
        finally:
            del session2.run
        assert seen == [100]
    finally:
        ip.run_line_magic("config", f"MLXDist.output_limit = {1 << 20}")
        api.set_current_session(None)


def test_text_written_past_the_wrapper_still_comes_with_its_cell(session2: Session) -> None:
    # a writer that kept the kernel's own stream (taken before the rank's streams were
    # wrapped) bypasses the wrapper: the cell's end must still flush what it wrote
    code = "import sys\nsys.stdout.out.write(f'direct {rank}\\n')\n"
    for _ in range(3):
        r = session2.run(code)
        assert [r.ranks[k].stdout for k in (0, 1)] == ["direct 0\n", "direct 1\n"]


def test_a_cell_result_shows_as_one_line() -> None:
    """A user trial: ``s.run(...)`` as a cell's last expression printed every rank's
    whole output in a dataclass repr."""
    from mlx_nbdist.results import CellResult, RankOutput

    r = CellResult(3, {0: RankOutput(0, 1, stdout="x" * 10000),
                       1: RankOutput(1, 2, status="error")}, 1.234, valid=False)
    assert repr(r) == "CellResult(cell 3, ranks {0: ok, 1: error}, 1.23 s, values invalid)"
