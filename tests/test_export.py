"""A session's cells exported as one script (``%mlxdist export``), run by ``mlx.launch``
and by ``python -m mlx_nbdist run``, printing the numbers the cells printed.

The transform from history to script is pure and tested here in-process; then a real
2-rank session runs cells (a seeded MLP, sharded from the notebook, trained a few
steps), exports them, and both launchers run the script on a real MLX ring group.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_nbdist.history import (
    ExportError,
    cell_entry,
    load_entry,
    note_entry,
    plain_python,
    render,
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
    assert "# %mlxdist load model ckpt/ --optimizer opt  (notebook only" in text
    assert "mlx_nbdist.consolidate('ckpt/', OUT)" in text
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


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_mlx_launch_runs_the_script_to_the_same_numbers(exported, session2):
    path, expected = exported
    session2.stop()  # the ranks of both launchers get the cores
    done = subprocess.run(
        [str(MLX_LAUNCH), "-n", "2", "--backend", "ring", "--", "python", str(path)],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=path.parent)
    got = values(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(expected) == 2 * 7, expected  # init, 3 losses, total, shown, last per rank
    assert got == expected, (done.stdout, done.stderr[-3000:])
    assert done.stdout.count("only rank 0") == 1


def test_mlx_nbdist_run_prints_each_ranks_lines_and_the_same_numbers(exported):
    path, expected = exported
    done = subprocess.run(
        [sys.executable, "-m", "mlx_nbdist", "run", "-n", "2", str(path)],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=path.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert values(done.stdout) == expected, done.stdout
    lines = [x for x in done.stdout.splitlines() if "rank=" in x]
    assert lines and all(x.startswith(f"[rank {x.split('rank=')[1][0]}] ") for x in lines), lines
    assert "[rank 0] only rank 0" in done.stdout


def test_a_failing_rank_exits_non_zero_naming_it(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import mlx_nbdist.script\n"
        "world, rank, size = mlx_nbdist.script.init(backend='ring', size=2)\n"
        "print(f'rank {rank} ran')\n"
        "if rank == 1:\n"
        "    raise ValueError('no data on this rank')\n")
    done = subprocess.run([sys.executable, "-m", "mlx_nbdist", "run", "-n", "2", str(bad)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "[rank 0] rank 0 ran" in done.stdout
    assert "ValueError: no data on this rank" in done.stderr
    assert done.stderr.rstrip().endswith(f"{bad} failed on rank 1 of 2"), done.stderr


def test_another_number_of_ranks_is_refused_naming_both(exported):
    path, _ = exported
    done = subprocess.run([sys.executable, "-m", "mlx_nbdist", "run", "-n", "1", str(path)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 1
    assert "exported from a session of 2 ranks but runs on 1" in done.stderr, done.stderr
    assert "failed on rank 0 of 1" in done.stderr
