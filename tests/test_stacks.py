"""Stacks of ranks: what faulthandler writes, parsed and trimmed to the user's code.

In-process and subprocess tests of :mod:`mlx_nbdist.stacks` and
:mod:`mlx_nbdist.engine.stacks`; the real-engine tests (a hung cell's error shows each
stuck rank's line) are in tests/test_faults.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlx_nbdist._ipykernel import cell_file_name
from mlx_nbdist.engine import stacks as engine_stacks
from mlx_nbdist.stacks import parse_dump, rank_stack, user_frames

CELL = "import time\n\ndef wait_for_peer():\n    time.sleep(60)\n\nwait_for_peer()\n"

pytestmark = pytest.mark.skipif(
    engine_stacks.SIGNAL is None, reason="stack dumps need SIGUSR2 (POSIX)"
)


def _blocked_process(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A process whose main thread runs a 'cell' file (named as ipykernel names it)
    that sleeps, with a helper thread beside it and the stack dumper installed."""
    cell_dir = tmp_path / "ipykernel_4242"
    cell_dir.mkdir()
    name = cell_file_name(CELL)
    assert name and name.endswith(".py")
    cell = cell_dir / name
    cell.write_text(CELL)
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import threading, time, pathlib
        from mlx_nbdist.engine import stacks
        ident = stacks.install({str(tmp_path)!r}, 3)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        pathlib.Path({str(ready)!r}).write_text(str(ident))
        code = compile(open({str(cell)!r}).read(), {str(cell)!r}, "exec")
        exec(code, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    t_end = time.monotonic() + 30
    while not ready.exists() or not ready.read_text():
        assert proc.poll() is None and time.monotonic() < t_end, "the process did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # into the sleep
    return proc, ready, engine_stacks.stack_file(tmp_path, 3)


def test_dump_of_a_blocked_main_thread_names_the_cell_line(tmp_path):
    proc, ready, path = _blocked_process(tmp_path)
    try:
        os.kill(proc.pid, engine_stacks.SIGNAL)
        t_end = time.monotonic() + 10
        while (not path.exists() or "sleep" not in path.read_text()) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert proc.poll() is None, "the signal must not end the process"
        dump = path.read_text()
    finally:
        proc.kill()
        proc.wait()
    threads = parse_dump(dump)
    assert len(threads) == 2, dump  # main and the helper thread
    main = int(ready.read_text())
    assert main in threads
    cells = {cell_file_name(CELL): ("In [7]", CELL)}
    st = rank_stack(3, dump, main, cells)
    assert [f.func for f in st.frames] == ["<module>", "wait_for_peer"], st.frames
    inner = st.innermost()
    assert inner is not None and inner.cell == "In [7]" and inner.line == 4
    assert inner.text.strip() == "time.sleep(60)"
    text = st.format()
    assert text.splitlines()[0] == "rank 3 is at In [7], line 4, in wait_for_peer"
    assert "    time.sleep(60)" in text
    # the helper thread is not the main thread's stack
    other = next(t for t in threads if t != main)
    assert rank_stack(3, dump, other, cells).note == "idle: no cell code is running"


def test_machinery_frames_are_trimmed():
    site = "/venv/lib/python3.11/site-packages"
    frames = [
        ("/usr/lib/python3.11/runpy.py", 198, "_run_module_as_main"),
        (f"{site}/ipykernel/kernelapp.py", 700, "start"),
        (f"{site}/IPython/core/interactiveshell.py", 3577, "run_code"),
        ("/tmp/ipykernel_9/123.py", 2, "<module>"),
        (f"{site}/mlx_lm/generate.py", 400, "generate"),
        (f"{site}/mlx_nbdist/engine/lm.py", 50, "generate"),
        ("/home/u/mine.py", 10, "step"),
        (f"{site}/mlx_nbdist/engine/tracker.py", 80, "all_sum"),
        ("/usr/lib/python3.11/threading.py", 320, "wait"),
    ]
    kept = user_frames(frames, {"123.py": ("In [4]", "x = 1\ny = step()\n")})
    assert [(Path(f.file).name, f.func) for f in kept] == [
        ("123.py", "<module>"),
        ("generate.py", "generate"),
        ("lm.py", "generate"),  # ours between user frames stays: the user called it
        ("mine.py", "step"),
    ]
    assert kept[0].cell == "In [4]" and kept[0].text == "y = step()"


def test_idle_and_empty_dumps_say_so():
    assert rank_stack(0, "", None).note == "the rank wrote no stack"
    idle = (
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/selectors.py", line 468 in select\n'
        '  File "/usr/lib/python3.11/asyncio/base_events.py", line 1898 in _run_once\n'
    )
    st = rank_stack(1, idle, 1)
    assert not st.frames and st.note == "idle: no cell code is running"
    assert st.format() == "rank 1: no stack (idle: no cell code is running)"


def test_cell_lines_count_as_ipython_runs_them():
    # IPython drops a cell's leading blank lines before it compiles it: a frame's line
    # 2 is the second line of what ran, not of what was typed
    from mlx_nbdist.session.stacks import cell_files

    typed = "\n\nx = 1\ny = wait()\n"
    files = cell_files({3: ("In [3]", typed)})
    (name, ran), = files.values()
    assert list(files) == [cell_file_name(typed)] and name == "In [3]"
    kept = user_frames([("/tmp/ipykernel_1/" + cell_file_name(typed), 2, "<module>")], files)
    assert kept[0].text == "y = wait()"
