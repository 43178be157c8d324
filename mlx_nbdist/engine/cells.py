"""The start and end of a cell (or of an apply) on a rank.

A ``%%mlxdist`` cell is an execute request: IPython's ``pre_run_cell`` and
``post_run_cell`` events (:func:`install_hooks`) call :func:`begin` and
:func:`finish`. An apply (``Session.apply``) runs through ``rpc.call``, which calls
them around the function. The session sends a cell's metadata (cell number, active
ranks, check mode, output limit) as the execute request's label, or as ``call``'s
first argument.

A SIGINT that arrives while a cell starts is held until its first statement, and a
cell takes one SIGINT (see :mod:`.interrupts`).

A cell whose metadata has ``"profile": true`` (``%%mlxdist --profile``) is timed: a
:class:`~.profile.Recorder` is installed on the tracker for the cell, and its events
are published at the end next to the ledger (see :mod:`.profile` for what that
measures and costs).
"""

from __future__ import annotations

import json
from typing import Any

from . import interrupts, output, state

#: the key of a cell's ledger among the data a rank publishes (``md["data"]``)
LEDGER_KEY = "mlx_nbdist.ledger"
#: the key of a profiled cell's timed collectives (``Recorder.finish``) in that data
PROFILE_KEY = "mlx_nbdist.profile"


def begin(meta: dict[str, Any]) -> None:
    """Start a cell or apply on this rank: cell number, active ranks, check mode."""
    st = state.current()
    cell = int(meta.get("cell", 0))
    st.tracker.begin_cell(cell, meta.get("ranks"), bool(meta.get("check")))
    st.tracker.recorder = None
    if meta.get("profile"):
        from .profile import Recorder

        recorder = Recorder(st.rank, st.size, st.tracker.backend)
        recorder.begin(cell)
        st.tracker.recorder = recorder
    output.begin_cell(cell, limit=meta.get("output_limit"))
    st.monitor.cell_started(cell)


def error_line(error: BaseException) -> str:
    """``Type: message`` of ``error`` (its type alone when its text cannot be made)."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001 - a __str__ that raises: the cell must still end
        return type(error).__name__


def finish(status: str, error: str = "") -> None:
    """End a cell or apply on this rank (``status``: ``ok`` or the exception's name;
    ``error``: its line, published while the cell's collectives settle):
    run its unevaluated collectives (see :meth:`Tracker.settle`), send the notebook
    its ledger when it issued any collective (and a profiled cell's timings), flush
    its output, publish its end."""
    st = state.current()
    recorder, st.tracker.recorder = st.tracker.recorder, None
    try:
        st.tracker.settle(after="" if status == "ok" else error[:300] or status)
        data: dict[str, Any] = {}
        if st.tracker.cell_count:
            data[LEDGER_KEY] = st.tracker.ledger()
            st.monitor.note_ledger(st.tracker.cell)
        if recorder is not None:
            data[PROFILE_KEY] = recorder.finish(status)
        if data:
            from ipyparallel.datapub import publish_data

            try:
                publish_data(data)
            except Exception:  # noqa: BLE001 - no kernel (plain process): nobody to tell
                pass
    finally:
        output.end_cell()
        st.monitor.cell_finished(status)


def install_hooks(ip: Any) -> None:
    """Run :func:`begin` and :func:`finish` around every cell of the shell ``ip``."""

    #: the cells begun and not finished, innermost last (a cell may run another)
    started: list[Any] = []

    def pre_run_cell(info: Any) -> None:
        interrupts.hold()  # IPython would swallow a KeyboardInterrupt raised in here
        started.append(info)
        begin(_meta(ip))

    def post_run_cell(result: Any) -> None:
        # IPython skips pre_run_cell for an empty cell but still ends it here
        info = getattr(result, "info", None)
        if not started or (result is not None and info is not started[-1]):
            return
        started.pop()
        interrupts.done()
        ok = result is not None and result.success
        error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        finish("ok" if ok else type(error).__name__ if error is not None else "Error",
               "" if ok or error is None else error_line(error))

    def number_as_notebook(lines: list[str]) -> list[str]:
        # A transformer runs before IPython takes the cell's number (pre_run_cell runs
        # after): a rank's traceback then says ``Cell In[8]`` as the notebook does,
        # not the engine's own count. Never backwards (IPython's history keys on it).
        number = _meta(ip).get("number")
        if isinstance(number, int) and number >= ip.execution_count:
            ip.execution_count = number
        return lines

    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)
    ip.ast_transformers.append(interrupts.prelude())
    ip.input_transformers_cleanup.append(number_as_notebook)


def _meta(ip: Any) -> dict[str, Any]:
    """The cell's metadata: the session sends it as the execute request's label."""
    try:
        label = ip.kernel.get_parent()["metadata"].get("label") or ""
    except Exception:  # noqa: BLE001 - no kernel (plain shell): no metadata
        return {}
    if not label.startswith('{"mlxdist"'):
        return {}
    return json.loads(label)
