"""The tutorial notebooks run end to end: a real kernel, a real 2-rank MLX group.

Each notebook in ``notebooks/`` is executed cell by cell with nbclient in the
``python3`` kernel of this environment. A cell that raises fails the test (notebook 06
catches the errors it provokes, by type, in the cell itself, so an unexpected error
still fails). After the last cell no controller or engine the notebook started may
remain, and the notebook must have run within a time bound.

The stored notebooks are also checked: outputs only in cells tagged ``figure``, no
errors, nothing that downloads.

Run ``python tests/test_notebooks.py --refresh`` to execute the notebooks and store
them again (outputs cleared except the figures).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import time
from pathlib import Path

import psutil
import pytest

try:
    from .conftest import is_ours
except ImportError:  # run as a script: python tests/test_notebooks.py --refresh
    from conftest import is_ours

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]-*.ipynb"))
#: Seconds one cell may take (the slowest cells start or restart a session, ~5-12 s).
CELL_TIMEOUT = 120
#: Seconds a whole notebook may take; each runs in 10-45 s on a 2-core machine.
NOTEBOOK_LIMIT = 150
FIGURE_TAG = "figure"
#: What each notebook must show its reader (beyond the asserts inside the notebook).
EXPECTED = {
    "01": ["all_sum:    array([3, 3, 3, 3]", "1 has [0, 100, 200]", "every rank holds rank 0's values: True"],
    "02": ["<- wrong", "AllToShardedLinear (256, 128)", "max |y_tp - y_full|", "all_sum shape=(32, 128)"],
    "03": ["DESYNC", "max |average_gradients - gradient of the whole batch|", "diverged on rank 1"],
    "04": ["all 10 replicated parameters are identical on every rank", "largest loss difference",
           "step 0: loss", "step 79: loss"],
    "05": ["FullyShardedModule", "QuantizedAllToShardedLinear", "sum_scatter not supported"],
    "07": ["2 + 1 kv", "do not divide by 2 ranks", "has no pipeline(group) method",
           "layer -> rank: 1 1 0 0", "max |logits_tp - logits_full|", "held by one rank only",
           "tok/s", "same tokens as the unsharded model: True", "refused: lora"],
    "06": ["Drained", "CollectiveTimeout after", "CellInterrupted after", "engine process died",
           "never received", "is in step", "exit code 3",
           "collective mismatch", "would wait forever", ", in load_batch",
           "mostly for rank 1", "trace events, ranks [0, 1]", "In [18]: "],
    "08": ["resharded from 2 to 1 ranks", "same losses as the notebook: True",
           "max |resumed - uninterrupted|", "plain MLX, consolidated weights",
           "mlx_nbdist.script.save_checkpoint(model, ", "model = mlx_nbdist.shard(model, 'megatron', segments=1)",
           "[rank 1] step 5: loss"],
}
DOWNLOADS = re.compile(
    r"urllib|requests\.|urlretrieve|wget|curl |from_pretrained|hf_hub|huggingface|load_dataset"
)


def _session_processes(kernel_pid: int) -> set[int]:
    try:
        kids = psutil.Process(kernel_pid).children(recursive=True)
    except psutil.Error:
        return set()
    return {p.pid for p in kids if is_ours(p)}


def _alive(pids: set[int], timeout: float) -> list[int]:
    t_end = time.monotonic() + timeout
    left = sorted(pids)
    while left and time.monotonic() < t_end:
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.2)
    return left


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # conftest sets Agg for the tests; the kernel draws inline
    env["MLX_NBDIST_PREWARM"] = "1"  # conftest turns it off for the tests' own process
    return env


def execute(path: Path) -> tuple[object, float, set[int]]:
    """Execute a notebook; returns (executed notebook, seconds, session PIDs seen).

    On a failing cell the session is stopped before the kernel goes, then the error
    is raised, so a failure leaves nothing running either (see
    ``test_an_unexpected_error_fails_and_leaves_nothing_running``).
    """
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    seen: set[int] = set()
    error: BaseException | None = None
    t0 = time.monotonic()
    with client.setup_kernel(env=_kernel_env()):
        kernel_pid = client.km.provisioner.pid
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
                seen |= _session_processes(kernel_pid)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after cleaning up
            error = e
            seen |= _session_processes(kernel_pid)
            stop = nbformat.v4.new_code_cell("import mlx_nbdist\nmlx_nbdist.stop()")
            try:
                client.execute_cell(stop, len(nb.cells))
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        elapsed = time.monotonic() - t0
        seen |= _session_processes(kernel_pid)
        left = _alive(seen, timeout=10)
    if error is not None and left:
        raise AssertionError(f"{path.name} failed and left processes running: {left}") from error
    if error is not None:
        raise error
    assert not left, f"{path.name}: session processes still running after the last cell: {left}"
    return nb, elapsed, seen


def _text(cell: object) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(str(out["data"].get("text/plain", "")))
    return "".join(parts)


def _has_png(cell: object) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def _figure_cells(nb: object) -> list[object]:
    return [c for c in nb.cells if FIGURE_TAG in c.get("metadata", {}).get("tags", [])]


def test_there_are_eight_tutorials() -> None:
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_notebook_is_clean(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for c in code:
        tagged = FIGURE_TAG in c.get("metadata", {}).get("tags", [])
        errors = [o for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"stored error output in: {c.source[:60]!r}"
        assert tagged or not c.get("outputs"), f"untagged cell stored with outputs: {c.source[:60]!r}"
        assert c.get("execution_count") is None
        assert not DOWNLOADS.search(c.source), f"downloads something: {c.source[:60]!r}"
    for c in _figure_cells(nb):
        assert _has_png(c), f"figure cell stored without its figure: {c.source[:60]!r}"
    assert "%mlxdist start" in code[0].source, "the first code cell starts the session"
    assert "%mlxdist stop" in code[-1].source, "the last code cell stops the session"


@pytest.mark.timeout(CELL_TIMEOUT + NOTEBOOK_LIMIT + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path: Path, tmp_path: Path) -> None:
    nb, elapsed, seen = execute(path)
    nbformat.write(nb, tmp_path / path.name)  # kept by pytest for a look afterwards
    assert seen, "the notebook started no engines"
    assert elapsed < NOTEBOOK_LIMIT, f"{path.name} took {elapsed:.0f} s"
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    for expected in EXPECTED[path.name[:2]]:
        assert expected in text, f"{path.name}: no {expected!r} in the outputs"
    for c in _figure_cells(nb):
        assert _has_png(c), f"{path.name}: no figure from {c.source[:60]!r}"
        for out in c.outputs:
            png = out.get("data", {}).get("image/png")
            if png:
                (tmp_path / f"{path.stem}-{len(list(tmp_path.glob('*.png')))}.png").write_bytes(
                    base64.b64decode(png)
                )
    print(f"{path.name}: {elapsed:.1f} s, {len(seen)} session processes, all gone")


def test_an_unexpected_error_fails_and_leaves_nothing_running(tmp_path: Path) -> None:
    """The harness itself: an error of a type the cell did not expect fails the run."""
    cells = [
        "%load_ext mlx_nbdist\n%mlxdist start -n 2",
        "import mlx_nbdist\nfrom mlx_nbdist import CollectiveTimeout\n"
        "s = mlx_nbdist.current_session()\n"
        "try:\n    s.run(\"raise ValueError('not the expected failure')\")\n"
        "except CollectiveTimeout:\n    pass",
        "%mlxdist stop",
    ]
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in cells],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    path = tmp_path / "99-broken.ipynb"
    nbformat.write(nb, path)
    before = {p.pid for p in psutil.Process().children(recursive=True) if is_ours(p)}
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="not the expected failure"):
        execute(path)
    after = {p.pid for p in psutil.Process().children(recursive=True) if is_ours(p)}
    assert _alive(after - before, timeout=10) == []


def refresh(paths: list[Path]) -> None:
    """Execute each notebook and store it with outputs cleared except figures."""
    for path in paths:
        nb, elapsed, _ = execute(path)
        for c in nb.cells:
            if c.cell_type != "code":
                continue
            c.execution_count = None
            if FIGURE_TAG not in c.get("metadata", {}).get("tags", []):
                c.outputs = []
            else:
                for out in c.outputs:
                    if "execution_count" in out:
                        out["execution_count"] = None
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {elapsed:.1f} s and stored")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--refresh"]:
        sys.exit("usage: python tests/test_notebooks.py --refresh [NOTEBOOK ...]")
    chosen = [Path(a).resolve() for a in sys.argv[2:]] or NOTEBOOKS
    refresh(chosen)
