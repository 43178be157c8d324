"""Show a cell's per-rank output under the cell, labelled and in rank order."""

from __future__ import annotations

import sys
from typing import Any

from ..results import OK, CellResult, RankOutput


def display_cell(result: CellResult, *, quiet: bool = False) -> None:
    """Print each rank's stdout/stderr, rich outputs and last expression.

    Args:
        result: the cell's result.
        quiet: show only ranks that did not finish normally.
    """
    multi = len(result.ranks) > 1
    for rank in sorted(result.ranks):
        out = result.ranks[rank]
        if quiet and out.status == OK:
            continue
        if not (out.stdout or out.stderr or out.outputs or out.result):
            continue
        if multi:
            _header(out)
        _show_rank(out)


def _header(out: RankOutput) -> None:
    label = f"[rank {out.rank}]"
    if out.status != OK:
        label += f" ({out.status})"
    sys.stdout.write(label + "\n")
    sys.stdout.flush()


def _show_rank(out: RankOutput) -> None:
    if out.stdout:
        sys.stdout.write(out.stdout if out.stdout.endswith("\n") else out.stdout + "\n")
        sys.stdout.flush()
    if out.stderr:
        sys.stderr.write(out.stderr if out.stderr.endswith("\n") else out.stderr + "\n")
        sys.stderr.flush()
    for msg in out.outputs:
        _display_bundle(msg.get("data", {}), msg.get("metadata", {}))
    if out.result:
        _show_result(out.rank, out.result)


def _show_result(rank: int, bundle: dict[str, Any]) -> None:
    text = bundle.get("text/plain", "")
    rich = {k: v for k, v in bundle.items() if k != "text/plain"}
    if rich:
        _display_bundle(bundle, {})
        return
    prefix = f"Out[rank {rank}]: "
    if "\n" in text:
        text = "\n" + text
    sys.stdout.write(prefix + text + "\n")
    sys.stdout.flush()


def _display_bundle(data: dict[str, Any], metadata: dict[str, Any]) -> None:
    from IPython.display import display

    if not data:
        return
    display(data, metadata=metadata, raw=True)
