"""The demo: tutorial 02 (a tensor-parallel MLP) run headless, with an HTML report.

``python -m mlx_nbdist.demo`` executes ``notebooks/02-tensor-parallelism.ipynb`` in a
real kernel against a real 2-rank group, writes the executed notebook as one
self-contained HTML file (figures embedded) and prints its path. Without the notebook
(an installed package rather than a checkout) or without nbclient/nbconvert (the
``dev`` extra), ``python -m mlx_nbdist demo`` falls back to :func:`run_quick_check`:
the same tensor-parallel MLP checked against the unsharded model, printed per rank.
A failure (no usable MLX, a start that fails, a rank that raises) ends in one paragraph
on stderr and exit status 1, not a traceback.
"""

from __future__ import annotations

import argparse
import html
import platform
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .backend_check import check_mlx
from .errors import MLXDistError
from .session import Session

#: Where the tutorials live in a source checkout.
NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
DEMO_NOTEBOOK = NOTEBOOK_DIR / "02-tensor-parallelism.ipynb"
DEFAULT_OUT = Path("reports") / "demo"
#: Seconds one notebook cell may take (starting the group is the slowest, ~5-10 s).
CELL_TIMEOUT = 300

MLP_CELL = """
import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

mx.random.seed(0)                       # the same weights on every rank
hidden = size * -(-256 // size)         # 256, rounded up to a multiple of the ranks
full = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 64))
x = mx.random.normal((8, 64), key=mx.random.key(1))
y_full = full(x)

tp = nn.Sequential(
    shard_linear(full.layers[0], "all-to-sharded", group=world),   # column parallel
    nn.ReLU(),
    shard_linear(full.layers[2], "sharded-to-all", group=world),   # row parallel: one all_sum
)
y_tp = tp(x)
err = mx.abs(y_tp - y_full).max().item()
print(f"rank {rank}/{size}: up.weight {tuple(tp.layers[0].weight.shape)} of "
      f"{tuple(full.layers[0].weight.shape)}, down.weight {tuple(tp.layers[2].weight.shape)}; "
      f"max |y_tp - y_full| = {err:.2e}")
assert err < 1e-5, f"rank {rank}: tensor-parallel output differs from the full model by {err}"
"""


class DemoError(RuntimeError):
    """The demo notebook failed; the report written so far is at ``report``."""

    def __init__(self, message: str, report: Path):
        super().__init__(message)
        self.report = report


def run_demo(n: int = 2) -> int:
    """``python -m mlx_nbdist demo``: the notebook report when possible, else the quick check.

    Args:
        n: number of ranks. The notebook is written for 2; other values run the
            quick check.

    Returns:
        The process exit status: 0 on success, 1 when the demo failed, 2 for a bad ``n``.
    """
    if n < 1:
        print(f"mlx-nbdist demo: -n must be a whole number of ranks >= 1, not {n}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        check_mlx()  # before a kernel or engines start, which would only fail later
        if n == 2 and DEMO_NOTEBOOK.exists() and _have_nbclient():
            return main([])
        return run_quick_check(n)
    except MLXDistError as e:
        print(failure_paragraph(e, n), file=sys.stderr)
        return 1


def failure_paragraph(error: MLXDistError, n: int) -> str:
    """One paragraph for a failed demo: what failed, the error's own text on one line."""
    text = " ".join(str(error).split())
    return f"mlx-nbdist demo failed ({n} ranks): {type(error).__name__}: {text}"


def run_quick_check(n: int = 2) -> int:
    """Start ``n`` ranks, run a tensor-parallel MLP, check it, print per rank, stop.

    Raises:
        MLXDistError: no usable MLX here (:class:`SetupError`), the ranks did not start,
            or a rank failed the check (:class:`CellError`).
    """
    check_mlx()  # a SetupError that names the extra, before any engine starts
    t0 = time.monotonic()
    with Session(n) as s:
        print(f"started {n} ranks ({s.backend} backend) in {time.monotonic() - t0:.1f} s")
        for r, info in s.ranks.items():
            print(f"  rank {r}: {info.device}, pid {info.pid}")
        result = s.run(MLP_CELL)
        for r, out in result.ranks.items():
            print(f"[rank {r}] {out.stdout.strip()}")
    print(f"demo ok: tensor-parallel MLP equals the unsharded model on {n} ranks")
    return 0


def run_notebook(notebook: Path, out_dir: Path, *, cell_timeout: float = CELL_TIMEOUT) -> Path:
    """Execute ``notebook`` headless and write it as self-contained HTML.

    The session the notebook starts is stopped even when a cell fails; the report is
    written in both cases, with a header saying how the run went.

    Args:
        notebook: the ``.ipynb`` to run (its folder is the kernel's working directory).
        out_dir: where the HTML report goes (created if needed).
        cell_timeout: seconds any one cell may take.

    Returns:
        The path of the HTML report.

    Raises:
        DemoError: a cell failed (the report, with the error, is still written).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=cell_timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    failure: str | None = None
    t0 = time.monotonic()
    with client.setup_kernel():
        try:
            for index, cell in enumerate(nb.cells):
                _say(f"cell {index + 1}/{len(nb.cells)}")
                client.execute_cell(cell, index)
        except Exception as e:  # noqa: BLE001 - a cell's error, timeout or a dead kernel
            lines = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
            failure = lines[-1] if lines else repr(e)
            stop = nbformat.v4.new_code_cell("import mlx_nbdist\nmlx_nbdist.stop()")
            try:
                client.execute_cell(stop, len(nb.cells))
            except Exception:  # noqa: BLE001 - the cell's error is the one to report
                pass
    elapsed = time.monotonic() - t0
    _say("")
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(_header(notebook, elapsed, failure)))
    report = out_dir / f"{notebook.stem}.html"
    _write_html(nb, report)
    if failure is not None:
        raise DemoError(f"{notebook.name} failed after {elapsed:.0f} s: {failure}", report)
    return report


def _header(notebook: Path, elapsed: float, failure: str | None) -> str:
    import mlx.core as mx

    outcome = (
        f"**Failed**: {html.escape(failure)}" if failure else "Every cell ran without error."
    )
    return (
        f"> **mlx_nbdist demo report**: `{notebook.name}` executed headless on "
        f"{html.escape(platform.node())} ({platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, MLX {mx.__version__}, default device "
        f"{mx.default_device()}), {datetime.now():%Y-%m-%d %H:%M}, in {elapsed:.1f} s. "
        f"{outcome}"
    )


def _write_html(nb: Any, path: Path) -> None:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")


def _have_nbclient() -> bool:
    try:
        import nbclient  # noqa: F401
        import nbconvert  # noqa: F401
    except ImportError:
        return False
    return True


def _say(text: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text:<40}")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m mlx_nbdist.demo [--notebook PATH] [--out DIR] [--quick] [-n N]``."""
    p = argparse.ArgumentParser(
        prog="python -m mlx_nbdist.demo",
        description="Run a tutorial notebook headless and write an HTML report.",
    )
    p.add_argument("--notebook", type=Path, default=DEMO_NOTEBOOK,
                   help="the notebook to run (default: tutorial 02, tensor parallelism)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the HTML report")
    p.add_argument("--quick", action="store_true",
                   help="no notebook: the tensor-parallel MLP check, printed per rank")
    p.add_argument("-n", type=int, default=2, help="ranks for --quick")
    args = p.parse_args(argv)
    if args.quick:
        try:
            return run_quick_check(args.n)
        except MLXDistError as e:
            print(failure_paragraph(e, args.n), file=sys.stderr)
            return 1
    if not args.notebook.exists():
        p.error(f"{args.notebook} not found (the notebooks are in a source checkout)")
    if not _have_nbclient():
        p.error("needs nbclient and nbconvert: pip install 'mlx_nbdist[dev]'")
    print(f"running {args.notebook} headless (2 ranks) ...", flush=True)
    try:
        report = run_notebook(args.notebook, args.out)
    except DemoError as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        print(f"report: {e.report.resolve()}")
        return 1
    print(f"demo ok: {args.notebook.name} ran end to end")
    print(f"report: {report.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
