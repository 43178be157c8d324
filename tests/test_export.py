"""A session's cells exported as one script (``%mlxdist export``), run by ``mlx.launch``
and by ``python -m mlx_nbdist run``, printing the numbers the cells printed.

The transform from history to script is pure and tested here in-process; then a real
2-rank session runs cells (a seeded MLP, sharded from the notebook, trained a few
steps), exports them, and both launchers run the script on a real MLX ring group.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_nbdist.history import (
    ExportError,
    cell_entry,
    load_entry,
    note_entry,
    plain_python,
    render,
    save_entry,
    shard_entry,
    write,
)

VENV_BIN = Path(sys.executable).parent
MLX_LAUNCH = VENV_BIN / "mlx.launch"

# ------------------------------------------------------------------ pure transform


def test_magics_shell_escapes_and_the_last_expression_become_plain_python():
    cell = "\n".join([
        "%time y = 2 * 3",
        "files = !ls /",
        "!echo hi",
        "%matplotlib inline",
        "for i in range(2):",
        "    %timeit i + 1",
        "x?",
        "(y +",
        "   1)  # shown",
    ])
    got = plain_python(cell)
    ast.parse(got)  # valid Python
    assert "y = 2 * 3  # was: %time" in got
    assert "files = mlx_nbdist.script.getoutput('ls /')" in got
    assert "mlx_nbdist.script.system('echo hi')" in got
    assert "# %matplotlib inline  (notebook only: not run here)" in got
    assert "    # %timeit i + 1  (notebook only: not run here)\n    pass" in got
    assert "# x?  (notebook only: not run here)" in got
    assert "display((y +\n   1))  # shown" in got
    assert "get_ipython" not in got


@pytest.mark.parametrize("cell, last", [
    ("a = 1\na;", "a;"),                       # Jupyter hides it: so does the script
    ("print(1)", "print(1)"),                  # returns None: nothing to show
    ("display(3)", "display(3)"),
    ("a = 1\na", "display(a)"),
])
def test_only_a_shown_last_expression_is_displayed(cell: str, last: str):
    assert plain_python(cell).rstrip().splitlines()[-1] == last


def test_cell_magics_run_their_body_or_become_comments():
    assert plain_python("%%time\nz = 1\nz\n") == "# %%time\nz = 1\ndisplay(z)\n"
    got = plain_python("%%writefile out.txt\nhello\n")
    assert got.startswith("# %%writefile out.txt  (notebook only")
    assert "#   hello" in got


def test_render_commands_notes_subsets_and_failed_cells():
    text = render([
        cell_entry("import math\nlong = '''a\nb'''", "In [1]"),
        shard_entry("model", "megatron", 2),
        shard_entry("model", {"layers.*": "all-to-sharded"}),
        note_entry("%mlxdist show model.layers.0.weight"),
        load_entry("model", "ckpt/", "opt"),
        save_entry("model", "/c k", "opt", overwrite=True),
        cell_entry("print(rank)", "In [4]", ranks=[0], n=2),
        cell_entry("print(size)", "In [5]", ranks=[0, 1], n=2),
        cell_entry("1 / 0", "In [6]", failed="rank 0: ZeroDivisionError: division by zero"),
    ], 2, "ring", session_id="abc", name="train.py")
    ast.parse(text)
    assert "# mlx_nbdist export: n=2 backend=ring" in text
    assert "mlx.launch -n 2 --backend ring -- python train.py" in text
    assert "world, rank, size = mlx_nbdist.script.init(backend='ring', size=2)" in text
    assert "model = mlx_nbdist.shard(model, 'megatron', segments=2)" in text
    assert "model = mlx_nbdist.shard(model, {'layers.*': 'all-to-sharded'}, segments=1)" in text
    assert "# %mlxdist show model.layers.0.weight  (notebook only: not run here)" in text
    assert "# --- %mlxdist load model ckpt/ --optimizer opt ---" in text
    assert "\nmlx_nbdist.script.load_checkpoint(model, 'ckpt/', optimizer=opt)\n" in text
    assert ("\nmlx_nbdist.script.save_checkpoint(model, '/c k', optimizer=opt, name='model', "
            "overwrite=True)\n") in text
    assert "if rank in (0,):\n    print(rank)" in text
    assert "long = '''a\nb'''" in text  # a string's lines are not indented
    assert "# --- In [5] ---" in text and "\nprint(size)\n" in text  # every rank: no if
    assert "# In [6] failed (rank 0: ZeroDivisionError: division by zero); not exported" in text
    assert "#   1 / 0" in text


def test_nothing_to_export_is_refused():
    with pytest.raises(ExportError, match="nothing to export: this session has run no"):
        render([note_entry("%mlxdist status")], 2, "ring")


def test_an_existing_file_is_kept_unless_overwrite(tmp_path: Path):
    path = tmp_path / "train.py"
    path.write_text("mine\n")
    with pytest.raises(ExportError, match=r"train.py exists; pass --overwrite"):
        write("new\n", path)
    assert path.read_text() == "mine\n"
    assert write("new\n", path, overwrite=True) == path
    assert path.read_text() == "new\n"
    assert write("x\n", tmp_path / "other").name == "other.py"


# ------------------------------------------------------------------ a real session

BUILD = """
import mlx.optimizers as optim

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(16, 32), nn.Linear(32, 8)]

    def __call__(self, x):
        return self.layers[1](nn.relu(self.layers[0](x)))

mx.random.seed(0)
model = MLP()
mx.eval(model.parameters())
print(f"rank={rank} init={model.layers[0].weight.sum().item():.6f}")
"""

TRAIN = """
def loss_fn(m, x, y):
    return mx.mean((m(x) - y) ** 2)

opt = optim.SGD(learning_rate=0.1)
for step in range(3):
    x = mx.random.normal((8, 16), key=mx.random.key(100 + step))
    y = mx.random.normal((8, 8), key=mx.random.key(200 + step))
    loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
    opt.update(model, grads)
    mx.eval(model.parameters())
    print(f"rank={rank} loss{step}={loss.item():.6f}")
%time total = mx.distributed.all_sum(model.layers[0].weight.sum(), group=world)
print(f"rank={rank} total={total.item():.6f}")
display(f"rank={rank} shown=yes")
f"rank={rank} last={model.layers[1].bias.sum().item():.6f}"
"""


def values(text: str) -> dict[tuple[int, str], str]:
    """``rank=R key=value`` lines (anywhere in a line) as ``{(R, key): value}``."""
    out = {}
    for m in re.finditer(r"rank=(\d+) (\w+)=([-\w.]+)", text):
        out[(int(m.group(1)), m.group(2))] = m.group(3)
    return out


@pytest.fixture(scope="module")
def shell() -> Iterator[Any]:
    from IPython.core.interactiveshell import InteractiveShell

    from mlx_nbdist import api

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mlx_nbdist")
    yield ip
    api.set_current_session(None)


@pytest.fixture(scope="module")
def exported(session2: Any, shell: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, dict[tuple[int, str], str]]:
    """The session's cells (and what they printed) and the script they export to."""
    import mlx_nbdist
    from mlx_nbdist import api

    s = session2
    api.set_current_session(s)
    folder = tmp_path_factory.mktemp("export")
    with pytest.raises(ExportError, match="nothing to export"):
        s.export(folder / "early.py")
    printed = s.run(BUILD).ranks
    mlx_nbdist.shard("model", "megatron", session=s)
    shell.run_line_magic("mlxdist", "check model")  # notebook-only: a comment
    trained = s.run(TRAIN).ranks
    s.run('print("only rank 0")', ranks=[0])
    text = ""
    for o in [*printed.values(), *trained.values()]:  # printed, displayed, the last value
        text += o.stdout + "".join((d.get("data") or {}).get("text/plain", "")
                                   for d in o.outputs) + (o.result_text or "")
    path = folder / "train.py"
    shell.run_line_magic("mlxdist", f"export {path}")
    assert path.is_file()
    return path, values(text)


def test_the_export_holds_the_cells_the_commands_and_comments(exported, shell):
    from IPython.core.error import UsageError

    path, _ = exported
    text = path.read_text()
    ast.parse(text)
    assert "# mlx_nbdist export: n=2 backend=ring" in text
    assert "model = mlx_nbdist.shard(model, 'megatron', segments=1)" in text
    assert "# %mlxdist check model  (notebook only: not run here)" in text
    assert "total = mx.distributed.all_sum(" in text and "# was: %time" in text
    assert "if rank in (0,):\n    print(\"only rank 0\")" in text
    assert text.index("class MLP") < text.index("mlx_nbdist.shard(model") < text.index("opt =")
    with pytest.raises(UsageError, match="exists; pass --overwrite"):
        shell.run_line_magic("mlxdist", f"export {path}")


NET = """
import mlx.optimizers as optim

def make_net(seed):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

def net_loss(m, x, y):
    return mx.mean((m(x) - y) ** 2)

def net_steps(m, opt, start, steps, tag):
    for step in range(start, start + steps):
        x = mx.random.normal((8, 16), key=mx.random.key(300 + step))
        y = mx.random.normal((8, 8), key=mx.random.key(400 + step))
        loss, grads = nn.value_and_grad(m, net_loss)(m, x, y)
        opt.update(m, grads)
        mx.eval(m.parameters(), opt.state)
        print(f"rank={rank} {tag}{step}={loss.item():.6f}")
"""

#: a hand-written script: the unsharded model on one rank loads the 2-rank checkpoint
ONE_RANK = """
import mlx.core as mx
import mlx.nn as nn
import mlx_nbdist.script

world, rank, size = mlx_nbdist.script.init(backend="ring", size=1)
{net}
net1 = make_net(11)
opt1 = optim.Adam(learning_rate=0.01)
got = mlx_nbdist.script.load_checkpoint(net1, {directory!r}, optimizer=opt1)
print(f"rank={{rank}} files={{len(got['files'])}}")
net_steps(net1, opt1, 3, 2, "resumed")
print(f"rank={{rank}} step={{int(opt1.step)}}")
"""


@pytest.fixture(scope="module")
def resumed(exported: Any, session2: Any, shell: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, Path, dict[tuple[int, str], str]]:
    """A notebook session trains a sharded model, saves it (the magic), loads it into a
    fresh model (the Python API) and trains on; then exports. Returns the script, the
    checkpoint folder and what the resumed cells printed."""
    import mlx_nbdist

    s = session2
    folder = tmp_path_factory.mktemp("resume")
    ckpt = folder / "ckpt"
    s.run(NET + "net = make_net(0)")
    mlx_nbdist.shard("net", "megatron", session=s)
    first = s.run('opt = optim.Adam(learning_rate=0.01)\nnet_steps(net, opt, 0, 3, "first")')
    shell.run_line_magic("mlxdist", f"save net {ckpt} --optimizer opt")
    s.run("net2 = make_net(7)\nopt2 = optim.Adam(learning_rate=0.01)")
    mlx_nbdist.shard("net2", "megatron", session=s)
    mlx_nbdist.load_checkpoint("net2", ckpt, optimizer="opt2", session=s)
    later = s.run('net_steps(net2, opt2, 3, 2, "resumed")\n'
                  'print(f"rank={rank} step={int(opt2.step)}")')
    printed = values("".join(o.stdout for r in (first, later) for o in r.ranks.values()))
    assert len(printed) == 2 * 6, printed  # 3 first, 2 resumed losses and the step
    path = folder / "resume.py"
    s.export(path)
    return path, ckpt, printed


def test_notebook_save_and_load_are_recorded_once_as_script_calls(resumed):
    path, ckpt, _ = resumed
    text = path.read_text()
    ast.parse(text)
    save = (f"mlx_nbdist.script.save_checkpoint(net, {str(ckpt)!r}, optimizer=opt, "
            "name='net')")
    load = f"mlx_nbdist.script.load_checkpoint(net2, {str(ckpt)!r}, optimizer=opt2)"
    assert text.count(save) == 1 and text.count("save_checkpoint(") == 1, text
    assert text.count(load) == 1 and text.count("load_checkpoint(") == 1, text
    assert "not replayed" not in text
    order = ["make_net(0)", "net = mlx_nbdist.shard(net", save, "net2 = make_net(7)",
             "net2 = mlx_nbdist.shard(net2", load, '"resumed")']
    assert [text.index(x) for x in order] == sorted(text.index(x) for x in order)


def test_the_exported_script_saves_and_loads_the_checkpoint_itself(resumed):
    """The checkpoint is removed first: the script's load reads what its own save wrote
    (each rank its slices), and resumes to the notebook's numbers."""
    import shutil

    path, ckpt, printed = resumed
    shutil.rmtree(ckpt)
    done = launch(path, 2)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    got = values(done.stdout)
    for key, value in printed.items():
        assert got.get(key) == value, (key, value, got.get(key), done.stdout[-3000:])
    index = json.loads((ckpt / "index.json").read_text())
    assert index["model"] == "net" and index["n_ranks"] == 2 and index["backend"] == "ring"
    assert index["optimizer_class"] == "Adam" and len(index["files"]) == 2


def test_a_one_rank_script_loads_the_two_rank_checkpoint_and_resumes(resumed):
    """Resharding in a script: the whole model on one rank reads both ranks' files."""
    path, ckpt, printed = resumed
    script = path.with_name("one_rank.py")
    script.write_text(ONE_RANK.format(net=NET, directory=str(ckpt)))
    done = launch(script, 1)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    got = values(done.stdout)
    assert got[(0, "files")] == "2" and got[(0, "step")] == printed[(0, "step")] == "5"
    for step in (3, 4):
        key = f"resumed{step}"
        np.testing.assert_allclose(float(got[(0, key)]), float(printed[(0, key)]), rtol=1e-4,
                                   err_msg=key)


def test_a_damaged_checkpoint_stops_the_script_on_every_rank(resumed, tmp_path: Path):
    """A corrupt file read by one rank: every rank refuses, naming it; nothing loaded."""
    import shutil

    path, ckpt, _ = resumed
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    index = json.loads((broken / "index.json").read_text())
    victim = broken / index["shards_dir"] / "rank-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    script = tmp_path / "load_broken.py"
    script.write_text(ONE_RANK.format(net=NET, directory=str(broken)).replace(
        "size=1", "size=2").replace("make_net(11)", 'mlx_nbdist.shard(make_net(11), "megatron")'))
    done = launch(script, 2)
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    assert "rank-00001.safetensors (written by rank 1) is corrupt" in done.stderr, done.stderr
    assert "nothing was loaded" in done.stderr
    assert "failed on ranks 0, 1 of 2" in done.stderr, done.stderr[-2000:]


def test_a_script_save_that_fails_on_one_rank_keeps_the_checkpoint(resumed, tmp_path: Path):
    """Rank 1's disk "fills" mid-save: every rank raises, naming rank 1, and the
    previous checkpoint (index and files) is as it was."""
    import shutil

    _, ckpt, _ = resumed
    kept = tmp_path / "kept"
    shutil.copytree(ckpt, kept)
    before = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    script = tmp_path / "save_full.py"
    script.write_text(
        "import errno\nimport mlx.core as mx\nimport mlx.nn as nn\nimport mlx_nbdist.script\n"
        "import mlx_nbdist.engine.checkpoint as ck\n"
        "world, rank, size = mlx_nbdist.script.init(backend='ring', size=2)\n"
        + NET +
        "def no_space(path, arrays):\n"
        "    open(path, 'wb').write(b'half a file')\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device', path)\n"
        "if rank == 1:\n"
        "    ck.write_tensors = no_space\n"
        "net = mlx_nbdist.shard(make_net(3), 'megatron')\n"
        f"mlx_nbdist.script.save_checkpoint(net, {str(kept)!r}, name='net')\n")
    done = launch(script, 2)
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    assert "failed on rank 1: OSError: [Errno 28] No space left on device" in done.stderr, (
        done.stderr[-3000:])
    assert "is intact (the partial files were removed)" in done.stderr
    assert "failed on ranks 0, 1 of 2" in done.stderr
    after = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    assert after == before


def launch(path: Path, n: int, *, mlx_launch: bool = False, cwd: Path | None = None,
           args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the script ``path`` on ``n`` ranks with ``args``: ``python -m mlx_nbdist run``
    (or MLX's ``mlx.launch --backend ring``), output captured, in ``cwd`` (default: its
    folder)."""
    if mlx_launch:
        cmd = [str(MLX_LAUNCH), "-n", str(n), "--backend", "ring", "--", "python", str(path)]
    else:
        cmd = [sys.executable, "-m", "mlx_nbdist", "run", "-n", str(n), str(path)]
    cmd += args
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=cwd or path.parent)


def test_run_does_not_show_the_scripts_last_value(tmp_path):
    """A script's last bare expression is not shown, as under mlx.launch (e.g. an
    export ending with ``save_checkpoint(...)``, whose value is the index)."""
    path = tmp_path / "last.py"
    path.write_text("print('line', 6 * 7)\n'the-last-value-' + str(size)\n")
    done = launch(path, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "line 42" in done.stdout and "the-last-value" not in done.stdout, done.stdout


def test_mlx_launch_runs_the_script_to_the_same_numbers(exported, session2):
    path, expected = exported
    session2.stop()  # the ranks of both launchers get the cores
    done = launch(path, 2, mlx_launch=True)
    got = values(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(expected) == 2 * 7, expected  # init, 3 losses, total, shown, last per rank
    assert got == expected, (done.stdout, done.stderr[-3000:])
    assert done.stdout.count("only rank 0") == 1


def test_mlx_nbdist_run_prints_each_ranks_lines_and_the_same_numbers(exported):
    path, expected = exported
    done = launch(path, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert values(done.stdout) == expected, done.stdout
    lines = [x for x in done.stdout.splitlines() if "rank=" in x]
    assert lines and all(x.startswith(f"[rank {x.split('rank=')[1][0]}] ") for x in lines), lines
    assert "[rank 0] only rank 0" in done.stdout


def test_a_failing_rank_exits_non_zero_naming_it(tmp_path: Path):
    """Rank 1 raises; rank 0, waiting in the next all_sum, is released: the traceback
    names the script's file and line, and the last line names rank 1 only."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import mlx_nbdist.script\n"
        "world, rank, size = mlx_nbdist.script.init(backend='ring', size=2)\n"
        "print(f'rank {rank} ran')\n"
        "if rank == 1:\n"
        "    raise ValueError('no data on this rank')\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))\n")
    done = launch(bad, 2)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "[rank 0] rank 0 ran" in done.stdout
    assert "ValueError: no data on this rank" in done.stderr
    assert f'File "{bad}", line 5' in done.stderr and "Cell In[" not in done.stderr, done.stderr
    assert " pass" not in done.stderr  # the line run_file adds after the script
    assert done.stderr.rstrip().endswith(f"{bad} failed on rank 1 of 2"), done.stderr


@pytest.mark.parametrize("arg, status, says", [
    ("6", 6, "exited with status 6 (sys.exit on rank 1)"),
    ("'bad config: lr must be positive'", 1, "[rank 1] bad config: lr must be positive"),
    # rank 0 was released from a collective rank 1 never joined: not a success
    ("0", 1, "failed: sys.exit(0) on rank 1 while rank 0 waited for it"),
])
def test_sys_exit_while_a_peer_waits_gives_its_status(tmp_path: Path, arg: str, status: int,
                                                       says: str):
    """Rank 1 leaves with sys.exit while rank 0 waits in an all_sum (released): the
    script's status is the exit's, and a message is printed, as Python does."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys\nimport mlx.core as mx\nworld = mx.distributed.init()\n"
        f"if world.rank() == 1:\n    sys.exit({arg})\n"
        "mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))\n")
    done = launch(script, 2)
    assert done.returncode == status, (done.stdout, done.stderr)
    assert says in done.stderr, done.stderr
    assert "SystemExit" not in done.stderr and "%tb" not in done.stderr, done.stderr


def test_a_syntax_error_names_the_scripts_line(tmp_path: Path):
    script = tmp_path / "syn.py"
    script.write_text("x = 1\ny = (\n")
    done = launch(script, 2)
    assert done.returncode == 1
    assert f"SyntaxError: '(' was never closed ({script}, line 2)" in done.stderr, done.stderr
    assert "of the cell" not in done.stderr


def test_run_gives_the_script_its_file_arguments_and_exit_status(tmp_path: Path):
    """As under mlx.launch: ``__file__``, ``sys.argv`` and ``sys.exit``'s status."""
    script = tmp_path / "args.py"
    script.write_text(
        "import sys\n"
        "import mlx.core as mx\n"
        "rank = mx.distributed.init().rank()\n"
        "print('file', __file__, 'argv', sys.argv[1:])\n"
        "sys.exit(int(sys.argv[2]) if rank == 1 else 0)\n")
    done = launch(script, 2, args=("--code", "3"))
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert f"[rank 0] file {script} argv ['--code', '3']" in done.stdout, done.stdout
    assert "To exit" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "exited with status 3 (sys.exit on rank 1)" in done.stderr
    done = launch(script, 2, args=("--code", "0"))
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def test_another_number_of_ranks_is_refused_naming_both(exported):
    path, _ = exported
    done = launch(path, 1)
    assert done.returncode == 1
    assert "exported from a session of 2 ranks but runs on 1" in done.stderr, done.stderr
    assert "failed on rank 0 of 1" in done.stderr
