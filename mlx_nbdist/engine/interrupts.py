"""When a SIGINT may stop a rank's cell: in its body, once per cell.

An interrupt (Ctrl-C, the dashboard's button, a deadline) reaches each rank as a
SIGINT. ipykernel runs each request under Python's default handler, which raises
``KeyboardInterrupt`` wherever the main thread happens to be, and two places lose it:

* IPython runs ``pre_run_cell`` callbacks, where a rank starts its cell
  (:func:`.cells.begin`), inside a ``try`` that catches ``KeyboardInterrupt`` and
  prints it; the cell then runs on as if never interrupted, and the notebook ends the
  rank once its grace is over (all its state lost);
* between requests the kernel ignores SIGINT, so one that arrives before the rank
  took the cell's request is lost; the notebook therefore sends it again while the
  rank still runs (``Policy.interrupt_resend``), and a rank must take only one.

So, inside a kernel's request and only where Python's default handler was in place
(an ``async`` cell has ipykernel's own):

* from the start of a cell until its body runs, a SIGINT is *held* (:func:`hold`);
  :func:`prelude` puts ``if enter_body(): raise KeyboardInterrupt`` before a cell's
  first statement, so a held interrupt stops the cell there, as IPython reports any
  error of the cell;
* in the body the first SIGINT raises ``KeyboardInterrupt``; later ones of the same
  cell are ignored (the cell is already stopping: another would break its
  ``except``/``finally`` blocks or IPython's report of the first);
* once the body is over (:func:`done`) a SIGINT is ignored: the cell is ending and
  its reply must leave. The kernel puts its own handler back after the request.

The handler's own frame never shows in a cell's traceback (the notebook trims
mlx_nbdist's engine frames).
"""

from __future__ import annotations

import ast
import signal
import threading
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any


class Phase(Enum):
    """Where the main thread is in a cell, as far as SIGINT is concerned."""

    HELD = auto()  # starting: a SIGINT waits for the body
    BODY = auto()  # running the cell's code: the first SIGINT raises
    DONE = auto()  # ending: SIGINT is ignored


@dataclass
class _Guard:
    phase: Phase = Phase.DONE
    depth: int = 0  # cells started and not done (a cell may run another: run_cell)
    pending: bool = False  # a SIGINT arrived while held
    raised: bool = False  # this cell already took its SIGINT
    ours: bool = False  # our handler is installed for this cell


_guard = _Guard()


def _on_sigint(signum: int, frame: Any) -> None:
    g = _guard
    if g.phase is Phase.HELD:
        g.pending = True
    elif g.phase is Phase.BODY and not g.raised:
        g.raised = True
        raise KeyboardInterrupt


def hold() -> None:
    """A cell or apply starts: until :func:`enter_body`, a SIGINT is held."""
    g = _guard
    main = threading.current_thread() is threading.main_thread()  # signals reach it only
    current = signal.getsignal(signal.SIGINT) if main else None
    ours = main and current in (signal.default_int_handler, _on_sigint)
    if main and current is not _on_sigint:
        # a new request (the kernel put its own handler back): a top-level cell, even
        # if an earlier one never reached done() (an interrupt in a gap of the hooks)
        g.depth = 0
    g.depth += 1
    if g.depth > 1:
        return  # a cell run from inside a cell: the outer one's guard stands
    g.pending = g.raised = False
    g.phase = Phase.HELD  # before the handler: it must never see the last cell's end
    g.ours = ours
    if ours and current is not _on_sigint:
        signal.signal(signal.SIGINT, _on_sigint)


def enter_body() -> bool:
    """The body starts: True when a SIGINT was held (the caller raises it)."""
    g = _guard
    if g.phase is not Phase.HELD:
        return False
    g.phase = Phase.BODY
    if g.ours and g.pending:
        g.raised = True
        return True
    return False


def done() -> None:
    """The body of a cell :func:`hold` began is over (whatever its end): a SIGINT is
    ignored from now on."""
    g = _guard
    if g.depth == 0:
        return  # nothing began (IPython skips pre_run_cell for an empty cell)
    g.depth -= 1
    if g.depth == 0:
        g.phase = Phase.DONE


class Prelude(ast.NodeTransformer):
    """IPython AST transformer: a cell starting now (held) first raises a held
    SIGINT. Cells compiled inside a body (``%timeit``) are left as they are."""

    def visit_Module(self, node: ast.Module) -> ast.Module:  # noqa: N802 - ast's name
        if _guard.phase is not Phase.HELD:
            return node
        check = ast.parse(
            "if __import__('mlx_nbdist.engine.interrupts', fromlist=['_']).enter_body():\n"
            "    raise KeyboardInterrupt"
        ).body
        for stmt in check:
            for sub in ast.walk(stmt):
                if hasattr(sub, "lineno"):
                    sub.lineno = sub.end_lineno = 1
                    sub.col_offset = sub.end_col_offset = 0
        at = 0  # after ``from __future__`` imports, which must come first
        while (
            at < len(node.body)
            and isinstance(node.body[at], ast.ImportFrom)
            and node.body[at].module == "__future__"
        ):
            at += 1
        node.body[at:at] = check
        return node


def prelude() -> Prelude:
    """The transformer to append to a shell's ``ast_transformers``."""
    return Prelude()
